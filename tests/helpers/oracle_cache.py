"""The transformers oracle's work on a file, kept on disk so a slow oracle runs once per
machine: under ``cache_dir()/oracle``, keyed by the file's sha256 and the transformers version
(and, for an answer, the question asked). On a miss the oracle itself computes it; nothing is
written by hand.

    oracle_answer(path, question, compute) -> the JSON value compute() returned for it
    oracle_folder(path, name, write) -> a folder write(folder) filled once (e.g. a conversion
                                        transformers saved, for from_pretrained to load)
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
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


def oracle_folder(path: Path, name: str, write: Callable[[Path], None]) -> Path:
    """The folder ``name`` of the file at ``path``: filled by ``write(folder)`` (the oracle's
    work) the first time, into a temporary folder renamed into place, so a reader never sees it
    half written; a process that loses the race to another keeps the other's (the same work)."""
    folder = cache_dir() / "oracle" / f"{file_sha256(path)[:32]}-transformers-{transformers.__version__}" / name
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{name}-"))
    try:
        write(tmp)
        os.rename(tmp, folder)
    except OSError:
        if not folder.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


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
