"""Linear kernels chosen by measurement (``engine.cpu_kernels = "auto"``): the timing loop against
known sleeps, the decision rules on hand-worked times, the memory budget, the on-disk cache (a
second start measures nothing; another thread count measures again), the busy-machine guard
against a process that spins, and a tuned model's logits against the dense model on every
bucket of rows."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from tandem.models import cpu_tuning
from tandem.models.cpu_linear import (BucketedLinear, PackedLinear, amx_available, dpbf16_available, kinds_for,
                                      pack_cpu_linears)
from tandem.models.cpu_tuning import M_BUCKETS, Shape, ShapeChoice, bucket_index, choose, measure, within_budget
from tandem.models.layers import LinearLayer, LMHead
from tests.helpers.tiny_models import load_tiny_model, tiny_model_dir

CPU = torch.device("cpu")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private cache, and a machine taken as idle (the suite runs beside other tests)."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_tuning, "machine_is_busy", lambda: None)
    monkeypatch.setattr(cpu_tuning.CpuMeter, "others_share", lambda self: 0.0)
    return tmp_path


def packed_layers(model):
    return [m for m in model.modules() if isinstance(m, (LinearLayer, LMHead))]


def kinds_of(model) -> list[list[str]]:
    return [p.kinds if isinstance(p, BucketedLinear) else [p.kind] * len(M_BUCKETS)
            for p in (m.packed for m in packed_layers(model))]


def test_measure_keeps_each_candidates_fastest_run():
    x = torch.zeros(1)
    got = measure({"fast": lambda x: None, "slow": lambda x: time.sleep(0.002)}, [x, x], budget_s=0.01)
    assert all(0.002 <= s < 0.05 for s in got["slow"]), got
    assert all(s < 0.001 for s in got["fast"]), got


def test_each_candidate_is_timed_after_itself_or_after_what_comes_before_it_in_a_step():
    """A kernel whose first call after another's pays a wake-up (here 2 ms of sleep): timed on
    its second call in a row by default, and with the wake-up after ``before``."""
    last = [None]

    def kernel(name):
        def call(x):
            if last[0] != name:
                time.sleep(0.002)
            last[0] = name
        return call

    got = measure({"a": kernel("a"), "b": kernel("b")}, [torch.zeros(1)], budget_s=0.01)
    assert got["a"][0] < 0.001 and got["b"][0] < 0.001, got

    # with what runs before it in a step (`before`, the work pool's job), the wake-up is timed
    pool = kernel("pool")
    got = measure({"a": kernel("a"), "b": kernel("b")}, [torch.zeros(1)], budget_s=0.01, before=lambda: pool(None))
    assert got["a"][0] >= 0.002 and got["b"][0] >= 0.002, got


def test_choice_caches_time_each_run_after_the_pool_job(monkeypatch):
    seen = {}
    monkeypatch.setattr(cpu_tuning, "pool_job", lambda: "the pool job")
    monkeypatch.setattr(cpu_tuning, "measure", lambda candidates, inputs, **kw: seen.update(kw) or {})
    cpu_tuning.ChoiceCache("attention").measure({}, [])
    assert seen["before"] == "the pool job"


def test_candidates_rotate_over_weight_copies_that_pass_the_streamed_bytes():
    assert cpu_tuning.num_copies(1 << 20) == 64  # 64 MiB of 1 MiB copies
    assert cpu_tuning.num_copies(3 << 20) == 22  # rounded up: 66 MiB
    assert cpu_tuning.num_copies(300 << 20) == 1
    assert cpu_tuning.num_copies(1 << 10) == cpu_tuning.MAX_COPIES
    seen = []
    rotation = cpu_tuning.Rotation([lambda x, i=i: seen.append(i) for i in range(3)])
    for _ in range(7):
        rotation(None)
    assert seen == [0, 1, 2, 0, 1, 2, 0]


def test_bucket_of_a_batch_is_the_nearest_on_a_log_scale():
    assert [bucket_index(m) for m in (1, 2, 3, 8, 9, 31, 33, 127, 129, 4096)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def times(**per_kind):
    return {k: [t * 1e-6 for t in v] for k, v in per_kind.items()}


def test_the_fixed_rules_kernel_stays_unless_clearly_slower():
    # onednn is 5% faster everywhere: noise, tandem stays; 30% faster everywhere: it takes over
    close = choose(times(tandem=[100] * 5, onednn=[95] * 5), "tandem")
    assert (close.primary, close.buckets) == ("tandem", ("tandem",) * 5)
    clear = choose(times(tandem=[100] * 5, onednn=[70] * 5), "tandem")
    assert (clear.primary, clear.buckets) == ("onednn", ("onednn",) * 5)


def test_a_bucket_takes_a_second_kernel_only_when_much_faster_there():
    # torch: 2x faster at M=1, 1.2x at M=4 (under SECOND_GAIN), 10x slower from M=16 on
    got = choose(times(tandem=[40, 50, 100, 300, 1000], torch=[20, 42, 1000, 3000, 10000]), "tandem")
    assert got.primary == "tandem" and got.buckets == ("torch", "tandem", "tandem", "tandem", "tandem")
    assert got.kinds == ["tandem", "torch"]


def test_a_kernel_other_than_the_fixed_rules_must_win_a_second_pass():
    """SmolLM2's o_proj (576x576) as timed in one disturbed first pass on a Zen 4 EPYC (µs):
    dpbf16 slowed from 16 rows on, so oneDNN took 64 rows (234 / 185 = 1.26x, past SECOND_GAIN)
    and 256 (829 / 481). Timed again there as the start before had timed them (dpbf16 137 and
    442, oneDNN 189 and 497), each keeps its faster pass and both buckets go back to dpbf16. A
    kernel that is faster in both passes keeps its bucket."""
    first = times(dpbf16=[39, 38, 71, 234, 829], onednn=[59, 59, 125, 185, 481])
    choice = choose(first, "dpbf16")
    assert choice.primary == "dpbf16" and choice.buckets == ("dpbf16",) * 3 + ("onednn",) * 2
    again = cpu_tuning.to_confirm(choice, "dpbf16")
    assert again == [3, 4]
    seconds = cpu_tuning.merged(first, times(dpbf16=[137, 442], onednn=[189, 497]), again)
    assert seconds["dpbf16"][3:] == pytest.approx([137e-6, 442e-6])
    assert seconds["onednn"][3:] == pytest.approx([185e-6, 481e-6])
    assert seconds["dpbf16"][:3] == first["dpbf16"][:3]
    assert choose(seconds, "dpbf16").buckets == ("dpbf16",) * 5
    still = cpu_tuning.merged(first, times(dpbf16=[240, 830], onednn=[180, 480]), again)
    assert choose(still, "dpbf16").buckets[3:] == ("onednn", "onednn")


def test_the_second_pass_comes_after_every_shape_and_only_where_needed(cache_dir, monkeypatch):
    """Through pack_cpu_linears: a first pass in which the fixed rule's kernel was slowed at one
    row for every shape, so that another took that bucket, and a second pass, after all the
    shapes' first ones and of that bucket alone, in which it was not: every layer keeps the fixed
    rule's kernel at every bucket."""
    fixed = kinds_for(Shape(torch.float32, 64, 64))[0]
    calls = []

    def fake_measure(candidates, inputs, before=None, **kwargs):
        first_pass = len(inputs) == len(M_BUCKETS)
        calls.append([x.shape[0] for x in inputs])
        return {k: [100e-6 if k == fixed and first_pass and x.shape[0] == 1 else
                    (40e-6 if k == fixed else 60e-6) * x.shape[0] for x in inputs] for k in candidates}

    monkeypatch.setattr(cpu_tuning, "measure", fake_measure)
    model, _ = load_tiny_model(tiny_model_dir("llama"))
    pack_cpu_linears(model, "auto", CPU)
    shapes = 5  # qkv, o, gate_up, down, lm_head
    assert calls == [list(M_BUCKETS)] * shapes + [[1]] * shapes
    assert kinds_of(model) == [[fixed] * len(M_BUCKETS)] * len(packed_layers(model))


def test_an_lm_head_is_chosen_on_the_rows_it_multiplies():
    """Gemma 3's LM head as measured on an AVX512-BF16 EPYC (µs). Geometric means of time over
    the fastest, by hand: over all five buckets dpbf16 1.151, oneDNN 1.040 (1.107x: past
    SWITCH_GAIN, oneDNN takes over, dpbf16's 1.19x at one row being under SECOND_GAIN); up to
    64 rows (max_num_seqs 64) 1.071 and 1.050 (1.02x: dpbf16, the fixed rule's, stays); up to 16
    rows 1.045 and 1.068."""
    seconds = times(dpbf16=[9891.81, 11948.91, 17395.11, 61139.27, 353376.75],
                    onednn=[11783.38, 10461.71, 17768.24, 53093.88, 230466.86],
                    tandem=[10390.78, 11301.89, 31688.51, 123882.22, 573361.98],
                    torch=[19125.59, 21629.84, 30575.42, 78734.25, 259527.32])
    every = choose(seconds, "dpbf16")
    assert (every.primary, every.buckets) == ("onednn", ("onednn",) * 5)
    for rows in (64, 16):  # and no second packing for 256 rows, which it never multiplies
        head = choose(seconds, "dpbf16", max_rows=rows)
        assert (head.primary, head.buckets) == ("dpbf16", ("dpbf16",) * 5)


def test_second_packings_fit_the_memory_budget_best_saving_per_byte_first():
    a, b = Shape(torch.float32, 8, 8), Shape(torch.float32, 16, 8)
    ca = ShapeChoice("tandem", ("torch",) + ("tandem",) * 4, times(tandem=[50] * 5, torch=[10] * 5))  # saves 40 us
    cb = ShapeChoice("tandem", ("torch",) + ("tandem",) * 4, times(tandem=[50] * 5, torch=[20] * 5))  # saves 30 us
    extra = {(a, "torch"): 100, (b, "torch"): 100}
    one = within_budget({a: ca, b: cb}, extra, budget=150)
    assert one[a].buckets[0] == "torch" and one[b].buckets == ("tandem",) * 5
    both = within_budget({a: ca, b: cb}, extra, budget=200)
    assert both[a].buckets[0] == both[b].buckets[0] == "torch"
    assert within_budget({a: ca}, extra, budget=99)[a].kinds == ["tandem"]


def test_a_second_start_measures_nothing_and_another_thread_count_measures_again(cache_dir, monkeypatch):
    first, _ = load_tiny_model(tiny_model_dir("llama"))
    assert pack_cpu_linears(first, "auto", CPU) == "tuned"
    (path,) = (cache_dir / "kernels").glob("linear-*.json")
    saved = json.loads(path.read_text())
    assert saved["key"]["threads"] == torch.get_num_threads() and saved["key"]["torch"] == torch.__version__
    assert len(saved["shapes"]) == 5  # qkv, o, gate_up, down, lm_head: all distinct

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured although the cache holds every shape")

    monkeypatch.setattr(cpu_tuning, "measure", no_measuring)
    second, _ = load_tiny_model(tiny_model_dir("llama"))
    pack_cpu_linears(second, "auto", CPU)
    assert kinds_of(second) == kinds_of(first)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        with pytest.raises(AssertionError, match="measured although"):
            pack_cpu_linears(load_tiny_model(tiny_model_dir("llama"))[0], "auto", CPU)
    finally:
        torch.set_num_threads(threads)


def test_an_unreadable_cache_is_measured_again(cache_dir):
    model, _ = load_tiny_model(tiny_model_dir("llama"))
    path = cpu_tuning.cache_path(cpu_tuning.machine_key())
    path.parent.mkdir(parents=True)
    path.write_text('{"shapes": {"float32:128x64": {"primary": "tandem"}}}')
    pack_cpu_linears(model, "auto", CPU)
    assert len(json.loads(path.read_text())["shapes"]) == 5


@pytest.mark.parametrize("model_kind", ["llama", "llama_tied"])
def test_a_model_on_mixed_kernels_keeps_its_logits_on_every_bucket(cache_dir, monkeypatch, model_kind, caplog):
    """A cache that puts each bucket on another kernel (and no memory limit): every batch size
    goes through the kernel its bucket names, with the dense model's values. With AMX, bucket 64
    on ``amx``'s float32 kernel, which multiplies ``tandem``'s panels (one packing for both)."""
    path = tiny_model_dir(model_kind)
    ref, _ = load_tiny_model(path)
    model, _ = load_tiny_model(path)
    amx = amx_available()
    mixed = ("torch", "tandem", "onednn", "amx" if amx else "tandem", "onednn")
    shapes = {f"float32:{m.weight.shape[0]}x{m.weight.shape[1]}" for m in packed_layers(ref)}
    cpu_tuning.write_cache(cpu_tuning.cache_path(cpu_tuning.machine_key()), {}, {
        key: ShapeChoice("tandem", mixed, times(tandem=[10] * 5, onednn=[5] * 5, torch=[5] * 5,
                                                **({"amx": [5] * 5} if amx else {}))) for key in shapes})
    monkeypatch.setattr(cpu_tuning, "EXTRA_BYTES_SHARE", 10.0)
    with caplog.at_level(logging.INFO, logger="tandem"):
        pack_cpu_linears(model, "auto", CPU)
    assert "all from the cache" in caplog.text
    rest = "tandem (M ≈ 4), onednn (M ≈ 16, 256), amx (M ≈ 64)" if amx else "tandem (M ≈ 4, 64), onednn (M ≈ 16, 256)"
    assert f"o_proj 64→64 float32 ×2: torch (M ≈ 1), {rest}" in caplog.text
    assert all(k == list(mixed) for k in kinds_of(model))
    if amx:
        o_proj = model.model.layers[0].self_attn.o_proj.packed
        assert o_proj.by_bucket[1].weight is o_proj.by_bucket[3].weight
    head = model.lm_head
    assert (head.weight is model.model.embed_tokens.weight) if head.tied else head.weight is None
    with torch.inference_mode():
        for rows in (1, 3, 20, 70, 300):
            hidden = torch.randn(rows, model.config.hidden_size)
            torch.testing.assert_close(model.compute_logits(hidden), ref.compute_logits(hidden), atol=1e-4, rtol=1e-4)
            for ours, theirs in zip(packed_layers(model), packed_layers(ref)):
                if isinstance(ours, LinearLayer):
                    x = torch.randn(rows, theirs.input_size)
                    torch.testing.assert_close(ours(x), theirs(x), atol=1e-4, rtol=1e-4)


def test_the_torch_kind_multiplies_by_the_plain_weight():
    gen = torch.Generator().manual_seed(0)
    w, x, bias = torch.randn(30, 20, generator=gen), torch.randn(5, 20, generator=gen), torch.randn(30, generator=gen)
    packed = PackedLinear.pack("torch", w)
    assert packed.weight.data_ptr() == w.data_ptr()
    torch.testing.assert_close(packed(x, bias), x @ w.t() + bias)


def test_the_meter_sees_a_process_that_spins():
    meter = cpu_tuning.CpuMeter()
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 0.6\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.5)
        share = meter.others_share()
    finally:
        spinner.wait(5)
    # the spinner keeps one CPU busy (half of it at least, beside other tests): 1 / cpu_count
    assert 0.5 / os.cpu_count() < share <= 1.0, share


def test_on_a_busy_machine_the_fixed_rule_is_used_and_nothing_is_cached(cache_dir, monkeypatch, caplog):
    monkeypatch.setattr(cpu_tuning, "machine_is_busy", lambda: 0.6)
    model, _ = load_tiny_model(tiny_model_dir("llama"))
    with caplog.at_level(logging.INFO, logger="tandem"):
        assert pack_cpu_linears(model, "auto", CPU) == "tuned"
    assert all(k == ["tandem"] * len(M_BUCKETS) for k in kinds_of(model))
    assert "other processes used 60% of the CPUs" in caplog.text and "the CPU was busy" in caplog.text
    assert not list((cache_dir / "kernels").glob("linear-*.json"))


def test_timings_disturbed_while_measuring_are_not_cached(cache_dir, monkeypatch):
    monkeypatch.setattr(cpu_tuning.CpuMeter, "others_share", lambda self: 0.5)
    model, _ = load_tiny_model(tiny_model_dir("llama"))
    pack_cpu_linears(model, "auto", CPU)
    assert all(k == ["tandem"] * len(M_BUCKETS) for k in kinds_of(model))
    assert not list((cache_dir / "kernels").glob("linear-*.json"))


@pytest.mark.skipif(not dpbf16_available(), reason="this CPU has no AVX512-BF16 instructions")
def test_on_a_busy_machine_bfloat16_layers_take_the_cpus_own_bfloat16_kernel(cache_dir, monkeypatch):
    # Not measured, a bfloat16 layer must not fall back to bfloat16 widened to float32 where the
    # CPU multiplies bfloat16 itself (the rule that made auto the slower choice on AVX512-BF16)
    monkeypatch.setattr(cpu_tuning, "machine_is_busy", lambda: 0.6)
    model, _ = load_tiny_model(tiny_model_dir("llama"), dtype=torch.bfloat16)
    assert pack_cpu_linears(model, "auto", CPU) == "tuned"
    own = "amx" if amx_available() else "dpbf16"
    assert all(k == [own] * len(M_BUCKETS) for k in kinds_of(model))


@pytest.mark.skipif(not dpbf16_available(), reason="this CPU has no AVX512-BF16 instructions")
def test_bfloat16_shapes_are_timed_on_dpbf16_too_and_float32_ones_are_not(cache_dir):
    model, _ = load_tiny_model(tiny_model_dir("llama"), dtype=torch.bfloat16)
    pack_cpu_linears(model, "auto", CPU)
    cached = cpu_tuning.read_cache(cpu_tuning.cache_path(cpu_tuning.machine_key()))
    assert cached and all(key.startswith("bfloat16") and "dpbf16" in c.seconds for key, c in cached.items())
    own = ["amx", "dpbf16"] if amx_available() else ["dpbf16"]  # the CPU's own bfloat16 kernels lead
    assert kinds_for(Shape(torch.bfloat16, 64, 32))[:len(own)] == own
    assert kinds_for(Shape(torch.bfloat16, 64, 48))[0] == "dpbf16"  # K not whole tiles of 32: not amx
    assert "dpbf16" not in kinds_for(Shape(torch.float32, 64, 32)) + kinds_for(Shape(torch.bfloat16, 64, 33))
    assert "amx" not in kinds_for(Shape(torch.float32, 64, 48)) + kinds_for(Shape(torch.bfloat16, 64, 48))
    # float32 on AMX (three bfloat16 parts a value): timed, but never the fixed rule's pick
    f32 = kinds_for(Shape(torch.float32, 64, 32))
    assert f32[0] == "tandem" and ("amx" in f32) == amx_available() and "amx" not in f32[:-1]
