"""Speculative decoding on the scheduler side: drafts scheduled with the last known token,
``num_computed_tokens`` taken back to what the model accepted, stops among accepted drafts, the
limits on drafts, and the prefix cache holding only computed tokens. Hand-worked cases."""
from __future__ import annotations

from tandem.sched.output import ModelRunnerOutput
from tests.sched.sched_helpers import make_request, make_scheduler, run_step

PROMPT = [1, 2, 3, 4, 1, 2]  # the suffix "1 2" occurred before, followed by "3 4 1 2"


def _decoding(scheduler, rid="a", prompt=PROMPT, first_token=3, **params):
    """Admit ``rid`` and run its prefill, which samples ``first_token``."""
    scheduler.add_request(make_request(rid, prompt, **params))
    run_step(scheduler, {rid: first_token})
    return scheduler.get_request(rid)


def _step(scheduler, tokens):
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=tokens))


def test_drafts_are_scheduled_and_rejected_ones_taken_back():
    s = make_scheduler(num_speculative_tokens=3, ngram_min=1, ngram_max=2)
    req = _decoding(s, max_tokens=20)                    # tokens 1 2 3 4 1 2 | 3
    out = s.schedule()
    assert out.spec_token_ids == {"a": [4, 1, 2]}        # after "2 3": "4 1 2"
    assert out.num_scheduled_tokens == {"a": 4}
    assert req.num_computed_tokens == 6 + 4              # counts the drafts while in flight
    # the model accepts "4" and then says 9 instead of "1"
    updates = s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": [4, 9]}))
    assert updates[0].new_token_ids == [4, 9]
    assert req.all_token_ids == PROMPT + [3, 4, 9]
    assert req.num_computed_tokens == req.num_tokens - 1  # KV of 3 and 4, not of 9
    out = s.schedule()
    assert out.num_scheduled_tokens["a"] == 1 + len(out.spec_token_ids.get("a", []))


def test_a_stop_among_accepted_drafts_ends_there():
    s = make_scheduler(num_speculative_tokens=3, ngram_min=1, ngram_max=2)
    req = _decoding(s, max_tokens=20, eos=(4,))
    out, updates = _step(s, {"a": [4, 1, 7]})
    assert out.spec_token_ids["a"] == [4, 1, 2]
    assert updates[0].new_token_ids == [4] and updates[0].finished
    assert req.all_token_ids == PROMPT + [3, 4]
    assert s.kv.num_free_blocks() == s.kv.num_usable_blocks  # no block leaked


def test_drafts_never_pass_max_tokens_or_the_budget():
    s = make_scheduler(num_speculative_tokens=4, ngram_min=1, ngram_max=2)
    req = _decoding(s, max_tokens=3)                     # 1 output so far, 2 more allowed
    out, updates = _step(s, {"a": [4, 1]})
    assert out.spec_token_ids["a"] == [4]                # one draft + the model's own token = 2
    assert updates[0].finished and req.num_output_tokens == 3
    s = make_scheduler(num_speculative_tokens=4, ngram_min=1, ngram_max=2, max_num_batched_tokens=3)
    _decoding(s, prompt=[1, 2, 1], first_token=2, max_tokens=20)  # 1 2 1 | 2
    assert s.schedule().spec_token_ids["a"] == [1, 2]    # budget 3 = last token + 2 drafts


def test_no_drafts_without_a_match():
    s = make_scheduler(num_speculative_tokens=3, ngram_min=2, ngram_max=3)
    _decoding(s, prompt=[5, 6, 7], first_token=8, max_tokens=10)
    out = s.schedule()
    assert out.spec_token_ids == {} and out.num_scheduled_tokens == {"a": 1}


def test_forked_sequences_draft_on_their_own():
    s = make_scheduler(num_speculative_tokens=3, ngram_min=1, ngram_max=2)
    s.add_request(make_request("p", PROMPT, max_tokens=10, n=2))
    run_step(s, {"p": 3, "p#1": 4})                      # p: ... 2 3, p#1: ... 2 4
    out = s.schedule()
    assert out.spec_token_ids == {"p": [4, 1, 2], "p#1": [1, 2, 4]}
    assert out.block_copies                              # each writes its own copy of the shared block


def test_the_prefix_cache_holds_only_accepted_tokens():
    """Block size 4: drafts fill a block that is then partly rejected; a later request with the
    rejected drafts as its prompt must not hit that block."""
    s = make_scheduler(num_speculative_tokens=3, ngram_min=1, ngram_max=2, block_size=4)
    req = _decoding(s, max_tokens=20)                    # 1 2 3 4 | 1 2 3 (pending)
    out, _ = _step(s, {"a": [9]})                        # drafts 4 1 2 rejected at once
    assert out.spec_token_ids["a"] == [4, 1, 2]
    _step(s, {"a": [5]})
    s.schedule()                                         # registers the blocks computed so far
    assert req.all_token_ids[:9] == [1, 2, 3, 4, 1, 2, 3, 9, 5]
    assert s.kv.get_num_cached_tokens(make_request("x", [1, 2, 3, 4, 1, 2, 3, 4, 9])) == 4
    assert s.kv.get_num_cached_tokens(make_request("y", [1, 2, 3, 4, 1, 2, 3, 9, 5])) == 8


def test_abort_in_flight_takes_the_drafts_back():
    s = make_scheduler(num_speculative_tokens=3, ngram_min=1, ngram_max=2)
    req = _decoding(s, max_tokens=20)
    out = s.schedule()
    assert out.spec_token_ids["a"]
    s.abort_requests(["a"])
    assert req.num_computed_tokens == 6                  # back to before the step
    assert s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": [4, 1]})) == []
    assert s.kv.num_free_blocks() == s.kv.num_usable_blocks


def test_json_mode_requests_get_no_drafts():
    s = make_scheduler(num_speculative_tokens=3, ngram_min=1, ngram_max=2)
    _decoding(s, max_tokens=20, structured_outputs={"json_object": True})
    assert s.schedule().spec_token_ids == {}
