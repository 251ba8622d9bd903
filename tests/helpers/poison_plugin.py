"""A test-only model plugin standing in for a model or kernel bug that one request triggers.

``PoisonLlamaForCausalLM`` is tandem's Llama, except that a forward pass whose input holds the
token ``POISON_TOKEN`` raises; ``BrokenLlamaForCausalLM`` raises on every forward pass.
``poison_model_dir(src, tmp)`` copies a tiny Llama checkpoint under another architecture name.
Register the plugin with ``installed()``, which rebuilds the registry with it and forgets it after.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

import tandem
from tandem.models.llama import LlamaForCausalLM
from tandem.plugin_manager import get_plugin_manager, reset_plugins

POISON_TOKEN = 77


class PoisonLlamaForCausalLM(LlamaForCausalLM):
    def forward(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if bool((input_ids == POISON_TOKEN).any()):
            raise RuntimeError("poisoned input: the model cannot run this batch")
        return super().forward(input_ids, *args, **kwargs)


class BrokenLlamaForCausalLM(LlamaForCausalLM):
    def forward(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        raise RuntimeError("the model is broken")


@tandem.hookimpl
def tandem_register_models(register) -> None:
    register("PoisonLlamaForCausalLM", PoisonLlamaForCausalLM)
    register("BrokenLlamaForCausalLM", BrokenLlamaForCausalLM)


def poison_model_dir(src: Path, dst: Path, architecture: str = "PoisonLlamaForCausalLM") -> Path:
    """A copy of the Llama checkpoint ``src`` whose config.json names ``architecture``."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = [architecture]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@contextmanager
def installed(*extra_plugins: object) -> Iterator[None]:
    """The installed plugins plus this module (and ``extra_plugins``), for the duration."""
    import sys

    reset_plugins()
    pm = get_plugin_manager()
    pm.register(sys.modules[__name__], name="test-poison")
    for i, plugin in enumerate(extra_plugins):
        pm.register(plugin, name=f"test-extra-{i}")
    try:
        yield
    finally:
        reset_plugins()
