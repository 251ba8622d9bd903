"""Layers against their transformers counterparts (LlamaRMSNorm, rope init functions,
LlamaRotaryEmbedding, apply_rotary_pos_emb, LlamaMLP) and the fused linear layer against plain
F.linear on the separate shards."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tandem.models.config import RopeScaling
from tandem.models.layers import GatedMLP, LinearLayer, RMSNorm
from tandem.interfaces import AttentionMetadata
from tandem.models.rotary import TABLE_MAX_POSITIONS, RotaryEmbedding, apply_rotary, compute_inv_freq
from tandem.quant.unquantized import UnquantizedLinearMethod

gen = torch.Generator().manual_seed(0)


def randn(*shape):
    return torch.randn(*shape, generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf_and_fuses_the_residual_add(dtype):
    hf = LlamaRMSNorm(32, eps=1e-5)
    ours = RMSNorm(32, eps=1e-5)
    weight = 1 + 0.1 * randn(32)
    hf.weight.data.copy_(weight)
    ours.weight.data.copy_(weight)
    hf, ours = hf.to(dtype), ours.to(dtype)
    x, residual = randn(5, 32).to(dtype), randn(5, 32).to(dtype)
    out, res = ours(x)
    assert torch.equal(out, hf(x)) and res is x
    out, res = ours(x, residual)
    assert torch.equal(res, x + residual)
    assert torch.equal(out, hf(x + residual))


LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def hf_config(rope_parameters, head_dim=32):
    return LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=512, rope_parameters=rope_parameters)


def test_inverse_frequencies_match_hf_for_default_linear_and_llama3():
    default = {"rope_type": "default", "rope_theta": 10000.0}
    hf_default, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config(default))
    assert torch.equal(compute_inv_freq(32, 10000.0, None), hf_default)
    linear = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    hf_linear, _ = ROPE_INIT_FUNCTIONS["linear"](hf_config(linear))
    assert torch.equal(compute_inv_freq(32, 10000.0, RopeScaling("linear", 4.0)), hf_linear)
    hf_llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config(LLAMA3))
    ours = compute_inv_freq(32, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    torch.testing.assert_close(ours, hf_llama3, rtol=1e-6, atol=0)
    # the test spans all three regimes: kept, blended and divided frequencies
    base = compute_inv_freq(32, 500000.0, None)
    ratio = base / ours
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


def test_cos_sin_tables_and_rotation_match_hf():
    config = hf_config(LLAMA3)
    positions = torch.tensor([0, 1, 7, 63, 64, 200, 511])
    x = randn(1, len(positions), 4 * 32)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(x, positions[None])
    ours = RotaryEmbedding(32, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    cos, sin = ours(positions, torch.float32)
    torch.testing.assert_close(cos, hf_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=1e-6, atol=1e-6)
    q, k = randn(len(positions), 4, 32), randn(len(positions), 2, 32)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    our_q, our_k = apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(our_q, hf_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_k, hf_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def _step_metadata(positions: list[int]) -> AttentionMetadata:
    """A decode step's metadata: one sequence per position (what the rotary table reads)."""
    n = len(positions)
    seq_lens = [p + 1 for p in positions]
    return AttentionMetadata(num_tokens=n, slot_mapping=torch.zeros(n, dtype=torch.long),
                             query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             context_lens=torch.tensor(positions, dtype=torch.int32),
                             block_tables=torch.zeros(n, 1, dtype=torch.int32), max_query_len=1,
                             max_seq_len=max(seq_lens), block_size=16, query_lens_cpu=[1] * n,
                             seq_lens_cpu=seq_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_table_looks_up_what_a_step_computes_and_hf_gives(dtype):
    """A CPU step's (cos, sin) come from a table grown as positions are met; the values are the
    ones computed from the positions (bit for bit) and HF's. Past the table, they are computed."""
    config = hf_config(LLAMA3)
    ours = RotaryEmbedding(32, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    for positions in ([0, 5], [300, 1000, 255, 256], [TABLE_MAX_POSITIONS - 1, 3], [TABLE_MAX_POSITIONS + 7]):
        index = torch.tensor(positions)
        cos, sin = ours(index, dtype, _step_metadata(positions))
        want_cos, want_sin = ours(index, dtype)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), positions
        hf_cos, hf_sin = LlamaRotaryEmbedding(config)(randn(1, len(positions), 32), index[None])
        torch.testing.assert_close(cos.float(), hf_cos[0].to(dtype).float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin.float(), hf_sin[0].to(dtype).float(), rtol=1e-6, atol=1e-6)
    assert ours._tables[dtype][0].shape == (TABLE_MAX_POSITIONS, 32)


def test_fused_linear_loads_shards_at_their_offsets():
    layer = LinearLayer(16, [12, 4, 4], bias=True, quant_method=UnquantizedLinearMethod())
    weights = [randn(n, 16) for n in (12, 4, 4)]
    biases = [randn(n) for n in (12, 4, 4)]
    for shard in (2, 0, 1):
        layer.load("weight", weights[shard], shard)
        layer.load("bias", biases[shard], shard)
    x = randn(3, 16)
    expected = torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)
    torch.testing.assert_close(layer(x), expected)


def test_linear_rejects_wrong_shapes_and_unknown_tensors():
    layer = LinearLayer(16, [8, 8], bias=False, quant_method=UnquantizedLinearMethod())
    with pytest.raises(ValueError, match="shape"):
        layer.load("weight", randn(16, 16), 0)
    with pytest.raises(ValueError, match="qweight"):
        layer.load("qweight", randn(8, 16), 0)
    with pytest.raises(ValueError, match="bias"):
        layer.load("bias", randn(8), 0)


def test_gated_mlp_matches_hf():
    config = LlamaConfig(hidden_size=16, intermediate_size=24, num_attention_heads=2)
    hf = LlamaMLP(config)
    ours = GatedMLP(16, 24, bias=False, hidden_act="silu", quant_method=UnquantizedLinearMethod())
    ours.gate_up_proj.load("weight", hf.gate_proj.weight.data, 0)
    ours.gate_up_proj.load("weight", hf.up_proj.weight.data, 1)
    ours.down_proj.load("weight", hf.down_proj.weight.data, 0)
    x = randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x))


def test_unsupported_activation_is_named():
    with pytest.raises(ValueError, match="relu2.*supported: silu"):
        GatedMLP(16, 24, bias=False, hidden_act="relu2", quant_method=UnquantizedLinearMethod())


@pytest.mark.parametrize("name, act", [("silu", torch.nn.SiLU()), ("gelu", torch.nn.GELU()),
                                       ("gelu_pytorch_tanh", torch.nn.GELU(approximate="tanh"))])
def test_gated_mlp_activation(name, act):
    mlp = GatedMLP(16, 24, bias=False, hidden_act=name, quant_method=UnquantizedLinearMethod())
    gate, up, down = torch.randn(24, 16), torch.randn(24, 16), torch.randn(16, 24)
    mlp.gate_up_proj.load("weight", gate, 0)
    mlp.gate_up_proj.load("weight", up, 1)
    mlp.down_proj.load("weight", down, 0)
    x = torch.randn(5, 16)
    torch.testing.assert_close(mlp(x), (act(x @ gate.T) * (x @ up.T)) @ down.T)
