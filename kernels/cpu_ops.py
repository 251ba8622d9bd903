"""The CPU kernels of ``kernels/cpu/`` (C++, built on first use with torch's cpp_extension into
one library of operators, ``torch.ops.tandem_cpu``).

``panel_linear(out, x, panels, bias)`` — ``out = x @ W.T + bias`` in float32 with ``W`` packed
into 16-column panels (``tandem.models.cpu_linear`` packs and calls it; layout in linear.cpp).

``paged_decode(out, q, kv, rows, tables, seq_lens, scale, window)`` — decode attention that
reads one layer of the paged KV pool in place (no gather into a padded buffer): query row ``i``
(token row ``rows[i]`` of ``q`` [T, H, D]) attends to the first ``seq_lens[i]`` keys of the
blocks ``tables[i]`` names (the last ``window`` of them when ``window`` > 0), and its output is
written to row ``rows[i]`` of ``out``. float32 arithmetic whatever the dtypes (float32,
bfloat16, float16 queries and pools); GQA by the head ratio. See the source for the layout.

``draw_rows(tokens, logits, uniforms)`` — the sampler's inverse-CDF draw, one token per row of
``softmax(logits)`` from that row's uniform number (``tandem.worker.sampler``; see sampling.cpp).

``argmax_rows(tokens, logits)`` — the greedy fast path: each row's first index of its largest
logit, -1 for a row that holds a NaN (sampling.cpp).

``load()`` builds the extension once per machine (g++ and ninja, 20–45 s; torch caches it under
``TORCH_EXTENSIONS_DIR``, by default ~/.cache/torch_extensions) and returns its operators
(``torch.ops.tandem_cpu``), or None when it cannot be built — callers then keep their torch
path. The build targets the CPU
capability torch reports (AVX2, AVX512); the extension's name carries that and a hash of the
sources, the flags and the torch it builds against, so a cache shared between machines or checkouts never hands one CPU another's
build, and two versions of tandem never rebuild each other's library under a running process.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("tandem")

SOURCES = [Path(__file__).parent / "cpu" / name
           for name in ("paged_attention.cpp", "linear.cpp", "elementwise.cpp", "sampling.cpp")]
HEADERS = [Path(__file__).parent / "cpu" / "work_queue.h"]
_ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}


@functools.cache
def load() -> Any | None:
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    isa = "AVX512" if capability.startswith("AVX512") else capability
    flags = ["-O3", "-ffast-math", "-fopenmp", *_ISA_FLAGS.get(isa, [])]
    built_with = " ".join([*flags, torch.__version__, torch.__file__])
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES + HEADERS) + built_with.encode())
    name = f"tandem_cpu_kernels_{isa.lower()}_{digest.hexdigest()[:12]}"
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load as build

        build(name=name, sources=[str(s) for s in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
              is_python_module=False, verbose=False)
        ops = torch.ops.tandem_cpu
        ops.paged_decode, ops.panel_linear, ops.rotary_neox, ops.draw_rows, ops.argmax_rows  # noqa: B018 - registered, or raise here rather than mid-step
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, no headers: keep the torch path
        logger.warning("tandem's CPU kernels could not be built (%s: %s); linear layers and decode "
                       "attention stay on torch's own kernels", type(exc).__name__,
                       str(exc).splitlines()[0] if str(exc) else "")
        return None
    seconds = time.perf_counter() - t0
    if seconds > 2:
        logger.info("built tandem's CPU kernels (%s) in %.0f s; cached for later runs", isa, seconds)
    return ops
