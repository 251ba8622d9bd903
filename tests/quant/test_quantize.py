"""`tandem quantize` writes checkpoints in the published layouts: every tensor's name, shape and
dtype as the format says, values that the tests' own unpacker turns back into the original
weights within the rounding error, the matching quantization_config — and tandem, HF's and
compressed-tensors' readers all load the result."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tandem.cli import main
from tests.helpers.tiny_models import hf_model, tiny_model_dir
from tests.quant.formats import AWQ_ORDER, awq_unpack, dequantized_copy, gptq_unpack, unpack_words
from tests.quant.oracle import hf_greedy, hf_logits, load_quantized, prompts, tandem_greedy, tandem_logits
from tests.quant.published import awq_through_compressed_tensors, fp8_block_through_transformers

ATOL = 1e-4
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

RUNS = {
    "gptq-4bit-sym": (["--method", "gptq", "--group-size", "32"],
                      {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
                       "checkpoint_format": "gptq"}),
    "gptq-4bit-asym-v1": (["--method", "gptq", "--group-size", "16", "--no-sym"],
                          {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": False,
                           "checkpoint_format": "gptq"}),
    "gptq-8bit-asym-v2-per_row": (["--method", "gptq", "--bits", "8", "--group-size", "-1", "--no-sym",
                                   "--checkpoint-format", "gptq_v2"],
                                  {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False,
                                   "sym": False, "checkpoint_format": "gptq_v2"}),
    "awq": (["--method", "awq", "--group-size", "32"],
            {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}),
    "fp8-tensor": (["--method", "fp8", "--fp8-scales", "tensor"],
                   {"quant_method": "fp8", "activation_scheme": "dynamic"}),
    "fp8-channel": (["--method", "fp8", "--fp8-scales", "channel"],
                    {"quant_method": "fp8", "activation_scheme": "dynamic"}),
    "fp8-block": (["--method", "fp8", "--block-size", "32"],
                  {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}),
}


def quantize(tmp_path, run: str, kind: str = "llama"):
    dst = tmp_path / run
    assert main(["quantize", str(tiny_model_dir(kind)), str(dst), *RUNS[run][0]]) == 0
    return dst


def _linear_weights(kind: str = "llama") -> dict[str, torch.Tensor]:
    original = load_file(tiny_model_dir(kind) / "model.safetensors")
    return {name[: -len("weight")]: t for name, t in original.items() if name.split(".")[-2] in LINEAR}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_writes_the_published_config_and_copies_everything_else(tmp_path, run):
    dst = quantize(tmp_path, run)
    src = tiny_model_dir("llama")
    config = json.loads((dst / "config.json").read_text())
    assert config.pop("quantization_config") == RUNS[run][1]
    assert config == json.loads((src / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    original = load_file(src / "model.safetensors")
    written = load_file(dst / "model.safetensors")
    untouched = [n for n in original if n.split(".")[-2] not in LINEAR]
    assert untouched and all(torch.equal(written[n], original[n]) for n in untouched)


@pytest.mark.parametrize("run", ["gptq-4bit-sym", "gptq-4bit-asym-v1", "gptq-8bit-asym-v2-per_row"])
def test_gptq_tensors_follow_the_published_layout(tmp_path, run):
    cfg = RUNS[run][1]
    bits, per_word = cfg["bits"], 32 // cfg["bits"]
    written = load_file(quantize(tmp_path, run) / "model.safetensors")
    for prefix, w in _linear_weights().items():
        n, k = w.shape
        size = k if cfg["group_size"] == -1 else cfg["group_size"]
        t = {s: written[prefix + s] for s in ("qweight", "qzeros", "scales", "g_idx")}
        assert prefix + "weight" not in written
        assert (t["qweight"].dtype, tuple(t["qweight"].shape)) == (torch.int32, (k // per_word, n))
        assert (t["qzeros"].dtype, tuple(t["qzeros"].shape)) == (torch.int32, (k // size, n // per_word))
        assert (t["scales"].dtype, tuple(t["scales"].shape)) == (torch.float16, (k // size, n))
        assert torch.equal(t["g_idx"], torch.arange(k, dtype=torch.int32) // size)
        q, zeros, scales, g_idx = gptq_unpack({s: v.numpy() for s, v in t.items()}, bits,
                                             cfg["checkpoint_format"] == "gptq_v2")
        if cfg["sym"]:
            assert (zeros == 2 ** (bits - 1)).all()
        if cfg["checkpoint_format"] == "gptq":
            assert (zeros >= 1).all()        # the original format cannot store a zero point of 0
        _check_rounding(w, q, zeros, scales, g_idx, slack=0.51 if cfg["sym"] else 1.01)


def test_awq_tensors_follow_the_published_layout(tmp_path):
    written = load_file(quantize(tmp_path, "awq") / "model.safetensors")
    for prefix, w in _linear_weights().items():
        n, k = w.shape
        t = {s: written[prefix + s] for s in ("qweight", "qzeros", "scales")}
        assert (t["qweight"].dtype, tuple(t["qweight"].shape)) == (torch.int32, (k, n // 8))
        assert (t["qzeros"].dtype, tuple(t["qzeros"].shape)) == (torch.int32, (k // 32, n // 8))
        assert (t["scales"].dtype, tuple(t["scales"].shape)) == (torch.float16, (k // 32, n))
        q, zeros, scales = awq_unpack({s: v.numpy() for s, v in t.items()})
        natural = unpack_words(t["qweight"].numpy(), 4, axis=1)
        assert not np.array_equal(natural, q), "AWQ's interleaved order must not read as natural order"
        _check_rounding(w, q, zeros, scales, np.arange(k) // 32, slack=1.01)
    assert AWQ_ORDER == [0, 2, 4, 6, 1, 3, 5, 7]


def _check_rounding(w: torch.Tensor, q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray,
                    slack: float) -> None:
    """Every weight is within ``slack`` quantization steps of its dequantized value."""
    steps = scales[g_idx].astype(np.float64).T                         # [N, K]
    restored = ((q - zeros[g_idx]).astype(np.float64).T) * steps
    assert (np.abs(restored - w.double().numpy()) <= slack * steps + 1e-6).all()


@pytest.mark.parametrize("run", ["fp8-tensor", "fp8-channel", "fp8-block"])
def test_fp8_tensors_follow_the_published_layout(tmp_path, run):
    written = load_file(quantize(tmp_path, run) / "model.safetensors")
    for prefix, w in _linear_weights().items():
        n, k = w.shape
        weight = written[prefix + "weight"]
        assert (weight.dtype, tuple(weight.shape)) == (torch.float8_e4m3fn, (n, k))
        if run == "fp8-block":
            scale = written[prefix + "weight_scale_inv"]
            assert (scale.dtype, tuple(scale.shape)) == (torch.float32, (-(-n // 32), -(-k // 32)))
            full = scale.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
        else:
            scale = written[prefix + "weight_scale"]
            assert (scale.dtype, tuple(scale.shape)) == (torch.float32, () if run == "fp8-tensor" else (n, 1))
            full = scale
        assert float((w.abs() / full).max()) == pytest.approx(448.0, rel=1e-6)   # amax maps to e4m3's max
        error = (weight.float() * full - w).abs()
        assert (error <= w.abs() / 16 + full * 2.0**-10).all()          # 3 mantissa bits, subnormal step


@pytest.mark.parametrize("run", sorted(RUNS))
def test_tandem_loads_the_result_and_matches_hf_on_its_dequantized_weights(tmp_path, run):
    dst = quantize(tmp_path, run)
    model, arch = load_quantized(dst)
    hf = hf_model(dequantized_copy(dst, tmp_path / "dequantized"))
    for ids in prompts():
        torch.testing.assert_close(tandem_logits(model, arch, ids), hf_logits(hf, ids), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("run", ["gptq-4bit-sym", "awq", "fp8-block"])
def test_greedy_output_is_identical_to_hf_on_the_dequantized_weights(tmp_path, run):
    dst = quantize(tmp_path, run, kind="qwen2")
    dequantized = dequantized_copy(dst, tmp_path / "dequantized")
    assert tandem_greedy(dst, prompts()) == hf_greedy(dequantized, prompts())


def test_compressed_tensors_reads_the_awq_output(tmp_path):
    dst = quantize(tmp_path, "awq")
    model, arch = load_quantized(dst)
    published = awq_through_compressed_tensors(dst, tmp_path / "ct")
    ids = prompts()[0]
    torch.testing.assert_close(tandem_logits(model, arch, ids), hf_logits(published, ids), atol=2e-2, rtol=0)


def test_transformers_reads_the_fp8_block_output(tmp_path):
    dst = quantize(tmp_path, "fp8-block")
    model, arch = load_quantized(dst)
    published = fp8_block_through_transformers(dst)
    ids = prompts()[1]
    torch.testing.assert_close(tandem_logits(model, arch, ids), hf_logits(published, ids), atol=ATOL, rtol=ATOL)


def test_large_checkpoints_are_sharded_with_an_index(tmp_path):
    dst = tmp_path / "sharded"
    assert main(["quantize", str(tiny_model_dir("llama")), str(dst), "--method", "awq", "--group-size", "32",
                 "--max-shard-size", "40000"]) == 0
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (dst / "model.safetensors").exists()
    for f in files:      # a shard stays under the limit unless one tensor alone exceeds it
        tensors = load_file(dst / f)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert nbytes <= 40000 or len(tensors) == 1
    assert tandem_greedy(dst, prompts()[:1]) == tandem_greedy(quantize(tmp_path, "awq"), prompts()[:1])


def test_refuses_unfit_shapes_and_existing_models(tmp_path, capsys):
    src = str(tiny_model_dir("llama"))
    assert main(["quantize", src, str(tmp_path / "a"), "--method", "awq", "--group-size", "48"]) == 2
    assert "multiple of group_size 48" in capsys.readouterr().err
    quantize(tmp_path, "awq")
    assert main(["quantize", src, str(tmp_path / "awq"), "--method", "fp8"]) == 2
    assert "already holds a model" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path / "awq"), str(tmp_path / "b"), "--method", "fp8"]) == 2
    assert "already quantized (awq)" in capsys.readouterr().err
