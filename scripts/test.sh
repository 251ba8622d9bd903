#!/usr/bin/env bash
# Set up .venv and run the whole test suite. Extra arguments go to pytest (later flags win, so
# `bash scripts/test.sh -n 0 tests/test_config.py` runs one file in this process).
#
# Two pytest-xdist workers (TANDEM_TEST_WORKERS to change), each taking whole files
# (--dist loadfile), so a module's shared server or model is built once: much of the suite waits
# on subprocesses, servers and networks, which two workers overlap even on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n "${TANDEM_TEST_WORKERS:-2}" --dist loadfile --durations=20 "$@"
