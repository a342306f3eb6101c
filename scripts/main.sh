#!/usr/bin/env bash
# The main job: CP parity of a small Qwen3.5 hybrid (3 GDN + 1 full attention layers) on 4 CPU ranks
# over gloo, every mode against the single-device model, on real text. Extra arguments go to the job.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
python -m deltacp.demo "$@"
