"""Load a Hugging Face model folder: config.json → model class (through the plugin registry),
safetensors weights (one file or shards with an index; pytorch_model.bin as a fallback),
generation config and tokenizer. A path ending in .gguf is a llama.cpp GGUF file instead, which
holds all of these (``tandem.models.gguf_*``): every function here takes either.

    model, arch = load_model(path, dtype=torch.float32, device=torch.device("cpu"),
                             registry=get_registry(), attn_backend_cls=TorchAttentionBackend,
                             quant_method=UnquantizedLinearMethod())
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from tqdm import tqdm

from tandem.interfaces import AttentionBackend, QuantMethod
from tandem.models.config import ModelArchConfig
from tandem.models.gguf_file import is_gguf, read_gguf

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"


class ModelRegistry(Protocol):
    """What the loader needs of ``tandem.plugin_manager.Registry``."""

    def get(self, kind: str, name: str) -> type: ...

    def names(self, kind: str) -> list[str]: ...


def resolve_model_class(registry: ModelRegistry, arch: ModelArchConfig) -> type:
    """The registered class of the first architecture config.json names that is installed."""
    supported = registry.names("model")
    for name in arch.architectures:
        if name in supported:
            return registry.get("model", name)
    named = ", ".join(arch.architectures) or "none"
    raise ValueError(f"unsupported model architecture {named}; supported: {', '.join(sorted(supported))}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    registry: ModelRegistry,
    attn_backend_cls: type[AttentionBackend],
    quant_method: QuantMethod,
) -> tuple[torch.nn.Module, ModelArchConfig]:
    """Build the model of the folder ``path`` on ``device`` with parameters in ``dtype`` (the
    quant method may store some in other types) and load its weights. Returns (model, config)."""
    arch = ModelArchConfig.from_pretrained_dir(path)
    cls = resolve_model_class(registry, arch)
    with _default_dtype(dtype), torch.device(device):
        model = cls(arch, quant_method, attn_backend_cls)
    model.load_weights(iter_checkpoint(path, packed=quant_method.reads_gguf_blocks))
    return model.eval(), arch


def checkpoint_files(path: str | Path) -> list[Path]:
    """The weight files of the folder, safetensors preferred, shards in name order (a GGUF
    file: itself)."""
    root = Path(path)
    if is_gguf(path):
        return [root]
    for index_name, single in ((SAFETENSORS_INDEX, SAFETENSORS_FILE), (TORCH_INDEX, TORCH_FILE)):
        index = root / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [root / s for s in shards]
        if (root / single).is_file():
            return [root / single]
    raise FileNotFoundError(f"no {SAFETENSORS_FILE}, {SAFETENSORS_INDEX} or {TORCH_FILE} in {root}")


def iter_checkpoint(path: str | Path, packed: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint, on the CPU, with a progress bar over tensors
    (shown on a terminal only). A GGUF file's tensors come dequantized to float32 under their
    HF names (``tandem.models.gguf_weights``), or with ``packed`` its quantized blocks as stored."""
    if is_gguf(path):
        from tandem.models.gguf_weights import iter_gguf_weights

        file = read_gguf(path)
        desc = "reading weights" if packed else "dequantizing weights"
        with tqdm(desc=desc, unit="tensor", disable=None, total=len(file.tensors)) as bar:
            for item in iter_gguf_weights(file, packed):
                yield item
                bar.update(1)
        return
    files = checkpoint_files(path)
    with tqdm(desc="loading weights", unit="tensor", disable=None, total=_count_tensors(files)) as bar:
        for file in files:
            for name, tensor in _iter_file(file):
                yield name, tensor
                bar.update(1)


_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def estimate_weight_bytes(path: str | Path, dtype: torch.dtype, packed: bool = False) -> int | None:
    """Bytes the checkpoint's tensors take once loaded with floating-point weights in ``dtype``
    (integer and FP8 tensors keep their size), read from the safetensors headers alone; None for
    pytorch_model.bin checkpoints. Tied or fused copies are counted as stored; every tensor of a
    GGUF file is counted in ``dtype`` (it is dequantized), or with ``packed`` its quantized
    tensors as stored."""
    if is_gguf(path):
        from tandem.models.gguf_weights import gguf_packed_bytes, gguf_weight_count

        file = read_gguf(path)
        return gguf_packed_bytes(file, dtype) if packed else gguf_weight_count(file) * dtype.itemsize
    files = checkpoint_files(path)
    if files[0].suffix != ".safetensors":
        return None
    total = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                numel = 1
                for size in piece.get_shape():
                    numel *= size
                stored = piece.get_dtype()
                total += numel * (dtype.itemsize if stored in _FLOAT_DTYPES else _SAFETENSORS_BYTES[stored])
    return total


_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2,
                      "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _count_tensors(files: list[Path]) -> int | None:
    if files[0].suffix != ".safetensors":
        return None
    total = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            total += len(f.keys())
    return total


def _iter_file(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if file.suffix == ".safetensors":
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    else:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def load_generation_config(path: str | Path) -> dict[str, Any]:
    """generation_config.json's fields (empty without the file) plus ``eos_token_ids``: the set of
    its ``eos_token_id`` (an int or a list), else config.json's. A GGUF file: its metadata's
    (``tandem.models.gguf_config.gguf_generation_config``)."""
    if is_gguf(path):
        from tandem.models.gguf_config import gguf_generation_config

        return gguf_generation_config(read_gguf(path))
    root = Path(path)
    gen_file = root / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    eos = gen.get("eos_token_id")
    if eos is None:
        config_file = root / "config.json"
        eos = json.loads(config_file.read_text()).get("eos_token_id") if config_file.is_file() else None
    if eos is None:
        eos_ids: set[int] = set()
    elif isinstance(eos, int):
        eos_ids = {eos}
    else:
        eos_ids = set(eos)
    return {**gen, "eos_token_ids": eos_ids}


GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""What ``sampling_defaults`` takes from generation_config.json, as vLLM does."""


def sampling_defaults(setting: str, model_path: str | Path) -> dict[str, Any]:
    """The sampling defaults a model's requests get where they set none, as vLLM's
    ``--generation-config``: ``"vllm"`` none (tandem's ``SamplingParams`` defaults); ``"auto"``
    the ``GENERATION_DEFAULT_FIELDS`` that the model folder's generation_config.json sets (none
    without the file; a GGUF file's ``general.sampling.*`` metadata); any other value is a folder
    whose generation_config.json is read so (ValueError when it has none). HF's ``do_sample`` is
    ignored, as vLLM does."""
    if setting == "vllm":
        return {}
    folder = Path(model_path if setting == "auto" else setting)
    if setting != "auto" and not (folder / "generation_config.json").is_file():
        raise ValueError(f"model.generation_config: {folder} holds no generation_config.json "
                         "(use auto, vllm or a folder that has one)")
    gen = load_generation_config(model_path if setting == "auto" else folder)
    return {name: gen[name] for name in GENERATION_DEFAULT_FIELDS if gen.get(name) is not None}


def load_tokenizer(path: str | Path) -> Any:
    """The folder's tokenizer through ``transformers.AutoTokenizer``; ValueError naming the folder
    (and what to install or add) when it cannot be loaded. A GGUF file's tokenizer is rebuilt
    from its metadata by transformers' GGUF conversion (vocabulary, merges, special tokens and
    chat template)."""
    if is_gguf(path):
        return _load_gguf_tokenizer(Path(path))
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
        root = Path(path)
        if (root / "tokenizer.model").is_file() and not (root / "tokenizer.json").is_file():
            hint = ("it has only a SentencePiece tokenizer.model: `pip install sentencepiece protobuf`, "
                    "or add a tokenizer.json")
        elif not any((root / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            hint = "it has no tokenizer.json, tokenizer.model or vocab.json; point --tokenizer at the folder that does"
        else:
            hint = f"{type(exc).__name__}: {exc}"
        raise ValueError(f"cannot load the tokenizer of {path}: {hint}") from exc


def _load_gguf_tokenizer(path: Path) -> Any:
    """What ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` builds (the tokenizer class
    of the file's model type, from transformers' GGUF conversion), without that call's second,
    slow parse of the file for its config."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    model_type = ModelArchConfig.from_pretrained_dir(path).model_type
    class_name = TOKENIZER_MAPPING_NAMES.get(model_type)
    cls = tokenizer_class_from_name(class_name) if class_name else PreTrainedTokenizerFast
    try:
        return cls.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
        raise ValueError(f"cannot build the tokenizer of {path} from its GGUF metadata: "
                         f"{type(exc).__name__}: {exc}") from exc
