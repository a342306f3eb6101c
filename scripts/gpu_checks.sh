#!/usr/bin/env bash
# GPU checks and benchmarks in one go (one H200): the GPU tests, the per-rank cost table, a 2-rank CP
# layer job sharing the GPU (with the p2p trace report) and the whole-model step. Logs go to $OUT (or ./out).
# Usage on the device: bash scripts/gpu_checks.sh [quick]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
step() { echo "=== $1"; shift; timeout "$@"; echo "=== rc=$?"; }
if [ "${1:-}" = "full" ]; then
  step "gdn op tests" 300 python -m pytest tests/gpu/test_triton_gdn.py -q -s -ra -p no:cacheprovider 2>&1 | tee "$OUT/gdn_op_tests.log"
fi
# The summary's product precision: tf32x3 becomes the setting for the rest of the run if all its cases pass.
step "summary precision" 120 python -m pytest tests/gpu/test_triton_gdn.py -q -s -ra -p no:cacheprovider -k summary \
  2>&1 | tee "$OUT/summary.log"
if grep -q "tf32x3" "$OUT/summary.log" && ! grep -E "FAILED.*tf32x3|XFAIL.*tf32x3" "$OUT/summary.log"; then
  export DELTACP_SUMMARY_DOT_PRECISION=tf32x3
fi
echo "summary dot precision: ${DELTACP_SUMMARY_DOT_PRECISION:-tf32 (default)}" | tee -a "$OUT/device.txt"
step "cp triton tests" 240 python -m pytest tests/gpu/test_cp_triton.py -q -s -ra -p no:cacheprovider 2>&1 \
  | tee "$OUT/cp_tests.log" | grep -vE "^\[transformers\]"
step "per-rank cost" 150 python bench/cp_layer.py --per-rank-cost --cp 4 8 --global-len 32768 131072 \
  --backend triton --json "$OUT/bench.jsonl" 2>&1 | tee "$OUT/per_rank.log" | grep -vE "^\[transformers\]"
step "cp2 layer job + trace" 120 torchrun --standalone --nproc-per-node 2 bench/cp_layer.py --global-len 32768 \
  --modes ulysses p2p --backend triton --trace "$OUT/trace" --json "$OUT/bench.jsonl" 2>&1 \
  | tee "$OUT/cp2_layer.log" | grep -vE "^\[transformers\]"
step "model step" 200 python bench/model.py --layers 4 --local-len 16384 --warmup 3 --repeat 10 --json "$OUT/bench.jsonl" 2>&1 \
  | tee "$OUT/model.log" | grep -vE "^\[transformers\]"
