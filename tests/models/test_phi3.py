"""Phi-3: fused checkpoint tensors split on load, partial rotary, and longrope (short and long
factors, attention factor), against HF transformers."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams
from tandem.models.config import ModelArchConfig
from tests.engine.test_greedy_vs_hf import _prompts, hf_greedy, tandem_greedy
from tests.helpers.tiny_models import hf_model, load_tiny_model, tiny_model_dir
from tests.models.test_model_vs_hf import ATOL, hf_logits, run_schedule


def test_longrope_config():
    arch = ModelArchConfig.from_pretrained_dir(tiny_model_dir("phi3_longrope"))
    s = arch.rope_scaling
    assert (s.rope_type, s.original_max_position_embeddings, s.short_factor) == ("longrope", 32, (1.0, 1.5, 2.5, 4.0))
    assert s.long_factor == (8.0,) * 4
    assert s.attention_factor == pytest.approx((1 + torch.log(torch.tensor(16.0)).item()
                                                / torch.log(torch.tensor(32.0)).item()) ** 0.5)
    assert arch.rotary_dim == 8  # head_dim 16 × partial_rotary_factor 0.5


@pytest.mark.parametrize("chunks", [[24], [5, 11, 1, 1, 1, 1, 1, 1, 1, 1]])
def test_longrope_logits_match_hf(chunks):
    ids = _prompts(9, [24])[0]
    ours = run_schedule("phi3_longrope", ids, chunks)
    torch.testing.assert_close(ours, hf_logits(hf_model(tiny_model_dir("phi3_longrope")), ids), atol=ATOL, rtol=ATOL)


def test_longrope_greedy_matches_hf_on_both_sides_of_the_original_context():
    """Original context 32, one mixed batch in chunks of 24 tokens: prompts of 3 and 12 tokens
    stay under 32 (short factors), prompts of 40 and 57 use the long factors from their first
    token — as HF generate does for each alone. A prompt of 20 that generates past position 32
    matches up to there; HF then recomputes the whole sequence with the long factors, tandem keeps
    the prompt's short-factor KV (README limits)."""
    path = tiny_model_dir("phi3_longrope")
    prompts = _prompts(4, [3, 12, 20, 40, 57])
    llm = LLM(model=str(path), num_kv_blocks=128, max_num_batched_tokens=24)
    got = [o.outputs[0].token_ids for o in tandem_greedy(llm, prompts, max_tokens=24)]
    expected = hf_greedy(path, prompts, max_tokens=24)
    assert [got[i] for i in (0, 1, 3, 4)] == [expected[i] for i in (0, 1, 3, 4)]
    assert got[2][:13] == expected[2][:13]  # tokens predicted from positions 19..31


def test_fused_tensors_of_the_wrong_size_are_named(tmp_path):
    src = tiny_model_dir("phi3")
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"qkv_proj.weight' has 127 rows, expected 64 \+ 32 \+ 32"):
        load_tiny_model(tmp_path)


def test_longrope_prompts_share_prefix_blocks_only_with_prompts_of_their_kind():
    """The same leading tokens are rotated with the short factors in a short prompt and with the
    long ones in a long prompt, so the engine salts the prefix cache with the kind: a long prompt
    after a short one with the same prefix recomputes it (and matches HF), another short one
    reuses the short prompt's blocks."""
    path = tiny_model_dir("phi3_longrope")
    llm = LLM(model=str(path), num_kv_blocks=128, enable_prefix_caching=True)
    shared = _prompts(6, [16])[0]
    prompts = [shared + p for p in _prompts(7, [4, 30, 6])]  # 20 tokens (short), 46 (long), 22 (short)
    outs = [tandem_greedy(llm, [p], max_tokens=8)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, max_tokens=8)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 16]
