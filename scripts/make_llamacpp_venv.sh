#!/usr/bin/env bash
# Build a venv of its own for llama.cpp's Python binding, the peer of `tandem bench offline
# --baseline llamacpp`. Usage: scripts/make_llamacpp_venv.sh [DIR]  (default .venv-llamacpp, git-ignored)
#
# llama-cpp-python 0.3.36 is built from its sdist (the registry has no wheel for this machine) with
# the cmake and g++ found here, for the CPU it is built on (llama.cpp's GGML_NATIVE default), so
# build it on the machine that runs the benchmark. Its dependencies are small (numpy, jinja2,
# diskcache, typing-extensions) and do not include torch. Takes several minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.venv-llamacpp}
PYTHON=${PYTHON:-python3}
VERSION=0.3.36
start=$(date +%s)
if [ ! -x "$DIR/bin/python" ]; then
    echo "llama.cpp venv: creating $DIR with $($PYTHON --version)"
    "$PYTHON" -m venv "$DIR"
fi
py="$DIR/bin/python"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
"$py" -m pip install -q --disable-pip-version-check --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
"$py" -c "import llama_cpp; print(f'llama.cpp venv: llama-cpp-python {llama_cpp.__version__}')"
echo "llama.cpp venv: $DIR ready in $(( $(date +%s) - start )) s, $(du -sh "$DIR" | cut -f1)"
