"""The scheduler's disaggregation bookkeeping on hand-computed cases (block size 4): admission to
WAITING_FOR_REMOTE_KV with local prefix hits, the end of a load (done, failed, after an abort),
quarantines of blocks a read may still write into, and pins of finished requests."""
from tandem.sched.request import RemoteKV, RequestStatus
from tandem.sched.scheduler import pin_holder_id, quarantine_holder_id
from tests.sched.sched_helpers import make_request, make_scheduler, run_step

PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]


def warm(scheduler) -> None:
    """Leave PREFIX's two full blocks in the prefix cache."""
    scheduler.add_request(make_request("warm", PREFIX + [99], max_tokens=1))
    run_step(scheduler)
    assert scheduler.kv.stats().num_used_blocks == 0


def test_remote_request_waits_with_blocks_for_all_but_the_last_prompt_token():
    s = make_scheduler(num_blocks=16, max_num_seqs=2)
    warm(s)
    s.add_request(make_request("r", PREFIX + [1, 2, 3], remote_kv=RemoteKV.LOAD))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {} and out.new_requests == []
    r = s.get_request("r")
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV and r.num_computed_tokens == 8
    # 11 prompt tokens: positions 0..9 need KV (3 blocks); 0..7 are local hits, block 2 is loaded
    (load,) = s.take_new_loads()
    table = s.kv.get_block_ids("r")
    assert (load.num_cached_tokens, load.first_block, load.block_ids) == (8, 2, table[2:])
    assert len(table) == 3 and s.num_loading == 1 and s.num_running == 0
    s.add_request(make_request("a", [1]))
    s.add_request(make_request("b", [2]))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["a"]  # the loading request holds one of 2 seats


def test_done_load_runs_the_last_prompt_token_and_is_sent_in_full():
    s = make_scheduler(num_blocks=16)
    s.add_request(make_request("r", [1, 2, 3, 4, 5, 6], remote_kv=RemoteKV.LOAD))
    run_step(s)
    (load,) = s.take_new_loads()
    assert (load.first_block, len(load.block_ids)) == (0, 2)
    s.finish_remote_load("r", ok=True)
    out, updates = run_step(s, tokens={"r": 42})
    (new,) = out.new_requests
    assert (new.num_computed_tokens, out.num_scheduled_tokens) == (5, {"r": 1})
    assert new.block_ids == load.block_ids
    assert updates[0].new_token_ids == [42]
    out, _ = run_step(s)
    assert out.new_requests == [] and [c.request_id for c in out.cached_requests] == ["r"]


def test_failed_load_frees_the_blocks_and_recomputes_from_the_local_cache():
    s = make_scheduler(num_blocks=16)
    warm(s)
    s.add_request(make_request("r", PREFIX + [1, 2, 3], remote_kv=RemoteKV.LOAD))
    run_step(s)
    s.take_new_loads()
    s.finish_remote_load("r", ok=False)
    assert s.get_request("r").status is RequestStatus.WAITING
    assert s.kv.stats().num_used_blocks == 0
    out, _ = run_step(s)
    (new,) = out.new_requests
    assert (new.num_computed_tokens, out.num_scheduled_tokens) == (8, {"r": 3})
    assert s.take_new_loads() == []


def test_abort_during_a_load_quarantines_the_blocks_until_the_load_ends():
    s = make_scheduler(num_blocks=16)
    s.add_request(make_request("r", list(range(1, 10)), remote_kv=RemoteKV.LOAD))
    run_step(s)
    (load,) = s.take_new_loads()
    assert s.kv.stats().num_used_blocks == 2
    (aborted,) = s.abort_requests(["r"])
    assert aborted.status is RequestStatus.FINISHED_ABORTED and s.get_request("r") is None
    assert s.kv.get_block_ids(quarantine_holder_id("r")) == load.block_ids
    assert s.kv.stats().num_used_blocks == 2
    assert s.release_blocks(quarantine_holder_id("r")) and not s.release_blocks(quarantine_holder_id("r"))
    assert s.kv.stats().num_used_blocks == 0


def test_a_failed_load_that_may_still_land_quarantines_its_blocks_while_the_request_recomputes():
    s = make_scheduler(num_blocks=16)
    r = s.add_request(make_request("r", list(range(1, 10)), remote_kv=RemoteKV.LOAD))
    run_step(s)
    (load,) = s.take_new_loads()
    s.finish_remote_load("r", ok=False, quarantine=True)
    assert r.status is RequestStatus.WAITING and s.kv.get_block_ids(quarantine_holder_id("r")) == load.block_ids
    out, _ = run_step(s)  # recomputed in other blocks: the held ones are not free
    (new,) = out.new_requests
    assert not set(new.block_ids) & set(load.block_ids)
    assert s.release_blocks(quarantine_holder_id("r"))
    # the held blocks never entered the prefix cache: their KV is whatever the late read wrote
    assert all(s.kv.block_pool.blocks[b].block_hash is None for b in load.block_ids)


def test_finished_request_pins_its_blocks_until_released():
    s = make_scheduler(num_blocks=16)
    s.add_request(make_request("p", list(range(1, 7)), max_tokens=1, remote_kv=RemoteKV.SEND))
    s.add_request(make_request("q", list(range(1, 7)), max_tokens=1))
    run_step(s)
    (pin,) = s.take_new_pins()
    assert (pin.request_id, pin.num_tokens, len(pin.block_ids)) == ("p", 6, 2)
    assert s.kv.stats().num_used_blocks == 2
    assert pin.pin_id == pin_holder_id("p") and pin.token_ids == tuple(range(1, 7)) and pin.cache_salt is None
    assert s.release_blocks(pin.pin_id) and not s.release_blocks(pin.pin_id)
    assert s.kv.stats().num_used_blocks == 0


def test_aborted_request_is_not_pinned():
    s = make_scheduler(num_blocks=16)
    s.add_request(make_request("p", list(range(1, 7)), max_tokens=4, remote_kv=RemoteKV.SEND))
    run_step(s)
    s.abort_requests(["p"])
    assert s.take_new_pins() == [] and s.kv.stats().num_used_blocks == 0


def test_a_read_never_writes_into_blocks_a_running_request_shares():
    """The prefix a running request holds is shared, not read again: the load covers only the
    blocks past it, in blocks of the loading request's own (block size 4, hand-worked)."""
    s = make_scheduler(num_blocks=16, max_num_seqs=4)
    s.add_request(make_request("a", PREFIX + [99], max_tokens=8))
    run_step(s)  # a computes 9 tokens: PREFIX's two blocks are full, cached and held by a
    held = s.kv.get_block_ids("a")
    s.add_request(make_request("r", PREFIX + [1, 2, 3, 4, 5], remote_kv=RemoteKV.LOAD))
    run_step(s)
    (load,) = s.take_new_loads()
    table = s.kv.get_block_ids("r")
    # 13 prompt tokens: positions 0..11 need KV (3 blocks); 0..7 are a's blocks, block 2 is read
    assert table[:2] == held[:2] and (load.first_block, load.block_ids) == (2, table[2:])
    assert not set(load.block_ids) & set(held)
    assert [s.kv.block_pool.blocks[b].ref_count for b in table] == [2, 2, 1]


def test_a_prompt_the_decode_instance_holds_whole_needs_an_empty_read():
    """Positions 0..P-2 all in the local prefix cache: the load has no block to read."""
    s = make_scheduler(num_blocks=16)
    warm(s)
    s.add_request(make_request("r", PREFIX + [1], remote_kv=RemoteKV.LOAD))
    run_step(s)
    (load,) = s.take_new_loads()
    assert (load.num_cached_tokens, load.first_block, load.block_ids) == (8, 2, [])
    s.finish_remote_load("r", ok=True)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"r": 1}


def test_a_streamed_request_announces_its_full_computed_blocks_then_pins_them():
    """Prompt of 10 tokens in chunks of 3 (block size 4): after each step the blocks whose 4
    tokens are all computed, then the whole prompt's 3 blocks pinned as complete."""
    s = make_scheduler(num_blocks=16, max_num_batched_tokens=3)
    s.add_request(make_request("p", list(range(1, 11)), max_tokens=1, remote_kv=RemoteKV.STREAM))
    announced = []
    for _ in range(3):
        run_step(s)
        (progress,) = s.stream_progress()
        announced.append(progress[1])
    table = s.kv.get_block_ids("p")
    assert announced == [[], table[:1], table[:2]]
    run_step(s)
    assert s.stream_progress() == [] and s.get_request("p") is None
    (pin,) = s.take_new_pins()
    assert pin.complete and pin.block_ids == table and pin.num_tokens == 10


def test_an_aborted_streamed_request_pins_what_it_holds_as_incomplete():
    """A reader may be reading the announced blocks: they stay held until it is done."""
    s = make_scheduler(num_blocks=16, max_num_batched_tokens=5)
    s.add_request(make_request("p", list(range(1, 11)), max_tokens=1, remote_kv=RemoteKV.STREAM))
    run_step(s)
    table = s.kv.get_block_ids("p")
    s.abort_requests(["p"])
    (pin,) = s.take_new_pins()
    assert not pin.complete and pin.block_ids == table and s.kv.stats().num_used_blocks == 2
    assert s.release_blocks(pin.pin_id) and s.kv.stats().num_used_blocks == 0


def test_a_preempted_streamed_request_pins_its_blocks_and_goes_on_as_an_ordinary_one():
    """5 usable blocks of 4 tokens, 5 tokens a step: "a" (4 + 12 tokens) and the streamed "s"
    (14 prompt tokens) fill the pool in three steps; "a" needs a sixth block, preempting "s",
    whose 3 blocks stay pinned (incomplete) for a reader that may be reading them."""
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=5)
    s.add_request(make_request("a", [1, 2, 3, 4], max_tokens=12, arrival=0.0))
    s.add_request(make_request("p", list(range(10, 24)), max_tokens=1, arrival=1.0, remote_kv=RemoteKV.STREAM))
    for _ in range(3):
        run_step(s)
    table = s.kv.get_block_ids("p")
    assert s.stream_progress() == [("p", table[:2])] and s.take_new_pins() == []
    out, _ = run_step(s)
    assert out.preempted_req_ids == {"p"}
    (pin,) = s.take_new_pins()
    assert not pin.complete and pin.block_ids == table
    p = s.get_request("p")
    assert p.status is RequestStatus.PREEMPTED and p.remote_kv is RemoteKV.NONE
    assert s.kv.get_block_ids(pin.pin_id) == table and s.stream_progress() == []
