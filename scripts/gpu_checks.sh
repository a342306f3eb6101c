#!/usr/bin/env bash
# GPU checks and benchmarks on one H200, in parts that each fit one device call (10 minutes). Logs go to $OUT
# (or ./out).
#   bash scripts/gpu_checks.sh tests   bitwise reproducibility, Triton self-check, GPU op tests (8K-32K), CP triton
#                                      tests (about 5 min)
#   bash scripts/gpu_checks.sh quick   the same with the op tests cut to the summary cases   (about 3 minutes)
#   bash scripts/gpu_checks.sh op      op bench 8K-64K (+ FLA when its wheels are in .whl/; FLA autotunes about
#                                      a minute per length), p2p stage times, long-memory accuracy (about 6 minutes)
#   bash scripts/gpu_checks.sh cp      per-rank cost, 2-rank CP job + p2p trace, model step    (about 5 minutes)
#   bash scripts/gpu_checks.sh ncu     Nsight Compute of the three backward kernels at 32K      (about 1 minute)
#   bash scripts/gpu_checks.sh varlen  packed documents: GPU varlen tests (vs eager fp32, vs FLA varlen), unpacked op bench
#                                      8K-64K before (.whl/before/src, when carried) and after, 128K packed-row bench
#                                      ours vs FLA varlen, unpacked op regression tests at 8K (about 8 minutes);
#                                      exits non-zero when any of its checks fails
#   bash scripts/gpu_checks.sh packed  packed documents end to end: per-document attention (bf16 vs fp32, no dense mask
#                                      at 128K), CP triton layer parity on packed rows (2/4 ranks on one GPU), 128K
#                                      packed-row op bench vs FLA varlen, per-rank cost of a packed 128K row at CP4/CP8 (about 6 minutes)
#   bash scripts/gpu_checks.sh shapes  the released Qwen3.5 sizes (vocabulary 248,320): peak memory of one training step
#                                      at 4K-16K, deltacp vs transformers (+FLA when carried; it autotunes about a minute
#                                      per length), longest sequence projected, tokens/s; fails unless deltacp's step runs
#                                      a 4-layer hidden-2048 model at 32K. SIZES="9B 27B" for the large ones (each
#                                      part about 9 minutes)
#   bash scripts/gpu_checks.sh attention       full attention per-rank cost (Ulysses, KV all-gather, ring, 2-D u=2/4)
#                                      at CP8/16/32 and 128K-512K, after a bf16 flash-tile vs fp32 check (about 5 min)
#   bash scripts/gpu_checks.sh attention_long  the same at 1M tokens                      (about 6 minutes)
#   bash scripts/gpu_checks.sh tiles   attention tile kernels: GPU tests (cuDNN tiles vs fp32, varlen packed rows of 10
#                                      and 1,000 documents vs per-document SDPA, the deterministic switch), the kernel
#                                      table's measurements (bench/attention_kernels.py: fails when CUDNN_TILES is out of
#                                      date or flash under the deterministic switch is not reproducible), a 64K packed
#                                      row of 1,000 vs 10 documents (fails above 1.3x)          (about 4 minutes)
#   bash scripts/gpu_checks.sh tiles_speed  per-rank attention tiles at CP4, 16K-128K tokens per rank, all_gather and
#                                      ring, contiguous and balanced: flash on every tile vs the measured table, and,
#                                      when .whl/before_tiles/src holds the source before the table (git archive
#                                      8764f85^1 src | tar -x -C .whl/before_tiles), that source's tiles; fails below
#                                      1.5x over the source before (over flash when it is absent)  (about 5 minutes)
#   bash scripts/gpu_checks.sh layergroup  a 3 GDN + 1 attention layer group per rank (2B shapes) at CP8/16/32 and
#                                      128K/512K: contiguous vs balanced sequence layout, p2p chain vs scan, 1-D vs 2-D
#                                      (modelled links; about 6 minutes); LAYERGROUP_LONG=1: 1M tokens at CP16/32 instead
#   bash scripts/gpu_checks.sh layergroup_balanced  the balanced 1-D and 2-D (u=2) layer groups at CP16/32, 512K and 1M,
#                                      with the kernel time of each by class (about 4 minutes)
#   bash scripts/gpu_checks.sh multi   2-8 GPUs over NCCL (torchrun): layer and model parity in every mode at CP2/4/8,
#                                      full attention all_gather/ring and the 2-D layouts, 20 steps with and without
#                                      activation checkpointing, FSDP2 on
#   bash scripts/gpu_checks.sh step_ab the Qwen3.5-2B step (deltacp, full checkpointing) at 16K and 64K before and after a
#                                      change, alternating twice: .whl/before and .whl/after hold `git archive` of
#                                      the two commits' src and bench (about 6 minutes)
#   bash scripts/gpu_checks.sh step    the whole training step at cp = 1 against the public stacks (transformers + FLA
#                                      with its Hopper guard BYPASSED + gradient checkpointing, and liger-kernel's Qwen3.5
#                                      patch (RMSNorm, SwiGLU, fused linear CE) or its fused linear CE only; wheels
#                                      carried in .whl/: flash-linear-attention 0.6.0, fla-core 0.6.0, einops,
#                                      liger-kernel 0.8.5): Qwen3.5-2B at 16K and 64K, deltacp with full and selective
#                                      activation checkpointing, kernel time by class at 64K, the targets line (about 6
#                                      minutes); fails if deltacp fails (out of memory included) or the step-0 losses disagree
#   bash scripts/gpu_checks.sh step_9b    the GPU test of selective checkpointing (tests/gpu/test_selective_checkpoint_gpu.py),
#                                      then the step for the 9B shape cut to 8 layers at 64K (about 6 minutes)
#   bash scripts/gpu_checks.sh step_128k  the same for Qwen3.5-2B at 128K (about 5 minutes)
#   bash scripts/gpu_checks.sh glue    the fused glue kernels on the GPU: conv + SiLU + q/k/v, gates and gated RMSNorm,
#                                      decoder RMSNorm / add+RMSNorm / SwiGLU, the fused linear cross entropy (bf16 vs
#                                      fp32 references, determinism, no recompiles, timings vs eager; the model losses'
#                                      kernels following the GDN backend), then the loss op
#                                      against liger-kernel (wheels in .whl/) at vocab 248,320 (about 7 minutes)
#   bash scripts/gpu_checks.sh logprobs  the token log-probability op: GPU tests (bf16 vs fp32 full logits at 4K, Triton vs
#                                      torch kernels, peak memory, no_grad), then the bench at 16K / 64K vs TRL's fused head,
#                                      TRL's full-logits selective_log_softmax and a chunked checkpointed torch loop (TRL's
#                                      rows need .whl/trl-1.16.0-py3-none-any.whl, installed --no-deps), d weight accuracy
#                                      at 64K (about 5 minutes); exits non-zero when a deltacp check fails
#   bash scripts/gpu_checks.sh load    load_pretrained on one GPU (FSDP2 over one rank): every class against from_pretrained
#                                      (parameters exact, logits), a synthetic 0.8B cut to 8 layers checked the same way,
#                                      then the peak device memory and time of loading the 27B (bf16 checkpoint, loaded
#                                      as bf16 and as float32; written to /tmp or /dev/shm, deleted after); exits
#                                      non-zero when a loaded model differs (about 6 minutes)
#   bash scripts/gpu_checks.sh rl      examples/grpo_trl_cp.py on the GPUs (bf16, NCCL): CPSFTTrainer warm-up, then
#                                      CPGRPOTrainer with generation on the model outside CP (FSDP2 parameters
#                                      unsharded), at CP1 and, with 2+ GPUs, CP2 (about 3 minutes)
#   bash scripts/gpu_checks.sh heads   the Triton backend at head dims (K, V) other than 128 (K != V too): GPU tests vs
#                                      eager fp32 at 8K in three gate regimes with beta up to 2, then the op bench at
#                                      16K for those dims (+ FLA when its wheels are in .whl/; FLA autotunes about a
#                                      minute per shape: HEADS_DIMS="128,128 96,192" narrows the bench); exits
#                                      non-zero when any check fails (about 4 minutes without FLA)
#   bash scripts/gpu_checks.sh ssd     the Mamba2 (SSD) scalar-decay recurrence on Triton: GPU tests vs eager float64 (three
#                                      gate regimes, initial state, packed rows, N 128/256), the Mamba2 mixers at their
#                                      config shapes under CP2 (bf16 Triton vs fp32 eager); the bench is part ssd_op
#                                      (about 6 minutes)
#   bash scripts/gpu_checks.sh ssd_step  bench/mamba2_step.py: the Nemotron-H-8B-shaped step (8 blocks) at 16K and 64K,
#                                      deltacp against transformers + mamba_ssm's Triton SSD + liger's fused linear CE,
#                                      kernel time by class                                         (about 5 minutes)
#   bash scripts/gpu_checks.sh kda     the KDA recurrence: its GPU tests (the Triton op vs eager float64 at
#                                      Kimi-Linear's head shape, three gate regimes, rows and packed), Kimi-Linear's
#                                      mixer at its config shape under CP2 (Triton bf16 vs eager fp32), then
#                                      bench/kda_op.py against FLA's chunk_kda                     (about 5 minutes)
#   bash scripts/gpu_checks.sh kda_ncu Nsight Compute of every kernel in one fwd+bwd at 32K, deltacp's KDA and FLA's
#                                      chunk_kda: speed of light, memory workload, occupancy, launch (about 3 minutes)
#   bash scripts/gpu_checks.sh selective  Mamba1's selective scan on Triton: its GPU tests vs eager float64 (fp32 and
#                                      bf16, three gate regimes, rows and packed, entering state; one compilation
#                                      across lengths), the Mamba1 mixers (Falcon-Mamba-7B, Mamba-2.8B, Jamba,
#                                      Zamba-7B's two heads) at released shapes under CP2 (bf16 Triton vs fp32 eager), then
#                                      bench/selective_op.py at Falcon-Mamba-7B's shape (I 8192, N 16): rel-L2 vs
#                                      float64 at 2K in three regimes, fwd / fwd+bwd ms and peak memory at 8K-64K
#                                      (SELECTIVE_LENGTHS), against transformers' torch loop (at 2K) and mamba_ssm's
#                                      selective_scan_fn / _ref when importable (said when not); exits non-zero
#                                      when a check fails                                          (about 5 minutes)
#   bash scripts/gpu_checks.sh mamba1_peer  mamba_ssm 2.3.2.post1's selective_scan_fn, the public Mamba1 CUDA kernel,
#                                      compiled here for this GPU only from .whl/mamba1_peer_src.tar.gz (made by
#                                      `python bench/mamba1_peer.py pack --mamba DIR`: its sources, einops, ninja;
#                                      built in 100 s on an H100 machine, 2026-12-06; a build cut short goes on at
#                                      the next call on the same machine),
#                                      then bench/selective_op.py with its rows at 8K-64K (SELECTIVE_LENGTHS); once
#                                      built, part selective adds the same rows; exits non-zero when a check fails
#   The public kernels (FLA, FlashQLA, mamba_ssm's Triton SSD, liger-kernel, transformers 5.25) come from
#   .whl/gpu_site.tar.xz (below).
#   bash scripts/gpu_checks.sh sweep   launch/product-variant sweeps of wy_bwd, wu_fwd and the state kernels at
#                                      32K (fp64 check where one exists, each candidate run twice)  (about 6 min)
#   bash scripts/gpu_checks.sh recurrences  the op tests of every Triton recurrence against float64 / fp32 references,
#                                      4 at a time (pytest -n 4): SSD, KDA, GDN, the Triton self-check (about 3 minutes;
#                                      the Mamba2 and KDA mixers at their config shapes are part `families`)
#   bash scripts/gpu_checks.sh indexed  indexed sparse attention (Qwen4-Exp's QSA layers): the Triton selected
#                                      attention vs a fp32 dense reference (bf16, 8K, row and packed; reproducible
#                                      bitwise), one compilation across lengths, the tiny Qwen4-Exp at CP2 on the GPU
#                                      vs transformers fp32, then
#                                      bench/selected_attention.py vs transformers' SDPA with its dense mask and causal
#                                      SDPA, 8K-64K (about 5 minutes)
#   bash scripts/gpu_checks.sh glm     GLM-5.3-Flash's indexed layers (its absorbed MLA: head dim 512, the wide
#                                      launches' blocks of 16 query heads): the selected attention at its shape vs a
#                                      fp32 dense reference (bf16, 4K, row and packed; reproducible bitwise), one
#                                      compilation across lengths (both shapes), the tiny GLM-5.3-Flash (latents 512
#                                      and 16) at CP2 on the GPU vs transformers fp32, then bench/selected_attention.py
#                                      --shape glm at 4K-32K with the wide launch and GLM_LAUNCH's others (warps,
#                                      stages, rows) (about 2 minutes with the column-block kernels, 2026-12-06)
#   bash scripts/gpu_checks.sh ssd_sweep  bench/launch_sweep.py --op ssd at 32K (SWEEP_BUDGET s), then the SSD GPU
#                                      tests and the ssd_op timings (32K, the peers beside) on its proposed table,
#                                      written to $OUT/ssd_launch.json (the peers compile and autotune first: about
#                                      2 minutes of the bench on a cold machine, 2026-12-06)       (about 9 minutes)
#   bash scripts/gpu_checks.sh kda_sweep  the KDA launch sweep at 32K (KDA_SWEEP_KERNELS), then the bf16 GPU tests and
#                                      the bench against FLA's chunk_kda on its proposal, written to
#                                      $OUT/kda_launch.json                                        (about 9 minutes)
#   bash scripts/gpu_checks.sh kda_prec  KDA's WY and state kernels with one tf32 pass (COMPOUND_PREC and
#                                      STATE_PREC 0) against the source's three: kda_op accuracy and 32K time of
#                                      each, then the bf16 KDA GPU tests on it                     (about 6 minutes)
#   bash scripts/gpu_checks.sh kda_ab  KDA's switchable module constants (KDA_AB="NAME=VALUE[,NAME=VALUE] ..." or
#                                      launch_sweep.py --apply table files t.json; default DECAYED and INVERSE at 0
#                                      together and each) each against the source in the same call: the op's GPU
#                                      tests with each, then fwd / fwd+bwd ms, peak memory and kernel time by class
#                                      at KDA_LENGTHS (32K), no accuracy rows (about 2 minutes a variant)
#   bash scripts/gpu_checks.sh selective_ab  variants of the selective scan (SELECTIVE_AB="NAME=VALUE[,...] ..." or
#                                      table files t.json, no default) against the source in the same call: the
#                                      op's GPU tests with each, then fwd / fwd+bwd ms, accuracy and kernel time by
#                                      class at SELECTIVE_LENGTHS (8K, 32K), no peers (about 1 minute a variant);
#                                      e.g. SELECTIVE_AB="bench/variants/t.json"
#   bash scripts/gpu_checks.sh selective_ncu  Nsight Compute of chunk_bwd at 32K: its warps' stall reasons and the
#                                      source lines they stall on, occupancy, launch, memory (about 2 minutes)
#   bash scripts/gpu_checks.sh ssd_op  bench/ssd_op.py: rel-L2 vs float64 at 4K in three gate regimes, fwd / fwd+bwd ms and
#                                      peak memory at 8K-64K (SSD_LENGTHS), ours vs mamba_ssm c128/c256 and FLA's
#                                      simple_gla (refused by FLA 0.6.0 on Hopper with Triton 3.6 unless
#                                      SSD_FLA_BYPASS=1: timed past its guard, its rel-L2 printed; its autotuning
#                                      adds about a minute a length), one shape (SSD_SHAPES) per call; kda_op:
#                                      bench/kda_op.py alone (ours vs FLA chunk_kda)          (about 4 minutes each)
#   bash scripts/gpu_checks.sh gdn_peers  bench/gdn_peers.py: our GDN op against FLA's Triton GDN and FlashQLA
#                                      (auto_cp False and True) at 8K-64K, Qwen3.5-2B's 16 heads, rel-L2 vs float64
#                                      in three gate regimes, kernel time at 32K (about 8 minutes, FlashQLA's compile
#                                      included); gdn_peers_32h: 32 value heads, timings only (about 2 minutes with
#                                      FlashQLA's kernels cached; its compile alone took over 8 on a fresh H100, so
#                                      a fresh machine may need the part twice)
#   bash scripts/gpu_checks.sh gdn_fill  the GDN op's and packed rows' GPU tests, then the op with the state kernels'
#                                      one-wave rule and without (bench/gdn_peers.py --no-peers [--no-fill]),
#                                      alternating twice, at GDN_HEADS (16) heads and GDN_LENGTHS (8K, 32K, 64K),
#                                      kernel time by class at 32K (about 6 minutes)
#   bash scripts/gpu_checks.sh gdn_split  bench/gdn_split.py: the cost model of an exact intra-device split of GDN
#                                      (the op on P segments as P rows, the summary pass it would add) (about 1 minute)
# Several parts in one call run one after the other: `bash scripts/gpu_checks.sh recurrences ssd kda`.
# The public kernels (FLA, FlashQLA and TileLang, liger-kernel, mamba_ssm's Triton SSD, and transformers 5.25 with the
# huggingface_hub it needs) come as one archive, .whl/gpu_site.tar.xz (scripts/gpu_site.sh builds it on a machine
# with PyPI), unpacked once per machine into /tmp/gpu_site and put first on PYTHONPATH.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PARTS="tests|quick|step_ab|families|heads|recurrences|selective|mamba1_peer|ssd|ssd_sweep|ssd_op|ssd_step|kda|kda_op|kda_sweep|kda_prec|kda_ab|kda_ncu|selective_ab|selective_ncu|gdn_peers|gdn_peers_32h|gdn_fill|gdn_split|indexed|glm|op|cp|ncu|sweep|varlen|packed|shapes|multi|attention|attention_long|layergroup|layergroup_balanced|step|step_9b|step_128k|glue|logprobs|tiles|tiles_speed|load|rl"
if [ $# -eq 0 ]; then
  echo "usage: $0 PART [PART...], PART one of $PARTS" >&2
  exit 2
fi
for part in "$@"; do
  if ! [[ "|$PARTS|" == *"|$part|"* ]]; then
    echo "unknown part '$part'; usage: $0 PART [PART...], PART one of $PARTS" >&2
    exit 2
  fi
done
export PYTHONPATH=src:tests PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
# Every check runs through `check NAME LIMIT_S CMD...`: its output goes to $OUT/NAME.log (shown without
# transformers' fallback notices and JSON rows), its exit status is kept, and the part exits non-zero naming
# every check that failed or timed out. No part can pass a failed check.
failed=()
check() {
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -vE '^\[transformers\]|^\{' "$OUT/$name.log"
  echo "=== $name rc=$rc"
  [ $rc -eq 0 ] || failed+=("$name (rc=$rc$([ $rc -eq 124 ] && echo ', timed out'))")
}
finish() {
  if [ ${#failed[@]} -gt 0 ]; then
    echo "=== parts '$*': ${#failed[@]} check(s) FAILED:"; printf '  - %s\n' "${failed[@]}"; exit 1
  fi
  echo "=== parts '$*': all checks passed"; exit 0
}
# The source against variants of an op's module constants (`bench/launch_sweep.py --apply`), each in a process of
# its own: `ab_variants OP "NAME=VALUE[,NAME=VALUE] ..." TESTS BENCH ARGS...` runs the bench on the source, then per
# variant (its constants set together) the op's GPU tests (TESTS; - for none) and the bench with it, the bench rows
# in $OUT/OP_ab.jsonl.
ab_variants() {
  local op=$1 variants=$2 tests=$3 v tag
  shift 3
  BENCH_VARIANT=source check "${op}_ab_source" 150 python "$@" --json "$OUT/${op}_ab.jsonl"
  for v in $variants; do
    if [[ $v == *.json ]]; then  # a table file (launch entries and module constants, launch_sweep.py --apply's form)
      tag=$(basename "$v" .json)
      cp "$v" "$OUT/${op}_ab_$tag.json" || { failed+=("${op}_ab_$tag (no file $v)"); continue; }
    else
      tag=${v//[=,]/_}
      python -c "import json, sys; print(json.dumps({k: int(x) for k, x in (p.split('=') for p in sys.argv[1].split(','))}))" \
        "$v" > "$OUT/${op}_ab_$tag.json"
    fi
    if [ "$tests" != - ]; then
      check "${op}_ab_tests_$tag" 150 python bench/launch_sweep.py --op "$op" --apply "$OUT/${op}_ab_$tag.json" -- \
        -q -rA -p no:cacheprovider "$tests"
    fi
    BENCH_VARIANT=$tag check "${op}_ab_$tag" 150 python bench/launch_sweep.py --op "$op" --apply \
      "$OUT/${op}_ab_$tag.json" -- "$@" --json "$OUT/${op}_ab.jsonl"
  done
  # one line per variant and length (the rows carry their variant: bench/timing.py's BENCH_VARIANT)
  python - "$OUT/${op}_ab.jsonl" <<'PY' || true
import json, sys
print(f"{'variant':<28} {'T':>6} {'fwd ms':>8} {'fwd+bwd ms':>11} {'peak GiB':>9}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "fwd_bwd_ms" in r:
        print(f"{r.get('variant', '?'):<28} {r['T']:>6} {r['fwd_ms']:>8.2f} {r['fwd_bwd_ms']:>11.2f} {r['peak_gib']:>9.2f}")
PY
}
# The public kernels for the comparisons, when .whl/gpu_site.tar.xz was carried: unpacked once per machine, first on
# PYTHONPATH (its transformers shadows the machine's). No hub downloads: the machine reaches nothing.
peers_env() {
  if [ -f .whl/gpu_site.tar.xz ] && [ ! -f /tmp/gpu_site/.unpacked ]; then
    mkdir -p /tmp/gpu_site && tar -xJf .whl/gpu_site.tar.xz -C /tmp/gpu_site && touch /tmp/gpu_site/.unpacked
  fi
  if [ -f /tmp/gpu_site/.unpacked ]; then
    export PYTHONPATH="/tmp/gpu_site/site312:/tmp/gpu_site/mamba_ssm_triton:src:tests"
    # mamba_ssm's selective-scan CUDA extension, once part mamba1_peer has built it on this machine
    [ -f /tmp/mamba1_peer/.built ] && export PYTHONPATH="/tmp/mamba1_peer:$PYTHONPATH"
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 USE_HUB_KERNELS=NO
    CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
    export CUDA_HOME
    python -c "import transformers, fla, flash_qla, mamba_ssm, liger_kernel; print('peers: transformers', \
transformers.__version__, 'fla', fla.__version__, 'flash_qla', flash_qla.__version__, 'mamba_ssm', \
mamba_ssm.__version__)" 2>&1 | tail -3 | tee -a "$OUT/device.txt"
  else
    echo "peers: .whl/gpu_site.tar.xz not carried: no public kernels to compare with" | tee -a "$OUT/device.txt"
  fi
}
# flash-linear-attention as a timing reference, when its wheels were carried in .whl/ (fetch them on a machine
# with PyPI: pip download --no-deps flash-linear-attention==0.6.0 fla-core==0.6.0 einops liger-kernel==0.8.5 -d .whl)
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | grep -v WARNING
fi
run_part() {
local part=$1
case "$part" in
tests|quick)
  # `quick`: the summary cases of the op tests only (the op tests at 8K-32K take about 3 minutes).
  if [ "$part" = "quick" ]; then op_filter=(-k summary); else op_filter=(); fi
  check determinism 90 python bench/determinism.py --length 8192
  check triton_selfcheck 90 python -m pytest tests/gpu/test_triton_selfcheck_gpu.py -q -s -ra -p no:cacheprovider
  check gdn_op_tests 330 python -m pytest tests/gpu/test_triton_gdn.py -q -s -ra -p no:cacheprovider "${op_filter[@]}"
  check cp_tests 240 python -m pytest tests/gpu/test_cp_triton.py -q -s -ra -p no:cacheprovider -k "not packed"
  ;;
glue)
  for t in fused_conv fused_gdn_glue fused_decoder linear_ce; do
    check "$t" 150 python -m pytest "tests/gpu/test_${t}_gpu.py" -q -s -ra -p no:cacheprovider
  done
  check loss_op 150 python bench/loss_op.py --tokens 16384 65536 --hidden 2048 --json "$OUT/loss_op.jsonl"
  ;;
logprobs)
  # TRL as a reference (trl.kernels imports only torch and transformers): pip download --no-deps trl==1.16.0 -d .whl
  if ls .whl/trl-*.whl >/dev/null 2>&1; then
    python -m pip install -q --no-deps --no-index .whl/trl-*.whl 2>&1 | grep -v WARNING
  fi
  check token_logprobs_tests 150 python -m pytest tests/gpu/test_token_logprobs_gpu.py -q -s -ra -p no:cacheprovider
  check logprobs_op 400 python bench/logprobs_op.py --tokens 16384 65536 --hidden 2048 --json "$OUT/logprobs_op.jsonl"
  ;;
step_ab)
  # the Qwen3.5-2B step at 16K and 64K before and after a change, alternating on one machine (deltacp, p2p, Triton,
  # full checkpointing): .whl/before and .whl/after each hold `git archive <commit> src bench` (untar'd)
  for side in before after before after; do
    check "step_$side" 240 env PYTHONPATH=.whl/$side/src:tests python .whl/$side/bench/step.py --size 2B \
      --lengths 16384 65536 --stacks deltacp --ac full --warmup 1 --repeat 3 --json "$OUT/step_ab_$side.jsonl"
  done
  ;;
step)
  # Qwen3.5-2B at 16K and 64K: liger, flce, deltacp full and selective; kernel classes at 64K (FLA autotunes each
  # new length first, about a minute)
  check step_2B 540 python bench/step.py --size 2B --lengths 16384 65536 --ac full selective --warmup 1 --repeat 2 \
    --profile --profile-at 65536 --json "$OUT/step.jsonl"
  ;;
step_9b)
  # selective checkpointing on CUDA (attention kernels once, the same gradients), then the 9B shape cut to 8 layers
  # at 64K
  check selective_gpu 150 python -m pytest tests/gpu/test_selective_checkpoint_gpu.py -q -s -ra -p no:cacheprovider
  check step_9B 400 python bench/step.py --size 9B --layers 8 --lengths 65536 --ac full selective --warmup 1 \
    --repeat 2 --json "$OUT/step.jsonl"
  ;;
step_128k)
  # Qwen3.5-2B at 128K, every stack (a public stack that does not fit is reported as OOM; deltacp must fit)
  check step_2B_128K 480 python bench/step.py --size 2B --lengths 131072 --ac full selective --warmup 1 --repeat 2 \
    --json "$OUT/step.jsonl"
  ;;
load)
  check load_classes 90 python -m pytest tests/gpu/test_load_pretrained_gpu.py -q -s -ra -p no:cacheprovider
  check load_check 150 python bench/load.py --gpu --size 0.8B --layers 8 --check --cleanup --json "$OUT/load.jsonl"
  check load_27b 330 python bench/load.py --gpu --size 27B --dtype bfloat16 float32 --cleanup --json "$OUT/load.jsonl"
  ;;
families)
  # the Triton backend on each family's GDN layer at its released head shapes (CP2 sharing the GPU)
  check family_shapes 420 python -m pytest tests/gpu/test_family_gdn_shapes_gpu.py -q -s -ra -p no:cacheprovider
  ;;
recurrences)
  # the op tests side by side (4 at a time: 8 ran an H100 out of memory, 2026-12-06); the tests that spawn ranks
  # (released family shapes, CP layer parity) are parts `families` and `tests`. -v: each verdict as it ends (a check
  # stopped at its limit still shows which ran); -rA: the rel-L2 figures the tests print
  check recurrence_tests 300 python -m pytest -n 4 -v -rA -p no:cacheprovider tests/gpu/test_ssd_triton_gpu.py \
    tests/gpu/test_kda_triton_gpu.py tests/gpu/test_triton_selfcheck_gpu.py tests/gpu/test_triton_gdn.py
  ;;
kda)
  check kda_tests 300 python -m pytest tests/gpu/test_kda_triton_gpu.py -q -s -ra -p no:cacheprovider
  check kda_shapes 240 python -m pytest tests/gpu/test_family_gdn_shapes_gpu.py -q -s -ra -p no:cacheprovider -k Kimi
  # shellcheck disable=SC2086  (KDA_LENGTHS: a list of lengths)
  check kda_op 420 python bench/kda_op.py --lengths ${KDA_LENGTHS:-8192 16384 32768 65536} --profile 32768 \
    --json "$OUT/kda_op.jsonl"
  ;;
selective)
  # limits sum to 540 s: with the archive unpacked first, the part reports inside one 10-minute device call (on an
  # H100, 2026-12-06: the tests 16 s, the mixers 61-71 s; the bench's deltacp rows about 60 s)
  check selective_tests 100 python -m pytest tests/gpu/test_selective_triton_gpu.py -q -s -ra -p no:cacheprovider
  check mamba1_shapes 200 python -m pytest tests/gpu/test_family_gdn_shapes_gpu.py -q -s -ra -p no:cacheprovider \
    -k "Mamba or Jamba or (Zamba and not Zamba2)"
  # shellcheck disable=SC2086  (SELECTIVE_LENGTHS: a list of lengths)
  check selective_op 240 python bench/selective_op.py --lengths ${SELECTIVE_LENGTHS:-8192 16384 32768 65536} \
    --profile 32768 --json "$OUT/selective_op.jsonl"
  ;;
mamba1_peer)
  # mamba_ssm's selective_scan_fn (CUDA) built on this machine from .whl/mamba1_peer_src.tar.gz (bench/mamba1_peer.py
  # pack), once: a build cut short by its limit goes on at the next call; then the op bench with its rows
  check mamba1_peer_build 400 python bench/mamba1_peer.py build --dest /tmp/mamba1_peer
  if [ -f /tmp/mamba1_peer/.built ]; then
    export PYTHONPATH="/tmp/mamba1_peer:$PYTHONPATH"
    # shellcheck disable=SC2086  (SELECTIVE_LENGTHS: a list of lengths)
    check selective_op 180 python bench/selective_op.py --lengths ${SELECTIVE_LENGTHS:-8192 32768 65536} \
      --profile 32768 --json "$OUT/selective_op.jsonl"
  fi
  ;;
ssd)
  # (the bench is part ssd_op: both do not fit one call)
  check ssd_tests 240 python -m pytest tests/gpu/test_ssd_triton_gpu.py -q -s -ra -p no:cacheprovider
  check mamba2_shapes 240 python -m pytest tests/gpu/test_family_gdn_shapes_gpu.py -q -s -ra -p no:cacheprovider \
    -k "Bamba or Nemotron or Granite"
  ;;
ssd_sweep)
  # the SSD launch sweep at 32K (Nemotron-H-8B's shape), then the op's bf16 GPU tests (the sweep changes only the bf16
  # launches; in this process: xdist's workers would not see the proposal) and its bench (timings, the peers in the
  # same process; accuracy is the tests') on the proposed table; the table changes in the source only after this part
  # passes
  # SSD_SWEEP_SHAPE (bench/ssd_op.py's SHAPES): another state size than Nemotron-H's sweeps its own <name>/n<N> entries
  shape=${SSD_SWEEP_SHAPE:-nemotron-h-8b}
  check ssd_sweep 230 python bench/launch_sweep.py --op ssd --shape "$shape" --length 32768 \
    --budget "${SWEEP_BUDGET:-90}" --table-out "$OUT/ssd_launch.json" --json "$OUT/ssd_sweep.jsonl"
  if [ -f "$OUT/ssd_launch.json" ]; then
    check ssd_tests_swept 100 python bench/launch_sweep.py --op ssd --apply "$OUT/ssd_launch.json" -- -q -rA -k bf16 \
      -p no:cacheprovider tests/gpu/test_ssd_triton_gpu.py
    # shellcheck disable=SC2086
    check ssd_op_swept 240 python bench/launch_sweep.py --op ssd --apply "$OUT/ssd_launch.json" -- bench/ssd_op.py \
      --lengths ${SSD_LENGTHS:-32768} --shapes "$shape" --regimes --profile 32768 --json "$OUT/ssd_op.jsonl"
  fi
  ;;
kda_sweep)
  # the KDA launch sweep at 32K (Kimi-Linear's 32 heads of 128, bf16; KDA_SWEEP_KERNELS, default the state and output
  # kernels and wy_fwd), then the op's bf16 GPU tests and its bench against FLA's chunk_kda (KDA_LENGTHS, default
  # 8K and 32K) on the proposed table; the table changes in the source only after this part passes
  # shellcheck disable=SC2086  (KDA_SWEEP_KERNELS: a list)
  check kda_sweep 260 python bench/launch_sweep.py --op kda --length 32768 \
    --kernels ${KDA_SWEEP_KERNELS:-state_fwd state_bwd out_fwd wy_fwd} --budget "${SWEEP_BUDGET:-200}" \
    --table-out "$OUT/kda_launch.json" --json "$OUT/kda_sweep.jsonl"
  if [ -f "$OUT/kda_launch.json" ]; then
    check kda_tests_swept 120 python bench/launch_sweep.py --op kda --apply "$OUT/kda_launch.json" -- -q -rA -k bf16 \
      -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py
    # shellcheck disable=SC2086
    check kda_op_swept 240 python bench/launch_sweep.py --op kda --apply "$OUT/kda_launch.json" -- bench/kda_op.py \
      --lengths ${KDA_LENGTHS:-8192 32768} --regimes --profile 32768 --json "$OUT/kda_op.jsonl"
  fi
  ;;
kda_prec)
  # the compounding KDA kernels (WY, state) with one tf32 pass instead of three under bf16 inputs
  # (kernels.COMPOUND_PREC and STATE_PREC 0): its accuracy against float64 in three regimes (the source's is in
  # NOTES.md) and the time of each beside the other in the same call; then (KDA_PREC_TESTS=1, the default) the op's bf16 GPU tests on it
  # (in this process: xdist's workers would not see it)
  echo '{"COMPOUND_PREC": 0, "STATE_PREC": 0}' > "$OUT/kda_prec0.json"
  # shellcheck disable=SC2086
  check kda_op_prec_source 90 python bench/kda_op.py --no-peers --regimes --lengths ${KDA_LENGTHS:-32768} \
    --json "$OUT/kda_prec.jsonl"
  # shellcheck disable=SC2086
  check kda_op_prec0 180 python bench/launch_sweep.py --op kda --apply "$OUT/kda_prec0.json" -- bench/kda_op.py \
    --no-peers --lengths ${KDA_LENGTHS:-32768} --json "$OUT/kda_prec.jsonl"
  if [ "${KDA_PREC_TESTS:-1}" = 1 ]; then
    check kda_tests_prec0 120 python bench/launch_sweep.py --op kda --apply "$OUT/kda_prec0.json" -- -q -rA -k bf16 \
      -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py
  fi
  ;;
kda_ab)
  # the source's table and switches, then one variant each (KDA_AB, default the tree before the decayed operands and
  # the narrow inverse, and each of the two alone turned off), each with the op's GPU tests first, then its kernel
  # time by class at 32K
  # shellcheck disable=SC2086
  ab_variants kda "${KDA_AB:-DECAYED=0,INVERSE=0 DECAYED=0 INVERSE=0}" tests/gpu/test_kda_triton_gpu.py \
    bench/kda_op.py --no-peers --regimes --lengths ${KDA_LENGTHS:-32768} --profile 32768
  ;;
selective_ab)
  # variants of the selective scan (SELECTIVE_AB: NAME=VALUE[,...] module constants or launch_sweep.py --apply table
  # files, space-separated; no default since CHUNK_BWD_CHANNELS_FIRST left the source): the op's GPU tests with each,
  # then its bench (accuracy at 2K in three regimes, fwd / fwd+bwd at SELECTIVE_LENGTHS, kernel time by class at 32K)
  # beside the source's
  if [ -z "${SELECTIVE_AB:-}" ]; then
    echo "selective_ab: set SELECTIVE_AB to the variants, e.g. SELECTIVE_AB=\"bench/variants/t.json\"" >&2
    failed+=("selective_ab (SELECTIVE_AB unset)")
  else
    # shellcheck disable=SC2086
    ab_variants selective "$SELECTIVE_AB" tests/gpu/test_selective_triton_gpu.py \
      bench/selective_op.py --no-peers --torch-lengths --lengths ${SELECTIVE_LENGTHS:-8192 32768} --profile 32768
  fi
  ;;
selective_ncu)
  # Falcon-Mamba-7B's shape, bf16; the first chunk_bwd launch (after its compile), timing only
  check selective_ncu 300 ncu -k regex:sel_chunk_bwd --launch-count 1 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
    python bench/selective_op.py --no-peers --lengths 32768 --torch-lengths --regimes --repeat 1
  ;;
ssd_op|kda_op)
  # the benches alone (the tests in `recurrences`); accuracy at 4K (the float64 reference at 128 heads is the slow
  # part: 3 regimes x 2 shapes at 8K did not finish in 200 s on an H100, 2026-12-06)
  # shellcheck disable=SC2086
  # one shape per call (Nemotron-H-8B's took about 5 minutes, 2026-12-06): SSD_SHAPES=h128-g1-n256 for another
  [ "$part" = ssd_op ] && check ssd_op 540 python bench/ssd_op.py --lengths ${SSD_LENGTHS:-8192 16384 32768 65536} \
    --shapes ${SSD_SHAPES:-nemotron-h-8b} --accuracy-length 4096 --profile 32768 \
    ${SSD_FLA_BYPASS:+--fla-bypass-hopper-guard} --json "$OUT/ssd_op.jsonl"
  # shellcheck disable=SC2086
  # (FLA's chunk_kda autotunes about a minute a new length: 240 s did not reach its 32K row after 8K, 2026-12-07)
  [ "$part" = kda_op ] && check kda_op 540 python bench/kda_op.py --lengths ${KDA_LENGTHS:-8192 16384 32768 65536} \
    --profile 32768 --json "$OUT/kda_op.jsonl"
  ;;
ssd_step)
  check mamba2_step 540 python bench/mamba2_step.py --lengths 16384 65536 --profile --json "$OUT/mamba2_step.jsonl"
  ;;
gdn_peers)
  # FlashQLA's TileLang kernels compile on first use: about 2.5 minutes on an H100 (2026-12-06), kept in
  # ~/.tilelang/cache while the machine stays warm
  # (16 heads: about 7.5 minutes with the compile, 2026-12-06; 32 value heads compile anew: a call of its own)
  check gdn_peers_16h 480 python bench/gdn_peers.py --hk 16 --hv 16 --lengths 8192 16384 32768 65536 \
    --accuracy-length 8192 --profile 32768 --json "$OUT/gdn_peers.jsonl"
  ;;
gdn_fill)
  # the state kernels' one-wave rule (launch.fill_bv) at GDN_HEADS heads (default 16, Qwen3.5-2B's): the GDN op's
  # GPU tests, then deltacp's op with the rule and without (--no-fill), alternating twice (one process each; the
  # first of each profiled by kernel class at 32K), no peers (their compile is gdn_peers' part); the rows carry
  # fill_on / fill_off (BENCH_VARIANT). The op's tests in 4 processes; the packed-row tests alone (at 32K each holds
  # about 20 GiB: four of them beside the op's ran out of the H100's 80 GB on 2026-12-07)
  check gdn_fill_tests 300 python -m pytest -n 4 -q -rA -p no:cacheprovider tests/gpu/test_triton_gdn.py
  check gdn_fill_varlen_tests 240 python -m pytest -q -rA -p no:cacheprovider tests/gpu/test_triton_varlen_gpu.py
  for round in 1 2; do
    for fill in on off; do
      # shellcheck disable=SC2046  (--no-fill, --profile or nothing)
      BENCH_VARIANT=fill_$fill check "gdn_fill_${fill}_$round" 200 python bench/gdn_peers.py --no-peers \
        --hk "${GDN_HEADS:-16}" --hv "${GDN_HEADS:-16}" --lengths ${GDN_LENGTHS:-8192 32768 65536} \
        --accuracy-length 4096 $([ $round = 1 ] && echo --profile 32768) $([ $fill = off ] && echo --no-fill) \
        --json "$OUT/gdn_fill.jsonl"
    done
  done
  ;;
indexed)
  check indexed_tests 300 python -m pytest tests/gpu/test_selected_attention_gpu.py tests/gpu/test_qwen4_exp_gpu.py -q -s \
    -ra -p no:cacheprovider -k "not glm"
  check indexed_op 300 python bench/selected_attention.py --lengths ${INDEXED_LENGTHS:-8192 16384 32768 65536} \
    --json "$OUT/selected_attention.jsonl"
  ;;
glm)
  check glm_tests 300 python -m pytest tests/gpu/test_selected_attention_gpu.py tests/gpu/test_glm5_next_gpu.py -q -s \
    -ra -p no:cacheprovider -k "glm or compilation"
  # shellcheck disable=SC2086  (GLM_LENGTHS, GLM_LAUNCH: lists)
  check glm_op 300 python bench/selected_attention.py --shape glm --block 16 --top 128 \
    --lengths ${GLM_LENGTHS:-4096 16384 32768} --sdpa-mask-max 16384 --json "$OUT/selected_attention_glm.jsonl" \
    --launch ${GLM_LAUNCH:-4,2,16 8,1,16 8,2,32}
  ;;
gdn_peers_32h)
  # 2026-12-07 on a fresh H100: cut off at 480 s inside FlashQLA's compile; 110 s in the next call (~/.tilelang/cache)
  check gdn_peers_32h 570 python bench/gdn_peers.py --hk 16 --hv 32 --lengths 8192 32768 65536 --regimes \
    --json "$OUT/gdn_peers.jsonl"
  ;;
gdn_split)
  check gdn_split 240 python bench/gdn_split.py --heads 16 32 --lengths 32768 65536 --splits 1 2 4 8 16 \
    --json "$OUT/gdn_split.jsonl"
  ;;
heads)
  fla=(); ls .whl/fla_core-*.whl >/dev/null 2>&1 && fla=(--fla)
  check head_dims_tests 330 python -m pytest tests/gpu/test_triton_head_dims_gpu.py -q -s -ra -p no:cacheprovider
  dims=${HEADS_DIMS:-128,128 64,64 96,192 128,256 192,96 256,256 64,128}
  # shellcheck disable=SC2086  (dims: a list of K,V words)
  check head_dims_bench 240 python bench/gdn_op.py --dims $dims --lengths 16384 --hk 16 --no-eager "${fla[@]}" \
    --json "$OUT/bench.jsonl"
  ;;
op)
  check op_bench 330 python bench/gdn_op.py --lengths 8192 16384 32768 65536 --no-eager --fla --json "$OUT/bench.jsonl"
  check stage_times 120 python bench/gdn_kernels.py --time prepare summary_prepared summary_s_only summary_state_fwd \
    initial_state_grad wy_bwd --length 16384
  check long_memory 90 python bench/long_memory_accuracy.py --lengths 8192 32768
  ;;
shapes)
  check vocab_32k 120 python bench/real_shapes.py --sizes 2B --layers 4 --lengths 32768 --repeat 3 --impls deltacp --no-fla \
    --require-deltacp --verify-budget-s 0 --json "$OUT/shapes.jsonl"
  check real_shapes 450 python bench/real_shapes.py --sizes ${SIZES:-0.8B 2B 4B} --json "$OUT/shapes.jsonl"
  ;;
varlen)
  check varlen_gpu_tests 240 python -m pytest tests/gpu/test_triton_varlen_gpu.py -q -s -ra -p no:cacheprovider
  if [ -d .whl/before/src ]; then  # the unpacked op before a change (git archive of an earlier commit's src)
    check bench_before 100 env PYTHONPATH=.whl/before/src:tests python bench/gdn_op.py \
      --lengths 8192 16384 32768 65536 --no-eager --repeat 30
  fi
  check bench_after 100 python bench/gdn_op.py --lengths 8192 16384 32768 65536 --no-eager --repeat 30 \
    --json "$OUT/bench.jsonl"
  check bench_varlen 150 python bench/gdn_op.py --varlen --fla --json "$OUT/bench.jsonl"
  check unpacked_tests 100 python -m pytest tests/gpu/test_triton_gdn.py -q -s -ra -p no:cacheprovider \
    -k "8192 or unaligned or prepared or repeated"
  ;;
packed)
  # limits sum to 570 s (one device call); 2026-12-03: 21 s, 92 s, 53 s measured, the bench with FLA about 200 s
  # (FLA autotunes at 128K; estimated from its call's total)
  check document_attention 60 python -m pytest tests/gpu/test_document_attention.py -q -s -ra -p no:cacheprovider
  check cp_packed 150 python -m pytest tests/gpu/test_cp_triton.py -q -s -ra -p no:cacheprovider -k packed
  check bench_varlen 240 python bench/gdn_op.py --varlen --fla --json "$OUT/bench.jsonl"
  check per_rank_packed 120 python bench/cp_layer.py --per-rank-cost --packed --cp 4 8 --global-len 131072 \
    --backend triton --json "$OUT/bench.jsonl"
  ;;
multi)
  ngpu=$(nvidia-smi -L | wc -l)
  if [ "$ngpu" -lt 2 ]; then echo "multi needs 2-8 GPUs, found $ngpu"; exit 2; fi
  for cp in 2 4 8; do
    [ "$cp" -le "$ngpu" ] || continue
    check "multi_cp$cp" 300 torchrun --standalone --nproc-per-node "$cp" tests/gpu/multi_gpu_checks.py --steps 20
  done
  ;;
rl)
  # the example's last line is the table: the right-sum rate at the first and last logged GRPO steps
  ngpu=$(nvidia-smi -L | wc -l)
  for cp in 1 2; do
    [ "$cp" -le "$ngpu" ] || { echo "=== grpo_cp$cp skipped: $ngpu GPU(s)"; continue; }
    check "grpo_cp$cp" 280 torchrun --standalone --nproc-per-node "$cp" examples/grpo_trl_cp.py --cp "$cp" \
      --sft-steps 20 --steps 30 --out "$OUT/grpo_cp$cp" --overwrite
  done
  ;;
attention)
  check attention_per_rank 560 python bench/attention_cp.py --per-rank-cost --cp 8 16 32 \
    --global-len 131072 262144 524288 --json "$OUT/bench.jsonl"
  ;;
layergroup)
  if [ -n "${LAYERGROUP_LONG:-}" ]; then
    check layer_group_1m 590 python bench/layer_group.py --cp 16 32 --global-len 1048576 --json "$OUT/bench.jsonl"
  else
    check layer_group 590 python bench/layer_group.py --cp 8 16 32 --global-len 131072 524288 --json "$OUT/bench.jsonl"
  fi
  ;;
layergroup_balanced)
  check layer_group_balanced 590 python bench/layer_group.py --cp 16 32 --global-len 524288 1048576 \
    --configs "balanced 1-D" "balanced 2-D u=2" --profile --json "$OUT/bench.jsonl"
  ;;
tiles)
  check attention_kernel_tests 150 python -m pytest tests/gpu/test_attention_kernels_gpu.py \
    tests/gpu/test_document_attention.py -q -s -ra -p no:cacheprovider
  check attention_kernels 180 python bench/attention_kernels.py --json "$OUT/bench.jsonl"
  check packed_docs 120 python bench/attention_cp.py --packed-docs --json "$OUT/bench.jsonl"
  ;;
tiles_speed)
  before=()
  [ -d .whl/before_tiles/src ] && before=(--tiles-before .whl/before_tiles)
  check tiles_speedup 560 python bench/attention_cp.py --tiles --warmup 1 --repeat 2 "${before[@]}" \
    --json "$OUT/bench.jsonl"
  ;;
attention_long)
  check attention_per_rank_1m 580 python bench/attention_cp.py --per-rank-cost --cp 8 16 32 --global-len 1048576 \
    --warmup 1 --repeat 2 --json "$OUT/bench.jsonl"
  ;;
sweep)
  # one process per kernel: an illegal memory access (some launch shapes on Triton 3.6) poisons the CUDA context;
  # SWEEP_HEADS: the key and value heads (default 32, the table's shape; 16 is Qwen3.5-2B's, where the state kernels
  # run half the programs)
  for kern in ${SWEEP_KERNELS:-wy_bwd wu_fwd tril_merge state_bwd state_fwd}; do
    check "sweep_$kern" 150 python bench/gdn_kernels.py --sweep --length 32768 --kernels $kern --budget-s 75 --top 8 \
      --hk "${SWEEP_HEADS:-32}" --hv "${SWEEP_HEADS:-32}"
  done
  ;;
kda_ncu)
  # Nsight Compute of every KDA kernel in one fwd + bwd at 32K (Kimi-Linear's 32 heads of 128, bf16; timing only):
  # throughput against the device's peaks, occupancy, launch (registers, shared memory, spilling requests); deltacp's
  # op and FLA's chunk_kda (when the site was carried) in two processes (2026-12-07: one process with both ran past
  # 240 s at FLA's first kernels; each stack's launches alone, picked by a name filter or a launch skip, about 30 s)
  for stack in no-peers peers-only; do
    check "kda_ncu_$stack" 240 ncu --profile-from-start off --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section MemoryWorkloadAnalysis python bench/kda_op.py --ncu --$stack --lengths 32768
  done
  ;;
ncu)
  check ncu 150 ncu --kernel-name regex:"wy_bwd_kernel|dqkwg_kernel|state_bwd_kernel" --launch-count 3 \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    python bench/gdn_kernels.py --time wy_bwd --length 32768 --warmup 0 --repeat 1
  ;;
cp)
  check per_rank_cost 150 python bench/cp_layer.py --per-rank-cost --cp 4 8 --global-len 32768 131072 \
    --backend triton --json "$OUT/bench.jsonl"
  check cp2_layer_trace 120 torchrun --standalone --nproc-per-node 2 bench/cp_layer.py --global-len 32768 \
    --modes ulysses p2p --backend triton --trace "$OUT/trace" --json "$OUT/bench.jsonl"
  check model_step 200 python bench/model.py --layers 4 --local-len 16384 --warmup 3 --repeat 10 \
    --json "$OUT/bench.jsonl"
  ;;
esac
}
peers_env
for part in "$@"; do
  echo "##### part $part"
  run_part "$part"
done
finish "$@"
