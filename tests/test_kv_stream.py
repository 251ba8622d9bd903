"""A streamed hand-over's announcement on the wire (tandem.kv_stream): block checksums written as
8 hex digits and read back, one per block or none; anything else is refused naming the field.
Oracle: hand-written JSON."""
from __future__ import annotations

import pytest

from tandem.kv_stream import KVAnnouncement


def test_checksums_go_out_as_eight_hex_digits_and_come_back():
    sent = KVAnnouncement("e/r1", (4, 9), "running", (0x1F, 0xDEADBEEF))
    assert sent.to_json() == {"transfer_id": "e/r1", "block_ids": [4, 9], "state": "running",
                              "kv_checksums": ["0000001f", "deadbeef"]}
    assert KVAnnouncement.from_json(sent.to_json()) == sent
    assert "kv_checksums" not in KVAnnouncement("e/r1", (4,)).to_json()


@pytest.mark.parametrize("checksums", [["0000001f"], ["0000001f", "DEADBEEF"], ["0000001f", "deadbee"],
                                       ["0000001f", "deadbeeg"], "0000001fdeadbeef", [31, 57]])
def test_malformed_checksums_are_refused_naming_the_field(checksums):
    data = {"transfer_id": "e/r1", "block_ids": [4, 9], "state": "done", "kv_checksums": checksums}
    with pytest.raises(ValueError, match="announcement.kv_checksums"):
        KVAnnouncement.from_json(data)
