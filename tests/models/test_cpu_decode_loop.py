"""The C++ decode loop (tandem.models.cpu_decode_loop) against HF transformers: a prompt, then
token-by-token decode steps that all go through ``decode_layers`` (counted), float32 logits
within test_model_vs_hf's tolerance, on each linear kernel the loop calls (tandem's panels,
oneDNN, dense torch weights, GGUF blocks) and each layer shape it runs (Llama, Qwen3's q/k norms,
Gemma 3's norms, GELU-tanh, sliding layers on their own rotary base); bfloat16 gives the
modules' own path's values exactly; stacks the loop cannot run keep the Python path."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams
from tandem.kernels import cpu_ops
from tandem.models.cpu_decode_loop import PREFETCH_KV_BYTES, CpuDecodeLoop, KvPrefetchChoice, enable_cpu_decode_loop
from tandem.models.cpu_linear import amx_available, dpbf16_available
from tests.helpers.gguf_files import write_tiny_gguf
from tests.helpers.tiny_models import hf_model, tiny_model_dir
from tests.models.test_cpu_kernels_vs_hf import load_with_kernels, run
from tests.models.test_model_vs_hf import ATOL, hf_logits, prompt

PREFILL = 9


@pytest.fixture
def loop_calls(monkeypatch):
    calls = []
    real = cpu_ops.decode_layers

    def counted(hidden, *args):
        calls.append(hidden.shape[0])
        return real(hidden, *args)

    monkeypatch.setattr(cpu_ops, "decode_layers", counted)
    return calls


def decode_logits(kind, kernels, dtype=torch.float32, loop=True):
    model, arch = load_with_kernels(kind, kernels, dtype)
    if loop:
        assert enable_cpu_decode_loop(model)
        assert model.model.decode_loop.final_norm is not None  # the model's last norm runs in the loop too
    ids = prompt()
    return run(model, arch, ids, [PREFILL] + [1] * (len(ids) - PREFILL)), ids


@pytest.mark.parametrize(("kind", "kernels"), [("llama", "tandem"), ("llama_tied", "onednn"), ("mistral", "torch"),
                                               ("llama3", "tandem"), ("qwen3", "tandem"), ("gemma3", "tandem"),
                                               ("gemma3", "onednn"), ("llama", "amx")])
def test_decode_steps_through_the_loop_match_hf(kind, kernels, loop_calls):
    if kernels == "amx" and not amx_available():
        pytest.skip("this CPU (or its kernel) gives no AMX-BF16 instructions")
    got, ids = decode_logits(kind, kernels)
    assert loop_calls == [1] * (len(ids) - PREFILL)
    torch.testing.assert_close(got, hf_logits(hf_model(tiny_model_dir(kind)), ids), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_steps_of_several_rows_a_sequence_through_the_loop_match_hf(kind, loop_calls):
    """Steps of up to DECODE_QUERY_MAX rows of one sequence (drafts being checked, a tiny chunk)
    run through the loop too, each row reading the sequence's one block table."""
    model, arch = load_with_kernels(kind, "tandem", torch.float32)
    assert enable_cpu_decode_loop(model)
    ids = prompt()
    chunks = [PREFILL, 3, 1, 8, 2]
    chunks += [1] * (len(ids) - sum(chunks))
    got = run(model, arch, ids, chunks)
    assert loop_calls == chunks[1:]
    torch.testing.assert_close(got, hf_logits(hf_model(tiny_model_dir(kind)), ids), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize(("kind", "kernels"), [("llama", "tandem"), ("llama", "dpbf16"), ("gemma3", "tandem"),
                                               ("qwen3", "dpbf16"), ("llama", "amx"), ("qwen3", "amx")])
def test_bfloat16_loop_gives_the_modules_values_exactly(loop_calls, kind, kernels):
    if kernels == "dpbf16" and not dpbf16_available():
        pytest.skip("this CPU has no AVX512-BF16 instructions")
    if kernels == "amx" and not amx_available():
        pytest.skip("this CPU (or its kernel) gives no AMX-BF16 instructions")
    got, _ = decode_logits(kind, kernels, torch.bfloat16)
    assert loop_calls
    want, _ = decode_logits(kind, kernels, torch.bfloat16, loop=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["qwen2", "granite", "smollm3"])
def test_stacks_the_loop_cannot_run_keep_the_python_path(kind):
    """q/k/v biases, a residual multiplier, rope-free layers."""
    model, _ = load_with_kernels(kind, "tandem")
    assert CpuDecodeLoop.build(list(model.model.stage_layers())) is None


@pytest.mark.parametrize("types", ["one type", "mixed"])
def test_gguf_blocks_through_the_loop_match_hf_greedy(tmp_path, loop_calls, types):
    """Every layer's blocks of one type, or (as llama.cpp's _K_M files) the v projection in
    other blocks than q and k: the loop runs the qkv layer as two parts."""
    pick = (lambda name, i: Q.Q8_0) if types == "one type" else \
        (lambda name, i: Q.Q8_0 if "attn_v" in name or "ffn_down" in name else Q.Q5_0)
    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama", pick)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    prompts = [[5, 100, 200, 300, 17, 42, 99, 7], [6, 100, 200, 300, 17, 42, 99, 7]]
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(6):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            want.append(ids[len(p):])
    llm = LLM(model=str(path), num_kv_blocks=32, dtype="float32", num_threads=1, quantization="gguf")
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]
    assert got == want and want[0] != want[1]
    assert 2 in loop_calls  # both sequences decoding in one step


@pytest.mark.parametrize("kernels", ["tandem", "dpbf16", "amx"])
def test_an_engine_forced_onto_one_of_tandems_kernels_keeps_the_loop(kernels, loop_calls):
    """``engine.cpu_kernels`` naming one of tandem's own linear kernels keeps its element-wise
    kernels and the decode loop (as ``auto`` does), and the greedy tokens stay HF's."""
    if kernels == "dpbf16" and not dpbf16_available() or kernels == "amx" and not amx_available():
        pytest.skip(f"this CPU has no instructions for {kernels}")
    hf = hf_model(tiny_model_dir("llama"))
    ids = [5, 100, 200, 300, 17, 42, 99, 7]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=32, dtype="float32", num_threads=1,
              cpu_kernels=kernels)
    got = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    assert got == want
    assert loop_calls[1:] == [1] * 5  # every decode step through the loop (the prompt too)


def test_asking_for_the_kv_ahead_leaves_the_values_as_they_were(loop_calls, monkeypatch):
    want, ids = decode_logits("llama", "tandem")
    monkeypatch.setenv("TANDEM_CPU_PREFETCH_KV_KB", "0")
    got, _ = decode_logits("llama", "tandem")
    assert len(loop_calls) == 2 * (len(ids) - PREFILL)
    assert torch.equal(got, want)


def play(choice, steps):
    """Steps of (rows, seconds with, seconds without) through ``choice``; the bytes each asked."""
    asked = []
    for rows, with_s, without_s in steps:
        b = choice.bytes_for(rows)
        asked.append(b)
        choice.record(rows, b, with_s if b else without_s)
    return asked


@pytest.mark.parametrize(("without", "chosen"), [(0.9, 0), (1.01, 0), (1.03, PREFETCH_KV_BYTES),
                                                  (1.1, PREFETCH_KV_BYTES)])
def test_the_kv_prefetch_is_kept_where_it_measured_faster(without, chosen):
    """Kept where steps without it took at least GAIN (2%) longer; a 1% edge is noise: off."""
    choice = KvPrefetchChoice(env={})
    asked = play(choice, [(16, 1.0, without)] * (2 * KvPrefetchChoice.PAIRS))
    assert asked == [PREFETCH_KV_BYTES, 0] * KvPrefetchChoice.PAIRS  # turns, with first
    assert choice.chosen == chosen
    assert play(choice, [(16, 1.0, without)] * 3) == [chosen] * 3


def test_the_kv_prefetch_measures_only_pairs_of_equal_batches_of_enough_rows():
    choice = KvPrefetchChoice(env={})
    assert play(choice, [(4, 1.0, 0.5)] * 5) == [PREFETCH_KV_BYTES] * 5  # few rows: with, not measured
    # the batch changes every step: no pair compares, and after WINDOW steps it stays on
    steps = [(8 + i % 2, 1.0, 0.5) for i in range(KvPrefetchChoice.WINDOW)]
    play(choice, steps)
    assert choice.chosen == PREFETCH_KV_BYTES


@pytest.mark.parametrize(("kb", "chosen"), [("0", 0), ("256", 256 << 10)])
def test_the_environment_fixes_the_kv_prefetch(kb, chosen):
    choice = KvPrefetchChoice(env={"TANDEM_CPU_PREFETCH_KV_KB": kb})
    assert play(choice, [(16, 1.0, 0.1)] * 20) == [chosen] * 20
