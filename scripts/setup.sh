#!/usr/bin/env bash
# Creates .venv (if missing) and installs deltacp with its dependencies. Sourced by main.sh and test.sh.
# CPU machines get the CPU build of torch explicitly: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.11"
  else
    # CPU build. DELTACP_TORCH_INDEX may name a CPU wheel index (e.g. PyTorch's /whl/cpu) on machines whose
    # default index would serve a CUDA build of this version.
    python -m pip install -q "torch==2.13.0" ${DELTACP_TORCH_INDEX:+--index-url "$DELTACP_TORCH_INDEX"}
  fi
fi
python -m pip install -q -e ".[test]"
