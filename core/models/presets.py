"""Model presets for demos, tests and benchmarks: ordinary Hugging Face folders built locally.

``make_demo_model(preset, path)`` writes config.json, model.safetensors, generation_config.json
and a tokenizer (byte-level BPE trained on the interpreter's standard library, Llama-3-like chat
template) that ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` load as they are. Weights
are random but deterministic (fixed seed): normal(0, 0.02) scaled ×3, the LM head a further ×8, so
greedy decoding has clear winners instead of near-ties (docs/architecture.md §4).

Presets (docs/architecture.md §4):
    demo        Llama, vocab 4096, hidden 256, 4 layers, 8 heads / 2 KV heads: built in seconds
    bench-100m  Llama, vocab 32000, hidden 768, intermediate 2048, 8 layers, 12 heads / 4 KV heads,
                untied, max position 4096, float32: about 100M parameters

A folder already holding the same preset and version (marker file ``.tandem-preset.json``) is
left as it is; the marker is written last, so an interrupted build is redone.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PRESET_VERSION = 1
MARKER_FILE = ".tandem-preset.json"
INIT_STD = 0.02
MATRIX_SCALE = 3.0
LM_HEAD_SCALE = 8.0


@dataclass(frozen=True, slots=True)
class Preset:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    corpus_files: int | None
    seed: int


PRESETS = {
    "demo": Preset(4096, 256, 768, 4, 8, 2, 2048, False, corpus_files=40, seed=0),
    "bench-100m": Preset(32000, 768, 2048, 8, 12, 4, 4096, False, corpus_files=None, seed=0),
}


def _check_preset(preset: str) -> Preset:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[preset]


def _marker(preset: str) -> dict:
    return {"preset": preset, "version": PRESET_VERSION, **asdict(PRESETS[preset])}


def is_built(preset: str, path: str | Path) -> bool:
    marker = Path(path) / MARKER_FILE
    return marker.is_file() and json.loads(marker.read_text()) == _marker(preset)


def make_demo_model(preset: str, path: str | Path) -> Path:
    """Build preset ``preset`` into the folder ``path`` (created if needed) unless it already
    holds it; returns the folder."""
    spec = _check_preset(preset)
    path = Path(path)
    if is_built(preset, path):
        return path
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER_FILE).unlink(missing_ok=True)
    from safetensors.torch import save_file

    from tandem.models.tokenizer_training import EOT, stdlib_corpus_files, train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(spec.vocab_size, stdlib_corpus_files(spec.corpus_files))
    tokenizer.save_pretrained(path)
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    _write_config(path, spec, special)
    _write_generation_config(path, special, tokenizer.convert_tokens_to_ids(EOT))
    save_file(_random_weights(spec), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / MARKER_FILE).write_text(json.dumps(_marker(preset), indent=2))
    return path


def _write_config(path: Path, spec: Preset, special: dict[str, int]) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=1e-5,
        dtype="float32",
        **special,
    )
    config.save_pretrained(path)


def _write_generation_config(path: Path, special: dict[str, int], eot_id: int) -> None:
    gen = {"bos_token_id": special["bos_token_id"], "eos_token_id": [special["eos_token_id"], eot_id],
           "pad_token_id": special["pad_token_id"]}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))


def _random_weights(spec: Preset) -> dict[str, torch.Tensor]:
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    h, head_dim = spec.hidden_size, spec.hidden_size // spec.num_attention_heads
    kv = spec.num_key_value_heads * head_dim

    def matrix(rows: int, cols: int, scale: float = MATRIX_SCALE) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen).mul_(INIT_STD * scale)

    weights = {"model.embed_tokens.weight": matrix(spec.vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        prefix = f"model.layers.{i}"
        weights.update({
            f"{prefix}.input_layernorm.weight": torch.ones(h),
            f"{prefix}.self_attn.q_proj.weight": matrix(h, h),
            f"{prefix}.self_attn.k_proj.weight": matrix(kv, h),
            f"{prefix}.self_attn.v_proj.weight": matrix(kv, h),
            f"{prefix}.self_attn.o_proj.weight": matrix(h, h),
            f"{prefix}.post_attention_layernorm.weight": torch.ones(h),
            f"{prefix}.mlp.gate_proj.weight": matrix(spec.intermediate_size, h),
            f"{prefix}.mlp.up_proj.weight": matrix(spec.intermediate_size, h),
            f"{prefix}.mlp.down_proj.weight": matrix(h, spec.intermediate_size),
        })
    weights["model.norm.weight"] = torch.ones(h)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = matrix(spec.vocab_size, h, MATRIX_SCALE * LM_HEAD_SCALE)
    return weights


def cache_dir() -> Path:
    """Where ``default_model_path`` keeps built presets: ``$TANDEM_CACHE_DIR`` or
    ``~/.cache/tandem``."""
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")


def default_model_path(preset: str) -> Path:
    """The preset's folder under ``cache_dir()/models``, built on first use. Concurrent callers
    each build into a private folder and the first to finish renames it into place."""
    _check_preset(preset)
    final = cache_dir() / "models" / preset
    if is_built(preset, final):
        return final
    scratch = final.with_name(f".{preset}.building-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    make_demo_model(preset, scratch)
    if final.exists() and not is_built(preset, final):
        shutil.rmtree(final, ignore_errors=True)
    try:
        scratch.rename(final)
    except OSError:
        shutil.rmtree(scratch, ignore_errors=True)
        if not is_built(preset, final):
            raise
    return final
