"""JSON mode's token side: token bytes against the tokenizer's own decoding, and the trie-walked
masks against checking every token one by one."""
from __future__ import annotations

import json
import random

import torch

from tandem.sched.json_grammar import START, advance
from tandem.worker.structured import JsonMasker, token_bytes
from tests.helpers.tiny_models import tiny_tokenizer

EOS = frozenset({1, 5})


def test_token_bytes_equal_the_tokenizers_decoding():
    tok = tiny_tokenizer()
    pieces = token_bytes(tok, 520, EOS)
    assert len(pieces) == 520 and pieces[512:] == [None] * 8
    assert all(pieces[i] is None for i in set(tok.all_special_ids) | EOS)
    checked = 0
    for token_id, data in enumerate(pieces[:512]):
        text = tok.decode([token_id])
        if data is not None and "\ufffd" not in text:
            assert data == text.encode(), (token_id, data, text)
            checked += 1
    assert checked > 300  # the rest are pieces of multi-byte characters


def _states():
    """States after random prefixes of JSON documents."""
    rng = random.Random(0)
    docs = [{"a": [1, 2.5e-3, None]}, {"key": "val\u00e9 \"quoted\"", "n": {"m": [True, False, {}]}}, {}]
    for doc in docs:
        data = json.dumps(doc, separators=(", ", ": ")).encode()
        for cut in sorted(rng.sample(range(len(data) + 1), min(12, len(data) + 1))):
            yield advance(START, data[:cut])


def test_masks_equal_checking_every_token():
    pieces = token_bytes(tiny_tokenizer(), 512, EOS)
    masker = JsonMasker(pieces, EOS, torch.device("cpu"))
    for state in _states():
        assert state is not None
        expected = torch.tensor([data is not None and advance(state, data) is not None for data in pieces])
        if state.complete:
            expected = torch.zeros(512, dtype=torch.bool)
            expected[list(EOS)] = True
        got = masker.mask(state)
        assert torch.equal(got, expected), state
        assert bool(got[list(EOS)].any()) == state.complete
