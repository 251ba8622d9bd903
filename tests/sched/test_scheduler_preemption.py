"""Scheduler under memory pressure, aborts and forks, on hand-computed cases.

Pools are tiny so that every block is accounted for by hand; block ids come from a fresh pool in
id order. Requests default to max_tokens=4 so that each alone fits these pools."""
from functools import partial

from tandem.plugins.policies import PriorityPolicy
from tandem.sched.output import ModelRunnerOutput
from tandem.sched.request import RequestStatus

from tests.sched.sched_helpers import make_request, make_scheduler, run_step

make_request = partial(make_request, max_tokens=4)


def test_fcfs_preempts_the_latest_arrival_when_a_block_runs_out():
    s = make_scheduler(num_blocks=5, block_size=2)  # 4 usable blocks
    a = s.add_request(make_request("a", range(3), arrival=0.0))
    b = s.add_request(make_request("b", range(10, 13), arrival=1.0))
    run_step(s)  # a: blocks 1, 2; b: blocks 3, 4 (3 tokens each + 1 sampled)
    run_step(s)  # position 3 of each still fits its second block
    out, _ = run_step(s)  # a's position 4 needs a block: b goes
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert [c.new_block_ids for c in out.cached_requests] == [[4]]  # b freed tail first: 4, 3
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.metrics.num_preemptions == 1
    assert (s.num_running, s.num_waiting) == (1, 1)
    assert s.kv.get_block_ids("b") == []
    assert a.status is RequestStatus.RUNNING


def test_a_victim_scheduled_earlier_in_the_step_gives_its_tokens_back():
    s = make_scheduler(num_blocks=4, block_size=4)  # 3 usable blocks
    b = s.add_request(make_request("b", range(2), arrival=1.0))
    run_step(s)  # b: block 1, 3 tokens now
    s.add_request(make_request("a", range(10, 18), arrival=0.5))
    run_step(s)  # b decodes in block 1; a admitted after b: blocks 2, 3 (pool full)
    out, _ = run_step(s)
    # running order [b, a]: b's decode fits its block and is scheduled; a's position 8 needs a
    # block, FCFS names b (latest arrival), and b's scheduling is undone.
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.total_num_scheduled_tokens == 1
    assert [c.request_id for c in out.cached_requests] == ["a"]
    assert b.num_computed_tokens == 0 and b.status is RequestStatus.PREEMPTED
    assert s.kv.get_block_ids("a") == [2, 3, 1]


def test_no_request_is_admitted_in_a_step_that_preempted():
    s = make_scheduler(num_blocks=5, block_size=2)
    a = s.add_request(make_request("a", range(4), arrival=0.0))
    b = s.add_request(make_request("b", range(10, 14), arrival=1.0))
    run_step(s)  # each holds 2 full blocks and has 5 tokens
    s.add_request(make_request("c", [1], arrival=2.0))
    out, _ = run_step(s)
    # a's position 4 needs a block: b (latest) goes; a gets block 4 (b's tail, freed first)
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}
    assert s.get_request("c").status is RequestStatus.WAITING  # no admission in a preempting step
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.PREEMPTED


def test_the_running_request_itself_is_the_victim_when_it_arrived_last():
    s = make_scheduler(num_blocks=4, block_size=2)  # 3 usable
    a = s.add_request(make_request("a", range(2), arrival=0.0))
    b = s.add_request(make_request("b", range(10, 12), arrival=1.0))
    run_step(s)  # a: block 1, b: block 2; 3 tokens each
    out, _ = run_step(s)  # a takes block 3 for position 2; b finds none and preempts itself
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_req_ids == {"b"}
    assert b.status is RequestStatus.PREEMPTED and a.status is RequestStatus.RUNNING


def test_a_preempted_request_resumes_with_every_token_so_far():
    s = make_scheduler(num_blocks=5, block_size=2, caching=False)
    s.add_request(make_request("a", range(3), arrival=0.0))
    b = s.add_request(make_request("b", range(10, 13), arrival=1.0, max_tokens=3))
    run_step(s, {"b": 60})
    run_step(s, {"b": 61})
    run_step(s)  # b preempted with 5 tokens
    assert b.status is RequestStatus.PREEMPTED
    s.abort_requests(["a"])
    out, _ = run_step(s, {"b": 62})
    [new] = out.new_requests
    assert new.request_id == "b" and new.token_ids == [10, 11, 12, 60, 61]
    assert new.num_prompt_tokens == 3 and new.num_computed_tokens == 0
    assert out.num_scheduled_tokens == {"b": 5}
    assert b.status is RequestStatus.FINISHED_LENGTH and b.output_token_ids == (60, 61, 62)


def test_a_resumed_request_finds_the_start_of_its_prefix_still_cached():
    s = make_scheduler(num_blocks=5, block_size=2)
    s.add_request(make_request("a", range(3), arrival=0.0))
    s.add_request(make_request("b", range(10, 13), arrival=1.0))
    run_step(s)
    run_step(s)
    run_step(s)
    # b was preempted with 4 computed tokens: its blocks 3 and 4 are cached and freed tail
    # first, so a's new block evicts 4 (b's tail) and block 3 survives
    s.abort_requests(["a"])
    out, _ = run_step(s)
    [new] = out.new_requests
    assert new.num_computed_tokens == 2 and new.block_ids[0] == 3
    assert out.num_scheduled_tokens == {"b": 3}


def test_without_chunked_prefill_a_resumed_request_longer_than_the_budget_is_chunked():
    s = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=4,
                       enable_chunked_prefill=False, caching=False)  # 5 usable blocks
    a = s.add_request(make_request("a", range(4), arrival=1.0, max_tokens=4))
    run_step(s)  # a: 4 tokens, blocks 1, 2
    run_step(s)  # a: position 4, block 3
    s.add_request(make_request("x", [50, 51], arrival=0.0, max_tokens=6))
    run_step(s)  # a: position 5; x admitted, block 4
    out, _ = run_step(s)  # a takes block 5; x's position 2 finds none: a (latest) is undone
    assert out.preempted_req_ids == {"a"} and a.num_tokens == 7
    s.abort_requests(["x"])
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 4}  # 7 > 4: chunked despite the setting
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 3}
    assert a.num_tokens == 8


def test_priority_preempts_a_lower_priority_running_request_for_a_waiting_one():
    s = make_scheduler(policy=PriorityPolicy(), num_blocks=3, block_size=4)  # 2 usable
    low = s.add_request(make_request("low", range(6), max_tokens=2, priority=5, arrival=0.0))
    run_step(s)  # low holds both blocks
    high = s.add_request(make_request("high", range(10, 13), priority=0, arrival=1.0))
    out, _ = run_step(s)
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 3}  # low's decode was undone
    assert [n.request_id for n in out.new_requests] == ["high"]
    assert low.status is RequestStatus.PREEMPTED and high.status is RequestStatus.RUNNING


def test_priority_does_not_preempt_for_an_equal_priority():
    s = make_scheduler(policy=PriorityPolicy(), num_blocks=3, block_size=4)
    s.add_request(make_request("first", range(6), max_tokens=2, priority=1, arrival=0.0))
    run_step(s)
    s.add_request(make_request("second", range(10, 13), priority=1, arrival=1.0))
    out, _ = run_step(s)
    assert out.preempted_req_ids == set() and out.num_scheduled_tokens == {"first": 1}


def test_fcfs_never_preempts_for_a_waiting_request():
    s = make_scheduler(num_blocks=3, block_size=4)
    s.add_request(make_request("first", range(6), max_tokens=2, priority=5, arrival=0.0))
    run_step(s)
    s.add_request(make_request("second", range(10, 13), priority=0, arrival=1.0))
    out, _ = run_step(s)
    assert out.preempted_req_ids == set() and out.num_scheduled_tokens == {"first": 1}
    assert s.num_waiting == 1


def test_priority_admits_lower_values_first():
    s = make_scheduler(policy=PriorityPolicy(), max_num_seqs=1)
    s.add_request(make_request("late-important", range(3), priority=-1, arrival=9.0))
    s.add_request(make_request("early", range(3), priority=0, arrival=0.0))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["late-important"]


def test_abort_mid_prefill_frees_blocks_and_reports_the_id():
    s = make_scheduler(max_num_batched_tokens=4)
    a = s.add_request(make_request("a", range(10)))
    run_step(s)
    assert s.abort_requests(["a", "nope"]) == [a]
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert s.kv.stats().num_used_blocks == 0 and not s.has_unfinished_requests()
    out = s.schedule()
    assert out.finished_req_ids == {"a"} and out.is_empty
    assert s.schedule().finished_req_ids == set()


def test_abort_mid_decode_and_while_waiting():
    s = make_scheduler(max_num_seqs=1)
    a = s.add_request(make_request("a", range(3)))
    b = s.add_request(make_request("b", range(3), arrival=1.0))
    run_step(s)
    run_step(s)
    aborted = s.abort_requests(["a", "b"])
    assert {r.request_id for r in aborted} == {"a", "b"}
    assert b.status is RequestStatus.FINISHED_ABORTED and a.num_output_tokens == 2
    assert (s.num_running, s.num_waiting) == (0, 0)
    assert s.kv.stats().num_used_blocks == 0
    assert s.abort_requests(["a"]) == []


def test_abort_between_schedule_and_update_drops_the_step_in_flight():
    s = make_scheduler(max_num_batched_tokens=4, block_size=4)
    a = s.add_request(make_request("a", range(9)))
    run_step(s)  # tokens 0..3 computed
    out = s.schedule()  # tokens 4..7 in flight
    s.abort_requests(["a"])
    result = ModelRunnerOutput(sampled_token_ids={"a": [5]})
    assert s.update_from_output(out, result) == []
    assert a.num_output_tokens == 0 and a.num_computed_tokens == 4
    # only the block computed before the aborted step may serve a prefix hit
    assert s.kv.get_num_cached_tokens(make_request("b", range(9))) == 4


def test_n_sequences_fork_when_the_prompt_completes():
    s = make_scheduler(block_size=4)
    a = s.add_request(make_request("a", range(6), n=3))
    out, updates = run_step(s, {"a": 1, "a#1": 2, "a#2": 3})
    assert [(f.request_id, f.parent_id, f.sample_index) for f in out.forked_requests] == [
        ("a#1", "a", 1), ("a#2", "a", 2)]
    assert out.num_scheduled_tokens == {"a": 6}  # the children compute nothing this step
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [
        ("a", [1]), ("a#1", [2]), ("a#2", [3])]
    assert a.num_sequences == 1 and s.num_running == 3
    children = [s.get_request(f"a#{i}") for i in (1, 2)]
    assert all(c.num_computed_tokens == 6 and c.status is RequestStatus.RUNNING for c in children)
    assert s.kv.get_block_ids("a#2") == [1, 2]
    assert [s.kv.block_pool.blocks[i].ref_count for i in (1, 2)] == [3, 3]


def test_forked_sequences_copy_the_shared_partial_block_on_their_first_write():
    s = make_scheduler(block_size=4)
    s.add_request(make_request("a", range(6), n=3))
    run_step(s)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "a#1": 1, "a#2": 1}
    assert out.block_copies == [(2, 3), (2, 4)]
    assert [(c.request_id, c.replaced_blocks) for c in out.cached_requests] == [
        ("a", [(1, 3)]), ("a#1", [(1, 4)]), ("a#2", [])]
    assert s.kv.get_block_ids("a") == [1, 3]
    assert s.kv.get_block_ids("a#1") == [1, 4]
    assert s.kv.get_block_ids("a#2") == [1, 2]


def test_a_chunked_prompt_forks_in_the_step_that_completes_it():
    s = make_scheduler(block_size=4, max_num_batched_tokens=4)
    s.add_request(make_request("a", range(6), n=2))
    out1, _ = run_step(s)
    assert out1.forked_requests == []
    out2, _ = run_step(s)
    assert [f.request_id for f in out2.forked_requests] == ["a#1"]


def test_aborting_a_parent_aborts_its_forked_sequences():
    s = make_scheduler()
    s.add_request(make_request("a", range(3), n=3))
    run_step(s)
    aborted = s.abort_requests(["a"])
    assert sorted(r.request_id for r in aborted) == ["a", "a#1", "a#2"]
    assert s.kv.stats().num_used_blocks == 0 and not s.has_unfinished_requests()


def test_a_forked_sequence_finishes_on_its_own():
    s = make_scheduler()
    s.add_request(make_request("a", range(3), n=2, eos={9}))
    run_step(s, {"a": 5, "a#1": 9})
    assert s.get_request("a#1") is None and s.get_request("a") is not None
    assert s.schedule().finished_req_ids == {"a#1"}


def test_a_waiting_request_never_hits_blocks_whose_computation_this_step_was_undone():
    s = make_scheduler(policy=PriorityPolicy(), num_blocks=6, block_size=2, max_num_batched_tokens=8)
    s.add_request(make_request("x", [50, 51, 52], priority=3, arrival=0.0))
    r = s.add_request(make_request("r", [1, 2, 3, 4, 5, 6], max_tokens=2, priority=5, arrival=1.0))
    run_step(s)  # x: 3 tokens in blocks 1, 2; r: 5 tokens (budget) in blocks 3, 4, 5; pool full
    w = s.add_request(make_request("w", [1, 2, 3, 4, 5, 6, 9], max_tokens=1, priority=1, arrival=2.0))
    out, _ = run_step(s)
    # r's position 5 (completing block 5) was scheduled, then undone when w preempted r and x.
    # Only blocks 3 and 4 hold computed KV; a hit on block 5 would read KV never written.
    assert out.preempted_req_ids == {"r", "x"}
    [new] = out.new_requests
    assert new.request_id == "w" and new.num_computed_tokens == 4 and new.block_ids[:2] == [3, 4]
    assert out.num_scheduled_tokens == {"w": 3}
    assert r.num_computed_tokens == 0 and w.metrics.num_cached_prompt_tokens == 4


def test_an_undone_victim_caches_only_the_blocks_computed_before_this_step():
    s = make_scheduler(policy=PriorityPolicy(), num_blocks=6, block_size=2, max_num_batched_tokens=6)
    r = s.add_request(make_request("r", range(1, 10), max_tokens=1, priority=5))
    run_step(s)  # r: positions 0..5 in blocks 1, 2, 3
    s.add_request(make_request("w", [40, 41], max_tokens=1, priority=0, arrival=1.0))
    out, _ = run_step(s)
    # r's last 3 prompt tokens took blocks 4 (full) and 5, then w preempted r and took one block;
    # w finished at once. Block 4 was never computed, so r finds only blocks 1..3 cached.
    assert out.preempted_req_ids == {"r"} and out.num_scheduled_tokens == {"w": 2}
    out, _ = run_step(s)
    [new] = out.new_requests
    assert new.request_id == "r" and new.num_computed_tokens == 6 and new.block_ids[:3] == [1, 2, 3]
    assert r.metrics.num_preemptions == 1
