"""The roofline of a decode step: this machine's floor for the model at a batch, measured in the
same run as the step it is compared with (``tandem bench offline``).

A decode step at batch B (B sequences, one new token each, sequence i attending to ``c_i`` KV
positions, its own included) cannot take less than either of

- **memory time** = bytes / read bandwidth, where bytes = weights + KV::

      weights = dtype_bytes × (every parameter − V·H + min(B, V)·H)     untied embeddings
              = dtype_bytes × every parameter                            tied (the LM head reads the table)
      KV      = dtype_bytes × Σ_layers Σ_i 2 · kv_heads · head_dim · min(c_i, window_layer)

  (a lookup reads only the batch's rows of the V × H embedding table; the LM head is read whole);
- **compute time** = FLOPs / GEMM rate at B rows, where::

      FLOPs = 2 · B · (L · (q + k + v + o + gate + up + down) + V·H)     every matmul's parameters
            + Σ_layers Σ_i 4 · heads · head_dim · min(c_i, window_layer)  QK^T and PV

The floor is the larger of the two; which one names the bound. Parameters are counted from the
architecture for Llama-shaped layers (q/k/v/o with a bias when ``attention_bias``, a gated MLP
with one when ``mlp_bias``, two RMSNorms per layer, a final norm): the few small extra tensors of
other families (Qwen2's q/k/v biases, Qwen3's and Gemma 3's q/k norms, Gemma 3's extra norms) are
left out, well below the measurements' noise. Weights are assumed unquantized, in the bench's dtype.

Read bandwidth: ``x.sum()`` over a float32 buffer larger than the last-level cache, on the
pages tandem's weights get (2 MiB ones where the system gives them, ``tandem.models.huge_pages``:
a floor read from 4 KiB pages would understate what the machine can read). It is sampled *during*
the run, after every ``BANDWIDTH_SAMPLE_EVERY`` th step (``recording_steps``; the time spent
sampling is left out of the run's time), and each step is compared with the floor at the higher
of the two samples around it (``step_bandwidths``): on a shared machine the read bandwidth can
double or halve within minutes as other tenants come and go, and a floor measured once before or
after the run would compare the steps with another machine. The ratio printed is the median over
the steps of step / floor; a run too short for a sample is compared with a bandwidth measured
after it. GEMM rate:
the fastest of ``torch.matmul`` and (on the CPU) tandem's packed kernels of
``tandem.models.cpu_linear`` for [B, hidden] × [hidden, intermediate] in the bench's dtype, the
weight in the model's layout (a weight that fits in cache, so it measures arithmetic, not
memory). Each is the fastest of several timed runs: a floor takes the machine at its best (a
median rate on a noisy machine can fall below what the model's own matmuls reach).
"""
from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.models.config import ModelArchConfig

if TYPE_CHECKING:
    from tandem.engine import StepStats

BANDWIDTH_BUFFER_BYTES = 512 * 2**20
BANDWIDTH_SAMPLE_BYTES = 64 * 2**20
"""Bytes one sample during a run reads (twice a 32 MiB last-level cache)."""
BANDWIDTH_SAMPLE_EVERY = 16
REPEATS = 7
GEMM_CALLS_PER_RUN = 10


@dataclass(slots=True, frozen=True)
class RecordedStep:
    """One engine step of the run: its ``StepStats`` and the KV positions each of its sequences
    attends to (``num_computed_tokens`` once scheduled, the new tokens included)."""

    stats: StepStats
    contexts: tuple[int, ...]
    read_bytes_per_s: float | None = None
    """The read bandwidth sampled right after this step (None: no sample then)."""
    sampling_s: float = 0.0
    """Seconds that sample took (not the run's: callers subtract it)."""

    @property
    def is_pure_decode(self) -> bool:
        """No prompt token and no draft: one new token per sequence."""
        return self.stats.num_prompt_tokens == 0 and self.stats.num_tokens == self.stats.num_seqs


@dataclass(slots=True, frozen=True)
class DecodeCost:
    """What one decode step must move and compute (see the module docstring)."""

    weight_bytes: float
    kv_bytes: float
    flops: float


@dataclass(slots=True, frozen=True)
class Machine:
    """This machine's measured rates: bytes/s read, FLOP/s of the GEMM at each batch measured."""

    read_bytes_per_s: float
    gemm_flops_per_s: dict[int, float]


class BandwidthSampler:
    """One sample of the read bandwidth between two steps: ``x.sum()`` over a cold
    ``BANDWIDTH_SAMPLE_BYTES`` half of a buffer, after a sum over the other half (which wakes the
    sum's threads; the steps in between have streamed the model's weights through the caches)."""

    def __init__(self, num_bytes: int = BANDWIDTH_SAMPLE_BYTES) -> None:
        import torch

        from tandem.models.huge_pages import HugePageArena

        self._x = HugePageArena().empty((2, num_bytes // 4), torch.float32)
        self._x.fill_(1)

    def __call__(self) -> float:
        self._x[0].sum()
        t0 = time.perf_counter()
        self._x[1].sum()
        return self._x[1].numel() * 4 / (time.perf_counter() - t0)


@contextmanager
def recording_steps(engine, sample_every: int = 0) -> Iterator[list[RecordedStep]]:
    """Record every step of ``engine`` while the block runs (wraps ``engine.step`` and, for the
    contexts, ``engine.executor.execute``, during which the scheduled requests are all alive);
    ``sample_every`` > 0: sample the read bandwidth after every ``sample_every``-th recorded step
    (``RecordedStep.read_bytes_per_s``, its cost in ``sampling_s``)."""
    step, executor, records = engine.step, engine.executor, []
    execute, contexts = executor.execute, []
    sampler = BandwidthSampler() if sample_every > 0 else None

    def recorded_execute(sched_out):
        requests = (engine.scheduler.get_request(rid) for rid in sched_out.num_scheduled_tokens)
        contexts.append(tuple(r.num_computed_tokens for r in requests if r is not None))
        return execute(sched_out)

    def recorded_step():
        contexts.clear()
        outputs = step()
        if engine.last_step is not None and contexts:
            bandwidth, sampling_s = None, 0.0
            if sampler is not None and len(records) % sample_every == 0:
                t0 = time.perf_counter()
                bandwidth = sampler()
                sampling_s = time.perf_counter() - t0
            records.append(RecordedStep(engine.last_step, contexts[-1], bandwidth, sampling_s))
        return outputs

    engine.step, executor.execute = recorded_step, recorded_execute
    try:
        yield records
    finally:
        engine.step, executor.execute = step, execute


def layer_matmul_params(arch: ModelArchConfig) -> int:
    """Weights of one layer's matmuls: q, k, v, o, gate, up, down."""
    h, i = arch.hidden_size, arch.intermediate_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    return h * q + 2 * h * kv + q * h + 3 * h * i


def num_parameters(arch: ModelArchConfig) -> int:
    """Every parameter of the model, a tied embedding table counted once."""
    h = arch.hidden_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    bias = (q + 2 * kv + h if arch.attention_bias else 0) + (2 * arch.intermediate_size + h if arch.mlp_bias else 0)
    layer = layer_matmul_params(arch) + bias + 2 * h
    table = arch.vocab_size * h
    return arch.num_hidden_layers * layer + h + table * (1 if arch.tie_word_embeddings else 2)


def decode_cost(arch: ModelArchConfig, contexts: Sequence[int], dtype_bytes: int) -> DecodeCost:
    """The cost of one decode step whose sequences attend to ``contexts`` KV positions each."""
    batch, h, table = len(contexts), arch.hidden_size, arch.vocab_size * arch.hidden_size
    unread_rows = 0 if arch.tie_word_embeddings else table - min(batch, arch.vocab_size) * h
    attended = sum(_attended(arch, layer, contexts) for layer in range(arch.num_hidden_layers))
    return DecodeCost(
        weight_bytes=float(dtype_bytes * (num_parameters(arch) - unread_rows)),
        kv_bytes=float(dtype_bytes * 2 * arch.num_key_value_heads * arch.head_dim * attended),
        flops=float(2 * batch * (arch.num_hidden_layers * layer_matmul_params(arch) + table)
                    + 4 * arch.num_attention_heads * arch.head_dim * attended),
    )


def _attended(arch: ModelArchConfig, layer: int, contexts: Sequence[int]) -> int:
    window = arch.sliding_window_for(layer)
    return sum(contexts) if window is None else sum(min(c, window) for c in contexts)


def measure_read_bandwidth(num_bytes: int = BANDWIDTH_BUFFER_BYTES, repeats: int = REPEATS) -> float:
    """Bytes per second that ``x.sum()`` reads from a float32 buffer of ``num_bytes`` (fastest
    run), the buffer on huge pages where tandem puts its weights on them."""
    import torch

    from tandem.models.huge_pages import HugePageArena

    x = HugePageArena().empty((num_bytes // 4,), torch.float32)
    x.fill_(1)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / min(times)


def measure_gemm_rate(rows: int, inner: int, outer: int, dtype: str, repeats: int = REPEATS) -> tuple[float, str]:
    """FLOP/s of the fastest GEMM this machine offers tandem for [rows, inner] x [inner, outer]
    in ``dtype`` (the fastest of ``repeats`` runs of ``GEMM_CALLS_PER_RUN`` calls each), and that
    kernel's name: torch's ``matmul`` against an [outer, inner] weight transposed (the layout of
    ``F.linear``; CPU torch multiplies a row-major [inner, outer] bfloat16 operand far slower)
    and, on the CPU, each packed kernel of ``tandem.models.cpu_linear`` that takes the shape here
    (AVX512-BF16's ``dpbf16`` among them where the CPU has it) — so the floor is the rate of the
    instructions the step can use."""
    import torch

    from tandem.models.cpu_linear import PackedLinear, kinds_for
    from tandem.models.cpu_tuning import Shape

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, inner, generator=gen).to(getattr(torch, dtype))
    weight = torch.randn(outer, inner, generator=gen).to(getattr(torch, dtype))
    out = torch.matmul(x, weight.t())
    candidates = {"torch": lambda: torch.matmul(x, weight.t(), out=out)}
    for kind in kinds_for(Shape(weight.dtype, outer, inner)):
        if kind != "torch":
            packed = PackedLinear.pack(kind, weight)
            candidates[kind] = lambda packed=packed: packed(x)
    best, best_kind = 0.0, "torch"
    for kind, call in candidates.items():
        call()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(GEMM_CALLS_PER_RUN):
                call()
            times.append((time.perf_counter() - t0) / GEMM_CALLS_PER_RUN)
        rate = 2 * rows * inner * outer / min(times)
        if rate > best:
            best, best_kind = rate, kind
    return best, best_kind


def decode_batches(records: Sequence[RecordedStep], full_batch: int) -> list[int]:
    """The batch sizes to report: the median (low) of the pure decode steps' batch sizes, and
    ``full_batch`` too when some pure decode step ran at it."""
    sizes = [r.stats.num_seqs for r in records if r.is_pure_decode]
    if not sizes:
        return []
    median = statistics.median_low(sizes)
    return [median] + ([full_batch] if full_batch != median and full_batch in sizes else [])


def step_bandwidths(records: Sequence[RecordedStep], fallback: float) -> list[float]:
    """Each record's read bandwidth: the higher of the samples taken just before and just
    after it (one sample where it has only one neighbour), ``fallback`` where the run has none.
    A floor takes the machine at its best: a sum the OS held up for a moment reads low (and
    would put the steps near it below their "floor"), but nothing makes one read faster than
    the memory can."""
    sampled = [i for i, r in enumerate(records) if r.read_bytes_per_s is not None]
    if not sampled:
        return [fallback] * len(records)
    out = []
    for i in range(len(records)):
        at = bisect.bisect_left(sampled, i)  # sampled[at]: the first sample taken after step i
        around = sampled[max(0, at - 1):at + 1]
        out.append(max(records[j].read_bytes_per_s for j in around))
    return out


def roofline_line(arch: ModelArchConfig, records: Sequence[RecordedStep], batch: int, dtype: str,
                  machine: Machine) -> str:
    """One line: the median measured pure decode step at ``batch`` against its floor, the cost
    averaged over those steps (their own context lengths), the ratio the median over the steps
    of each one's time over its floor (at the bandwidth sampled around it, module doc)."""
    bandwidths = step_bandwidths(records, machine.read_bytes_per_s)
    chosen = [i for i, r in enumerate(records) if r.is_pure_decode and r.stats.num_seqs == batch]
    steps = [records[i] for i in chosen]
    costs = [decode_cost(arch, r.contexts, _dtype_bytes(dtype)) for r in steps]
    weights, kv, flops = (statistics.fmean(getattr(c, f) for c in costs)
                          for f in ("weight_bytes", "kv_bytes", "flops"))
    gemm = machine.gemm_flops_per_s[batch]
    floors = [max(c.flops / gemm, (c.weight_bytes + c.kv_bytes) / bandwidths[i]) for c, i in zip(costs, chosen)]
    ratio = statistics.median(r.stats.duration_s / f for r, f in zip(steps, floors))
    bandwidth = statistics.median(bandwidths[i] for i in chosen)
    compute_s, memory_s = flops / gemm, (weights + kv) / bandwidth
    measured_s = statistics.median(r.stats.duration_s for r in steps)
    mean_context = statistics.fmean(c for r in steps for c in r.contexts)
    compute = f"{flops / 1e9:.3g} GFLOP at {gemm / 1e9:.3g} GFLOP/s = {1e3 * compute_s:.1f} ms"
    memory = (f"weights {weights / 1e6:.3g} MB + KV {kv / 1e6:.3g} MB at "
              f"{bandwidth / 1e9:.1f} GB/s = {1e3 * memory_s:.1f} ms")
    first, second = (("compute", compute), ("memory", memory)) if compute_s >= memory_s else \
        (("memory", memory), ("compute", compute))
    floor_s = statistics.median(floors)
    return (f"decode step at batch {batch}: {1e3 * measured_s:.1f} ms measured (median of "
            f"{len(steps)} steps, mean context {mean_context:.0f}), floor {1e3 * floor_s:.1f} ms "
            f"({first[0]}-bound: {first[1]}; {second[0]}: {second[1]}) → "
            f"{ratio:.2f}x the floor (median over the steps)")


def report(arch: ModelArchConfig, records: Sequence[RecordedStep], dtype: str, full_batch: int) -> None:
    """Measure this machine and print the roofline lines for the run's decode batches."""
    batches = decode_batches(records, full_batch)
    if not batches:
        print("roofline: the run had no pure decode step")
        return
    from tandem.models.huge_pages import available as huge_pages_available

    samples = [r.read_bytes_per_s for r in records if r.read_bytes_per_s is not None]
    pages = " on huge pages" if huge_pages_available() else ""
    if samples:
        bandwidth = statistics.median(samples)
        read = (f"read bandwidth sampled during the run {bandwidth / 1e9:.1f} GB/s (median of "
                f"{len(samples)}, {min(samples) / 1e9:.1f}-{max(samples) / 1e9:.1f}; float32 sum over "
                f"{BANDWIDTH_SAMPLE_BYTES // 2**20} MiB{pages} every {BANDWIDTH_SAMPLE_EVERY} steps)")
    else:
        bandwidth = measure_read_bandwidth()
        read = (f"read bandwidth measured now {bandwidth / 1e9:.1f} GB/s (float32 sum over "
                f"{BANDWIDTH_BUFFER_BYTES // 2**20} MiB{pages})")
    shape = (arch.hidden_size, arch.intermediate_size)
    gemms = {b: measure_gemm_rate(b, *shape, dtype) for b in batches}
    machine = Machine(bandwidth, {b: rate for b, (rate, _) in gemms.items()})
    print(f"\nroofline: {read}, best GEMM [B, {shape[0]}] x {list(shape)} {dtype} "
          + ", ".join(f"{rate / 1e9:.3g} GFLOP/s at B={b} ({kind})" for b, (rate, kind) in gemms.items())
          + f" (fastest of {REPEATS} runs); KV reads and attention FLOPs from the steps' own contexts")
    for batch in batches:
        print(roofline_line(arch, records, batch, dtype, machine))


def _dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
