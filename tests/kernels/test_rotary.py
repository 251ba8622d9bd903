"""apply_rotary_ rotates q and k in place like its torch reference; the reference rotates like
HF Llama's apply_rotary_pos_emb with HF's own cos/sin tables."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tandem.kernels.rotary import apply_rotary_, rotary_reference

from .paged_inputs import tolerances

MAX_POSITION = 256


def _hf_tables(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos/sin for positions 0..MAX_POSITION-1, ``[MAX_POSITION, head_dim]`` float32."""
    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                         max_position_embeddings=MAX_POSITION, rope_theta=10000.0)
    rope = LlamaRotaryEmbedding(config)
    positions = torch.arange(MAX_POSITION)[None]
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0].contiguous(), sin[0].contiguous()


def _fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, gen):
    """q and k as views of one fused projection output whose v part is poisoned with NaN."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(device=device, dtype=dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv[:, q_size + kv_size:] = float("nan")
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    return qkv, q, k


@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_matches_hf_apply_rotary_pos_emb(head_dim, gen):
    cos, sin = _hf_tables(head_dim)
    q = torch.randn(6, 4, head_dim, generator=gen)
    k = torch.randn(6, 2, head_dim, generator=gen)
    positions = torch.tensor([0, 1, 7, 64, 100, MAX_POSITION - 1])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      cos[positions][None], sin[positions][None])
    ref_q, ref_k = rotary_reference(q, k, positions, cos, sin)
    torch.testing.assert_close(ref_q, hf_q[0].transpose(0, 1))
    torch.testing.assert_close(ref_k, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_reference_in_place(dtype, num_heads, num_kv_heads, head_dim, device, gen):
    cos, sin = (t.to(device) for t in _hf_tables(head_dim))
    qkv, q, k = _fused_qkv(9, num_heads, num_kv_heads, head_dim, dtype, device, gen)
    positions = torch.randint(0, MAX_POSITION, (9,), generator=gen)
    positions[:2] = torch.tensor([0, MAX_POSITION - 1])
    positions = positions.to(device)
    expected_q, expected_k = rotary_reference(q, k, positions, cos, sin)
    apply_rotary_(q, k, positions, cos, sin)
    torch.testing.assert_close(q, expected_q, **tolerances(dtype))
    torch.testing.assert_close(k, expected_k, **tolerances(dtype))
    assert qkv[:, (num_heads + num_kv_heads) * head_dim:].isnan().all(), "v must stay untouched"


def test_position_zero_is_identity(device, gen):
    cos, sin = (t.to(device) for t in _hf_tables(64))
    _, q, k = _fused_qkv(3, 2, 1, 64, torch.float32, device, gen)
    q0, k0 = q.clone(), k.clone()
    apply_rotary_(q, k, torch.zeros(3, dtype=torch.int32, device=device), cos, sin)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_rejects_bad_arguments(device, gen):
    cos, sin = (t.to(device) for t in _hf_tables(64))
    _, q, k = _fused_qkv(3, 2, 1, 64, torch.float16, device, gen)
    positions = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="cos_cache has dtype"):
        apply_rotary_(q, k, positions, cos.half(), sin)
    with pytest.raises(ValueError, match="key has dtype"):
        apply_rotary_(q, k.float(), positions, cos, sin)
