#!/usr/bin/env bash
# The test suite (CPU, gloo). GPU tests are skipped with a visible reason where no CUDA device exists.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
python -m pytest tests -ra -q "$@"
