"""The hand-over state machines (tandem.handover): every transition of the diagram, and every
other one refused — checked against the diagram written out by hand here."""
from __future__ import annotations

import itertools

import pytest

from tandem import handover
from tandem.handover import DecodeHandover, DecodeState, IllegalTransition, PrefillHandover, PrefillState

# transition → (the states it leaves, the state it reaches), as the module's diagram draws them
DECODE = {
    "start": ({DecodeState.ADMITTED}, DecodeState.LOADING),
    "start_stream": ({DecodeState.ADMITTED}, DecodeState.STREAMING),
    "last_announced": ({DecodeState.STREAMING}, DecodeState.LOADING),
    "refuse": ({DecodeState.ADMITTED}, DecodeState.FAILED),
    "cancel": ({DecodeState.ADMITTED}, DecodeState.CANCELLED),
    "loaded": ({DecodeState.LOADING}, DecodeState.LOADED),
    "fail": ({DecodeState.LOADING, DecodeState.STREAMING}, DecodeState.FAILED),
    "quarantine": ({DecodeState.LOADING, DecodeState.STREAMING}, DecodeState.QUARANTINED),
    "release_quarantine": ({DecodeState.QUARANTINED}, DecodeState.RELEASED),
}
PREFILL = {
    "pin": ({PrefillState.STREAMING}, PrefillState.PINNED),
    "abandon": ({PrefillState.STREAMING}, PrefillState.RELEASED),
    "release": ({PrefillState.PINNED}, PrefillState.RELEASED),
    "expire": ({PrefillState.PINNED}, PrefillState.EXPIRED),
}
ARGS = {"start": (3, 1.0), "start_stream": (3, 1.0), "refuse": ("mismatch",), "fail": ("peer",), "quarantine": ("q", "deadline")}


def _decode(state: DecodeState) -> DecodeHandover:
    return DecodeHandover("t", "r", "peer", "engine", (1, 2, 3), state=state)


@pytest.mark.parametrize(("name", "state"), list(itertools.product(DECODE, DecodeState)))
def test_decode_transitions_follow_the_diagram(name, state):
    sources, target = DECODE[name]
    h = _decode(state)
    move = getattr(handover, name)
    if state in sources:
        move(h, *ARGS.get(name, ()))
        assert h.state is target
    else:
        with pytest.raises(IllegalTransition, match=f"{state.value} → {target.value}"):
            move(h, *ARGS.get(name, ()))
        assert h.state is state


@pytest.mark.parametrize(("name", "state"), list(itertools.product(PREFILL, PrefillState)))
def test_prefill_transitions_follow_the_diagram(name, state):
    sources, target = PREFILL[name]
    h = PrefillHandover("t", "t#kv-pin", 4, 10.0, state=state)
    args = (3, 20.0) if name == "pin" else ()
    if state in sources:
        getattr(handover, name)(h, *args)
        assert h.state is target
    else:
        with pytest.raises(IllegalTransition):
            getattr(handover, name)(h, *args)


def test_a_pin_is_released_once_whether_by_notification_or_expiry():
    h = PrefillHandover("t", "t#kv-pin", 4, 10.0)
    handover.release(h)
    with pytest.raises(IllegalTransition):
        handover.expire(h)
    with pytest.raises(IllegalTransition):
        handover.release(h)


def test_what_a_transition_records():
    h = _decode(DecodeState.ADMITTED)
    handover.start(h, 3, 12.5)
    assert (h.num_blocks, h.started_at, h.finished) == (3, 12.5, False)
    handover.quarantine(h, "r#kv-load", "deadline")
    assert (h.quarantine_id, h.reason, h.finished) == ("r#kv-load", "deadline", False)
    handover.release_quarantine(h)
    assert h.finished
    final = {s for s in DecodeState if _decode(s).finished}
    assert final == {DecodeState.LOADED, DecodeState.FAILED, DecodeState.CANCELLED, DecodeState.RELEASED}
