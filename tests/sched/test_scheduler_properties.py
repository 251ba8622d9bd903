"""Property tests: Scheduler + PagedKVAllocator under random workloads, against a simulated runner.

Random arrivals, prompts that often share prefixes, output lengths, n, priorities, aborts (between
steps and while a step is in flight), stop-string finishes, tiny KV pools and small budgets, both
policies and a prompt cap, and speculative decoding (n-gram drafts the simulated model accepts
or rejects at random, so rejected drafts' KV sits in blocks that other requests may share). Checked at every step: the token budget and the sequence limit hold;
every block's ref count equals the number of block tables holding it and the free count matches;
tables cover exactly ``num_computed_tokens`` (plus at most the slots of rejected drafts); waiting requests hold no blocks; the runner's view of
every table (rebuilt from the diffs alone) equals the allocator's; every context slot a request
reads holds that request's own prefix (see sim_runner); under FCFS no request is admitted while an
earlier one waits. At the end: every request finished, was aborted, or was rejected with a
reason, within a step bound, and the whole pool is free again.

Some steps fail after the runner wrote their KV (a model error), and some requests are poison:
every step they are in fails. After a failed step the scheduler isolates (``isolate_step``) and
the harness aborts the request it names; then a poison request never samples a token, and
every other one still ends, with no block leaked and no stale KV read.

Some requests take their prompt's KV from a simulated remote instance (WAITING_FOR_REMOTE_KV):
a load ends after a few steps, done or failed, and on "done" writes the prompt's prefixes into
the shadow pool exactly where a connector would (even for a request aborted meanwhile, whose
blocks the scheduler must therefore hold). Some failed loads are late: they pass their deadline,
the request recomputes, and a few steps later the read still lands in the blocks it was given,
which must have stayed held out of the free pool until the harness releases them. Others pin their blocks when they finish; a pin must
hold the request's own prefix until it is released.
"""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.plugins.policies import FCFSPolicy, PriorityPolicy
from tandem.sched.kv_manager import PagedKVAllocator
from tandem.sched.request import RemoteKV, Request, RequestStatus
from tandem.sampling_params import SamplingParams
from tandem.sched.scheduler import Scheduler, SchedulerConfig, quarantine_holder_id

from tests.sched.sim_runner import EOS, SimulatedRunner

PREFIXES = [tuple(range(101, 113)), tuple(range(201, 207)), (7, 7, 7, 7, 7, 7, 7, 7)]
MAX_STEPS = 2000


@dataclass(frozen=True)
class Spec:
    rid: str
    prompt: tuple[int, ...]
    arrival_step: int
    max_tokens: int
    n: int
    priority: int
    ignore_eos: bool
    prompt_logprobs: bool
    exit_step: int | None
    exit_kind: str
    kv_role: str = "none"
    kv_steps: int = 0
    load_ok: bool = True
    late: bool = False
    poison: bool = False


@dataclass(frozen=True)
class Workload:
    block_size: int
    num_blocks: int
    caching: bool
    config: SchedulerConfig
    specs: tuple[Spec, ...]
    failing_steps: frozenset[int] = frozenset()


@st.composite
def prompts(draw):
    prefix = draw(st.sampled_from(PREFIXES))
    prefix = prefix[: draw(st.integers(0, len(prefix)))]
    suffix = draw(st.lists(st.integers(1, 30), min_size=0 if prefix else 1, max_size=8))
    return (*prefix, *suffix)


@st.composite
def specs(draw, index, with_priorities):
    return Spec(
        rid=f"r{index}",
        prompt=draw(prompts()),
        arrival_step=draw(st.sampled_from([0, 0, 0, 1, 2, 3, 5, 8, 13])),
        max_tokens=draw(st.integers(1, 10)),
        n=draw(st.sampled_from([1, 1, 1, 2, 3])),
        priority=draw(st.integers(0, 3)) if with_priorities else 0,
        ignore_eos=draw(st.booleans()),
        prompt_logprobs=draw(st.integers(0, 5)) == 0,
        exit_step=draw(st.integers(0, 30)) if draw(st.integers(0, 3)) == 0 else None,
        exit_kind=draw(st.sampled_from(["abort", "abort_in_flight", "finish"])),
        kv_role=draw(st.sampled_from(["none", "none", "remote", "pin"])),
        kv_steps=draw(st.integers(0, 4)),
        load_ok=draw(st.integers(0, 3)) > 0,
        late=draw(st.booleans()),
        poison=draw(st.integers(0, 11)) == 0,
    )


@st.composite
def workloads(draw, with_priorities=False):
    num_requests = draw(st.integers(1, 12))
    block_size = draw(st.sampled_from([1, 2, 4]))
    return Workload(
        block_size=block_size,
        num_blocks=draw(st.integers(16, 64)) // block_size + 1,
        caching=draw(st.booleans()),
        config=SchedulerConfig(
            max_num_seqs=draw(st.integers(2, 8)),
            max_num_batched_tokens=draw(st.integers(3, 32)),
            max_model_len=draw(st.integers(16, 48)),
            enable_chunked_prefill=draw(st.booleans()),
            num_speculative_tokens=draw(st.sampled_from([0, 0, 1, 3])),
            ngram_min=1,
        ),
        specs=tuple(draw(specs(i, with_priorities)) for i in range(num_requests)),
        failing_steps=frozenset(draw(st.lists(st.integers(0, 40), max_size=3))),
    )


def build(spec: Spec) -> Request:
    return Request(
        request_id=spec.rid,
        prompt_token_ids=list(spec.prompt),
        sampling_params=SamplingParams(
            n=spec.n, max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos,
            prompt_logprobs=0 if spec.prompt_logprobs else None,
        ),
        eos_token_ids=frozenset({EOS}),
        priority=spec.priority,
        arrival_time=spec.arrival_step + int(spec.rid[1:]) * 1e-3,
        max_tokens=spec.max_tokens,
    )


class Harness:
    def __init__(self, workload: Workload, policy) -> None:
        self.w = workload
        self.kv = PagedKVAllocator(workload.num_blocks, workload.block_size, workload.caching)
        self.sched = Scheduler(workload.config, self.kv, policy)
        self.runner = SimulatedRunner(workload.num_blocks, workload.block_size)
        self.policy = policy
        self.requests: dict[str, Request] = {}
        self.specs = {spec.rid: spec for spec in workload.specs}
        self.loads: dict[str, list] = {}
        self.loaded: set[str] = set()
        self.pins: dict[str, list] = {}
        self.isolated_once = False

    def run(self) -> None:
        for step in range(MAX_STEPS):
            self._arrive(step)
            self._exit(step, ("abort", "finish"))
            self._collect_pins()
            self._advance_kv()
            out = self.sched.schedule()
            self._check_step(out)
            for load in self.sched.take_new_loads():
                self.loads[load.request_id] = [load, self.specs[load.request_id].kv_steps, False]
            self._exit(step, ("abort_in_flight",))
            result = self.runner.execute(out)
            if self._fails(step, out):
                self._isolate(out)
                self.isolated_once = True
                continue
            self.sched.update_from_output(out, result)
            self._collect_pins()
            self._check_blocks(runner_synced=True)
            all_arrived = step >= max(s.arrival_step for s in self.w.specs)
            idle = not (self.sched.has_unfinished_requests() or self.loads)
            if all_arrived and idle and not self.pins:
                break
        else:
            raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")
        self._check_end()

    def _fails(self, step: int, out) -> bool:
        """Whether the model "raises" on this step (after its KV was written)."""
        poisoned = any(self.specs[rid.split("#")[0]].poison for rid in out.num_scheduled_tokens)
        return poisoned or (step in self.w.failing_steps and bool(out.num_scheduled_tokens))

    def _isolate(self, out) -> None:
        in_step = {rid.split("#")[0] for rid in out.num_scheduled_tokens
                   if not self.requests[rid].is_finished}
        in_step |= {f.parent_id for f in out.forked_requests if not self.requests[f.parent_id].is_finished}
        failed = self.sched.isolate_step()
        assert failed == (sorted(in_step) if len(in_step) == 1 else []), (failed, in_step)
        for request in self.sched.abort_requests(failed):
            assert request.status is RequestStatus.FINISHED_ABORTED
        self.kv.check_consistency()
        self._check_blocks(runner_synced=False)

    def _collect_pins(self) -> None:
        for pin in self.sched.take_new_pins():
            self._check_pin(pin)
            self.pins[pin.pin_id] = [pin, self.specs[pin.request_id].kv_steps]

    def _advance_kv(self) -> None:
        for rid, entry in list(self.loads.items()):
            load, steps, late = entry
            if steps:
                entry[1] -= 1
                continue
            spec, request = self.specs[rid], self.requests[rid]
            if late or request.is_finished:  # the read ends into blocks held for it
                if late or spec.load_ok or spec.late:
                    self._write_loaded(request, load)
                del self.loads[rid]
                assert self.sched.release_blocks(quarantine_holder_id(rid)) or not load.block_ids
            elif spec.load_ok:
                self._write_loaded(request, load)
                self.loaded.add(rid)
                del self.loads[rid]
                self.sched.finish_remote_load(rid, True)
            elif spec.late:  # past its deadline: it recomputes, the read lands later
                entry[1], entry[2] = spec.kv_steps, True
                self.sched.finish_remote_load(rid, False, quarantine=True)
            else:
                del self.loads[rid]
                self.sched.finish_remote_load(rid, False)
        for pin_id, entry in list(self.pins.items()):
            pin, steps = entry
            if steps:
                entry[1] -= 1
                continue
            self._check_pin(pin)
            del self.pins[pin_id]
            assert self.sched.release_blocks(pin_id)
            assert not self.sched.release_blocks(pin_id)

    def _write_loaded(self, request: Request, load) -> None:
        """What a connector writes: the prompt's KV at positions [num_cached, P-1)."""
        bs, prompt = self.w.block_size, request.prompt_token_ids
        assert load.first_block == load.num_cached_tokens // bs
        assert load.first_block + len(load.block_ids) == -(-(len(prompt) - 1) // bs)
        for pos in range(load.num_cached_tokens, len(prompt) - 1):
            block = load.block_ids[pos // bs - load.first_block]
            self.runner.shadow[block][pos % bs] = tuple(prompt[:pos + 1])

    def _check_pin(self, pin) -> None:
        tokens, bs = self.requests[pin.request_id].all_token_ids, self.w.block_size
        assert pin.block_ids == self.kv.get_block_ids(pin.pin_id)
        assert len(pin.block_ids) >= -(-pin.num_tokens // bs)
        for pos in range(pin.num_tokens):
            found = self.runner.shadow[pin.block_ids[pos // bs]][pos % bs]
            assert found == tuple(tokens[:pos + 1]), f"pin {pin.pin_id} position {pos} holds {found}"

    def _arrive(self, step: int) -> None:
        for spec in self.w.specs:
            if spec.arrival_step == step:
                request = build(spec)
                request.remote_kv = {"remote": RemoteKV.LOAD, "pin": RemoteKV.SEND}.get(spec.kv_role, RemoteKV.NONE)
                request = self.sched.add_request(request)
                self.requests[spec.rid] = request
                if request.status is RequestStatus.FINISHED_REJECTED:
                    assert request.reject_reason

    def _exit(self, step: int, kinds: tuple[str, ...]) -> None:
        ids = [s.rid for s in self.w.specs if s.exit_step == step and s.exit_kind in kinds]
        if "finish" in kinds:
            finish = [s.rid for s in self.w.specs if s.exit_step == step and s.exit_kind == "finish"]
            self.sched.finish_requests(finish, RequestStatus.FINISHED_STOPPED)
            ids = [i for i in ids if i not in finish]
        for request in self.sched.abort_requests(ids):
            assert request.status is RequestStatus.FINISHED_ABORTED

    def _live(self) -> list[Request]:
        return [r for r in self.requests.values() if not r.is_finished]

    def _check_step(self, out) -> None:
        cfg, bs = self.w.config, self.w.block_size
        for fork in out.forked_requests:
            self.requests[fork.request_id] = self.sched.get_request(fork.request_id)
        assert all(n >= 1 for n in out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        running = [r for r in self._live() if r.status is RequestStatus.RUNNING]
        loading = [r for r in self._live() if r.status is RequestStatus.WAITING_FOR_REMOTE_KV]
        assert sum(r.num_sequences for r in running + loading) <= cfg.max_num_seqs
        assert len(running) == self.sched.num_running
        assert len(loading) == self.sched.num_loading
        for r in self._live():
            table = self.kv.get_block_ids(r.request_id)
            if r.status is RequestStatus.RUNNING:
                # rejected drafts leave their blocks to the next steps' tokens: at most k slots
                spare = cfg.num_speculative_tokens
                assert -(-r.num_computed_tokens // bs) <= len(table) <= -(-(r.num_computed_tokens + spare) // bs)
            elif r.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                assert len(table) == -(-(r.num_prompt_tokens - 1) // bs)
                assert r.num_computed_tokens % bs == 0
            else:
                assert table == [] and r.num_computed_tokens == 0
        self._check_blocks(runner_synced=False)
        if isinstance(self.policy, FCFSPolicy) and not self.sched.num_isolated and not self.isolated_once:
            waiting = [r for r in self._live()
                       if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)]
            from_loads = self.loaded & {new.request_id for new in out.new_requests}
            self.loaded -= from_loads
            for new in out.new_requests:
                if new.request_id in from_loads:
                    preempted = self.requests[new.request_id].metrics.num_preemptions > 0
                    assert preempted or new.num_computed_tokens == new.num_prompt_tokens - 1
                    continue
                key = self.policy.sort_key(self.requests[new.request_id])
                assert all(key < self.policy.sort_key(w) for w in waiting), "a request was overtaken"

    def _check_blocks(self, runner_synced: bool) -> None:
        refs = [0] * self.w.num_blocks
        tables = [self.kv.get_block_ids(pin_id) for pin_id in self.pins]
        tables += [self.kv.get_block_ids(quarantine_holder_id(rid)) for rid in self.loads]
        for r in self.requests.values():
            table = self.kv.get_block_ids(r.request_id)
            assert not (r.is_finished and table), f"finished {r.request_id} still holds blocks"
            held = self.runner.held.get(r.request_id)
            if runner_synced and held is not None and r.status is RequestStatus.RUNNING:
                assert held.table == table, f"runner's table of {r.request_id} is out of sync"
            tables.append(table)
        for table in tables:
            for block_id in table:
                refs[block_id] += 1
        pool = self.kv.block_pool
        assert refs[0] == 0
        assert refs == [b.ref_count for b in pool.blocks]
        assert pool.num_free_blocks == self.w.num_blocks - 1 - sum(1 for c in refs if c)

    def _check_end(self) -> None:
        for r in self.requests.values():
            assert r.is_finished, f"{r.request_id} ended as {r.status!r}"
            if r.status is RequestStatus.FINISHED_REJECTED:
                assert r.reject_reason
            assert r.num_output_tokens <= r.max_tokens
            if self.specs[r.request_id.split("#")[0]].poison:
                assert r.num_output_tokens == 0, f"poison request {r.request_id} sampled"
        assert self.kv.stats().num_free_blocks == self.w.num_blocks - 1
        assert all(b.ref_count == 0 for b in self.kv.block_pool.blocks)


PROPERTY_SETTINGS = settings(max_examples=100, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(workloads())
def test_fcfs_workloads_keep_every_invariant_and_finish(workload):
    Harness(workload, FCFSPolicy()).run()


@PROPERTY_SETTINGS
@given(workloads(with_priorities=True))
def test_priority_workloads_keep_every_invariant_and_finish(workload):
    Harness(workload, PriorityPolicy()).run()


class CappedFCFS(FCFSPolicy):
    """FCFS that admits at most ``cap`` prompt-phase tokens per step."""

    def __init__(self, cap: int) -> None:
        self.cap = cap

    def max_prompt_tokens_per_step(self) -> int:
        return self.cap


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 12))
def test_capped_prompt_workloads_keep_every_invariant_and_finish(workload, cap):
    Harness(workload, CappedFCFS(cap)).run()
