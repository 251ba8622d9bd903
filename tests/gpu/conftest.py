"""Tests marked ``gpu`` need a CUDA device: without one they are skipped, wherever they live.

``tests/gpu/run_gpu_checks.py`` runs them, with the kernel tests, on a GPU machine."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
