"""Fingerprints of a checkpoint's weights and of a tokenizer, cheap enough for start-up: two
instances whose fingerprints differ must not exchange KV blocks (they enter the KV compat hash,
``LLMEngine.kv_compat_hash``).

Weights: for each weight file, in the loader's order, its name, its size and

- a safetensors file: its header's tensor entries (names, dtypes, shapes, data offsets; the JSON
  header is read through its 8-byte length prefix, the tensors are not) plus
  ``TENSOR_SAMPLE_BYTES`` from the middle of each tensor's data;
- any file: ``FILE_SAMPLE_BYTES`` at each of ``FILE_SAMPLE_FRACTIONS`` of its data::

      | 8 B | header (N bytes) | data ................................................ |
                               ^0      ^1/4          ^1/2          ^3/4          ^end-4 KiB

So a checkpoint with other weights of the same shapes (another seed, a fine-tune, a merged
adapter) differs in the sampled bytes; one that differs only in bytes no sample covers (a single
edited weight) is not told apart (README limits). Reading costs one small read per tensor plus
five per file, whatever the checkpoint's size.

Tokenizer: its vocabulary (every token and its id) and its special tokens.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

FILE_SAMPLE_BYTES = 4096
FILE_SAMPLE_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
TENSOR_SAMPLE_BYTES = 64
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def weights_fingerprint(files: Sequence[Path]) -> str:
    """A hex digest of the weight ``files`` (see the module docstring); raises ValueError for a
    safetensors file whose header cannot be read."""
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            fd = f.fileno()
            size = os.fstat(fd).st_size
            digest.update(json.dumps([Path(file).name, size]).encode())
            data_start = 0
            if Path(file).suffix == ".safetensors":
                data_start = _add_safetensors_header(digest, fd, size, file)
            for fraction in FILE_SAMPLE_FRACTIONS:
                offset = data_start + int(fraction * max(size - data_start - FILE_SAMPLE_BYTES, 0))
                digest.update(os.pread(fd, FILE_SAMPLE_BYTES, offset))
    return digest.hexdigest()


def _add_safetensors_header(digest, fd: int, size: int, file: Path) -> int:
    """Hash the tensor entries and a sample of each tensor; return where the data starts."""
    (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if header_len > min(_MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"{file} is not a safetensors file: its header length is {header_len}")
    try:
        header = json.loads(os.pread(fd, header_len, 8))
    except ValueError as exc:
        raise ValueError(f"{file} is not a safetensors file: its header is not JSON ({exc})") from None
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    tensors = sorted(header.items(), key=lambda item: (item[1]["data_offsets"], item[0]))
    digest.update(json.dumps(tensors, sort_keys=True).encode())
    for _, entry in tensors:
        begin, end = entry["data_offsets"]
        length = min(TENSOR_SAMPLE_BYTES, end - begin)
        digest.update(os.pread(fd, length, data_start + begin + (end - begin - length) // 2))
    return data_start


def tokenizer_fingerprint(tokenizer) -> str:
    """A hex digest of a Hugging Face tokenizer's vocabulary (``get_vocab()``: token → id) and
    special tokens (``all_special_tokens``)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    specials = sorted(tokenizer.all_special_tokens)
    canonical = json.dumps({"vocab": vocab, "special_tokens": specials}, ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()
