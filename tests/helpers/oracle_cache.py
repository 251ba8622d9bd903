"""The transformers oracle's answers on a file, kept on disk so a slow oracle runs once per
machine: under ``cache_dir()/oracle``, keyed by the file's sha256, the transformers version and
the question asked. On a miss the oracle itself computes the answer; nothing is written by hand.

    oracle_answer(path, question, compute) -> the JSON value compute() returned for it
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers

from tandem.models.presets import cache_dir


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def oracle_answer(path: Path, question: dict[str, Any], compute: Callable[[], Any]) -> Any:
    """What ``compute()`` (the oracle, run on ``path``) answers to ``question`` (JSON-able: every
    input the answer depends on), from the cache or computed and stored."""
    key = {"sha256": file_sha256(path), "transformers": transformers.__version__, "question": question}
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    folder = cache_dir() / "oracle"
    entry = folder / f"{name}.json"
    if entry.is_file():
        return json.loads(entry.read_text())["answer"]
    answer = compute()
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({**key, "answer": answer}, f)
    os.replace(tmp, entry)
    return answer
