"""`tandem quantize --method gptq|awq|fp8 SRC DST`: a quantized copy of a Hugging Face checkpoint,
by round-to-nearest, in the layout the published tools write (see tandem.quant.gptq, .awq, .fp8)
and with the matching ``quantization_config`` in config.json, so that tandem (and other servers)
load it. No calibration data and no GPU are needed.

Quantized: the 2-D ``*_proj.weight`` tensors of the decoder layers. Copied unchanged: every other
tensor (embeddings, norms, LM head, biases) and every file of SRC besides the weights and
config.json (tokenizer, generation config…). SRC must hold safetensors weights.

Round-to-nearest, per group of ``group_size`` consecutive inputs of each output row
(``maxq = 2**bits - 1``), with the scale rounded to fp16 before the weights are rounded::

    sym:   scale = 2·max|w| / maxq,                zero = (maxq + 1) / 2
    asym:  scale = (max(w, 0) - min(w, 0)) / maxq,  zero = round(-min(w, 0) / scale)
    q = clamp(round(w / scale) + zero, 0, maxq),    w ≈ scale · (q - zero)

GPTQ's original format stores ``zero - 1``, which cannot hold a zero point of 0 (readers add
the 1 back without masking): there the zero point is clamped to at least 1. FP8 scales are
``amax / 448`` per tensor, per output channel or per block.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.quant.quantize_args import CHECKPOINT_FORMATS, DEFAULT_SHARD_BYTES, FP8_GRANULARITIES, METHODS
from tandem.quant.packing import awq_interleave, pack_int32, values_per_word

logger = logging.getLogger("tandem")

FP8_MAX = 448.0
FP16_SMALLEST = 2.0**-24
LINEAR_WEIGHT = re.compile(r"\.layers\.\d+\..*_proj\.weight$")
WEIGHT_FILES = re.compile(r"(\.safetensors|\.bin|\.pt|\.index\.json)$")


@dataclass(frozen=True, slots=True)
class QuantizeSpec:
    """What to write. ``bits``, ``group_size``, ``sym`` and ``checkpoint_format`` concern GPTQ
    and AWQ (AWQ: 4 bits); ``fp8_scales`` and ``block_size`` concern FP8."""

    method: str
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    checkpoint_format: str = "gptq"
    fp8_scales: str = "block"
    block_size: int = 128

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        values_per_word(self.bits)
        if self.method == "awq" and self.bits != 4:
            raise ValueError("AWQ writes 4-bit weights only")
        if self.group_size < 1 and not (self.method == "gptq" and self.group_size == -1):
            raise ValueError(f"group_size must be positive (or -1 for GPTQ), got {self.group_size}")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format must be one of {', '.join(CHECKPOINT_FORMATS)}")
        if self.fp8_scales not in FP8_GRANULARITIES or self.block_size < 1:
            raise ValueError(f"fp8_scales must be one of {', '.join(FP8_GRANULARITIES)} with a positive block size")

    def quantization_config(self) -> dict:
        """The ``quantization_config`` of config.json, as the published tools write it."""
        if self.method == "gptq":
            return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                    "desc_act": False, "sym": self.sym, "checkpoint_format": self.checkpoint_format}
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm"}
        config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if self.fp8_scales == "block":
            config["weight_block_size"] = [self.block_size, self.block_size]
        return config

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """A linear layer's ``weight [N, K]`` → its checkpoint tensors, by suffix."""
        if self.method == "gptq":
            return quantize_gptq(weight, self.bits, self.group_size, self.sym,
                                 CHECKPOINT_FORMATS[self.checkpoint_format])
        if self.method == "awq":
            return quantize_awq(weight, self.group_size, self.sym)
        return quantize_fp8(weight, self.fp8_scales, self.block_size)


# ------------------------------------------------------------------------------ tensor formats


def round_to_nearest(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
                     min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` → (q int32 [N, K], scales fp16 [N, G], zeros int32 [N, G]) with groups of
    ``group_size`` consecutive inputs (the last one may be short)."""
    maxq = (1 << bits) - 1
    n, k = weight.shape
    num_groups = -(-k // group_size)
    w = F.pad(weight.float(), (0, num_groups * group_size - k)).reshape(n, num_groups, group_size)
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scale = 2 * torch.maximum(-low, high) / maxq if sym else (high - low) / maxq
    scale = torch.where(scale > 0, scale, 1.0).half().clamp(min=FP16_SMALLEST)
    s = scale.float()
    zero = torch.full_like(s, (maxq + 1) // 2) if sym else torch.round(-low / s)
    zero = zero.clamp(min_zero, maxq)
    q = torch.round(w / s.unsqueeze(-1)) + zero.unsqueeze(-1)
    q = q.clamp(0, maxq).reshape(n, -1)[:, :k]
    return q.to(torch.int32), scale, zero.to(torch.int32)


def quantize_gptq(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
                  zero_offset: int) -> dict[str, torch.Tensor]:
    """GPTQ tensors: qweight [K/P, N], qzeros [G, N/P] (zero - zero_offset), scales fp16 [G, N],
    g_idx [K] (no activation order)."""
    n, k = weight.shape
    per_word = values_per_word(bits)
    if k % per_word or n % per_word:
        raise ValueError(f"GPTQ needs both dimensions to be multiples of {per_word}, got [{n}, {k}]")
    size = k if group_size == -1 else group_size
    q, scales, zeros = round_to_nearest(weight, bits, size, sym, min_zero=zero_offset)
    stored_zeros = zeros - zero_offset
    return {
        "qweight": pack_int32(q.t(), bits, dim=0),
        "qzeros": pack_int32(stored_zeros.t(), bits, dim=1),
        "scales": scales.t().contiguous(),
        "g_idx": torch.arange(k, dtype=torch.int32) // size,
    }


def quantize_awq(weight: torch.Tensor, group_size: int, sym: bool) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors: qweight [K, N/8], qzeros [G, N/8], scales fp16 [G, N]."""
    n, k = weight.shape
    if k % group_size or n % 8:
        raise ValueError(f"AWQ needs inputs that are a multiple of group_size {group_size} and outputs "
                         f"that are a multiple of 8, got [{n}, {k}]")
    q, scales, zeros = round_to_nearest(weight, 4, group_size, sym)
    return {
        "qweight": pack_int32(awq_interleave(q.t()), 4, dim=1),
        "qzeros": pack_int32(awq_interleave(zeros.t()), 4, dim=1),
        "scales": scales.t().contiguous(),
    }


def quantize_fp8(weight: torch.Tensor, granularity: str, block_size: int) -> dict[str, torch.Tensor]:
    """FP8 tensors: weight e4m3fn [N, K] and weight_scale [] (tensor) or [N, 1] (channel), or
    weight_scale_inv [ceil(N/b), ceil(K/b)] (block)."""
    w = weight.float()
    n, k = w.shape
    if granularity == "tensor":
        scale = _fp8_scale(w.abs().amax())
        return {"weight": _to_fp8(w / scale), "weight_scale": scale}
    if granularity == "channel":
        scale = _fp8_scale(w.abs().amax(1, keepdim=True))
        return {"weight": _to_fp8(w / scale), "weight_scale": scale}
    rows, cols = -(-n // block_size), -(-k // block_size)
    blocks = F.pad(w, (0, cols * block_size - k, 0, rows * block_size - n))
    blocks = blocks.reshape(rows, block_size, cols, block_size)
    scale = _fp8_scale(blocks.abs().amax((1, 3)))
    q = (blocks / scale[:, None, :, None]).reshape(rows * block_size, cols * block_size)[:n, :k]
    return {"weight": _to_fp8(q), "weight_scale_inv": scale}


def _fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / FP8_MAX, 1.0).float()


def _to_fp8(w: torch.Tensor) -> torch.Tensor:
    return w.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous()


# ------------------------------------------------------------------------------ checkpoint folders


def source_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        return [src / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (src / "model.safetensors").is_file():
        return [src / "model.safetensors"]
    raise FileNotFoundError(f"{src} holds no model.safetensors or model.safetensors.index.json "
                            "(tandem quantize reads safetensors checkpoints)")


def quantized_tensors(src: Path, spec: QuantizeSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the output checkpoint, one source tensor at a time."""
    for file in source_files(src):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if LINEAR_WEIGHT.search(name) and tensor.dim() == 2:
                    prefix = name[: -len("weight")]
                    for suffix, value in spec.quantize(tensor).items():
                        yield prefix + suffix, value
                else:
                    yield name, tensor


def write_shards(tensors: Iterator[tuple[str, torch.Tensor]], dst: Path, max_shard_bytes: int) -> list[str]:
    """Save the tensors as model.safetensors, or as numbered shards with an index when they
    exceed ``max_shard_bytes``; each shard is written as soon as it is full, so at most one
    shard is held in memory. Returns the file names."""
    parts: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0

    def flush() -> None:
        part = dst / f"part-{len(parts)}.safetensors.tmp"
        save_file(shard, part, metadata={"format": "pt"})
        parts.append((part, list(shard)))
        shard.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
            shard_bytes = 0
        shard[name] = tensor.contiguous()
        shard_bytes += nbytes
        total_bytes += nbytes
    flush()
    if len(parts) == 1:
        parts[0][0].rename(dst / "model.safetensors")
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    weight_map = {}
    for file, (part, tensor_names) in zip(names, parts):
        part.rename(dst / file)
        weight_map.update(dict.fromkeys(tensor_names, file))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names


def quantize_checkpoint(src: str | Path, dst: str | Path, spec: QuantizeSpec,
                        max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the quantized copy of the HF folder ``src`` into ``dst`` (created; it must not hold
    a model already) and return ``dst``."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    if (dst / "config.json").exists():
        raise ValueError(f"{dst} already holds a model; choose a new folder")
    dst.mkdir(parents=True, exist_ok=True)
    write_shards(quantized_tensors(src, spec), dst, max_shard_bytes)
    config["quantization_config"] = spec.quantization_config()
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in src.iterdir():
        if path.is_file() and path.name != "config.json" and not WEIGHT_FILES.search(path.name):
            shutil.copy2(path, dst / path.name)
    return dst


# ------------------------------------------------------------------------------ command line


def run(args: argparse.Namespace) -> int:
    """Quantize ``args.src`` into ``args.dst``; print the destination. Exit status 2 on bad input."""
    sym = args.sym if args.sym is not None else args.method != "awq"
    try:
        spec = QuantizeSpec(method=args.method, bits=args.bits, group_size=args.group_size, sym=sym,
                            checkpoint_format=args.checkpoint_format, fp8_scales=args.fp8_scales,
                            block_size=args.block_size)
        dst = quantize_checkpoint(args.src, args.dst, spec, args.max_shard_size)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem quantize: {exc}", file=sys.stderr)
        return 2
    logger.info("wrote a %s copy of %s to %s", args.method, args.src, dst)
    print(dst)
    return 0
