#!/usr/bin/env bash
# GPU checks and benchmarks on one H200, in parts that each fit one device call (10 minutes). Logs go to $OUT
# (or ./out).
#   bash scripts/gpu_checks.sh tests   bitwise reproducibility, GPU op tests (8K-32K), CP triton tests (about 5 min)
#   bash scripts/gpu_checks.sh quick   the same with the op tests cut to the summary cases   (about 3 minutes)
#   bash scripts/gpu_checks.sh op      op bench 8K-64K (+ FLA when its wheels are in .whl/; FLA autotunes about
#                                      a minute per length), p2p stage times, long-memory accuracy (about 6 minutes)
#   bash scripts/gpu_checks.sh cp      per-rank cost, 2-rank CP job + p2p trace, model step    (about 5 minutes)
#   bash scripts/gpu_checks.sh ncu     Nsight Compute of the three backward kernels at 32K      (about 1 minute)
#   bash scripts/gpu_checks.sh varlen  packed documents: GPU varlen tests (vs eager fp32, vs FLA varlen), unpacked op bench
#                                      8K-64K before (.whl/before/src, when carried) and after, 128K packed-row bench
#                                      ours vs FLA varlen, unpacked op regression tests at 8K (about 8 minutes);
#                                      exits non-zero when any of its checks fails
#   bash scripts/gpu_checks.sh sweep   launch/product-variant sweeps of wy_bwd, wu_fwd and the state kernels at
#                                      32K (fp64 check where one exists, each candidate run twice)  (about 6 min)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
part=${1:-}
case "$part" in tests|quick|op|cp|ncu|sweep|varlen) ;; *) echo "usage: $0 tests|quick|op|cp|ncu|sweep|varlen" >&2; exit 2 ;; esac
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
step() { echo "=== $1"; shift; timeout "$@"; echo "=== rc=$?"; }
# flash-linear-attention as a timing reference, when its wheels were carried in .whl/ (fetch them on a machine
# with PyPI: pip download --no-deps flash-linear-attention==0.6.0 fla-core==0.6.0 einops -d .whl)
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | grep -v WARNING
fi
if [ "$part" = tests ] || [ "$part" = quick ]; then
# `quick`: the summary cases of the op tests only (the op tests at 8K-32K take about 3 minutes).
if [ "$part" = "quick" ]; then op_filter=(-k summary); else op_filter=(); fi
step "determinism" 90 python bench/determinism.py --length 8192 2>&1 | tee "$OUT/determinism.log" \
  | grep -vE "^\[transformers\]"
step "gdn op tests" 330 python -m pytest tests/gpu/test_triton_gdn.py -q -s -ra -p no:cacheprovider "${op_filter[@]}" \
  2>&1 | tee "$OUT/gdn_op_tests.log"
step "cp triton tests" 240 python -m pytest tests/gpu/test_cp_triton.py -q -s -ra -p no:cacheprovider 2>&1 \
  | tee "$OUT/cp_tests.log" | grep -vE "^\[transformers\]"
exit 0
fi
if [ "$part" = op ]; then
step "op bench" 330 python bench/gdn_op.py --lengths 8192 16384 32768 65536 --no-eager --fla --json "$OUT/bench.jsonl" \
  2>&1 | tee "$OUT/op_bench.log" | grep -vE "^\[transformers\]|^\{"
step "stage times" 120 python bench/gdn_kernels.py --time prepare summary_prepared summary_s_only summary_state_fwd \
  initial_state_grad wy_bwd --length 16384 \
  2>&1 | tee "$OUT/summary_time.log" | grep -vE "^\[transformers\]"
step "long-memory accuracy" 90 python bench/long_memory_accuracy.py --lengths 8192 32768 \
  2>&1 | tee "$OUT/long_memory.log" | grep -vE "^\[transformers\]"
exit 0
fi
if [ "$part" = varlen ]; then
# Self-contained: every check's exit status is kept (each logs to $OUT/varlen_<name>.log); non-zero exit if any failed.
vfail=0
vrun() {
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  timeout "$limit" "$@" > "$OUT/varlen_$name.log" 2>&1
  local rc=$?
  grep -vE '^\[transformers\]|^\{' "$OUT/varlen_$name.log"
  echo "=== $name rc=$rc"
  if [ $rc -ne 0 ]; then vfail=$((vfail + 1)); fi
}
vrun gpu_tests 240 python -m pytest tests/gpu/test_triton_varlen.py -q -s -ra -p no:cacheprovider
if [ -d .whl/before/src ]; then  # the unpacked op before this change (git archive of the previous commit's src)
  vrun bench_before 100 env PYTHONPATH=.whl/before/src:tests python bench/gdn_op.py --lengths 8192 16384 32768 65536 \
    --no-eager --repeat 30
fi
vrun bench_after 100 python bench/gdn_op.py --lengths 8192 16384 32768 65536 --no-eager --repeat 30 \
  --json "$OUT/bench.jsonl"
vrun bench_varlen 150 python bench/gdn_op.py --varlen --fla --json "$OUT/bench.jsonl"
vrun unpacked_tests 100 python -m pytest tests/gpu/test_triton_gdn.py -q -s -ra -p no:cacheprovider \
  -k "8192 or unaligned or prepared or repeated"
echo "=== varlen: $vfail failed check(s)"
exit $((vfail > 0))
fi
if [ "$part" = sweep ]; then
# one process per kernel: an illegal memory access (some launch shapes on Triton 3.6) poisons the CUDA context
for kern in ${SWEEP_KERNELS:-wy_bwd wu_fwd tril_merge state_bwd state_fwd}; do
  step "sweep $kern" 150 python bench/gdn_kernels.py --sweep --length 32768 --kernels $kern --budget-s 75 --top 8 \
    2>&1 | tee -a "$OUT/sweep.log" | grep -vE "^\[transformers\]|illegal memory access"
done
exit 0
fi
if [ "$part" = ncu ]; then
step "ncu" 150 ncu --kernel-name regex:"wy_bwd_kernel|dqkwg_kernel|state_bwd_kernel" --launch-count 3 \
  --section SpeedOfLight --section Occupancy --section LaunchStats \
  python bench/gdn_kernels.py --time wy_bwd --length 32768 --warmup 0 --repeat 1 2>&1 | tee "$OUT/ncu.log" \
  | grep -E "_kernel|Throughput|Duration|Registers|Occupancy|Block Limit|Shared Memory Per|Waves|ERR"
exit 0
fi
step "per-rank cost" 150 python bench/cp_layer.py --per-rank-cost --cp 4 8 --global-len 32768 131072 \
  --backend triton --json "$OUT/bench.jsonl" 2>&1 | tee "$OUT/per_rank.log" | grep -vE "^\[transformers\]"
step "cp2 layer job + trace" 120 torchrun --standalone --nproc-per-node 2 bench/cp_layer.py --global-len 32768 \
  --modes ulysses p2p --backend triton --trace "$OUT/trace" --json "$OUT/bench.jsonl" 2>&1 \
  | tee "$OUT/cp2_layer.log" | grep -vE "^\[transformers\]"
step "model step" 200 python bench/model.py --layers 4 --local-len 16384 --warmup 3 --repeat 10 --json "$OUT/bench.jsonl" 2>&1 \
  | tee "$OUT/model.log" | grep -vE "^\[transformers\]"
