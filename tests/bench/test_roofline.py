"""The decode-step roofline (tandem.bench.roofline): parameter, byte and FLOP counts against
hand-computed cases and HF transformers' own parameter count; the machine measurements return
rates (no timing is asserted); the recorded contexts against the requests' lengths; and a smoke
run of `tandem bench offline --modes tandem` that prints the roofline lines."""
from __future__ import annotations

import argparse
import math
import re

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.bench.offline import add_arguments, run
from tandem.bench.roofline import (
    Machine,
    RecordedStep,
    decode_batches,
    decode_cost,
    layer_matmul_params,
    measure_gemm_rate,
    measure_read_bandwidth,
    num_parameters,
    recording_steps,
    roofline_line,
    step_bandwidths,
)
from tandem.engine import StepStats
from tandem.models.config import ModelArchConfig
from tandem.models.cpu_linear import kinds_for
from tandem.models.cpu_tuning import Shape
from tests.helpers.tiny_models import hf_model, tiny_model_dir

NUMBER = r"[0-9]+(?:\.[0-9]+)?"
# hidden 8, intermediate 16, 2 layers, 2 heads of 4, 1 KV head, vocab 10
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 10}


def test_hand_computed_parameter_counts():
    arch = ModelArchConfig.from_dict(TINY)
    # q 8x8 + k 8x4 + v 8x4 + o 8x8 + gate/up/down 3 x 8x16 = 64 + 32 + 32 + 64 + 384
    assert layer_matmul_params(arch) == 576
    # 2 layers x (576 + two norms of 8) + final norm 8 + embeddings 80 + LM head 80
    assert num_parameters(arch) == 1352
    tied = ModelArchConfig.from_dict({**TINY, "tie_word_embeddings": True})
    assert num_parameters(tied) == 1272
    biased = ModelArchConfig.from_dict({**TINY, "attention_bias": True, "mlp_bias": True})
    # + per layer q 8, k 4, v 4, o 8 and gate 16, up 16, down 8
    assert num_parameters(biased) == 1352 + 2 * (24 + 40)


def test_hand_computed_decode_cost_at_batch_3():
    cost = decode_cost(ModelArchConfig.from_dict(TINY), (5, 7, 9), dtype_bytes=2)
    # every parameter but the 7 unread rows of the embedding table: (1352 - 80 + 3 x 8) x 2 bytes
    assert cost.weight_bytes == 2592
    # 2 layers x K and V x 1 KV head x 4 x (5 + 7 + 9) positions x 2 bytes
    assert cost.kv_bytes == 672
    # 2 x 3 rows x (2 x 576 + LM head 80) + 2 layers x 4 x 2 heads x 4 x 21 positions
    assert cost.flops == 7392 + 1344


def test_tied_lm_head_reads_the_whole_table():
    cost = decode_cost(ModelArchConfig.from_dict({**TINY, "tie_word_embeddings": True}), (5,), 4)
    assert cost.weight_bytes == 1272 * 4


def test_sliding_layers_attend_to_their_window_only():
    arch = ModelArchConfig.from_dict({**TINY, "model_type": "mistral", "sliding_window": 6})
    cost = decode_cost(arch, (5, 7, 9), dtype_bytes=2)
    # both layers slide: 5 + 6 + 6 positions each
    assert cost.kv_bytes == 2 * 2 * 1 * 4 * 17 * 2
    assert cost.flops == 7392 + 2 * 4 * 2 * 4 * 17


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_parameter_count_matches_transformers(kind):
    path = tiny_model_dir(kind)
    expected = sum(p.numel() for p in hf_model(path).parameters())
    assert num_parameters(ModelArchConfig.from_pretrained_dir(path)) == expected


def test_measurements_return_positive_finite_rates():
    bandwidth = measure_read_bandwidth(num_bytes=4 * 2**20, repeats=3)
    assert math.isfinite(bandwidth) and bandwidth > 0
    for dtype in ("float32", "bfloat16"):
        rate, kernel = measure_gemm_rate(4, 64, 128, dtype, repeats=3)
        assert math.isfinite(rate) and rate > 0
        assert kernel in kinds_for(Shape(getattr(torch, dtype), 128, 64))


def _step(num_seqs: int, num_prompt_tokens: int = 0, duration_s: float = 0.01,
          bandwidth: float | None = None) -> RecordedStep:
    stats = StepStats(num_tokens=num_seqs + num_prompt_tokens, num_seqs=num_seqs,
                      num_prompt_tokens=num_prompt_tokens, num_generation_tokens=num_seqs, duration_s=duration_s)
    return RecordedStep(stats, (10,) * num_seqs, bandwidth)


def test_each_step_takes_the_higher_of_the_bandwidths_sampled_around_it():
    # a sample is taken right after its step: step 0 has only the sample after it; steps 1-3
    # lie between the samples after steps 0 and 3; steps 4-5 come after the last one
    steps = [_step(1, bandwidth=10.0), _step(1), _step(1), _step(1, bandwidth=40.0), _step(1), _step(1)]
    assert step_bandwidths(steps, fallback=99.0) == [10.0, 40.0, 40.0, 40.0, 40.0, 40.0]
    # one sample disturbed (the OS held the sum up) does not lower the floor of the steps by it
    steps = [_step(1, bandwidth=25.0), _step(1), _step(1, bandwidth=5.0), _step(1), _step(1, bandwidth=26.0)]
    assert step_bandwidths(steps, fallback=99.0) == [25.0, 25.0, 25.0, 26.0, 26.0]
    assert step_bandwidths([_step(1), _step(1)], fallback=99.0) == [99.0, 99.0]


def test_the_ratio_is_the_median_of_each_steps_time_over_its_own_floor():
    arch = ModelArchConfig.from_dict(TINY)
    cost = decode_cost(arch, (10,), 4)
    memory_bytes = cost.weight_bytes + cost.kv_bytes
    machine = Machine(read_bytes_per_s=1.0, gemm_flops_per_s={1: 1e30})  # memory-bound
    # samples B/2, B/2, B after three decode steps, so the steps' bandwidths are B/2, B/2, B
    # (their floors 2t, 2t, t); taking 2t, 3t, 2t: ratios 1, 1.5, 2
    t = 1e-3
    bandwidth = memory_bytes / t
    steps = [_step(1, duration_s=2 * t, bandwidth=bandwidth / 2), _step(1, duration_s=3 * t, bandwidth=bandwidth / 2),
             _step(1, duration_s=2 * t, bandwidth=bandwidth)]
    line = roofline_line(arch, steps, 1, "float32", machine)
    assert re.search(r"→ 1\.50x the floor \(median over the steps\)$", line), line
    assert "floor 2.0 ms (memory-bound" in line, line  # the median floor


def test_decode_batches_are_the_median_and_the_full_batch_when_seen():
    steps = [_step(64, num_prompt_tokens=200), _step(64), _step(40), _step(30), _step(30)]
    assert decode_batches(steps, full_batch=64) == [30, 64]
    assert decode_batches(steps, full_batch=48) == [30]
    assert decode_batches([_step(8, num_prompt_tokens=3)], full_batch=8) == []


@pytest.mark.timeout(120)
def test_recorded_contexts_follow_the_request_lengths():
    llm = LLM(model=str(tiny_model_dir("llama")), max_num_seqs=4)
    with recording_steps(llm.engine) as steps:
        llm.generate([[5, 6, 7, 8, 9], [5, 6, 7]], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                                     SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)])
    # one prompt step of 5 + 3 tokens, then one decode token per sequence still running
    assert [sorted(s.contexts) for s in steps] == [[3, 5], [4, 6], [7], [8]]
    assert [s.is_pure_decode for s in steps] == [False, True, True, True]
    assert all(s.read_bytes_per_s is None and s.sampling_s == 0 for s in steps)


@pytest.mark.timeout(120)
def test_the_bandwidth_is_sampled_every_nth_step_and_its_time_kept_apart():
    llm = LLM(model=str(tiny_model_dir("llama")), max_num_seqs=4)
    with recording_steps(llm.engine, sample_every=2) as steps:
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(steps) == 5
    sampled = [s.read_bytes_per_s is not None for s in steps]
    assert sampled == [True, False, True, False, True]
    assert all(s.read_bytes_per_s > 0 and math.isfinite(s.read_bytes_per_s) and s.sampling_s > 0
               for s in steps if s.read_bytes_per_s is not None)


@pytest.mark.timeout(180)
def test_bench_offline_prints_the_roofline(capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir("llama")), "--modes", "tandem",
                              "--num-requests", "4", "--prompt-len", "4", "12", "--output-len", "6", "10",
                              "--max-num-seqs", "4"])
    assert run(args) == 0
    report = capsys.readouterr().out
    expected = [
        rf"^roofline: read bandwidth (sampled during the run|measured now) {NUMBER} GB/s .* GEMM \[B, 64\] x "
        rf"\[64, 128\] float32 {NUMBER} GFLOP/s at B=[0-9]+",
        rf"^decode step at batch [0-9]+: {NUMBER} ms measured \(median of [0-9]+ steps, mean context [0-9]+\), "
        rf"floor {NUMBER} ms \((compute|memory)-bound: .* → {NUMBER}x the floor \(median over the steps\)$",
    ]
    for line in expected:
        assert re.search(line, report, re.MULTILINE), f"no line matching {line!r} in:\n{report}"
