"""Running a quantized checkpoint through tandem and its dequantized twin through HF transformers.

    model, arch = load_quantized(path)               # quant method from config.json, as the engine picks it
    ours = tandem_logits(model, arch, ids)          # [len(ids), vocab]: a prefill chunk, then decode steps
    ref = hf_logits(hf_model(dequantized_dir), ids)
    tandem_greedy(path, prompts) == hf_greedy(dequantized_dir, prompts)
"""
from __future__ import annotations

from pathlib import Path

import torch

from tandem import LLM, SamplingParams
from tandem.models.config import ModelArchConfig, kv_cache_shape
from tandem.models.loader import load_model
from tandem.plugins.attention_torch import TorchAttentionBackend
from tests.helpers.paged_batch import SeqSpec, build_metadata, positions_of, scattered_tables
from tests.helpers.tiny_models import builtin_registry, hf_model, tiny_tokenizer

BLOCK_SIZE = 4
NUM_BLOCKS = 64
MAX_TOKENS = 12
TEXTS = [
    "def load_model(path, *, dtype, device):\n    return build(path).to(device, dtype)",
    "The quick brown fox jumps over the lazy dog.",
    "import os\nprint(os.getcwd())",
]


def prompts() -> list[list[int]]:
    return [tiny_tokenizer().encode(t) for t in TEXTS]


def load_quantized(path: str | Path, dtype: torch.dtype = torch.float32,
                   device: str = "cpu") -> tuple[torch.nn.Module, ModelArchConfig]:
    registry = builtin_registry()
    qcfg = ModelArchConfig.from_pretrained_dir(path).quantization_config
    method = registry.get("quant_method", qcfg.get("quant_method", "unquantized")).from_config(qcfg)
    return load_model(path, dtype=dtype, device=torch.device(device), registry=registry,
                      attn_backend_cls=TorchAttentionBackend, quant_method=method)


@torch.inference_mode()
def tandem_logits(model: torch.nn.Module, arch: ModelArchConfig, ids: list[int],
                  device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits of every position: the first two thirds of ``ids`` in one chunk, then one token
    per step, over a scattered block table. Returned on the CPU."""
    pool = torch.zeros(kv_cache_shape(arch, NUM_BLOCKS, BLOCK_SIZE), dtype=dtype, device=device)
    table = scattered_tables([len(ids)], BLOCK_SIZE, NUM_BLOCKS, seed=3)[0]
    first = 2 * len(ids) // 3
    outs, start = [], 0
    for n in [first] + [1] * (len(ids) - first):
        seqs = [SeqSpec(table, start, n)]
        md = build_metadata(seqs, BLOCK_SIZE, device=device)
        TorchAttentionBackend.prepare_metadata(md)
        hidden = model(torch.tensor(ids[start:start + n], device=device), positions_of(seqs).to(device), pool, md)
        outs.append(model.compute_logits(hidden).cpu())
        start += n
    return torch.cat(outs)


@torch.inference_mode()
def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


def tandem_greedy(path: str | Path, token_prompts: list[list[int]], **overrides) -> list[list[int]]:
    llm = LLM(model=str(path), num_kv_blocks=128, **overrides)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(token_prompts, params)]


@torch.inference_mode()
def hf_greedy(path: str | Path, token_prompts: list[list[int]]) -> list[list[int]]:
    model = hf_model(path)
    outs = []
    for p in token_prompts:
        ids = torch.tensor([p])
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                           min_new_tokens=MAX_TOKENS, do_sample=False)
        outs.append(g[0, len(p):].tolist())
    return outs
