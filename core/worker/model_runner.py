"""The model runner: the only engine part that touches tensors.

It keeps per-request state from the scheduler's diffs, executes copy-on-write block copies, builds
one flattened batch per step (tandem.worker.input_batch), runs the model over the paged KV pool and
samples. ``execute`` is called once per step by the engine thread (or a worker process's loop).
Pure decode steps run through ``graphs`` (tandem.worker.cuda_graphs) when the worker captured
CUDA graphs.

Under tensor and pipeline parallelism (``parallel``) every rank runs the same ``execute`` on the
same message and keeps the same per-request state; only the driver (tensor rank 0 of the last
stage) samples and returns a non-empty output. With pp stages the step's requests are cut into
pp micro-batches (``split_microbatches``, by tokens) that flow through the stages one after
the other: stage 0 starts micro-batch 2 while stage 1 runs micro-batch 1, so every stage is busy
but for the fill and drain of each step. Stage s receives ``[k, T, hidden]`` (hidden state and
residual) from stage s-1 and sends its own on.
"""
from __future__ import annotations

import torch

from tandem.distributed import ParallelContext
from tandem.sched.output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from tandem.worker.cuda_graphs import DecodeGraphs
from tandem.worker.input_batch import RunnerRequest, StepInputs, build_step_inputs, split_microbatches
from tandem.worker.logits_processing import select_rows
from tandem.worker.sampler import Sampler, compute_logprobs, make_generator
from tandem.worker.sampling_row import SamplingRow, TokenSpan
from tandem.worker.structured import allowed_tokens


class ModelRunner:
    """Runs ``model`` (see tandem.models: ``model(input_ids, positions, kv_cache, metadata)`` and
    ``model.compute_logits(hidden)``) over ``kv_cache``, the instance's block-major KV pool.
    ``cpu_kernels``: the sampler uses tandem's CPU kernels (see ``Sampler``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        block_size: int,
        eos_token_ids: frozenset[int],
        attn_backend_cls: type,
        parallel: ParallelContext | None = None,
        cpu_kernels: bool = False,
    ) -> None:
        self.parallel = parallel or ParallelContext()
        self.samples = self.parallel.is_driver
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.eos_token_ids = eos_token_ids
        self.attn_backend_cls = attn_backend_cls
        self.sampler = Sampler(cpu_kernels)
        self.requests: dict[str, RunnerRequest] = {}
        # Seeded requests keep their random stream across preemptions (dropped when they finish).
        self.generators: dict[str, torch.Generator] = {}
        # Decode steps that fit replay captured CUDA graphs (set by the engine on CUDA).
        self.graphs: DecodeGraphs | None = None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        starts = self._update_states(out)
        self._add_forks(out)
        self._copy_blocks(out.block_copies)
        result = ModelRunnerOutput()
        if out.total_num_scheduled_tokens == 0:
            return result
        if self.parallel.pp_size > 1:
            self._run_pipelined(out, starts, result)
            return result
        inputs = build_step_inputs(self.requests, out, starts, self.block_size, self.device)
        if self.graphs is not None and self.graphs.can_run(inputs):
            hidden = self.graphs.run(inputs)
        else:
            self.attn_backend_cls.prepare_metadata(inputs.metadata)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata)
        self._prompt_logprobs(hidden, inputs, result)
        self._sample(hidden, inputs, out, result)
        return result

    def _run_pipelined(self, out: SchedulerOutput, starts: dict[str, int], result: ModelRunnerOutput) -> None:
        """This stage's part of the step: each micro-batch received (after the first stage),
        run through the stage's layers, and sent on (before the last stage) or sampled."""
        parallel, sends = self.parallel, []
        hidden_size = self.model.config.hidden_size
        try:
            for part in split_microbatches(out, parallel.pp_size):
                inputs = build_step_inputs(self.requests, part, starts, self.block_size, self.device)
                self.attn_backend_cls.prepare_metadata(inputs.metadata)
                intermediate = None
                if not parallel.is_first_stage:
                    shape = (self.model.model.intermediate_count, inputs.metadata.num_tokens, hidden_size)
                    intermediate = parallel.recv_prev(shape, self.kv_cache.dtype, self.device)
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata,
                                    intermediate)
                if not parallel.is_last_stage:
                    sends.append(parallel.send_next(hidden))
                    continue
                self._prompt_logprobs(hidden, inputs, result)
                self._sample(hidden, inputs, part, result)
        finally:
            for work in sends:
                work.wait()

    def _update_states(self, out: SchedulerOutput) -> dict[str, int]:
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.requests.pop(rid, None)
        starts: dict[str, int] = {}
        for data in out.new_requests:
            req = RunnerRequest.from_new(data)
            req.generator = self._generator(data.request_id, data.sampling_params.seed, data.sample_index)
            self.requests[data.request_id] = req
            starts[data.request_id] = data.num_computed_tokens
        for data in out.cached_requests:
            req = self.requests[data.request_id]
            for index, block_id in data.replaced_blocks:
                req.block_ids[index] = block_id
            req.block_ids.extend(data.new_block_ids)
            req.token_ids.extend(data.new_token_ids)
            starts[data.request_id] = data.num_computed_tokens
        return starts

    def _add_forks(self, out: SchedulerOutput) -> None:
        """Children forked this step share the parent's table as it is after this step's
        allocation (every rank keeps them; the sampling rank samples their first token from
        the parent's logits)."""
        for fork in out.forked_requests:
            parent = self.requests[fork.parent_id]
            child = RunnerRequest(
                request_id=fork.request_id,
                token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens,
                params=parent.params,
                sample_index=fork.sample_index,
                block_ids=list(parent.block_ids),
            )
            child.generator = self._generator(fork.request_id, parent.params.seed, fork.sample_index)
            self.requests[fork.request_id] = child

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            self.kv_cache[dst] = self.kv_cache[src]

    def _sample(
        self, hidden: torch.Tensor, inputs: StepInputs, out: SchedulerOutput, result: ModelRunnerOutput
    ) -> None:
        rids = list(inputs.sample_request_ids)
        hidden_rows = list(inputs.sample_rows)
        row_of = dict(zip(rids, hidden_rows))
        for fork in out.forked_requests:
            rids.append(fork.request_id)
            hidden_rows.append(row_of[fork.parent_id])
        sampling_rows = [self._sampling_row(self.requests[rid]) for rid in rids]
        # A request checking k drafts samples k + 1 rows: row i as if drafts[:i] were accepted.
        spec: list[tuple[str, int, list[int]]] = []
        for rid, row0 in inputs.spec_rows.items():
            drafts, req = out.spec_token_ids[rid], self.requests[rid]
            spec.append((rid, len(sampling_rows), drafts))
            hidden_rows.extend(range(row0, row0 + len(drafts) + 1))
            sampling_rows.extend(self._sampling_row(req, drafts[:i]) for i in range(len(drafts) + 1))
        if not sampling_rows:
            return
        logits = self.model.compute_logits(select_rows(hidden, hidden_rows))
        if logits is None:  # a tensor rank other than 0: it lent its vocabulary shard
            return
        if out.grammar is not None:  # constrained sequences have no drafts: rows 0..len(rids)-1
            for row, mask in zip(sampling_rows, allowed_tokens(out.grammar, rids, logits.shape[1], logits.device)):
                row.allowed = mask
        sampled = self.sampler(logits, sampling_rows)
        for i, rid in enumerate(rids):
            self._emit(rid, sampled.token_ids[i:i + 1], sampled.logprobs[i:i + 1], result)
        for rid, first, drafts in spec:
            tokens = sampled.token_ids[first:first + len(drafts) + 1]
            accepted = next((i for i, (t, d) in enumerate(zip(tokens, drafts)) if t != d), len(drafts))
            self._emit(rid, tokens[:accepted + 1], sampled.logprobs[first:first + accepted + 1], result)

    def _emit(self, rid: str, tokens: list[int], logprobs: list[TokenLogprobs | None],
              result: ModelRunnerOutput) -> None:
        result.sampled_token_ids[rid] = tokens
        if logprobs and logprobs[0] is not None:
            result.logprobs[rid] = logprobs

    def _generator(self, request_id: str, seed: int | None, sample_index: int) -> torch.Generator | None:
        if seed is None:
            return None
        if request_id not in self.generators:
            self.generators[request_id] = make_generator(seed, sample_index, self.device)
        return self.generators[request_id]

    def _sampling_row(self, req: RunnerRequest, drafts: list[int] | None = None) -> SamplingRow:
        return SamplingRow(
            params=req.params,
            generator=req.generator,
            prompt_token_ids=TokenSpan(req.token_ids, 0, req.num_prompt_tokens),
            output_token_ids=TokenSpan(req.token_ids, req.num_prompt_tokens, len(req.token_ids), drafts or ()),
            eos_token_ids=self.eos_token_ids,
        )

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs, result: ModelRunnerOutput) -> None:
        for rid, (row0, start, last) in inputs.prompt_rows.items():
            req = self.requests[rid]
            entries: list[TokenLogprobs | None] = [None] if start == 0 else []
            if last > start:
                logits = self.model.compute_logits(hidden[row0 : row0 + last - start])
                if logits is None:
                    continue
                targets = req.token_ids[start + 1 : last + 1]
                entries.extend(compute_logprobs(logits, targets, req.params.prompt_logprobs))
            result.prompt_logprobs[rid] = entries
