"""CPU linear kernels chosen by measurement on the running machine (``engine.cpu_kernels = "auto"``).

Which kernel multiplies fastest depends on the CPU (AVX2 only, AVX512, AVX512-BF16, AMX), the
dtype, the layer's shape, the number of rows and the threads — a rule written on one machine is
wrong on the next. So at load, for each distinct ``(dtype, N, K)`` of the model's unquantized
linear layers and LM head, every available kernel (tandem's panels, oneDNN, ``F.linear``) is
timed at each of ``M_BUCKETS`` rows, and each layer multiplies a batch with the kernel measured
fastest for its bucket. The choice is cached on disk (``cache_dir()/kernels``), keyed by the
CPU model, its ISA flags, the torch version, the thread count and tandem's kernel build, so a
second start measures nothing; processes that start together measure once (a file lock).

Decisions, per shape (``choose``):

- The *primary* kernel is the one with the lowest geometric mean of its time over the buckets
  relative to the fastest there (for the LM head, only the buckets up to the most rows it
  multiplies in a step: ``max_num_seqs`` times one plus the speculative tokens). The fixed
  rule's kernel (``fallback``: ``dpbf16`` for a bfloat16 layer on a CPU with AVX512-BF16, else
  tandem's panels when they build, else oneDNN, else torch; ``cpu_linear.kinds_for``) stays
  primary unless another is at least
  ``SWITCH_GAIN`` faster on that mean — timing noise on a shared machine does not flip a choice.
- Where the first pass over the shapes gives a bucket a kernel other than the fixed rule's (a
  second kernel, or a new primary), that shape's buckets are timed again after the others
  (``to_confirm``), and each candidate keeps the faster of its two times there (``merged``)
  before the choice is made again (a disturbance only ever adds time): one pass disturbed
  for seconds gave a layer's larger batches to oneDNN on a Zen 4 EPYC, and the decode steps at
  those batches ran slower for it (docs/benchmarks.md).
- A bucket may use a second kernel when it is at least ``SECOND_GAIN`` faster there than the
  primary. That kernel's packing is extra memory, so second packings are granted in order of
  time saved per byte while their bytes stay within ``EXTRA_BYTES_SHARE`` of the model's
  packed weights; a tied LM head's ``F.linear`` reuses the embedding and costs nothing.

Timing (``measure``): each candidate multiplies by copies of the weight in turn, as many as pass
``STREAM_BYTES`` together (``num_copies``), on the pages the model's weights get: a decode step
reads every weight from memory once, and one weight timed again and again from the cache would
favour the kernel with the quicker arithmetic over the one that streams memory faster (it made
oneDNN look fastest for SmolLM2's gate/up projection at one row, where it is the slowest).
Candidates run interleaved, round after round, each timed on a call that follows a short job on
tandem's work pool (``pool_job``), as every linear layer's call follows one in a decode step (the
norms, attention and the other products of tandem's kernels run there): a kernel on OpenMP's
threads then pays for waking them, which under ``OMP_WAIT_POLICY=PASSIVE`` have slept since its
last call, and shares the cores with the pool's helpers still spinning (timed on its second
call in a row instead, oneDNN looked faster than ``amx`` for SmolLM2's qkv projection on an AMX
Xeon and slowed its decode steps: docs/benchmarks.md). Each keeps its fastest run (the least
disturbed by other processes) until every candidate has ``MIN_ROUNDS`` runs and the bucket's
time budget is spent. Timings taken while
other processes keep the CPU busy are wrong in a way no minimum repairs (a parallel kernel
waits at every barrier for its descheduled thread, a single-threaded one does not), and a
cached mistake would last: so measuring starts only when other processes use under
``BUSY_SHARE`` of the machine (``CpuMeter``), its results are cached only if that still held
while it ran, and otherwise this start uses the fixed rule and the next one measures again.
"""
from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.device import cpu_flags

logger = logging.getLogger("tandem")

M_BUCKETS = (1, 4, 16, 64, 256)
"""Rows a kernel is timed at; a batch of M rows uses the bucket nearest to M on a log scale."""
SWITCH_GAIN = 1.1
SECOND_GAIN = 1.25
EXTRA_BYTES_SHARE = 0.25
MIN_ROUNDS = 2
BUCKET_BUDGET_S = 0.03
STREAM_BYTES = 64 << 20
"""Bytes of weight copies a candidate is timed over (twice a 32 MiB last-level cache)."""
MAX_COPIES = 128
BUSY_SHARE = 0.15
"""Other processes' share of all CPUs above which timings are not trusted."""
BUSY_PROBE_S = 0.05
CACHE_VERSION = 5
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
             "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")
"""The /proc/cpuinfo flags that decide which instructions a kernel can use."""


@dataclass(slots=True, frozen=True)
class Shape:
    """A linear layer's weight: ``out_features`` × ``in_features`` of ``dtype``."""

    dtype: torch.dtype
    n: int
    k: int

    @property
    def key(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}:{self.n}x{self.k}"


@dataclass(slots=True)
class ShapeChoice:
    """The kernels of one shape: ``buckets[i]`` multiplies batches of bucket ``M_BUCKETS[i]``;
    ``seconds[kind][i]`` is what was measured (absent when it came from the cache)."""

    primary: str
    buckets: tuple[str, ...]
    seconds: dict[str, list[float]] = field(default_factory=dict)

    @property
    def kinds(self) -> list[str]:
        """The kernels whose packings the shape keeps, primary first."""
        return [self.primary, *sorted(set(self.buckets) - {self.primary})]

    def to_json(self) -> dict:
        return {"primary": self.primary, "buckets": list(self.buckets),
                "us": {k: [round(s * 1e6, 2) for s in v] for k, v in self.seconds.items()}}

    @classmethod
    def from_json(cls, data: Mapping) -> ShapeChoice:
        """Raises ValueError (or KeyError/TypeError) for a malformed entry."""
        buckets = tuple(str(b) for b in data["buckets"])
        seconds = {str(k): [float(t) / 1e6 for t in v] for k, v in data["us"].items()}
        if len(buckets) != len(M_BUCKETS) or any(len(v) != len(M_BUCKETS) for v in seconds.values()) \
                or not {data["primary"], *buckets} <= set(seconds):
            raise ValueError("malformed kernel choice")
        return cls(str(data["primary"]), buckets, seconds)


def bucket_index(rows: int) -> int:
    """The index in ``M_BUCKETS`` of the bucket a batch of ``rows`` rows uses."""
    return min(bisect.bisect_left(_BOUNDS, rows), len(M_BUCKETS) - 1)


_BOUNDS = [math.sqrt(a * b) for a, b in zip(M_BUCKETS, M_BUCKETS[1:])]


# ---------------------------------------------------------------------------- measuring


def num_copies(weight_bytes: int, total: int = STREAM_BYTES) -> int:
    """How many copies of a weight of ``weight_bytes`` a candidate is timed over: enough to pass
    ``total`` bytes together (at most ``MAX_COPIES``)."""
    return max(1, min(MAX_COPIES, -(-total // max(weight_bytes, 1))))


class Rotation:
    """One candidate over copies of its weight: each call goes to the next of ``fns``."""

    def __init__(self, fns: Sequence[Callable[[torch.Tensor], object]]) -> None:
        self.fns, self.calls = list(fns), 0

    def __call__(self, x: torch.Tensor) -> object:
        fn = self.fns[self.calls % len(self.fns)]
        self.calls += 1
        return fn(x)


def pool_job() -> Callable[[], None] | None:
    """A short job on tandem's work pool (a SiLU-and-mul of 4 rows of 16K float32 values, shared
    out in chunks), the kind of call that comes before each linear layer's in a decode step;
    None where tandem's kernels do not build (then every kernel runs on OpenMP's threads)."""
    from tandem.kernels import cpu_ops

    if not cpu_ops.load():
        return None
    gate_up, out = torch.ones(4, 1 << 15), torch.empty(4, 1 << 14)
    return lambda: cpu_ops.silu_and_mul(out, gate_up)


def measure(candidates: Mapping[str, Callable[[torch.Tensor], object]], inputs: Sequence[torch.Tensor],
            budget_s: float = BUCKET_BUDGET_S, min_rounds: int = MIN_ROUNDS,
            clock: Callable[[], float] = time.perf_counter,
            before: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """The fastest of each candidate's interleaved runs on each of ``inputs`` (one per bucket),
    in seconds: ``{name: [seconds per input]}``. Each input gets ``min_rounds`` rounds at least
    and more while ``budget_s`` lasts; one untimed run first (caches, lazy set-up). Each timed
    run follows an untimed call of ``before`` (what runs before the kernel in a step: the
    module doc), or of the candidate itself where None."""
    best = {name: [math.inf] * len(inputs) for name in candidates}
    for i, x in enumerate(inputs):
        for fn in candidates.values():
            fn(x)
        rounds, deadline = 0, clock() + budget_s
        while rounds < min_rounds or clock() < deadline:
            for name, fn in candidates.items():
                if before is None:
                    fn(x)
                else:
                    before()
                t0 = clock()
                fn(x)
                best[name][i] = min(best[name][i], clock() - t0)
            rounds += 1
    return best


def choose(seconds: Mapping[str, Sequence[float]], fallback: str, max_rows: int | None = None) -> ShapeChoice:
    """The primary kernel of a shape and the faster one per bucket (before the memory budget,
    which ``plan`` applies across shapes); see the module doc. ``max_rows``: the most rows the
    layer multiplies at once (the LM head: the sequences sampled in a step), so that buckets
    above its own do not weigh in the primary's choice and take no second packing."""
    fastest = [min(s[i] for s in seconds.values()) for i in range(len(M_BUCKETS))]
    counted = range(len(M_BUCKETS) if max_rows is None else bucket_index(max_rows) + 1)

    def score(kind: str) -> float:
        ratios = [seconds[kind][i] / fastest[i] for i in counted]
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios))

    primary = fallback if fallback in seconds else min(seconds, key=score)
    best = min(seconds, key=score)
    if score(best) * SWITCH_GAIN <= score(primary):
        primary = best
    buckets = []
    for i in range(len(M_BUCKETS)):
        quick = min(seconds, key=lambda k: seconds[k][i])
        gain = seconds[primary][i] / seconds[quick][i]
        buckets.append(quick if gain >= SECOND_GAIN and i in counted else primary)
    return ShapeChoice(primary, tuple(buckets), {k: list(v) for k, v in seconds.items()})


def to_confirm(choice: ShapeChoice, fallback: str) -> list[int]:
    """The buckets (indices in ``M_BUCKETS``) where ``choice`` runs a kernel other than the fixed
    rule's ``fallback``: timed a second time before the choice is kept (``merged``)."""
    return [i for i, kind in enumerate(choice.buckets) if kind != fallback]


def merged(earlier: Mapping[str, Sequence[float]], later: Mapping[str, Sequence[float]],
           buckets: Sequence[int]) -> dict[str, list[float]]:
    """``earlier``'s times with those of ``buckets`` (``later[kind][j]`` is bucket
    ``buckets[j]``'s) each the faster of the two passes: a disturbance that slowed one
    candidate through one pass (seconds long: another process's burst, a clock that dropped)
    is not what the choice rests on, while a kernel that is faster wins both passes."""
    out = {kind: list(v) for kind, v in earlier.items()}
    for kind, times in later.items():
        for j, i in enumerate(buckets):
            out[kind][i] = min(out[kind][i], times[j])
    return out


def within_budget(choices: Mapping[Shape, ShapeChoice], extra_bytes: Mapping[tuple[Shape, str], int],
                  budget: int) -> dict[Shape, ShapeChoice]:
    """The choices with second packings dropped (their buckets back on the primary) wherever
    they do not fit ``budget`` bytes: granted in order of measured time saved per byte, each
    costing ``extra_bytes[(shape, kind)]`` (over all the layers of that shape)."""
    offers = []
    for shape, choice in choices.items():
        for kind in set(choice.buckets) - {choice.primary}:
            saved = sum(choice.seconds[choice.primary][i] - choice.seconds[kind][i]
                        for i, b in enumerate(choice.buckets) if b == kind)
            cost = extra_bytes[(shape, kind)]
            offers.append((saved / max(cost, 1), cost, shape, kind))
    granted: set[tuple[Shape, str]] = set()
    for _, cost, shape, kind in sorted(offers, key=lambda o: -o[0]):
        if cost <= budget:
            budget -= cost
            granted.add((shape, kind))
    return {shape: ShapeChoice(c.primary, tuple(b if b == c.primary or (shape, b) in granted else c.primary
                                                 for b in c.buckets), c.seconds)
            for shape, c in choices.items()}


class CpuMeter:
    """Other processes' share of the machine's CPU time since the meter started (or was
    ``restart``-ed): busy time of all CPUs in /proc/stat minus this process's own, over the
    elapsed time of all CPUs. 0.0 where /proc is not readable (nothing is known to be busy)."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self._start = _cpu_times()

    def others_share(self) -> float:
        now = _cpu_times()
        if now is None or self._start is None:
            return 0.0
        busy, total, own = (a - b for a, b in zip(now, self._start))
        return max(busy - own, 0) / total if total > 0 else 0.0


def _cpu_times() -> tuple[int, int, int] | None:
    """(busy, total) clock ticks of all CPUs and this process's ticks, or None without /proc."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait, int(own[11]) + int(own[12])


def machine_is_busy(probe_s: float = BUSY_PROBE_S) -> float | None:
    """Other processes' share of the CPUs over ``probe_s`` when above ``BUSY_SHARE``, else None."""
    meter = CpuMeter()
    time.sleep(probe_s)
    share = meter.others_share()
    return share if share > BUSY_SHARE else None


# ---------------------------------------------------------------------------- the cache


def machine_key() -> dict[str, object]:
    """What a measurement depends on besides the shape: CPU model, ISA flags, torch version,
    threads, and the build of tandem's linear kernels (not of the rest of the library)."""
    from tandem.kernels import cpu_ops

    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
                break
    return {"version": CACHE_VERSION, "cpu": model, "isa": sorted(cpu_flags() & set(ISA_FLAGS)),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "kernels": cpu_ops.linear_build() if cpu_ops.load() else None}


def cache_path(key: Mapping[str, object], name: str = "linear") -> Path:
    """The cache file of ``name``'s choices (linear layers; ``attention``) under ``key``."""
    from tandem.models.presets import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{name}-{digest}.json"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s lock file: one process measures, the others wait
    and then read what it wrote."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_cache(path: Path) -> dict[str, ShapeChoice]:
    """The cached choices by ``Shape.key``; an unreadable or malformed file counts as empty."""
    try:
        shapes = json.loads(path.read_text())["shapes"]
        return {key: ShapeChoice.from_json(value) for key, value in shapes.items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def write_cache(path: Path, key: Mapping[str, object], choices: Mapping[str, ShapeChoice]) -> None:
    """Replace the file (a private scratch file renamed into place)."""
    write_json(path, {"key": key, "shapes": {k: c.to_json() for k, c in choices.items()}})


class ChoiceCache:
    """Measured choices other than the linear layers' (``name``: "attention"), one JSON entry per
    shape, in their own file under the same key and with the same rules: measured under the
    file's lock, only on a machine other processes leave alone, and cached only if that held
    while it ran. Handed to plugins (``AttentionBackend.for_model``), which may not import core."""

    @staticmethod
    def measure(candidates: Mapping[str, Callable[[torch.Tensor], object]], inputs: Sequence[torch.Tensor],
                **kwargs) -> dict[str, list[float]]:
        """``measure``, each timed run after a ``pool_job`` as in a step."""
        return measure(candidates, inputs, before=pool_job(), **kwargs)

    def __init__(self, name: str) -> None:
        self.name = name

    def get(self, shape: str, compute: Callable[[], dict]) -> tuple[dict | None, str]:
        """``shape``'s entry and where it came from: the cache, or ``compute()`` (then cached);
        (None, why) where the machine was too busy to measure."""
        key = machine_key()
        path = cache_path(key, self.name)
        with locked(path):
            try:
                entries = json.loads(path.read_text())["shapes"]
                if not isinstance(entries, dict):
                    entries = {}
            except (OSError, ValueError, KeyError, TypeError):
                entries = {}
            if isinstance(entries.get(shape), dict):
                return entries[shape], f"from the cache, {path}"
            busy = machine_is_busy()
            if busy is None:
                meter = CpuMeter()
                entry = compute()
                busy = meter.others_share()
                if busy <= BUSY_SHARE:
                    entries[shape] = entry
                    write_json(path, {"key": key, "shapes": entries})
                    return entry, f"measured, cached in {path}"
        return None, f"not measured: other processes used {busy * 100:.0f}% of the CPUs"


def write_json(path: Path, payload: Mapping[str, object]) -> None:
    """Write ``payload`` to ``path`` through a private scratch file renamed into place (a reader
    sees the old file or the new one, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    scratch.write_text(json.dumps(payload, indent=1, sort_keys=True))
    scratch.replace(path)
