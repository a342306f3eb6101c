#!/usr/bin/env bash
# The test suite (CPU, gloo). GPU tests are skipped with a visible reason where no CUDA device exists.
# Arguments go to pytest: `bash scripts/test.sh -m fast` is the fast tier (README, "Tests": both commands' times).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Triton too (CPU build of the wheel), so the TRITON_INTERPRET=1 kernel parity test runs here.
DELTACP_EXTRAS=test,triton . scripts/setup.sh
python -m pytest tests -ra -q --durations=25 "$@"
