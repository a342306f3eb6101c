#!/usr/bin/env bash
# Creates the virtual environment (if missing) and installs deltacp with its dependencies. Sourced by main.sh and
# test.sh.
# - Default: `.venv`, every package at the version in constraints.txt (what the suite was verified with), so a fresh
#   clone installs what CI tested.
# - DELTACP_DEPS=newest: `.venv-newest`, the newest releases that pyproject.toml's ranges allow (upgraded at every
#   run), to see whether a new transformers / TRL / torch release breaks something before the pins move.
# CPU machines get the CPU build of torch explicitly: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
case "${DELTACP_DEPS:-pinned}" in
  pinned) VENV=.venv; PINS=(-c "$VENV/constraints.txt") ;;
  newest) VENV=.venv-newest; PINS=(--upgrade --upgrade-strategy eager) ;;
  *) echo "DELTACP_DEPS=${DELTACP_DEPS}: expected 'pinned' (default: constraints.txt) or 'newest'" >&2; exit 2 ;;
esac
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
. "$VENV/bin/activate"
# A GPU machine keeps the torch (and the Triton that torch pins) it has: constraints.txt holds the CPU suite's.
if command -v nvidia-smi >/dev/null 2>&1; then
  grep -v -e '^torch==' -e '^triton==' constraints.txt > "$VENV/constraints.txt"
else
  cp constraints.txt "$VENV/constraints.txt"
fi
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.11"
  else
    # CPU build. DELTACP_TORCH_INDEX may name a CPU wheel index (e.g. PyTorch's /whl/cpu) on machines whose
    # default index would serve a CUDA build of this version.
    torch_pin=$(grep '^torch==' constraints.txt)
    [ "${DELTACP_DEPS:-pinned}" = newest ] && torch_pin="torch>=2.11"
    python -m pip install -q "$torch_pin" ${DELTACP_TORCH_INDEX:+--index-url "$DELTACP_TORCH_INDEX"}
  fi
fi
# DELTACP_EXTRAS: the optional dependencies to install (test.sh adds triton, for the TRITON_INTERPRET kernel tests).
python -m pip install -q "${PINS[@]}" -e ".[${DELTACP_EXTRAS:-test}]"
