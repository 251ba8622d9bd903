"""The tests' own packer and unpacker of the published quantized formats, written from the format
descriptions alone with numpy bit operations; it shares no code with ``tandem.quant``.

GPTQ (AutoGPTQ / GPTQModel)::

    qweight int32 [K/P, N]: word [r, n] holds q[r*P + j, n] in bits j*b .. j*b+b-1 (P = 32/b)
    qzeros  int32 [G, N/P]: word [g, c] holds the zero point of column c*P + j the same way,
                            minus one in the original format ("gptq"), as is in "gptq_v2"
    scales  fp16  [G, N];  g_idx int32 [K]
    W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])

AutoAWQ GEMM::

    qweight int32 [K, N/8]: nibble j of word [k, c] holds q[k, 8c + ORDER[j]], ORDER = 0 2 4 6 1 3 5 7
    qzeros  int32 [K/gs, N/8] the same way;  scales fp16 [K/gs, N]
    W[n, k] = scales[k // gs, n] * (q[k, n] - zero[k // gs, n])

FP8: weight float8_e4m3fn [N, K] times weight_scale ([] per tensor, [N, 1] per channel) or
weight_scale_inv [ceil(N/bn), ceil(K/bk)] (block ``bn × bk``).

``build_pair`` turns a tiny model (tests.helpers.tiny_models) into one of these checkpoints plus an
unquantized float32 copy holding exactly the dequantized weights — the HF oracle's checkpoint.
"""
from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.tiny_models import tiny_model_dir

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                   "gate_proj.weight", "up_proj.weight", "down_proj.weight")


# ------------------------------------------------------------------------------ int packing


def pack_words(values: np.ndarray, bits: int, axis: int, order: list[int] | None = None) -> np.ndarray:
    """Pack unsigned ``values`` along ``axis`` into int32 words; value ``order[j]`` of every run
    of 32/bits lands in bits j*bits.."""
    per_word = 32 // bits
    order = order or list(range(per_word))
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    words = np.zeros((v.shape[0] // per_word,) + v.shape[1:], dtype=np.uint32)
    for j in range(per_word):
        words |= v[order[j]::per_word] << np.uint32(bits * j)
    return np.moveaxis(words.view(np.int32), 0, axis)


def unpack_words(words: np.ndarray, bits: int, axis: int, order: list[int] | None = None) -> np.ndarray:
    """The inverse of ``pack_words``: int64 values, 32/bits times longer along ``axis``."""
    per_word = 32 // bits
    order = order or list(range(per_word))
    w = np.moveaxis(words.view(np.uint32), axis, 0)
    values = np.zeros((w.shape[0] * per_word,) + w.shape[1:], dtype=np.int64)
    for j in range(per_word):
        values[order[j]::per_word] = (w >> np.uint32(bits * j)) & np.uint32((1 << bits) - 1)
    return np.moveaxis(values, 0, axis)


# ------------------------------------------------------------------------------ integer formats


def round_groups(w: np.ndarray, bits: int, g_idx: np.ndarray, num_groups: int, sym: bool,
                 min_zero: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize ``w [N, K]`` per (row, group of inputs named by g_idx): returns q [K, N],
    zero points [G, N] (integers) and scales fp16 [G, N]."""
    maxq = 2**bits - 1
    n, k = w.shape
    q = np.zeros((k, n), dtype=np.int64)
    zeros = np.zeros((num_groups, n), dtype=np.int64)
    scales = np.zeros((num_groups, n), dtype=np.float16)
    for g in range(num_groups):
        cols = np.flatnonzero(g_idx == g)
        block = w[:, cols].astype(np.float64)
        if sym:
            scale = np.maximum(np.abs(block).max(axis=1), 1e-6) * 2 / maxq
        else:
            lo, hi = np.minimum(block.min(axis=1), 0), np.maximum(block.max(axis=1), 0)
            scale = np.maximum(hi - lo, 1e-6) / maxq
        scales[g] = scale.astype(np.float16)
        s = scales[g].astype(np.float64)
        zero = np.full(n, (maxq + 1) // 2) if sym else np.clip(np.rint(-lo / s), min_zero, maxq)
        zeros[g] = zero
        q[cols] = np.clip(np.rint(block / s[:, None]) + zero[:, None], 0, maxq).T
    return q, zeros, scales


def dequantize(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    """W [N, K] float32 from q [K, N], zeros and scales [G, N], g_idx [K] — float32 arithmetic."""
    diff = (q - zeros[g_idx]).astype(np.float32)
    return (diff * scales[g_idx].astype(np.float32)).T


def gptq_layer(w: np.ndarray, rng: np.random.Generator, *, bits: int = 4, group_size: int = 32,
               sym: bool = True, v2: bool = False, desc_act: bool = False) -> tuple[dict, np.ndarray]:
    n, k = w.shape
    size = k if group_size == -1 else group_size
    num_groups = -(-k // size)
    g_idx = np.arange(k) // size
    if desc_act:
        g_idx = g_idx[rng.permutation(k)]
    q, zeros, scales = round_groups(w, bits, g_idx, num_groups, sym, min_zero=0 if v2 else 1)
    stored = zeros if v2 else zeros - 1
    tensors = {"qweight": pack_words(q, bits, axis=0), "qzeros": pack_words(stored, bits, axis=1),
               "scales": scales, "g_idx": g_idx.astype(np.int32)}
    return tensors, dequantize(q, zeros, scales, g_idx)


def awq_layer(w: np.ndarray, rng: np.random.Generator, *, group_size: int = 32) -> tuple[dict, np.ndarray]:
    n, k = w.shape
    g_idx = np.arange(k) // group_size
    q, zeros, scales = round_groups(w, 4, g_idx, k // group_size, sym=False)
    tensors = {"qweight": pack_words(q, 4, axis=1, order=AWQ_ORDER),
               "qzeros": pack_words(zeros, 4, axis=1, order=AWQ_ORDER), "scales": scales}
    return tensors, dequantize(q, zeros, scales, g_idx)


def gptq_unpack(t: dict, bits: int, v2: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(q [K, N], zero points [G, N], scales, g_idx) of a GPTQ layer's tensors (numpy)."""
    zeros = unpack_words(t["qzeros"], bits, axis=1) + (0 if v2 else 1)
    return unpack_words(t["qweight"], bits, axis=0), zeros, t["scales"], t["g_idx"]


def awq_unpack(t: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [K, N], zero points [G, N], scales) of an AWQ layer's tensors (numpy)."""
    return (unpack_words(t["qweight"], 4, axis=1, order=AWQ_ORDER),
            unpack_words(t["qzeros"], 4, axis=1, order=AWQ_ORDER), t["scales"])


# ------------------------------------------------------------------------------ FP8


def fp8_layer(w: np.ndarray, rng: np.random.Generator, *, scales: str = "tensor", block: int = 32,
              static: bool = False) -> tuple[dict, np.ndarray]:
    """FP8 tensors of ``w`` with scales per "tensor", "channel" or "block" (block × block)."""
    wt = torch.from_numpy(w).double()
    n, k = wt.shape
    if scales == "block":
        rows, cols = -(-n // block), -(-k // block)
        scale = torch.zeros(rows, cols, dtype=torch.float32)
        for r in range(rows):
            for c in range(cols):
                scale[r, c] = wt[r * block:(r + 1) * block, c * block:(c + 1) * block].abs().max() / 448
        full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
        name = "weight_scale_inv"
    else:
        scale = (wt.abs().amax() if scales == "tensor" else wt.abs().amax(1, keepdim=True)) / 448
        scale = scale.float()
        full = scale
        name = "weight_scale"
    q = (wt / full.double()).to(torch.float8_e4m3fn)
    tensors = {"weight": q, name: scale}
    if static:
        tensors["input_scale"] = torch.tensor(float(rng.uniform(0.01, 0.05)), dtype=torch.float32)
    return tensors, (q.float() * full).numpy()


# ------------------------------------------------------------------------------ checkpoints

LAYER_BUILDERS: dict[str, Callable] = {"gptq": gptq_layer, "awq": awq_layer, "fp8": fp8_layer}


def quantization_config(fmt: str, **opts) -> dict:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": opts.get("bits", 4), "group_size": opts.get("group_size", 32),
                "desc_act": opts.get("desc_act", False), "sym": opts.get("sym", True),
                "checkpoint_format": "gptq_v2" if opts.get("v2") else "gptq"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": opts.get("group_size", 32), "zero_point": True,
                "version": "gemm"}
    config = {"quant_method": "fp8", "activation_scheme": "static" if opts.get("static") else "dynamic"}
    if opts.get("scales") == "block":
        config["weight_block_size"] = [opts.get("block", 32)] * 2
    return config


def _write(dst: Path, src: Path, tensors: dict[str, torch.Tensor], qconfig: dict | None) -> Path:
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config", None)
    if qconfig:
        config["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _as_torch(value) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))


def _input_rng(name: str) -> np.random.Generator:
    """A generator seeded by the layer and the input a projection reads: projections that share
    their input (q, k, v; gate, up) draw the same desc_act order, as GPTQ computes it from that
    input alone."""
    layer = int(name.split(".layers.")[1].split(".")[0])
    projection = name.rsplit(".", 2)[-2]
    shared_input = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2}
    return np.random.default_rng([layer, shared_input.get(projection, 3)])


@functools.cache
def build_pair(kind: str, fmt: str, **opts) -> tuple[Path, Path]:
    """(quantized checkpoint, float32 checkpoint of its dequantized weights) of tiny model ``kind``
    in format ``fmt`` ("gptq", "awq", "fp8") with the layer builder's options; built once."""
    src = tiny_model_dir(kind)
    quantized, dequantized = {}, {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if not name.endswith(LINEAR_SUFFIXES):
            quantized[name] = dequantized[name] = tensor
            continue
        layer, weight = LAYER_BUILDERS[fmt](tensor.numpy(), _input_rng(name), **opts)
        prefix = name[: -len("weight")]
        quantized.update({prefix + key: _as_torch(value) for key, value in layer.items()})
        dequantized[name] = torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))
    root = Path(tempfile.mkdtemp(prefix=f"tandem-{fmt}-"))
    atexit.register(shutil.rmtree, root, True)
    return (_write(root / "quantized", src, quantized, quantization_config(fmt, **opts)),
            _write(root / "dequantized", src, dequantized, None))


# ------------------------------------------------------------------------------ reading back

QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv", "input_scale")


def dequantized_copy(quantized: Path, dst: Path) -> Path:
    """An unquantized float32 copy of a single-file GPTQ, AWQ or FP8 checkpoint, each linear
    weight rebuilt by this module's unpackers from the published layout."""
    qcfg = json.loads((quantized / "config.json").read_text())["quantization_config"]
    tensors = load_file(quantized / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        layer = {s: tensors[f"{prefix}.{s}"] for s in QUANT_SUFFIXES if f"{prefix}.{s}" in tensors}
        if suffix == "qweight":
            out[f"{prefix}.weight"] = torch.from_numpy(np.ascontiguousarray(_int_weight(qcfg, layer)))
        elif suffix == "weight" and tensor.dtype == torch.float8_e4m3fn:
            out[name] = _fp8_weight(qcfg, tensor, layer)
        elif suffix not in QUANT_SUFFIXES:
            out[name] = tensor
    return _write(dst, quantized, out, None)


def _int_weight(qcfg: dict, layer: dict[str, torch.Tensor]) -> np.ndarray:
    t = {k: v.numpy() for k, v in layer.items()}
    if qcfg["quant_method"] == "gptq":
        q, zeros, scales, g_idx = gptq_unpack(t, qcfg["bits"], qcfg["checkpoint_format"] == "gptq_v2")
        return dequantize(q, zeros, scales, g_idx.astype(np.int64))
    q, zeros, scales = awq_unpack(t)
    return dequantize(q, zeros, scales, np.arange(q.shape[0]) // qcfg["group_size"])


def _fp8_weight(qcfg: dict, weight: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
    n, k = weight.shape
    if "weight_scale_inv" in layer:
        block_n, block_k = qcfg["weight_block_size"]
        scale = layer["weight_scale_inv"].repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]
    else:
        scale = layer["weight_scale"]
    return weight.float() * scale
