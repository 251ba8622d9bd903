"""The engine: one object that owns the scheduler, the executor (which runs the model) and the
output processor.

``step()`` is the whole loop — schedule, execute, update — and is what the offline ``LLM`` and the
server's async engine drive. Not thread-safe: one thread calls it (and ``add_request`` /
``abort_request``) at a time.

Fault isolation. An exception while scheduling or executing a step (a model, kernel or plugin
error) does not escape ``step()``: the step's tokens count as never computed and its sequences are
retried one by one, alone (``Scheduler.isolate_step``); a request whose step fails alone is failed
— finish reason "error", its blocks freed — and the others go on as if nothing happened. An
exception while post-processing one request (detokenizing, stop strings) fails that request
alone. ``step()`` raises only ``EngineDeadError``: on a CUDA (accelerator) error, when the KV pool
is found inconsistent after a failure, or after ``MAX_FAILED_STEPS_IN_ROW`` failed steps with
no good step between them — states a process should not go on serving from.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from itertools import count
from typing import Any

import torch

from tandem.errors import EngineDeadError, RequestRejected
from tandem.config import ConfigError, Role, TandemConfig
from tandem.device import resolve_device, resolve_dtype
from tandem.interfaces import compat_hash
from tandem.kv_events.publisher import KVEventPublisher, PublisherSettings
from tandem.kv_transfer import KVTransferCoordinator, RemotePrefill
from tandem.models.config import ModelArchConfig, kv_bytes_per_block
from tandem.output_processor import OutputProcessor
from tandem.outputs import RequestOutput
from tandem.plugin_manager import call_observers, get_registry
from tandem.sched.request import RemoteKV, Request, RequestStatus, request_cache_salt
from tandem.input_processor import InputProcessor, ProcessedRequest, RequestLimits
from tandem.sampling_params import SamplingParams
from tandem.sched.scheduler import Scheduler, SchedulerConfig
from tandem.structured_outputs import StructuredOutputManager

logger = logging.getLogger("tandem")

_GRAMMAR_POLL_S = 0.01
"""How long an engine with only compiling requests waits for a compile per step."""

MAX_FAILED_STEPS_IN_ROW = 8
"""Failed steps with no successful step between them before the engine gives up: isolation makes
a single poison request cost two failed steps (its batch, then itself alone)."""


@dataclass(slots=True, frozen=True)
class StepStats:
    """What one step did, for metrics: tokens computed, sequences in the batch, wall time."""

    num_tokens: int
    num_seqs: int
    num_prompt_tokens: int
    num_generation_tokens: int
    duration_s: float
    kv_transfer_seconds: tuple[float, ...] = ()
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


class LLMEngine:
    """Loads the model named by ``config`` and serves requests step by step."""

    def __init__(self, config: TandemConfig) -> None:
        from tandem.models.loader import load_generation_config, load_tokenizer

        self.config = config
        self.registry = get_registry()
        path = config.model.path
        self.arch = ModelArchConfig.from_pretrained_dir(path)
        self.device = resolve_device(config.engine.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device, self.arch.torch_dtype)
        self.tokenizer = load_tokenizer(config.model.tokenizer or path)
        self.eos_token_ids = frozenset(load_generation_config(path)["eos_token_ids"])
        self.default_sampling = self._default_sampling()
        """Sampling fields a request leaves out take these (the model's generation_config.json)."""
        self.executor = self._build_executor()
        self.max_model_len = self.executor.max_model_len
        self.scheduler = self._build_scheduler()
        self.outputs = OutputProcessor(self.tokenizer)
        self.delta_outputs = False
        """Outputs of ``step()`` carry only what changed (the async engine sets it)."""
        self.final_outputs_only = False
        """``step()`` returns a request's output only once it is finished (``LLM.generate``,
        which keeps nothing else, sets it while it runs; vLLM's ``FINAL_ONLY``)."""
        self._ids = count()
        self.last_step: StepStats | None = None
        self.kv_transfer = self._build_kv_transfer()
        self.kv_events = self._build_kv_events()
        """The KV event publisher (``kv_events.enabled``), or None."""
        self._failed: list[tuple[str, str]] = []
        self._num_failed_steps_in_row = 0
        self.structured = self._build_structured_outputs()
        self.input_processor = InputProcessor(self.request_limits, self.structured)
        """Checks and tokenizes every request (``add_request``; ``AsyncEngine.add_requests`` runs
        it on its tokenizer thread, then calls ``add_processed``)."""
        self.report_grammar_admissions = False
        """Record the ends of grammar waits for ``take_grammar_admissions`` (the async engine
        sets it)."""
        self._grammar_admissions: list[tuple[str, BaseException | None]] = []
        call_observers("tandem_engine_started", config=config)

    # ----------------------------------------------------------------------------- start-up

    def _default_sampling(self) -> dict[str, Any]:
        """The model's sampling defaults (``tandem.models.loader.sampling_defaults``), checked by
        ``SamplingParams`` and logged; ConfigError when the file or its values are refused."""
        from tandem.models.loader import sampling_defaults

        setting = self.config.model.generation_config
        try:
            defaults = sampling_defaults(setting, self.config.model.path)
            SamplingParams(**defaults)
        except ValueError as exc:
            raise ConfigError(f"model.generation_config ({setting}): {exc}") from exc
        if defaults:
            logger.info("sampling defaults from generation_config.json (model.generation_config = %s): "
                        "%s; requests that set these fields keep their own; --generation-config vllm "
                        "ignores the file", setting,
                        ", ".join(f"{k}={v}" for k, v in defaults.items()))
        return defaults

    def _build_executor(self):
        name = self.config.engine.distributed_executor_backend
        par = self.config.parallel
        if name == "auto":
            name = "mp" if par.world_size > 1 else "uniproc"
        if name == "uniproc" and par.world_size > 1:
            raise ConfigError(f"engine.distributed_executor_backend = 'uniproc' runs one rank; "
                              f"tensor_parallel_size × pipeline_parallel_size = {par.world_size} needs 'mp'")
        return self.registry.get("executor", name)(self.config, self.eos_token_ids)

    def _build_scheduler(self) -> Scheduler:
        eng = self.config.engine
        allocator_cls = self.registry.get("kv_allocator", eng.kv_allocator)
        policy_cls = self.registry.get("scheduler", eng.scheduler)
        kv = allocator_cls(self.executor.num_kv_blocks, eng.block_size, eng.enable_prefix_caching)
        cfg = SchedulerConfig(
            max_num_seqs=eng.max_num_seqs,
            max_num_batched_tokens=eng.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=eng.enable_chunked_prefill,
            num_speculative_tokens=eng.num_speculative_tokens,
            ngram_min=eng.speculative_ngram_min,
            ngram_max=eng.speculative_ngram_max,
        )
        return Scheduler(cfg, kv, policy_cls())

    def _kv_variant(self, num_prompt_tokens: int) -> str | None:
        """Longrope rotates a prompt with its long factors when the prompt is longer than the
        original context, so the same tokens' KV differs between short and long prompts: they
        must not share prefix-cache blocks."""
        scaling = self.arch.rope_scaling
        if scaling is None or scaling.rope_type != "longrope":
            return None
        return "longrope-long" if num_prompt_tokens > scaling.original_max_position_embeddings else "longrope-short"

    def kv_compat_hash(self) -> str:
        """What two instances must share to exchange KV blocks (docs/architecture.md §2): the model
        name, dtype, KV shapes and block size, and fingerprints of the weights and the tokenizer
        (``tandem.models.fingerprint``), so that two checkpoints of one architecture, or two
        tokenizers, never exchange KV. The parallel sizes are not in it: instances split
        differently read each other's KV by shard (``tandem.transport.shard_plan``)."""
        from tandem.models.fingerprint import tokenizer_fingerprint, weights_fingerprint
        from tandem.models.loader import checkpoint_files

        a = self.arch
        path = self.config.model.path.rstrip("/")
        model = self.config.model.served_model_name or path.rsplit("/", 1)[-1]
        t0 = time.perf_counter()
        weights = weights_fingerprint(checkpoint_files(path))
        tokenizer = tokenizer_fingerprint(self.tokenizer)
        logger.info("fingerprinted the weights and tokenizer in %.3f s", time.perf_counter() - t0)
        return compat_hash(model=model, dtype=str(self.dtype).removeprefix("torch."),
                           num_layers=a.num_hidden_layers, num_kv_heads=a.num_key_value_heads,
                           head_dim=a.head_dim, block_size=self.config.engine.block_size,
                           weights=weights, tokenizer=tokenizer)

    def _build_structured_outputs(self) -> StructuredOutputManager:
        """The grammars of constrained requests (the backend reads the whole vocabulary once,
        when the first constrained request needs it)."""
        from tandem.models.loader import load_tokenizer

        eng = self.config.engine
        backend = self.registry.get("structured_output_backend", eng.structured_output_backend)
        path = self.config.model.tokenizer or self.config.model.path
        return StructuredOutputManager(backend, lambda: load_tokenizer(path), self.arch.vocab_size,
                                       self.eos_token_ids, compile_threads=eng.grammar_compile_threads,
                                       compile_timeout_s=eng.grammar_compile_timeout_s,
                                       max_ms_per_token=eng.max_grammar_ms_per_token)

    def _build_kv_transfer(self) -> KVTransferCoordinator | None:
        """A prefill or decode instance registers its KV pool with the configured connector."""
        disagg = self.config.disaggregation
        if disagg.role is Role.BOTH:
            return None
        compat = self.kv_compat_hash()
        connector = self.executor.connect_kv(disagg.kv_connector, compat)
        secret = disagg.kv_transfer_secret
        return KVTransferCoordinator(
            connector, self.scheduler, engine_id=uuid.uuid4().hex, compat_hash=compat,
            block_bytes=kv_bytes_per_block(self.arch, self.config.engine.block_size, self.dtype),
            transfer_timeout_s=disagg.kv_transfer_timeout_s, expiry_s=disagg.kv_expiry_s,
            failure_policy=disagg.kv_load_failure_policy,
            secret=secret.get_secret_value().encode() if secret is not None else None)

    def _build_kv_events(self) -> KVEventPublisher | None:
        cfg = self.config.kv_events
        if not cfg.enabled:
            return None
        if not self.config.engine.enable_prefix_caching:
            raise ConfigError("kv_events.enabled needs engine.enable_prefix_caching: the events say "
                              "what enters and leaves the prefix cache")
        self.scheduler.kv.record_events()
        settings = PublisherSettings(endpoint=cfg.endpoint, replay_endpoint=cfg.replay_endpoint,
                                     topic=cfg.topic, buffer_steps=cfg.buffer_steps, hwm=cfg.hwm,
                                     max_queue_size=cfg.max_queue_size, medium=cfg.medium)
        try:
            return KVEventPublisher(settings)
        except OSError as exc:
            raise ConfigError(f"kv_events.endpoint / kv_events.replay_endpoint: {exc}") from exc

    def close(self) -> None:
        """Stop the executor, the KV event publisher and release the KV connector (idempotent)."""
        self.structured.close()
        if self.kv_events is not None:
            self._publish_kv_events()
            self.kv_events.close()
        self.executor.close()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (published as a KV event at once); returns
        how many."""
        forgotten = self.scheduler.kv.reset_prefix_cache()
        self._publish_kv_events()
        return forgotten

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None and (events := self.scheduler.kv.take_events()):
            self.kv_events.publish(events)

    # ----------------------------------------------------------------------------- requests

    @property
    def request_limits(self) -> RequestLimits:
        """What ``add_request`` lets through (see ``tandem.input_processor``)."""
        return RequestLimits(vocab_size=self.arch.vocab_size, max_model_len=self.max_model_len,
                             max_num_seqs=self.config.engine.max_num_seqs,
                             max_logprobs=self.config.engine.max_logprobs,
                             max_abs_priority=self.config.server.max_abs_priority)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        remote_decode: bool = False,
        remote_prefill: RemotePrefill | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Check the request (``InputProcessor.process``, with the engine's tokenizer) and queue
        it (``add_processed``); returns its id. ``cache_salt`` (vLLM's): its prompt shares
        prefix-cache blocks only with requests of the same salt. Raises ``InvalidRequest`` (a
        ValueError naming the field) for input this engine refuses (see
        ``InputProcessor.process``), ValueError for an id already in use (the offline path's one
        check of ids: ``add_processed``'s callers own it), and what ``add_processed`` raises."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.outputs.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = self.input_processor.process(self.tokenizer, prompt, params or SamplingParams(),
                                                 priority, cache_salt)
        self.add_processed(request_id, processed, arrival_time, remote_decode, remote_prefill)
        return request_id

    def add_processed(self, request_id: str, processed: ProcessedRequest, arrival_time: float | None = None,
                      remote_decode: bool = False, remote_prefill: RemotePrefill | None = None) -> None:
        """Queue a request the input processor has checked, under an id not in use (the
        caller's to check: ``add_request``, ``AsyncEngine.add_requests``). Raises
        RequestRejected (a ValueError) when the KV pool could never hold it, an
        ``InvalidRequest`` for a grammar that does not compile when it compiles at once, and
        ValueError for a KV hand-over asked of a colocated instance.

        On a prefill instance, ``remote_decode`` keeps the request's blocks pinned when it
        finishes; its final output carries the ``kv_transfer_params`` a decode instance needs.
        On a decode instance, ``remote_prefill`` loads the prompt's KV from the prefill instance
        instead of computing it (see ``KVTransferCoordinator.admit``: a used transfer id raises
        ``KVTransferReplayed``, a compat mismatch ValueError, a load refused under the "fail"
        policy ``KVTransferFailed``)."""
        if (remote_decode or remote_prefill is not None) and self.kv_transfer is None:
            raise ValueError("kv_transfer_params need a prefill or decode instance; this one is "
                             "colocated (disaggregation.role = both)")
        params, token_ids = processed.params, processed.prompt_token_ids
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(self.max_model_len - len(token_ids), 1)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=processed.priority,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            max_tokens=max_tokens,
            cache_salt=request_cache_salt(processed.cache_salt, self._kv_variant(len(token_ids))),
        )
        if remote_decode:
            request.remote_kv = RemoteKV.STREAM if self.config.disaggregation.stream_kv else RemoteKV.SEND
        try:  # all or nothing: a plugin or tokenizer that raises leaves no trace of the request
            if request.remote_kv is RemoteKV.STREAM:
                self.kv_transfer.open_stream(request_id, token_ids, request.cache_salt)
            if remote_prefill is not None and self.kv_transfer.admit(request_id, remote_prefill,
                                                                     token_ids, request.cache_salt):
                request.remote_kv = RemoteKV.LOAD
            if params.structured_outputs is not None:
                self.structured.compile_for(request_id, params.structured_outputs)
                self._check_added(self.scheduler.add_request(request, wait_for_grammar=True))
                self._admit_compiled([request_id], adding=True)
            else:
                self._check_added(self.scheduler.add_request(request))
            # last: what it raises it raises before it keeps anything
            self.outputs.add_request(request_id, processed.prompt, token_ids, params)
        except BaseException:
            if self.kv_transfer is not None:
                self.kv_transfer.forget(request_id)
            self.structured.release(request_id)
            self.scheduler.abort_requests([request_id])
            raise

    @staticmethod
    def _check_added(request: Request) -> None:
        if request.status is RequestStatus.FINISHED_REJECTED:
            raise RequestRejected(request.reject_reason)

    def _admit_compiled(self, request_ids: list[str], adding: bool = False) -> list[RequestOutput]:
        """Move the requests of ``request_ids`` whose grammar has compiled into the scheduler;
        a compile that failed or passed its time limit, or a request the scheduler rejects,
        fails the request. With ``adding`` (``add_request``'s own request) it raises instead.
        Each request settled here is recorded for ``take_grammar_admissions``."""
        outputs = []
        for rid in request_ids:
            try:
                if not self.structured.start_compiled(rid):
                    continue
                self._check_added(self.scheduler.grammar_compiled(rid))
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                if adding:
                    raise
                self._report_admission(rid, exc)
                outputs.append(self._fail(rid, exc, "starting its grammar"))
            else:
                if not adding:
                    self._report_admission(rid, None)
        return outputs

    def is_awaiting_grammar(self, request_id: str) -> bool:
        """True while ``request_id``'s grammar compiles (WAITING_FOR_GRAMMAR)."""
        request = self.scheduler.get_request(request_id)
        return request is not None and request.status is RequestStatus.WAITING_FOR_GRAMMAR

    def take_grammar_admissions(self) -> list[tuple[str, BaseException | None]]:
        """(request id, None when it joined the scheduler, else why it failed) of the requests
        whose grammar wait ended since the last call (``add_request``'s own are not listed)."""
        taken, self._grammar_admissions = self._grammar_admissions, []
        return taken

    def _report_admission(self, request_id: str, error: BaseException | None) -> None:
        if self.report_grammar_admissions:
            self._grammar_admissions.append((request_id, error))

    def abort_request(self, request_ids: str | list[str], error: str | None = None) -> list[RequestOutput]:
        """Abort requests at any moment (ids it does not hold are ignored): their blocks are free
        when this returns. Returns their final outputs: finish reason "abort" for every sequence
        that had not finished, or "error" with ``error`` as the output's message when one is
        given."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        reason = "abort" if error is None else "error"
        if self.kv_transfer is not None:
            for rid in ids:
                self.kv_transfer.forget(rid)
        for rid in ids:
            self.outputs.finish_all(rid, reason, error)
        for request in self.scheduler.abort_requests(ids):
            self._on_finished(request, reason)
        return [out for rid in ids if (out := self.outputs.output(rid, self.delta_outputs)) is not None]

    def request_ids(self) -> list[str]:
        """The ids of the requests this engine holds: admitted, their final output not yet
        returned."""
        return list(self.outputs.states)

    def has_unfinished_requests(self) -> bool:
        """Requests to step, or KV hand-overs not over (reads whose blocks are held)."""
        return self.scheduler.has_unfinished_requests() or (
            self.kv_transfer is not None and self.kv_transfer.has_loads())

    def awaits_kv_announcements(self) -> bool:
        """Every KV load in progress waits for announcements of a streamed hand-over."""
        return self.kv_transfer is not None and self.kv_transfer.awaits_announcements()

    def has_kv_pins(self) -> bool:
        """Blocks pinned for decode instances: ``poll_kv_transfers`` must run now and then."""
        return self.kv_transfer is not None and self.kv_transfer.has_pins()

    def check_health(self) -> None:
        """While idle: raise ``EngineDeadError`` when the executor's workers died (a step would
        find out only when the next request comes)."""
        self.executor.check_health()

    def poll_kv_transfers(self) -> None:
        """Release notified or expired pins and end finished loads (every ``step`` does it too;
        call it while idle). Requests failed by the "fail" policy: ``take_failed_requests``."""
        if self.kv_transfer is None:
            return
        self.kv_transfer.on_new_pins(self.scheduler.take_new_pins())  # of aborted streams: no params
        for request_id, message in self.kv_transfer.poll():
            for request in self.scheduler.abort_requests([request_id]):
                self._on_finished(request)
            self.outputs.finish_all(request_id, "abort")
            self._failed.append((request_id, message))

    def take_failed_requests(self) -> list[tuple[str, str]]:
        """(request id, message) of the requests failed since the last call: their KV could not
        be loaded. They are finished (reason "abort") and hold no blocks."""
        failed, self._failed = self._failed, []
        return failed

    # ----------------------------------------------------------------------------- the loop

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update. Returns the outputs of the requests that changed, failed
        ones included (see the module docstring); raises only ``EngineDeadError``."""
        t0 = time.perf_counter()
        started = self._start_compiled()
        try:
            self.poll_kv_transfers()
            sched_out = self.scheduler.schedule()
            if self.kv_transfer is not None:
                self.kv_transfer.start_loads(self.scheduler.take_new_loads())
            sched_out.grammar = self.structured.bitmask(sched_out)
            runner_out = self.executor.execute(sched_out)
            updates = self.scheduler.update_from_output(sched_out, runner_out)
        except Exception as exc:  # noqa: BLE001 - isolated below; only EngineDeadError escapes
            return started + self._on_step_failed(exc)
        self._num_failed_steps_in_row = 0
        changed: dict[str, None] = {}
        failed: dict[str, BaseException] = {}
        for update in updates:
            req = update.request
            root = req.parent_id or req.request_id
            try:
                self._process_update(req, update.new_token_ids, runner_out)
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                failed.setdefault(root, exc)
            changed[root] = None
        self._take_chunk_prompt_logprobs(updates, runner_out, changed)
        self._record_step(sched_out, runner_out, time.perf_counter() - t0)
        self._publish_kv_events()
        outputs = [o for rid in changed if rid not in failed and (o := self._output(rid, failed))]
        outputs += [self._fail(rid, exc, "post-processing its tokens") for rid, exc in failed.items()]
        outputs += started
        if self.kv_transfer is not None:
            self.kv_transfer.announce(self.scheduler.stream_progress())
            params = self.kv_transfer.on_new_pins(self.scheduler.take_new_pins())
            for out in outputs:
                if out.request_id in params:
                    out.kv_transfer_params = params[out.request_id]
        return outputs

    def _start_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar compiled since the last step. While nothing else
        is there to step, wait a little for a compile rather than spin."""
        compiling = self.scheduler.waiting_for_grammar()
        if not compiling:
            return []
        if not self.scheduler.has_requests_to_step():
            self.structured.wait_for_compiles(_GRAMMAR_POLL_S)
        return self._admit_compiled(compiling)

    def _process_update(self, req: Request, new_token_ids: list[int], runner_out: Any) -> None:
        if not self.structured.accept(req.request_id, new_token_ids):
            raise ValueError(f"its output left its grammar at one of the tokens {new_token_ids} (no "
                             "token the grammar allows was left after the request's other bans, "
                             "such as min_tokens)")
        stop_str = self.outputs.process(req, new_token_ids, runner_out)
        if stop_str is not None and not req.is_finished:
            req.stop_reason = stop_str
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        if req.is_finished:
            self._on_finished(req)

    def _take_chunk_prompt_logprobs(self, updates: list, runner_out: Any, changed: dict[str, None]) -> None:
        """The prompt logprobs of the requests that computed a chunk of their prompt this step
        without sampling (the others took theirs with their tokens)."""
        sampled = {update.request.request_id for update in updates}
        for request_id in runner_out.prompt_logprobs.keys() - sampled:
            request = self.scheduler.get_request(request_id)
            if request is not None and self.outputs.add_prompt_logprobs(request, runner_out):
                changed[request.parent_id or request_id] = None

    def _output(self, request_id: str, failed: dict[str, BaseException]) -> RequestOutput | None:
        try:
            if self.final_outputs_only and not self.outputs.is_finished(request_id):
                return None
            return self.outputs.output(request_id, self.delta_outputs)
        except Exception as exc:  # noqa: BLE001 - this request alone fails
            failed[request_id] = exc
            return None

    def _on_step_failed(self, exc: Exception) -> list[RequestOutput]:
        """Isolate the failed step's requests; fail the one that failed alone."""
        if isinstance(exc, EngineDeadError):
            raise exc
        if _is_accelerator_error(exc):
            raise EngineDeadError(f"the device failed: {type(exc).__name__}: {exc}") from exc
        self._num_failed_steps_in_row += 1
        failed = self.scheduler.isolate_step()
        logger.error("an engine step failed (%s); %s", f"{type(exc).__name__}: {exc}",
                     f"failing request {failed[0]}, which failed alone" if failed else
                     "retrying its requests one by one", exc_info=exc)
        try:
            self.scheduler.kv.check_consistency()
        except AssertionError as bad:
            raise EngineDeadError(f"the KV pool is inconsistent after a failed step: {bad}") from exc
        if self._num_failed_steps_in_row >= MAX_FAILED_STEPS_IN_ROW:
            raise EngineDeadError(f"{self._num_failed_steps_in_row} engine steps failed in a row; "
                                  f"the last one: {type(exc).__name__}: {exc}") from exc
        return [self._fail(rid, exc, "its step") for rid in failed]

    def _fail(self, request_id: str, exc: BaseException, where: str) -> RequestOutput:
        """Fail one client request: its blocks are freed, its output ends with finish reason
        "error" and a message naming the request and the exception."""
        if where != "its step":
            logger.error("request %s failed while %s", request_id, where, exc_info=exc)
        message = f"request {request_id} failed in the engine ({where}): {type(exc).__name__}: {exc}"
        finals = self.abort_request(request_id, error=message)
        if finals:
            return finals[0]
        return RequestOutput(request_id, None, [], [], finished=True, error=message)

    def _on_finished(self, request: Request, reason: str | None = None) -> None:
        self.structured.release(request.request_id)
        self.outputs.finish(request)
        call_observers(
            "tandem_request_finished",
            request_id=request.request_id,
            finish_reason=reason or request.status.finish_reason or "abort",
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
        )

    def _record_step(self, sched_out: Any, runner_out: Any, duration_s: float) -> None:
        sampled = runner_out.sampled_token_ids
        drafts = sched_out.spec_token_ids
        num_drafts = sum(len(d) for d in drafts.values())
        num_accepted = sum(len(sampled[rid]) - 1 for rid in drafts if rid in sampled)
        total = sched_out.total_num_scheduled_tokens
        self.last_step = StepStats(
            num_tokens=total,
            num_seqs=len(sched_out.num_scheduled_tokens),
            # each sampling request's last token and its drafts are generation-phase inputs
            num_prompt_tokens=max(total - len(sampled) - num_drafts, 0),
            num_generation_tokens=sum(len(t) for t in sampled.values()),
            num_draft_tokens=num_drafts,
            num_accepted_draft_tokens=num_accepted,
            duration_s=duration_s,
            kv_transfer_seconds=tuple(self.kv_transfer.take_transfer_durations()
                                      if self.kv_transfer is not None else ()),
        )


def _is_accelerator_error(exc: BaseException) -> bool:
    """A CUDA (or other accelerator) error: the device's state is unknown afterwards."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)
