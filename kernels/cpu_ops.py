"""The CPU kernels of ``kernels/cpu/`` (C++, built on first use with torch's cpp_extension into
one library of operators, ``torch.ops.tandem_cpu``), and the one place that calls them.

Every operator the library defines has a typed wrapper here, in the role of vLLM's
``_custom_ops.py``: callers import this module and never touch ``torch.ops.tandem_cpu``. Each
wrapper writes into tensors the caller allocated (``out``, ``tokens``) or in place, returns
None, and states the shapes and dtypes it accepts; the C++ side checks them and raises
``RuntimeError`` otherwise. The GGUF ones (``gguf_linear``, ``gguf_dequantize_rows``) return
a new tensor and raise ``ValueError`` for a type or shape they cannot take. All tensors are CPU tensors. Call ``load()`` first: a wrapper
called when it returned False fails.

``load()`` builds the extension once per machine (g++ and ninja; torch caches it under
``TORCH_EXTENSIONS_DIR``, by default ~/.cache/torch_extensions) and registers its operators;
it returns False when they cannot be built — callers then keep their torch path. The build
targets the CPU capability torch reports (AVX2, AVX512); the extension's name carries that and
a hash of the sources, the flags and the torch it builds against, so a cache shared between
machines or checkouts never hands one CPU another's build, and two versions of tandem never
rebuild each other's library under a running process.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.kernels.gguf_types import check_qweight

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("tandem")

SOURCES = [Path(__file__).parent / "cpu" / name
           for name in ("paged_attention.cpp", "prefill_tiles.cpp", "linear.cpp", "linear_dpbf16.cpp", "linear_amx_f32.cpp", "elementwise.cpp",
                        "sampling.cpp", "gguf_matmul.cpp", "gguf_dpbf16.cpp", "decode_layers.cpp",
                        "work_pool.cpp")]
HEADERS = [Path(__file__).parent / "cpu" / name
           for name in ("work_queue.h", "gguf_blocks.h", "amx_tiles.h", "prefill_tiles.h", "transpose16.h", "vec_exp.h",
                        "bf16_round.h")]
OPS = ("paged_decode", "panel_linear", "panel_linear_dpbf16", "panel_linear_dpbf16_silu", "dpbf16_supported", "panel_linear_amx",
       "panel_linear_amx_silu", "amx_supported", "panel_linear_amx_f32", "rms_norm", "add_rms_norm",
       "silu_and_mul", "rotary_neox", "draw_rows", "argmax_rows", "gguf_linear", "gguf_dequantize_rows",
       "decode_layers", "use_work_pool", "use_gguf_int8", "use_prefill_amx", "head_rms_norm", "gemma_rms_norm",
       "gemma_add_rms_norm", "gelu_tanh_and_mul", "copy_rows")
"""Every operator of the library, each wrapped below."""
_ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}


@functools.cache
def _build() -> tuple[str, str, list[str]]:
    """(library name, ISA, compiler flags) of this machine's build."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    isa = "AVX512" if capability.startswith("AVX512") else capability
    flags = ["-O3", "-ffast-math", "-fopenmp", *_ISA_FLAGS.get(isa, [])]
    built_with = " ".join([*flags, torch.__version__, torch.__file__])
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES + HEADERS) + built_with.encode())
    return f"tandem_cpu_kernels_{isa.lower()}_{digest.hexdigest()[:12]}", isa, flags


def build_name() -> str:
    """The library's name: the ISA it targets and a hash of its sources, flags and torch."""
    return _build()[0]


LINEAR_SOURCES = ("linear.cpp", "linear_dpbf16.cpp", "linear_amx_f32.cpp", "work_pool.cpp", "work_queue.h",
                  "amx_tiles.h", "vec_exp.h", "bf16_round.h")
"""The files the linear kernels' speed depends on (their code and the thread pool's)."""


@functools.cache
def linear_build() -> str:
    """The ISA and a hash of ``LINEAR_SOURCES`` and the flags (torch's version is in the tuner's
    key beside it): what a timing of the linear kernels depends on, so that a change elsewhere in the library (attention, sampling) keeps
    the kernel choices measured before it (``tandem.models.cpu_tuning``)."""
    _, isa, flags = _build()
    paths = [p for p in SOURCES + HEADERS if p.name in LINEAR_SOURCES]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in paths) + " ".join(flags).encode())
    return f"{isa.lower()}_{digest.hexdigest()[:12]}"


ATTENTION_SOURCES = ("paged_attention.cpp", "prefill_tiles.cpp", "prefill_tiles.h", "amx_tiles.h", "transpose16.h",
                     "vec_exp.h", "bf16_round.h", "work_queue.h")
"""The files the attention kernel's speed depends on."""


@functools.cache
def attention_build() -> str:
    """``linear_build`` for the attention kernel (``ATTENTION_SOURCES``): what a timing of it
    against SDPA depends on (``tandem.plugins.attention_cpu``)."""
    _, isa, flags = _build()
    paths = [p for p in SOURCES + HEADERS if p.name in ATTENTION_SOURCES]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in paths) + " ".join(flags).encode())
    return f"{isa.lower()}_{digest.hexdigest()[:12]}"


@functools.cache
def load() -> bool:
    """Build (once per process; the build itself is cached on disk) and register the operators.
    True when every one of ``OPS`` is registered, False (after one warning) when they cannot be
    built here."""
    import torch

    name, isa, flags = _build()
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load as build

        build(name=name, sources=[str(s) for s in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
              is_python_module=False, verbose=False)
        for op in OPS:  # registered, or raise here rather than mid-step
            getattr(torch.ops.tandem_cpu, op)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, no headers: keep the torch path
        logger.warning("tandem's CPU kernels could not be built (%s: %s); linear layers and decode "
                       "attention stay on torch's own kernels", type(exc).__name__,
                       str(exc).splitlines()[0] if str(exc) else "")
        return False
    seconds = time.perf_counter() - t0
    if seconds > 2:
        logger.info("built tandem's CPU kernels (%s) in %.0f s; cached for later runs", isa, seconds)
    return True


def _ops():
    import torch

    return torch.ops.tandem_cpu


def paged_decode(out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor,
                 tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int,
                 row_tables: torch.Tensor | None = None) -> None:
    """Decode attention that reads one layer of the paged KV pool in place (paged_attention.cpp).

    ``q``, ``out`` [T, H, D] of one dtype; ``kv`` [num_blocks, 2, block_size, Hkv, D] (index 0:
    K, 1: V), H a multiple of Hkv (GQA by the ratio), D contiguous everywhere; ``rows`` [N],
    ``tables`` [S, max_blocks], ``seq_lens`` [N], ``row_tables`` [N] (or None: S = N and row
    ``i`` takes table ``i``), int64, contiguous. Query row ``i`` (token row ``rows[i]`` of ``q``)
    attends to the first ``seq_lens[i]`` keys of the blocks ``tables[row_tables[i]]`` names (the
    last ``window`` of them when ``window`` > 0) with scores scaled by ``scale``; its output goes
    to row ``rows[i]`` of ``out`` (other rows untouched). The rows of one prefill share their
    sequence's table through ``row_tables``. float32, bfloat16 or float16 queries and pools,
    float32 arithmetic. RuntimeError for a ``row_tables`` entry outside ``[0, S)``."""
    _ops().paged_decode(out, q, kv, rows, tables, seq_lens, scale, window, row_tables)


def panel_linear(out: torch.Tensor, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``out = x @ W.T + bias`` with ``W`` [N, K] packed into 16-column panels (linear.cpp).

    ``x`` [M, K] float32 with contiguous rows; ``panels`` [ceil(N / 16), K, 16] contiguous,
    float32, bfloat16 or float16: panel ``p``, row ``k`` holds ``W[16p .. 16p + 15, k]``, columns
    past N zero (``tandem.models.cpu_linear`` packs them); ``out`` [M, N] float32 with contiguous
    rows; ``bias`` [N] float32 or None. Products and sums in float32."""
    _ops().panel_linear(out, x, panels, bias)


def dpbf16_supported() -> bool:
    """Whether this CPU has the AVX512-BF16 instructions ``panel_linear_dpbf16`` needs (CPUID,
    asked by the library)."""
    return bool(_ops().dpbf16_supported())


def panel_linear_dpbf16(out: torch.Tensor, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                        bf16_values: bool = False) -> None:
    """``out = x @ W.T + bias`` by AVX512-BF16 pair dot products (linear_dpbf16.cpp); call only
    where ``dpbf16_supported()``.

    ``x`` [M, K] bfloat16 with contiguous rows, K and the row stride even; ``panels``
    [ceil(N / 16), K / 2, 16, 2] contiguous bfloat16: panel ``p``, pair row ``j``, column ``c``
    holds ``W[16p + c, 2j : 2j + 2]``, columns past N zero; ``out`` [M, N] float32 or bfloat16
    (the float32 sums rounded as ``.to(torch.bfloat16)`` rounds them) with contiguous rows;
    ``bias`` [N] float32 or None. Products exact in float32, sums in float32. ``bf16_values``
    (float32 ``out`` only): each sum rounded to bfloat16 as above, then stored widened back —
    ``.to(torch.bfloat16).float()`` of the float32 out, without those passes."""
    _ops().panel_linear_dpbf16(out, x, panels, bias, bf16_values)


def amx_supported() -> bool:
    """Whether ``panel_linear_amx`` runs here: a CPU with AMX-TILE, AMX-BF16 and AVX512-BF16, and
    a Linux kernel that lets the process use the tile state (asked once, by the library)."""
    return bool(_ops().amx_supported())


def panel_linear_amx(out: torch.Tensor, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                     bf16_values: bool = False) -> None:
    """``panel_linear_dpbf16`` on AMX tiles: the same arguments, panels and results (products
    exact in float32, float32 sums in another order), K a multiple of 32; call only where
    ``amx_supported()``."""
    _ops().panel_linear_amx(out, x, panels, bias, bf16_values)


def panel_linear_dpbf16_silu(out: torch.Tensor, x: torch.Tensor, panels: torch.Tensor) -> None:
    """``panel_linear_amx_silu`` by AVX512-BF16 pair dot products on the same panels
    (``PackedLinear.pack("dpbf16", w)``): ``out`` [M, I] bfloat16 is ``silu_and_mul`` of the
    bfloat16 ``panel_linear_dpbf16`` product, bit for bit, without that ``[M, 2 I]`` product; each
    thread takes a gate panel and its up panel together. Call only where ``dpbf16_supported()``."""
    _ops().panel_linear_dpbf16_silu(out, x, panels)


def panel_linear_amx_silu(out: torch.Tensor, x: torch.Tensor, panels: torch.Tensor) -> None:
    """``out = SiLU(x @ gate.T) * (x @ up.T)`` in one pass over the amx panels of a gated MLP's
    fused ``[gate; up]`` projection (``PackedLinear.pack("amx", w)``, ``w`` [2 I, K] bfloat16,
    I a multiple of 16): ``out`` [M, I] bfloat16, as ``silu_and_mul`` computes it on the bfloat16
    ``panel_linear_amx`` product (gate and up rounded to bfloat16 first, then SiLU's value, then the
    product) up to the order of the float32 sums; the product's ``[M, 2 I]`` never exists. Call only
    where ``amx_supported()``."""
    _ops().panel_linear_amx_silu(out, x, panels)


def panel_linear_amx_f32(out: torch.Tensor, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``out = x @ W.T + bias`` in float32 on AMX tiles (linear_amx_f32.cpp): each value split
    into three bfloat16 parts, the products of the parts that float32 resolves summed in float32.
    ``x`` [M, K] float32 with contiguous rows, K a multiple of 32; ``panels`` contiguous float32
    [ceil(N / 16), K / 2, 16, 2] (the pair panels' layout of ``panel_linear_dpbf16``, float32
    values); ``out`` [M, N] float32 with contiguous rows; ``bias`` [N] float32 or None. Call only
    where ``amx_supported()``."""
    _ops().panel_linear_amx_f32(out, x, panels, bias)


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``out = weight * to_dtype(rms_norm(float(x)))`` per row (elementwise.cpp), rounded where
    torch rounds. ``out``, ``x`` [rows, width] with contiguous rows and ``weight`` [width]
    contiguous, all of one dtype: float32, bfloat16 or float16."""
    _ops().rms_norm(out, x, weight, eps)


def copy_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[index[i]] = src[i]`` for every row i of ``src`` (elementwise.cpp): torch's
    ``dst.index_copy_(0, index, src)``, a row a ``memcpy``, rows shared out over tandem's work
    pool. Each row (everything past dimension 0) one contiguous run in both, one dtype, the same
    row shape; ``index`` int64 [N], every entry a row of ``dst`` (else RuntimeError, nothing
    copied); a row named twice gets one of its sources."""
    _ops().copy_rows(dst, index, src)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """The residual add and RMSNorm in one pass, both in place (elementwise.cpp): ``residual``
    becomes ``x + residual`` (rounded to the dtype) and ``x`` the norm of that sum, as
    ``rms_norm`` computes it. ``x``, ``residual`` [rows, width] with contiguous rows and
    ``weight`` [width] contiguous, all of one dtype: float32, bfloat16 or float16."""
    _ops().add_rms_norm(x, residual, weight, eps)


def silu_and_mul(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    """``out = silu(gate) * up`` per row, where each row of ``gate_up`` is ``[gate | up]``
    (elementwise.cpp). ``gate_up`` [rows, 2 * width] and ``out`` [rows, width], contiguous rows,
    one dtype: float32, bfloat16 or float16."""
    _ops().silu_and_mul(out, gate_up)


def rotary_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """HF Llama's rotary embedding in place: ``x = x * cos + rotate_half(x) * sin``
    (elementwise.cpp). ``x`` [T, heads, D] with D even and contiguous (a view of a projection's
    output will do); ``cos``, ``sin`` [T, D] with contiguous rows; one dtype: float32, bfloat16
    or float16."""
    _ops().rotary_neox(x, cos, sin)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> None:
    """Every head vector of ``x`` [T, heads, D] normed over D in place (elementwise.cpp): the
    q/k norms. ``weight * to_dtype(rms_norm(float(v)))`` as ``rms_norm`` (Qwen3's), or with
    ``gemma`` ``to_dtype(rms_norm(float(v)) * (1 + float(weight)))`` (Gemma 3's). D contiguous
    (a view of a projection's output will do), ``weight`` [D] contiguous, one dtype: float32,
    bfloat16 or float16."""
    _ops().head_rms_norm(x, weight, eps, gemma)


def gemma_rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Gemma's RMSNorm per row (elementwise.cpp): ``out = to_dtype(rms_norm(float(x)) * (1 +
    float(weight)))``, the scale in float32 as HF's ``Gemma3RMSNorm``. ``out``, ``x`` [rows,
    width] with contiguous rows (``out`` may be ``x``), ``weight`` [width] contiguous, one dtype:
    float32, bfloat16 or float16."""
    _ops().gemma_rms_norm(out, x, weight, eps)


def gemma_add_rms_norm(residual: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Gemma's norm after a block and the residual add in one pass, in place (elementwise.cpp):
    ``residual = residual + gemma_rms_norm(h)``, each rounded to the dtype as torch rounds.
    Shapes and dtypes as ``gemma_rms_norm``'s."""
    _ops().gemma_add_rms_norm(residual, h, weight, eps)


def gelu_tanh_and_mul(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    """``out = gelu(gate, approximate="tanh") * up`` per row, each row of ``gate_up`` being
    ``[gate | up]`` (elementwise.cpp; Gemma's MLP). Shapes and dtypes as ``silu_and_mul``'s."""
    _ops().gelu_tanh_and_mul(out, gate_up)


def draw_rows(tokens: torch.Tensor, logits: torch.Tensor, uniforms: torch.Tensor) -> None:
    """The sampler's inverse-CDF draw, one token per row of ``softmax(logits)`` (sampling.cpp).

    ``logits`` [N, V] float32 with contiguous rows, holding no NaN or +inf; ``uniforms`` [N]
    float32 in [0, 1), contiguous; ``tokens`` [N] int64, contiguous. ``tokens[i]`` is the first
    token whose running sum of probabilities passes ``uniforms[i]`` times the row's total; a
    token of probability 0 is never drawn, and a row of -inf only gets -1."""
    _ops().draw_rows(tokens, logits, uniforms)


def argmax_rows(tokens: torch.Tensor, logits: torch.Tensor) -> None:
    """The greedy fast path (sampling.cpp): ``tokens[i]`` is the first index of row ``i``'s
    largest logit, as torch's ``max(dim=-1)``, or -1 where the row holds a NaN. ``logits``
    [N, V] float32 with contiguous rows, 1 <= V < 2^31; ``tokens`` [N] int64, contiguous."""
    _ops().argmax_rows(tokens, logits)


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    """``x @ W.T`` with ``W`` [N, in_features] read from its GGUF blocks (gguf_matmul.cpp).

    ``x`` [M, in_features] float32 or bfloat16; ``qweight`` uint8 [N, row_bytes], row ``n`` the
    file's blocks of ``W[n, :]`` (``tandem.kernels.gguf_types``); ``ggml_type`` a
    ``GGMLQuantizationType`` value with a kernel (``gguf_types.BLOCKS``). Returns a new [M, N]
    tensor in x's dtype, products and sums in float32 — but for 1 to 3 rows of bfloat16 x on a CPU
    with AVX512-VNNI, where x is first put in 15-bit fixed point a group of 32
    (``use_gguf_int8``). ValueError for another type or a qweight whose rows do not fit
    in_features."""
    check_qweight(qweight, ggml_type, in_features)
    return _ops().gguf_linear(x, qweight, ggml_type, in_features)


def gguf_dequantize_rows(qweight: torch.Tensor, ggml_type: int, in_features: int, rows: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """Rows ``rows`` of ``W`` dequantized from their GGUF blocks: a new [len(rows), in_features]
    tensor of ``dtype`` (gguf_matmul.cpp) — an embedding lookup on a quantized table.
    ``qweight``, ``ggml_type``, ``in_features`` as in ``gguf_linear``; ``rows`` int64 [R], each in
    [0, N) (IndexError otherwise). Values are computed in float32, then rounded to ``dtype``."""
    check_qweight(qweight, ggml_type, in_features)
    return _ops().gguf_dequantize_rows(qweight, ggml_type, in_features, rows, dtype)


def decode_layers(hidden: torch.Tensor, residual: torch.Tensor | None, norms: list[torch.Tensor],
                  weights: list[torch.Tensor], info: list[int], parts: list[int], cos: torch.Tensor,
                  sin: torch.Tensor,
                  cos_local: torch.Tensor | None, sin_local: torch.Tensor | None, local: list[int],
                  pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor,
                  seq_lens: torch.Tensor, windows: list[int], heads: int, kv_heads: int, head_dim: int,
                  scale: float, eps: float, flags: int,
                  final_norm: torch.Tensor | None = None,
                  prefetch_kv_bytes: int = 1 << 20,
                  row_tables: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step through ``len(windows)`` Llama-family decoder layers (decode_layers.cpp,
    whose header draws the steps): returns the last layer's (MLP output, residual), as
    ``LlamaDecoderLayer.forward`` does (Gemma 3's layers: the residual stream twice), each row
    one token that attends through ``paged_decode``.

    ``flags``: 1 q/k norms, 2 Gemma 3's layer, 4 GELU-tanh for SiLU (``cpu_decode_loop.FLAGS``).
    ``hidden`` [M, hidden] contiguous and ``residual`` (None before the first layer: the first
    norm has no add) of the model's dtype, both overwritten as the layers' norms overwrite them;
    ``norms`` per layer: input, post-attention, (pre- and post-feedforward with Gemma), (q and
    k with q/k norms); four linears per layer (qkv, o, gate_up, down), linear ``i`` made of
    ``parts[i]`` consecutive entries of ``weights`` whose outputs side by side are its output
    (a GGUF layer with shards of different block types), and ``info`` four ints per entry
    (kind, out_features, in_features, ggml_type; kinds in the C++ header); ``cos``, ``sin``
    [M, head_dim] of the dtype, and ``cos_local``, ``sin_local`` for the layers where
    ``local[l]`` is 1 (Gemma's sliding layers; else None); ``pool``
    ``[num_blocks, >= layers, 2, block_size, kv_heads, head_dim]`` of the dtype, layer ``l``
    writing and reading ``pool[:, l]``; ``slots`` [M] int64 >= 0, row ``t``'s KV slot; ``rows``,
    ``tables``, ``seq_lens``, ``row_tables`` as ``paged_decode`` takes them; ``windows`` each layer's sliding
    window (0: none). ``final_norm``: the model's norm after the last layer, applied before
    returning as ``RMSNorm.forward(output, residual)`` (Gemma: ``GemmaRMSNorm.forward(stream)``)
    returns it: (normed, residual). ``prefetch_kv_bytes``: before each layer's qkv product, ask
    for up to this many bytes of the KV blocks its attention will read (0: none; the values do
    not depend on it)."""
    return _ops().decode_layers(hidden, residual, norms, weights, info, parts, cos, sin, cos_local, sin_local,
                                local, pool, slots, rows, tables, seq_lens, windows, heads, kv_heads, head_dim,
                                scale, eps, flags, final_norm, prefetch_kv_bytes, row_tables)


def use_gguf_int8(on: bool) -> bool:
    """Give ``gguf_linear``'s bfloat16 x of 1 to 3 rows to the int8 kernel where the CPU has
    AVX512-VNNI (True, the default: x in 15-bit fixed point a 32-value group, gguf_dpbf16.cpp) or
    to the bfloat16 one (False), from now on, in this process; returns the previous setting."""
    return _ops().use_gguf_int8(on)


def use_prefill_amx(on: bool) -> bool:
    """Give ``paged_decode``'s runs of prompt rows (bfloat16, prefill_tiles.cpp) to AMX tiles
    where the CPU has them (True, the default) or to vdpbf16ps (False: what a CPU with
    AVX512-BF16 and no AMX runs), from now on, in this process; returns the previous setting."""
    return _ops().use_prefill_amx(on)


def use_work_pool(on: bool) -> bool:
    """Share the kernels' work out over tandem's own helper threads (True, the default unless
    ``TANDEM_CPU_WORK_POOL=omp``) or OpenMP's (False), from now on, in this process
    (work_queue.h says why); returns the previous setting."""
    return _ops().use_work_pool(on)
