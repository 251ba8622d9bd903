"""Helpers shared by the scheduler tests: request factories and a one-step fake runner."""
from tandem.plugins.policies import FCFSPolicy
from tandem.sched.kv_manager import PagedKVAllocator
from tandem.sched.output import ModelRunnerOutput
from tandem.sched.request import RemoteKV, Request
from tandem.sampling_params import SamplingParams
from tandem.sched.scheduler import Scheduler, SchedulerConfig


def make_request(rid, prompt, *, max_tokens=8, arrival=0.0, priority=0, eos=(),
                 remote_kv=RemoteKV.NONE, **params):
    return Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=frozenset(eos),
        priority=priority,
        arrival_time=arrival,
        max_tokens=max_tokens,
        remote_kv=remote_kv,
    )


def make_scheduler(*, num_blocks=64, block_size=4, policy=None, caching=True, **config):
    kv = PagedKVAllocator(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(**config), kv, policy or FCFSPolicy())


def run_step(scheduler, tokens=None, default_token=100):
    """schedule(), then sample ``tokens.get(rid, default_token)`` for every request whose last
    known token this step computed (and every sequence forked this step), then update."""
    out = scheduler.schedule()
    result = ModelRunnerOutput()
    ids = [*out.num_scheduled_tokens, *(f.request_id for f in out.forked_requests)]
    for rid in ids:
        request = scheduler.get_request(rid)
        if request.num_computed_tokens == request.num_tokens:
            result.sampled_token_ids[rid] = [(tokens or {}).get(rid, default_token)]
    updates = scheduler.update_from_output(out, result)
    return out, updates

