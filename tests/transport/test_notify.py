"""Notifications that count their readers: a transfer id is complete once as many notifications
as each says have arrived, and a message without a count is one reader's."""
from __future__ import annotations

from tandem.transport.notify import MAX_PARTIAL, NotificationTally, encode


def test_an_id_read_by_two_is_complete_at_the_second_notification_only():
    tally = NotificationTally()
    assert encode("e/r1", 2) == b"e/r1#2"
    assert tally.add([b"e/r1#2"]) == []
    assert tally.add([b"e/r2#1", b"e/r1#2"]) == ["e/r2", "e/r1"]
    assert tally.add([b"e/r1#2"]) == []  # a late duplicate starts over, it completes nothing


def test_messages_without_a_sane_count_are_whole_ids():
    tally = NotificationTally()
    assert tally.add(["plain", "a#b", "x#0", "y#²", "z#99999999"]) == ["plain", "a#b", "x#0", "y#²",
                                                                       "z#99999999"]


def test_partial_ids_are_bounded():
    tally = NotificationTally()
    tally.add([encode(f"t{i}", 2) for i in range(MAX_PARTIAL + 10)])
    assert tally.add([encode("t0", 2)]) == []  # the oldest partial ones were forgotten
    assert tally.add([encode(f"t{MAX_PARTIAL + 9}", 2)]) == [f"t{MAX_PARTIAL + 9}"]
