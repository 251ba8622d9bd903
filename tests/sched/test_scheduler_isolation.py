"""Isolation after a failed step, on hand-worked cases: the step's tokens count as never
computed, its sequences are retried one at a time, and only a step that fails alone names a
request to fail."""
import pytest

from tandem.plugins.policies import FCFSPolicy
from tandem.sched.request import RequestStatus

from tests.sched.sched_helpers import make_request, make_scheduler, run_step


def _fail_step(scheduler):
    """schedule() and then a runner that raises: the engine calls isolate_step()."""
    out = scheduler.schedule()
    return out, scheduler.isolate_step()


def test_a_failed_batch_is_retried_one_request_at_a_time():
    s = make_scheduler(block_size=4)
    a, b, c = (s.add_request(make_request(rid, range(i, i + 6))) for i, rid in enumerate("abc"))
    out, failed = _fail_step(s)
    assert out.num_scheduled_tokens == {"a": 6, "b": 6, "c": 6} and failed == []
    assert [r.status for r in (a, b, c)] == [RequestStatus.PREEMPTED] * 3
    assert [r.num_computed_tokens for r in (a, b, c)] == [0, 0, 0]
    assert s.kv.stats().num_used_blocks == 0
    # each alone, in the failed step's order; the runner is told to drop its state of all three
    out1, up1 = run_step(s)
    assert out1.num_scheduled_tokens == {"a": 6}
    assert out1.preempted_req_ids == {"a", "b", "c"}
    assert [u.request.request_id for u in up1] == ["a"]
    out2, _ = run_step(s)
    assert out2.num_scheduled_tokens == {"b": 6}
    out3, _ = run_step(s)
    assert out3.num_scheduled_tokens == {"c": 6}
    # isolation over: normal batching
    out4, _ = run_step(s)
    assert out4.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    assert s.num_preemptions == 0  # isolation is not a preemption for memory


def test_a_request_that_fails_alone_is_named_and_the_others_go_on():
    s = make_scheduler(block_size=4)
    for i, rid in enumerate("abc"):
        s.add_request(make_request(rid, range(i, i + 6)))
    _fail_step(s)
    run_step(s)  # a alone: fine
    out, failed = _fail_step(s)  # b alone: raises again
    assert out.num_scheduled_tokens == {"b": 6} and failed == ["b"]
    s.abort_requests(failed)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"c": 6}
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "c": 1}


def test_a_single_request_step_that_fails_names_it_at_once():
    s = make_scheduler()
    s.add_request(make_request("a", range(5)))
    run_step(s)
    _, failed = _fail_step(s)
    assert failed == ["a"]


def test_the_failed_steps_tokens_never_enter_the_prefix_cache():
    s = make_scheduler(block_size=4)
    s.add_request(make_request("a", range(8)))
    s.add_request(make_request("b", range(100, 108)))
    _fail_step(s)
    # nothing was computed: a request with a's prompt finds no cached block
    probe = make_request("x", range(8))
    assert s.kv.get_num_cached_tokens(probe) == 0


def test_a_decoding_request_stays_alone_until_it_samples_a_new_token():
    s = make_scheduler(block_size=4, max_num_batched_tokens=4, caching=False)
    a = s.add_request(make_request("a", range(3), max_tokens=8))
    b = s.add_request(make_request("b", range(10, 13), max_tokens=8))
    run_step(s)  # a's prompt (3) + 1 token of b
    run_step(s)  # a decodes, b continues its prompt
    assert a.num_output_tokens == 2 and b.num_output_tokens == 1
    _fail_step(s)
    # a recomputes prompt + outputs (5 tokens, no prefix cache) in chunks of 4, alone, and must
    # sample once more before b gets its turn
    out1, up1 = run_step(s)
    assert out1.num_scheduled_tokens == {"a": 4} and up1 == []
    out2, up2 = run_step(s)
    assert out2.num_scheduled_tokens == {"a": 1} and [u.request.request_id for u in up2] == ["a"]
    out3, _ = run_step(s)
    assert out3.num_scheduled_tokens == {"b": 4}


def test_forked_children_of_a_failed_step_are_retried_too():
    s = make_scheduler(block_size=4)
    s.add_request(make_request("p", range(6), n=2))
    s.add_request(make_request("q", range(50, 56)))
    out, failed = _fail_step(s)
    assert [f.request_id for f in out.forked_requests] == ["p#1"] and failed == []
    child = s.get_request("p#1")
    assert child.status is RequestStatus.PREEMPTED and child.num_computed_tokens == 0
    assert s.kv.stats().num_used_blocks == 0
    seen = []
    for _ in range(3):
        out, _ = run_step(s)
        seen.append(set(out.num_scheduled_tokens))
    assert seen == [{"p"}, {"q"}, {"p#1"}]


def test_a_failure_inside_schedule_requeues_the_request_it_was_admitting():
    class Fragile(FCFSPolicy):
        name = "fragile"

        def should_preempt_for(self, waiting, running):
            raise RuntimeError("policy bug")

    s = make_scheduler(num_blocks=4, block_size=4, policy=Fragile())
    a = s.add_request(make_request("a", range(8), max_tokens=4))
    run_step(s)
    b = s.add_request(make_request("b", range(20, 28), max_tokens=4))
    try:
        s.schedule()  # b needs blocks a holds: the policy is asked, and raises
    except RuntimeError:
        failed = s.isolate_step()
    else:
        raise AssertionError("the policy was not asked")
    assert failed == []  # a (in flight) and b (being admitted) are both suspects
    assert a.status is RequestStatus.PREEMPTED and b.status is RequestStatus.WAITING
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1}  # its 8 prompt tokens' blocks are cached
    assert s.get_request("b") is b


def test_a_policy_whose_sort_key_raises_leaves_no_trace_of_the_request():
    class Picky(FCFSPolicy):
        name = "picky"

        def sort_key(self, request):
            if request.request_id == "bad":
                raise RuntimeError("policy bug")
            return super().sort_key(request)

    s = make_scheduler(policy=Picky())
    with pytest.raises(RuntimeError, match="policy bug"):
        s.add_request(make_request("bad", range(4)))
    assert not s.has_unfinished_requests() and s.get_request("bad") is None


def test_a_running_probe_short_of_blocks_preempts_another_request_not_itself():
    # 7 usable blocks of 4 tokens; a (8 tokens) is retried first and keeps its 2 blocks while it
    # waits for the isolation to end; b (24 tokens) then needs 6 blocks over two chunks, and for
    # the second only 1 is free. FCFS names the newest request, b itself, as the victim: b must
    # take a's blocks instead, or it would start over at every step and never finish.
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=16)
    a = s.add_request(make_request("a", range(8), max_tokens=4, arrival=0.0))
    b = s.add_request(make_request("b", range(100, 124), max_tokens=4, arrival=1.0))
    out, failed = _fail_step(s)
    assert out.num_scheduled_tokens == {"a": 8, "b": 8} and failed == []
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 8} and a.status is RequestStatus.RUNNING
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"b": 16}
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"b": 8} and b.num_output_tokens == 1
    assert out.preempted_req_ids == {"a"} and s.num_isolated == 0
