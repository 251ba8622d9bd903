"""Fingerprints of weights and tokenizers (``tandem.models.fingerprint``), on tiny checkpoints
built for each case: equal for copies of one checkpoint, different for other weights of the same
shapes, another tensor layout, another tokenizer. The cases are stated by hand; the fingerprint
is never compared with a value the code computed the same way."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tandem.models.fingerprint import (
    FILE_SAMPLE_BYTES,
    tokenizer_fingerprint,
    weights_fingerprint,
)
from tandem.models.loader import checkpoint_files, load_tokenizer
from tandem.models.tokenizer_training import stdlib_corpus_files, train_bpe_tokenizer
from tests.helpers.tiny_models import TINY_VOCAB, build_tiny_model, tiny_model_dir, tiny_tokenizer


def fingerprint(path: Path) -> str:
    return weights_fingerprint(checkpoint_files(path))


@pytest.fixture(scope="module")
def llama() -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def other_seed(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("seed1") / "llama", "llama", seed=1)


def test_a_copy_has_the_same_fingerprint(llama, tmp_path):
    copy = shutil.copytree(llama, tmp_path / "elsewhere" / "renamed")
    assert fingerprint(copy) == fingerprint(llama)


def test_other_weights_of_the_same_shapes_differ(llama, other_seed):
    mine, theirs = load_file(checkpoint_files(llama)[0]), load_file(checkpoint_files(other_seed)[0])
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}
    assert fingerprint(other_seed) != fingerprint(llama)


def _edited(llama: Path, tmp_path: Path, edit) -> Path:
    folder = shutil.copytree(llama, tmp_path / "edited")
    file = checkpoint_files(folder)[0]
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return folder


def test_a_changed_tensor_is_seen(llama, tmp_path):
    """One layer's o_proj scaled by 1.01: a fine-tune of one tensor (its middle is sampled)."""
    def scale(tensors):
        tensors["model.layers.1.self_attn.o_proj.weight"].mul_(1.01)

    assert fingerprint(_edited(llama, tmp_path, scale)) != fingerprint(llama)


def test_a_renamed_tensor_is_seen(llama, tmp_path):
    def rename(tensors):
        tensors["model.layers.0.mlp.up_proj.weight"], tensors["model.layers.0.mlp.gate_proj.weight"] = (
            tensors["model.layers.0.mlp.gate_proj.weight"], tensors["model.layers.0.mlp.up_proj.weight"])

    assert fingerprint(_edited(llama, tmp_path, rename)) != fingerprint(llama)


def test_saving_the_same_tensors_again_keeps_the_fingerprint(llama, tmp_path):
    assert fingerprint(_edited(llama, tmp_path, lambda tensors: None)) == fingerprint(llama)


def test_a_byte_outside_every_sample_is_not_seen(llama, tmp_path):
    """The documented limit: a checkpoint is sampled, not read. The byte just before the middle
    sample of the file's data lies in no sample (tensor middles are 64 bytes, this tensor's is
    far from it), so changing it keeps the fingerprint."""
    folder = shutil.copytree(llama, tmp_path / "byte")
    file = checkpoint_files(folder)[0]
    raw = bytearray(file.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    header.pop("__metadata__", None)
    start = 8 + header_len
    offset = start + (len(raw) - start - FILE_SAMPLE_BYTES) // 2 - 1
    middles = [(start + b + (e - b - 64) // 2, start + b + (e - b - 64) // 2 + 64)
               for b, e in (t["data_offsets"] for t in header.values())]
    assert not any(lo <= offset < hi for lo, hi in middles)
    raw[offset] ^= 0xFF
    file.write_bytes(raw)
    assert fingerprint(folder) == fingerprint(llama)


def test_a_truncated_header_is_an_error(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(ValueError, match="not a safetensors file"):
        weights_fingerprint([bad])


def test_the_same_tokenizer_loaded_twice_has_one_fingerprint(llama):
    assert tokenizer_fingerprint(load_tokenizer(llama)) == tokenizer_fingerprint(tiny_tokenizer())


def test_another_vocabulary_differs(llama):
    other = train_bpe_tokenizer(TINY_VOCAB, stdlib_corpus_files(4))
    assert other.vocab_size == tiny_tokenizer().vocab_size  # same size, other merges
    assert other.get_vocab() != tiny_tokenizer().get_vocab()
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tiny_tokenizer())


def test_another_special_token_differs(llama):
    tok = load_tokenizer(llama)
    before = tokenizer_fingerprint(tok)
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    assert tokenizer_fingerprint(tok) != before
