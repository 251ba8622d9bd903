"""Scheduler basics on hand-computed cases: budget, chunked prefill, seats, rejection, stop checks,
the per-step diff (new / cached request data), metrics."""
import pytest

from tandem.interfaces import SchedulingPolicy
from tandem.plugins.policies import FCFSPolicy
from tandem.sched.request import RequestStatus
from tandem.sched.scheduler import SchedulerConfig

from tests.sched.sched_helpers import make_request, make_scheduler, run_step


def test_a_long_prompt_is_split_into_budget_sized_chunks():
    s = make_scheduler(max_num_batched_tokens=4)
    a = s.add_request(make_request("a", range(10)))
    out1, up1 = run_step(s)
    assert out1.num_scheduled_tokens == {"a": 4}
    [new] = out1.new_requests
    assert (new.request_id, new.num_computed_tokens, new.block_ids) == ("a", 0, [1])
    assert up1 == []  # a partial chunk samples nothing
    out2, _ = run_step(s)
    assert out2.num_scheduled_tokens == {"a": 4}
    assert [(c.num_computed_tokens, c.new_block_ids) for c in out2.cached_requests] == [(4, [2])]
    out3, up3 = run_step(s)
    assert out3.num_scheduled_tokens == {"a": 2}
    assert [(c.num_computed_tokens, c.new_block_ids) for c in out3.cached_requests] == [(8, [3])]
    assert [(u.request.request_id, u.new_token_ids) for u in up3] == [("a", [100])]
    assert a.num_computed_tokens == 10 and a.num_tokens == 11


def test_running_requests_come_first_then_waiting_ones_share_the_rest():
    s = make_scheduler(max_num_batched_tokens=6)
    s.add_request(make_request("a", range(3)))
    run_step(s)
    s.add_request(make_request("b", range(20, 30)))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}
    assert out.total_num_scheduled_tokens == 6
    assert [c.request_id for c in out.cached_requests] == ["a"]
    assert [n.request_id for n in out.new_requests] == ["b"]


def test_num_computed_tokens_advances_inside_schedule():
    s = make_scheduler(max_num_batched_tokens=4)
    a = s.add_request(make_request("a", range(6)))
    s.schedule()
    assert a.num_computed_tokens == 4 and a.status is RequestStatus.RUNNING


def test_admission_stops_at_the_sequence_limit():
    s = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        s.add_request(make_request(rid, range(3)))
    out, _ = run_step(s)
    assert sorted(out.num_scheduled_tokens) == ["a", "b"]
    assert (s.num_running, s.num_waiting) == (2, 1)


def test_a_request_with_n_sequences_takes_n_seats():
    s = make_scheduler(max_num_seqs=4)
    s.add_request(make_request("a", range(3), n=3))
    s.add_request(make_request("b", range(3), n=2, arrival=1.0))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["a"]
    assert s.num_running == 3 and s.num_waiting == 1


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    s = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    s.add_request(make_request("a", range(6)))
    s.add_request(make_request("b", range(10, 16), arrival=1.0))
    s.add_request(make_request("c", range(20, 22), arrival=2.0))
    out1, _ = run_step(s)
    assert out1.num_scheduled_tokens == {"a": 6}  # b does not fit the 4 left; c waits behind it
    out2, _ = run_step(s)
    assert out2.num_scheduled_tokens == {"a": 1, "b": 6, "c": 2}


class CappedPolicy(FCFSPolicy):
    def max_prompt_tokens_per_step(self):
        return 3


def test_the_policy_caps_prompt_tokens_but_not_decodes():
    s = make_scheduler(policy=CappedPolicy(), max_num_batched_tokens=16)
    s.add_request(make_request("a", range(2)))
    run_step(s)
    s.add_request(make_request("b", range(10, 20), arrival=1.0))
    s.add_request(make_request("c", range(20, 30), arrival=2.0))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}


def test_without_chunking_the_cap_admits_whole_prompts_until_it_is_reached():
    s = make_scheduler(policy=CappedPolicy(), max_num_batched_tokens=16, enable_chunked_prefill=False)
    s.add_request(make_request("a", range(5)))
    s.add_request(make_request("b", range(10, 12), arrival=1.0))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 5}
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 2}


def test_a_cap_below_one_is_refused():
    class Broken(FCFSPolicy):
        def max_prompt_tokens_per_step(self):
            return 0

    with pytest.raises(ValueError, match="at least 1"):
        make_scheduler(policy=Broken())


def test_config_values_must_be_positive():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


@pytest.mark.parametrize(
    ("config", "request_kwargs", "fragment"),
    [
        ({"max_num_seqs": 2}, {"n": 3}, "n=3 exceeds max_num_seqs=2"),
        ({"max_model_len": 12}, {"max_tokens": 4},
         "plus max_tokens (4) exceeds the model's context length (12"),
        ({"num_blocks": 4}, {"max_tokens": 8},
         "needs 5 KV blocks at its longest but the KV cache holds 3"),
        ({"num_blocks": 6}, {"max_tokens": 4, "n": 2},
         "needs 6 KV blocks at its longest but the KV cache holds 5"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 8}, {},
         "exceeds max_num_batched_tokens (8)"),
    ],
)
def test_requests_that_can_never_run_are_rejected_with_a_reason(config, request_kwargs, fragment):
    # prompt of 9 tokens, block size 4: 9 + 8 = 17 tokens need 5 blocks; 9 + 4 = 13 need 4, and
    # with n=2 the second sequence needs ceil(4/4) + 1 = 2 more: 6.
    s = make_scheduler(**config)
    request = s.add_request(make_request("a", range(9), **{"max_tokens": 4, **request_kwargs}))
    assert request.status is RequestStatus.FINISHED_REJECTED
    assert fragment in request.reject_reason
    assert s.num_waiting == 0 and not s.has_unfinished_requests()
    assert s.get_request("a") is None


def test_a_request_that_fits_exactly_is_accepted():
    s = make_scheduler(num_blocks=5, max_model_len=13)
    request = s.add_request(make_request("a", range(9), max_tokens=4))
    assert request.status is RequestStatus.WAITING and request.reject_reason is None
    assert s.num_waiting == 1


def decode_until_finished(s, rid, tokens):
    """Feed ``tokens`` one per step as request ``rid``'s samples; return its final updates."""
    updates = []
    for token in tokens:
        _, ups = run_step(s, {rid: token})
        updates += ups
    return updates


def test_eos_stops_the_request_and_frees_its_blocks():
    s = make_scheduler()
    a = s.add_request(make_request("a", range(3), eos={7}))
    updates = decode_until_finished(s, "a", [5, 7])
    assert a.status is RequestStatus.FINISHED_STOPPED and a.output_token_ids == (5, 7)
    assert [u.finished for u in updates] == [False, True]
    assert s.kv.stats().num_used_blocks == 0 and not s.has_unfinished_requests()
    assert "a" in s.schedule().finished_req_ids


def test_ignore_eos_keeps_going_until_max_tokens():
    s = make_scheduler()
    a = s.add_request(make_request("a", range(3), eos={7}, ignore_eos=True, max_tokens=3))
    decode_until_finished(s, "a", [7, 7, 7])
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 3


def test_min_tokens_defers_eos_and_stop_tokens():
    s = make_scheduler()
    a = s.add_request(make_request("a", range(3), eos={7}, stop_token_ids=[9], min_tokens=3))
    decode_until_finished(s, "a", [7, 9, 9])
    assert a.status is RequestStatus.FINISHED_STOPPED and a.stop_reason == 9
    assert a.num_output_tokens == 3


def test_a_stop_token_sets_the_stop_reason_and_eos_is_checked_first():
    s = make_scheduler()
    a = s.add_request(make_request("a", range(3), stop_token_ids=[9]))
    b = s.add_request(make_request("b", range(3), eos={9}, stop_token_ids=[9]))
    run_step(s, {"a": 9, "b": 9})
    assert a.status is RequestStatus.FINISHED_STOPPED and a.stop_reason == 9
    assert b.status is RequestStatus.FINISHED_STOPPED and b.stop_reason is None


def test_the_context_length_ends_a_request():
    s = make_scheduler(max_model_len=6)
    a = s.add_request(make_request("a", range(4), max_tokens=2))
    a.max_tokens = 5  # a caller that resolved max_tokens past the context (not re-checked)
    decode_until_finished(s, "a", [1, 2])
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_tokens == 6


def test_finish_requests_ends_and_frees():
    s = make_scheduler()
    a = s.add_request(make_request("a", range(3)))
    run_step(s)
    s.finish_requests(["a", "unknown"], RequestStatus.FINISHED_STOPPED)
    assert a.status is RequestStatus.FINISHED_STOPPED
    assert s.kv.stats().num_used_blocks == 0
    assert s.schedule().finished_req_ids == {"a"}


def test_metrics_record_the_request_timeline():
    s = make_scheduler()
    a = s.add_request(make_request("a", range(3), max_tokens=2))
    run_step(s)
    m = a.metrics
    assert m.first_scheduled_time is not None and m.first_token_time is not None
    first = m.last_token_time
    run_step(s)
    assert m.first_scheduled_time <= m.first_token_time <= first <= m.last_token_time <= m.finished_time


def test_a_prefix_hit_is_reported_as_where_the_new_tokens_start():
    s = make_scheduler(block_size=4)
    s.add_request(make_request("a", range(9), max_tokens=1))
    run_step(s)  # a computes 9 tokens, samples its only token, finishes: blocks 1, 2 cached
    b = s.add_request(make_request("b", [*range(8), 50, 51]))
    out, _ = run_step(s)
    [new] = out.new_requests
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens == {"b": 2}
    assert new.block_ids[:2] == [1, 2]
    assert b.metrics.num_cached_prompt_tokens == 8
    stats = s.kv.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9 + 10, 8)


def test_an_empty_scheduler_plans_an_empty_step():
    s = make_scheduler()
    out = s.schedule()
    assert out.is_empty and out.num_scheduled_tokens == {}
    assert not s.has_unfinished_requests()


def test_a_custom_policy_orders_admission():
    class ShortestFirst(SchedulingPolicy):
        name = "shortest"

        def sort_key(self, request):
            return request.num_tokens

        def select_victim(self, running):
            return running[-1]

    s = make_scheduler(policy=ShortestFirst(), max_num_seqs=1)
    s.add_request(make_request("long", range(9)))
    s.add_request(make_request("short", range(2), arrival=5.0))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["short"]


def test_a_request_waiting_for_its_grammar_is_held_apart_until_it_compiled():
    s = make_scheduler(num_blocks=4, block_size=4)
    a = s.add_request(make_request("a", range(4)), wait_for_grammar=True)
    assert a.status is RequestStatus.WAITING_FOR_GRAMMAR and s.get_request("a") is a
    assert s.waiting_for_grammar() == ["a"] and not s.has_requests_to_step() and s.num_waiting == 0
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {}
    assert s.grammar_compiled("a") is a and a.status is RequestStatus.WAITING
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 4} and s.waiting_for_grammar() == []


def test_a_compiled_request_that_could_never_run_is_rejected_and_an_aborted_one_ends():
    s = make_scheduler(num_blocks=4, block_size=4)
    big = s.add_request(make_request("big", range(40)), wait_for_grammar=True)
    assert big.status is RequestStatus.WAITING_FOR_GRAMMAR  # checked once its grammar is there
    assert s.grammar_compiled("big").status is RequestStatus.FINISHED_REJECTED and big.reject_reason
    assert s.get_request("big") is None
    b = s.add_request(make_request("b", range(4)), wait_for_grammar=True)
    assert s.abort_requests(["b"]) == [b] and b.status is RequestStatus.FINISHED_ABORTED
    assert not s.has_unfinished_requests()
