"""The models with tandem's CPU kernels on (weights packed for the panel kernel or oneDNN, the
fused norm/activation/rotary passes, the "cpu" attention backend's in-place decode attention)
against HF transformers' forward logits, float32 — the same families, schedules and tolerance as
test_model_vs_hf.py, whose models stay on torch. And bfloat16: the fused passes give torch's
values exactly."""
from __future__ import annotations

import functools

import pytest
import torch

from tandem.models.config import kv_cache_shape
from tandem.models.cpu_fusion import enable_cpu_fusion
from tandem.models.cpu_linear import pack_cpu_linears
from tandem.models.loader import load_model
from tandem.plugins.attention_cpu import CpuAttentionBackend
from tandem.plugins.attention_torch import TorchAttentionBackend
from tests.helpers.paged_batch import SeqSpec, build_metadata, positions_of, scattered_tables
from tests.helpers.tiny_models import builtin_registry, hf_model, load_tiny_model, tiny_model_dir
from tests.models.test_model_vs_hf import ATOL, BLOCK_SIZE, KINDS, NUM_BLOCKS, hf_logits, prompt

CPU = torch.device("cpu")


def load_with_kernels(kind: str, kernels: str, dtype=torch.float32, fuse=True, attention=CpuAttentionBackend):
    registry = builtin_registry()
    model, arch = load_model(tiny_model_dir(kind), dtype=dtype, device=CPU, registry=registry,
                             attn_backend_cls=attention,
                             quant_method=registry.get("quant_method", "unquantized")())
    assert pack_cpu_linears(model, kernels, CPU) == kernels
    if fuse:
        assert enable_cpu_fusion(model) > 0
    return model, arch


@functools.cache
def models(kind, kernels):
    return (*load_with_kernels(kind, kernels), hf_model(tiny_model_dir(kind)))


@torch.inference_mode()
def run(model, arch, ids, chunks, attention=CpuAttentionBackend):
    pool = torch.zeros(kv_cache_shape(arch, NUM_BLOCKS, BLOCK_SIZE), dtype=next(model.parameters()).dtype)
    table = scattered_tables([len(ids)], BLOCK_SIZE, NUM_BLOCKS, seed=11)[0]
    outs, start = [], 0
    for n in chunks:
        seqs = [SeqSpec(table, start, n)]
        md = build_metadata(seqs, BLOCK_SIZE)
        attention.prepare_metadata(md)
        hidden = model(torch.tensor(ids[start:start + n]), positions_of(seqs), pool, md)
        outs.append(model.compute_logits(hidden))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("schedule", ["one_pass", "chunks", "token_by_token"])
def test_logits_match_hf_with_tandem_kernels(kind, schedule):
    model, arch, hf = models(kind, "tandem")
    ids = prompt()
    chunks = {"one_pass": [len(ids)], "chunks": [7, 13, 1, len(ids) - 21], "token_by_token": [1] * len(ids)}
    torch.testing.assert_close(run(model, arch, ids, chunks[schedule]), hf_logits(hf, ids), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize(("kind", "kernels"), [("llama", "onednn"), ("qwen3", "onednn"), ("phi3", "onednn"),
                                               ("llama", "amx"), ("gemma3", "amx")])
def test_logits_match_hf_with_onednn_or_amx_linears(kind, kernels):
    """float32 layers on oneDNN, or on AMX tiles as three bfloat16 parts a value (where K is
    whole tiles of 32; the rest on tandem's panels)."""
    from tandem.models.cpu_linear import amx_available

    if kernels == "amx" and not amx_available():
        pytest.skip("this CPU (or its kernel) gives no AMX-BF16 instructions")
    model, arch, hf = models(kind, kernels)
    ids = prompt(1)
    torch.testing.assert_close(run(model, arch, ids, [9, 1, 1, len(ids) - 11]), hf_logits(hf, ids),
                               atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "granite"])
def test_fused_passes_give_torchs_bfloat16_values_exactly(kind):
    """Linear layers and attention on torch's kernels in both, so only the fused
    norm/activation/rotary differ."""
    ours, arch = load_with_kernels(kind, "torch", torch.bfloat16, fuse=True, attention=TorchAttentionBackend)
    ref, _ = load_tiny_model(tiny_model_dir(kind), dtype=torch.bfloat16)
    ids = prompt(2)
    got = run(ours, arch, ids, [len(ids)], TorchAttentionBackend)
    want = run(ref, arch, ids, [len(ids)], TorchAttentionBackend)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kernels", ["tandem", "dpbf16", "amx", "onednn", "torch"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_bfloat16_next_tokens_match_hf_on_each_kernel(kind, kernels):
    """Every kernel ``auto`` may pick, forced in turn, on a bfloat16 model: at each position where
    HF's own bfloat16 forward is not near a tie, the next token it predicts is HF's, and the
    logits stay within bfloat16's reach of HF's (the kernels sum in float32, HF rounds as torch
    does: exact agreement is not to be had)."""
    from tandem.models.cpu_linear import amx_available, dpbf16_available

    if kernels == "dpbf16" and not dpbf16_available():
        pytest.skip("this CPU has no AVX512-BF16 instructions")
    if kernels == "amx" and not amx_available():
        pytest.skip("this CPU (or its kernel) gives no AMX-BF16 instructions")
    model, arch = load_with_kernels(kind, kernels, torch.bfloat16)
    hf = hf_model(tiny_model_dir(kind)).to(torch.bfloat16)
    ids = prompt(0)
    got = run(model, arch, ids, [9, 1, 1, len(ids) - 11]).float()
    want = hf_logits(hf, ids).float()
    top2 = want.topk(2, dim=-1).values
    scale = want.abs().max().item()
    clear = (top2[:, 0] - top2[:, 1]) > 0.025 * scale  # twice the logits' tolerance below
    assert clear.sum() >= len(ids) // 2, "the test model must have clear next tokens"
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    torch.testing.assert_close(got, want, atol=0.0125 * scale, rtol=0.02)


@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen3"])
def test_prompts_through_sdpa_match_hf(kind):
    """The cpu backend with a sequence of 9 or more query rows in a step on torch's SDPA
    (``engine.cpu_prefill_attention = "sdpa"``): a whole prompt, then chunks over a cached prefix
    (Gemma 3's sliding layers take the masked path)."""
    model, arch, hf = models(kind, "tandem")
    sdpa = type("CpuSdpa", (CpuAttentionBackend,), {"sdpa_rows": 9})
    ids = prompt()
    for chunks in ([len(ids)], [10, 1, 12, len(ids) - 23]):
        torch.testing.assert_close(run(model, arch, ids, chunks, attention=sdpa), hf_logits(hf, ids),
                                   atol=ATOL, rtol=ATOL)
