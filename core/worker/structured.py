"""JSON mode on the runner side: which tokens may come next, as a boolean mask over the vocabulary.

Every token is turned into its bytes once (``token_bytes``), and the tokens are put in a trie of
those bytes. The tokens allowed in a state of the JSON recognizer (tandem.sched.json_grammar)
are found by walking the trie with the recognizer, dropping a whole subtree at the first byte it
refuses; the masks are cached by state, which repeats a lot (inside a string, after a comma...).
EOS tokens are allowed exactly when the object is complete, and then nothing else is.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from tandem.sched.json_grammar import START, JsonState, advance, step

_CACHE_SIZE = 512


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes-to-unicode table (byte-level BPE token strings)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int] = frozenset()) -> list[bytes | None]:
    """The bytes each token id stands for (None: a special, EOS or unknown token, never allowed
    as text). Byte-level BPE (GPT-2, Llama 3, Qwen) and SentencePiece (``▁`` and ``<0xNN>`` byte
    tokens) vocabularies are read exactly; others through ``decode([id])``."""
    special = set(getattr(tokenizer, "all_special_ids", ())) | set(eos_token_ids)
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    kind = _vocabulary_kind(tokenizer)
    byte_of = _gpt2_byte_decoder()
    out: list[bytes | None] = []
    for token_id, piece in enumerate(pieces):
        if piece is None or token_id in special:
            out.append(None)
        elif kind == "byte_level" and all(c in byte_of for c in piece):
            out.append(bytes(byte_of[c] for c in piece))
        elif kind == "sentencepiece" and piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            out.append(bytes([int(piece[3:5], 16)]))
        elif kind == "sentencepiece":
            out.append(piece.replace("\u2581", " ").encode())
        else:
            text = tokenizer.decode([token_id])
            out.append(None if "\ufffd" in text else text.encode())
    return out + [None] * (vocab_size - len(out))


def _vocabulary_kind(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "other"
    decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
    if "ByteLevel" in decoder:
        return "byte_level"
    if "ByteFallback" in decoder or "Metaspace" in decoder or "\u2581" in decoder:
        return "sentencepiece"
    return "other"


class JsonMasker:
    """Masks ``[vocab_size]`` of the tokens allowed after a ``JsonState``."""

    def __init__(self, pieces: Sequence[bytes | None], eos_token_ids: frozenset[int], device: torch.device):
        self.pieces = pieces
        self.vocab_size = len(pieces)
        self.eos = [t for t in eos_token_ids if t < self.vocab_size]
        self.device = device
        self.trie: dict = {}
        for token_id, data in enumerate(pieces):
            if data:
                node = self.trie
                for b in data:
                    node = node.setdefault(b, {})
                node.setdefault(None, []).append(token_id)
        self._cache: OrderedDict[JsonState, torch.Tensor] = OrderedDict()

    def advance(self, state: JsonState, token_id: int) -> JsonState:
        """The state after a sampled token (EOS or a token the mask allowed)."""
        data = self.pieces[token_id] if token_id < self.vocab_size else None
        if data is None:
            return state
        after = advance(state, data)
        return after if after is not None else state

    def initial_state(self, output_token_ids: Sequence[int]) -> JsonState:
        state = START
        for token_id in output_token_ids:
            state = self.advance(state, token_id)
        return state

    def mask(self, state: JsonState) -> torch.Tensor:
        cached = self._cache.get(state)
        if cached is not None:
            self._cache.move_to_end(state)
            return cached
        allowed: list[int] = []
        if state.complete:
            allowed = list(self.eos)
        else:
            self._walk(state, self.trie, allowed)
            if not allowed:
                allowed = list(self.eos)  # nothing fits: let the sequence end rather than stall
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[allowed] = True
        mask = mask.to(self.device)
        self._cache[state] = mask
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return mask

    def _walk(self, state: JsonState, node: dict, allowed: list[int]) -> None:
        for key, child in node.items():
            if key is None:
                allowed.extend(child)
                continue
            after = step(state, key)
            if after is not None:
                self._walk(after, child, allowed)
