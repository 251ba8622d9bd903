"""One llama.cpp GGUF file, parsed by the ``gguf`` package (llama.cpp's own reader): its
metadata as plain Python values and its tensors, memory-mapped.

A GGUF file is a whole checkpoint: config (``{arch}.*`` keys), tokenizer (``tokenizer.*``) and
weights in one file, so ``model.path`` may name it where a Hugging Face folder is expected
(``is_gguf``). Parsing walks every metadata entry (the vocabulary's strings one by one), which
is slow for a large vocabulary, so one parse per file is kept per process.
"""
from __future__ import annotations

import functools
import os

import numpy as np
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"
_LONG_ARRAY = 4096
"""Arrays longer than this (the vocabulary, its scores and merges) are kept as their length:
transformers rebuilds the tokenizer from the file itself."""


def is_gguf(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; the file need not exist yet)."""
    return path is not None and str(path).lower().endswith(GGUF_SUFFIX)


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """The parsed file: ``metadata`` maps each key to its value (long arrays to their length),
    ``tensors`` are the reader's ``ReaderTensor``s in file order (name, ggml type, raw data)."""

    path: Path
    metadata: dict[str, Any]
    tensors: tuple[Any, ...]

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def arch_key(self, name: str, default: Any = None) -> Any:
        """``{architecture}.{name}`` (e.g. ``block_count``), or ``default``."""
        return self.metadata.get(f"{self.architecture}.{name}", default)

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tensors)


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """The file at ``path``, parsed once per process (again after the file changes); ValueError
    naming the file when it is missing or not a GGUF file."""
    file = Path(path).resolve()
    try:
        stat = file.stat()
    except OSError as exc:
        raise ValueError(f"cannot read the GGUF file {path}: {exc.strerror}") from None
    return _read(file, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read(file: Path, size: int, mtime_ns: int) -> GGUFFile:
    from gguf import GGUFValueType

    try:
        reader = _reader_class()(file)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{file} is not a GGUF file: {exc}") from None
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > _LONG_ARRAY:
            metadata[key] = len(field.data)
        else:
            metadata[key] = field.contents()
    if "general.architecture" not in metadata:
        raise ValueError(f"{file} has no general.architecture: not a model GGUF file")
    return GGUFFile(file, metadata, tuple(reader.tensors))


@functools.cache
def _reader_class() -> type:
    """``gguf.GGUFReader`` reading through a plain ndarray view of its memory map: the reader
    indexes its map once per metadata value, and ``np.memmap``'s slower indexing would take most
    of the parse. The values and tensors are the same (read-only views of the file)."""
    from gguf import GGUFReader

    class PlainViewReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return PlainViewReader
