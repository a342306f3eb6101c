#!/usr/bin/env bash
# The test suite (CPU, gloo). GPU tests are skipped with a visible reason where no CUDA device exists.
# Arguments go to pytest: `bash scripts/test.sh -m fast` is the fast tier (README, "Tests": both commands' times).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
# Triton too (CPU build of the wheel), so the TRITON_INTERPRET=1 kernel parity test runs here.
python -m pip install -q -e ".[test,triton]"
python -m pytest tests -ra -q --durations=25 "$@"
