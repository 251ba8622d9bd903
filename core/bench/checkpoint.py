"""The model a benchmark runs, for tandem and for its peers.

``model_path(name)`` turns ``--model`` into a path tandem loads: a folder or ``.gguf`` file as
given, a preset's name (``bench-100m``, the default; ``demo``) built on first use, or a trained
registry model's name (``smollm2-135m-instruct``, ``gemma3-270m``; ``tandem.models.registry_weights``).

``hf_folder(path)`` is the same model as a folder of safetensors, for what cannot read GGUF blocks
the way tandem does: the benchmarks' transformers modes and vLLM. A folder is returned as it is; a
``.gguf`` file is dequantized to float32 by transformers' own GGUF loader (``gguf_file=``) and saved
with its tokenizer and generation config, once per machine, under
``cache_dir()/dense/<file stem>-<sha256 prefix>`` (``$TANDEM_CACHE_DIR`` or ``~/.cache/tandem``).
Concurrent callers each build a private folder and the first to finish renames it into place.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from tandem.models.gguf_file import is_gguf
from tandem.models.presets import PRESETS, cache_dir, default_model_path
from tandem.models.registry_weights import WEIGHTS, weights_path

DEFAULT_PRESET = "bench-100m"
_LAYOUT = "v2"
"""Part of the folder's name: a change to what the folder holds builds it anew."""
_DONE = "tandem-dense.done"
"""Written last into a built folder: a folder without it is an interrupted build."""


def model_path(name: str | None) -> str:
    """``--model`` as a path tandem loads (see the module docstring); None is ``bench-100m``."""
    if name is None:
        return str(default_model_path(DEFAULT_PRESET))
    if not Path(name).exists():
        if name in PRESETS:
            return str(default_model_path(name))
        if name in WEIGHTS:
            return str(weights_path(name))
    return name


def hf_folder(path: str) -> str:
    """A safetensors folder of the model at ``path`` (a folder, or a ``.gguf`` file dequantized
    to float32 once per machine)."""
    if not is_gguf(path):
        return path
    source = Path(path)
    final = cache_dir() / "dense" / f"{source.stem}-{_sha256(source)[:16]}-{_LAYOUT}"
    if (final / _DONE).is_file():
        return str(final)
    scratch = final.with_name(f".{final.name}.building-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        _dequantize(source, scratch)
        if final.exists() and not (final / _DONE).is_file():
            shutil.rmtree(final, ignore_errors=True)  # an interrupted build's
        scratch.rename(final)
    except OSError:
        if not (final / _DONE).is_file():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(final)


def _dequantize(source: Path, into: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"{source.name}: dequantizing to a float32 safetensors folder for the baseline (once "
          f"per machine) -> {into.parent}", flush=True)
    kwargs = {"gguf_file": source.name}
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), dtype=torch.float32, **kwargs)
    # save_pretrained refuses a model transformers loaded from GGUF: its weights, config and
    # generation config are written one by one
    into.mkdir(parents=True)
    save_file(_weights(model), str(into / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]  # what vLLM picks its model class by
    config.save_pretrained(into)
    model.generation_config.save_pretrained(into)
    AutoTokenizer.from_pretrained(str(source.parent), **kwargs).save_pretrained(into)
    (into / _DONE).write_text(source.name + "\n")


def _weights(model) -> dict:
    """The state dict as HF checkpoints hold it: a tied output embedding is left out (readers tie
    it to the input embedding, which is kept under its own name; vLLM, for one, loads no
    embedding from ``lm_head.weight``), and other tensors sharing storage are copied apart."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        output = model.get_output_embeddings()
        for name, module in model.named_modules():
            if module is output:
                state.pop(f"{name}.weight", None)
    seen: set[int] = set()
    weights = {}
    for name, tensor in state.items():
        pointer = tensor.untyped_storage().data_ptr()
        weights[name] = tensor.clone().contiguous() if pointer in seen else tensor.contiguous()
        seen.add(pointer)
    return weights


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
