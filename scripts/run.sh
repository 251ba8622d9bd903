#!/usr/bin/env bash
# Set up .venv (first run only does real work) and serve the default model, SmolLM2-135M-Instruct,
# on http://127.0.0.1:8000.
# Extra arguments go to `tandem serve` (e.g. a model folder, --port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tandem serve "$@"
