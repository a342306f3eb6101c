"""Triton kernels of KDA (Kimi delta attention, `ops/kda/eager.py` is the reference) and their launchers. Imports
triton: only on the Triton path (`deltacp.ops.kda.triton` loads this module on first use).

Per chunk of BT = 64 tokens and head, gam the chunk-local inclusive cumsum of g (per key channel), gl its last row,
q already l2-normalised and scaled, k l2-normalised, h_c the state [K, V] entering chunk c:
    wy_fwd     A_ij = beta_i sum_c k_ic k_jc e^{gam_ic - gam_jc} (j < i),  Tm = (I + A)^-1 (16 x 16 diagonal blocks
               by forward substitution, then (I - N)(I + N^2) D, `_inverse`),
               W = Tm (beta k e^{gam}),  U = Tm (beta v),  P_ij = sum_c q_ic k_jc e^{gam_ic - gam_jc} (j <= i),
               and (DECAYED) the decayed operands Kt = k e^{gl - gam}, Qg = q e^{gam} of the kernels below
    state_fwd  vn = U - W h_c,  h_{c+1} = e^{gl} h_c + (k e^{gl - gam})ᵀ vn    (h_c, vn stored; with no U and
               h_0 = I it is the summary's M, one K-column block of it per program)
    out_fwd    o = (q e^{gam}) h_c + P vn   (DVL: dvl = Pᵀ dO instead, the part of dvn the chunk's own outputs give)
    state_bwd  dvn = dvl + (k e^{gl - gam}) dh_{c+1},  dh_c = e^{gl} dh_{c+1} + (q e^{gam})ᵀ dO - Wᵀ dvn
               (dh_{c+1} and dvn stored; dh_0 the entering state's gradient)
    bwd_wy     one chunk's gradient terms through h_c, dh_{c+1} and the WY form: dv, dA, dP, and the parts of dq, dk,
               dbeta, dgam outside the pair products (formulas at the kernel)
    bwd_intra  the pair products' terms of dq, dk, dbeta, dgam from dA and dP, added in place
dgam is the gradient of the chunk-local cumsum; g's is its suffix sum within the chunk (prep_bwd). Around them: prep
(q, k l2-normalised, q scaled, gam = the cumsum of g; one pass over the inputs in their dtype) and prep_bwd; the
diagonal sub-chunk blocks (below) in their own kernels, wy_diag before wy_fwd and intra_diag after bwd_intra
(INTRA_DIAG_KERNEL).

Decayed pair products (A, P and their backward) on tensor cores, exact for any finite g <= 0. The chunk is four
sub-chunks of BS = 16 tokens. For i in a later sub-chunk than j, e^{gam_i - gam_j} = e^{gam_i - gam_e} e^{gam_e - gam_j}
through the last row e of j's sub-chunk (`_through`): both exponents are <= 0, so the products are tl.dot of decayed
operands, one per sub-chunk jb (three), with the factors zero outside the rows they serve. Inside a sub-chunk (the
16 x 16 diagonal blocks) the factor is formed per element: wy_diag and intra_diag, one row of a sub-chunk per step
(bwd_intra under fp32 inputs: in its own loop, one column of every block per step, [BT, BK] elementwise work). No exponent is ever positive (e^{gam} and e^{gl - gam} are <= 1 as well): nothing overflows
however fast the gate (Kimi's unbounded one and Bailing's g >= kda_lower_bound alike); an underflow drops only a
term below e^{-87} (fp32) times products of unit vectors.

Tiling: the per-chunk kernels (wy_fwd, bwd_wy, bwd_intra: one program per chunk and head) step over K in BK columns
and V in BV columns inside the program (no [BT, K] tile lives whole; [BT, BT] tiles do); out_fwd has one program per
chunk, V block and head; the state kernels one per V block and head, the state [K, BV] held as row blocks of at most
64 (two at K = 128), the chunks in sequence. Products (`_dot`): one tf32 pass in the per-chunk output and gradient
kernels under bf16 / fp16 inputs, three (about fp32) where errors compound across chunks (WY, the state kernels)
and everywhere under fp32 inputs, fp64 for fp64 (`_prec`).

Layouts (every tensor contiguous, Tp = NT * 64 rows per sequence: padded, or a packed row laid out chunk-aligned,
`ops/gdn/varlen.py`; a zero token leaves the state unchanged): q, k, gam, W, Kt, Qg [B, Tp, H, K]; v, U, vn, dvl, dvn,
o, dO [B, Tp, H, V]; beta [B, Tp, H]; Tm, P, dA, dP [B, Tp, H, BT]; h, dh [B, NT, H, K, V]; h0, ht, dht, dh0 [B, H, K, V].
Everything the kernels compute and store is in the accumulator dtype (fp32; fp64 for fp64 inputs, the interpreter
tests), except o (v's dtype), under OPERANDS16 W, Kt, Qg (fp16) and under STATE16 h, dh, vn, dvn (scaled fp16,
`Stored`); loads are cast to it. `resets` [NT] int32
(packed rows only): the state entering those chunks is zero (backward: no gradient crosses them). Names start with
kda_.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

BT = 64  # the chunk
BS = 16  # the sub-chunk of the pair products (their elementwise diagonal blocks)

# Launch configurations and blocks (BK, BV: clipped to K, V): timed by bench/launch_sweep.py on an H100 (Triton 3.6,
# Kimi-Linear's 32 heads of 128, bf16, 32K tokens: one fwd + bwd 96.0 ms with 8 warps everywhere, 60.7 ms with this
# table; the op's GPU tests pass with it, 2026-12-06). Blocks of 32 in wy_fwd's V loop hit Triton 3.6's tf32x3
# miscompile (an illegal address). bench/kernel_resources.py (Triton 3.9, sm_90): every kernel under a Hopper program's
# 232,448 bytes of shared memory (state_bwd the most, 188,928); 4 warps spill (bf16 inputs: state_bwd 376 bytes,
# bwd_wy 288, bwd_intra 144, wy_fwd 44; fp32 inputs: bwd_intra 1,192), which the timings above include.
# The products of the kernels whose errors compound across chunks (WY, the state kernels) under bf16 / fp16 inputs:
# 1, three tf32 passes (about fp32); 0, one (tf32's 10-bit mantissa, still above the bf16 inputs' 7). `_prec`.
# COMPOUND_PREC is WY's (wy_fwd, wu_fwd) and the summary's M (a product of factors that cancel strongly), STATE_PREC
# the state kernels' (state_fwd with values, state_bwd). STATE_PREC 0 alone (fp32 operands) was slower on an H100 than
# 1: 34.72 against 33.13 ms at 32K (NOTES.md, sixteenth set).
# wy_diag, intra_diag, prep, prep_bwd and wy_fwd / bwd_intra after their diagonal loops moved out: swept at 32K
# (`bench/launch_sweep.py --op kda --kernels wy_diag intra_diag prep prep_bwd wy_fwd bwd_intra`, one H100,
# 2026-12-06): BK 32 in wy_fwd and bwd_intra took the op's fwd + bwd from 41.7 to 39.6 ms, the others kept their
# offline first choices; the op's bf16 GPU tests pass with the table. "<name>/fp32": the entry for fp32 / fp64 inputs
# where it differs (`_launch`): wy_fwd and bwd_intra keep BK 16 there, the launch their fp32 GPU tests passed with.
# state_fwd, state_bwd and out_fwd after the decayed operands (DECAYED) cut their shared memory: swept at 32K
# (`KDA_LENGTHS="8192 32768" bash scripts/gpu_checks.sh kda_sweep`, one H100, 2026-12-07): V blocks of 32 in the
# state kernels (16 before) and of 64 in out_fwd (32) took the op's fwd + bwd from 37.1 to 33.9 ms; the op's 12 GPU
# tests (bf16 and fp32) and Kimi-Linear's mixer under CP2 pass with them. bwd_wy at V blocks of 32 and one stage
# (offline 12 bytes of spill instead of 200): 33.88 -> 33.09 ms in one call (one H100, 2026-12-07, `launch_sweep.py
# --op kda --apply` beside the source); the op's 12 GPU tests pass with it.
COMPOUND_PREC = 1
STATE_PREC = 1
LAUNCH: dict[str, dict[str, int]] = {
    "wy_fwd": dict(num_warps=4, num_stages=2, BK=32, BV=16),
    "wu_fwd": dict(num_warps=4, num_stages=2, BK=32, BV=32),
    "state_fwd": dict(num_warps=4, num_stages=2, BV=32),
    "out_fwd": dict(num_warps=8, num_stages=2, BK=32, BV=64),
    "state_bwd": dict(num_warps=4, num_stages=2, BV=32),
    "bwd_wy": dict(num_warps=8, num_stages=1, BK=32, BV=32),
    "bwd_intra": dict(num_warps=4, num_stages=2, BK=32),
    "wy_fwd/fp32": dict(num_warps=4, num_stages=2, BK=16, BV=16),
    "bwd_intra/fp32": dict(num_warps=4, num_stages=2, BK=16),
    "wy_diag": dict(num_warps=4, num_stages=2, BR=16, BK=32),
    "intra_diag": dict(num_warps=4, num_stages=2, BR=16, BK=32),
    "prep": dict(num_warps=8, num_stages=1),
    "prep_bwd": dict(num_warps=8, num_stages=1),
}
# wy_fwd's diagonal BS x BS sub-chunk blocks of A and P come from their own kernel before it, which wy_fwd reads back
# ([B, Tp, H, BS] each): wy_diag, BR rows per program (BR = BS: one sub-chunk, one row of k and gam per step; offline
# sm_90, bf16: 72 registers at BK 32, no spill; under the interpreter BR = BT, INTERPRETER_BR). On an H100 at 32K
# (2026-12-06, bench/kda_op.py, Kimi-Linear's shape, bf16) this and the prep kernels (chunk.py: the l2 norms, the
# query scale and the cumsum of g in one pass each way, instead of about ten torch passes over fp32 tensors) took the
# op's fwd + bwd from 59.9 to 41.9 ms: the prep kernels 12.2 ms of it, wy_diag 3.3; the variants they replaced
# (torch glue; the diagonal blocks one column per step inside wy_fwd, per K block) were removed.
# bwd_intra's diagonal-block terms: 1, their own kernel after it (intra_diag, BR rows per program, as wy_diag; one
# more read-modify-write of dq, dk, dgam, dbeta; offline sm_90, bf16: bwd_intra 255 registers, spill 144 -> 0 bytes,
# intra_diag 168 registers, no spill); 0, inside bwd_intra (gathered [BT, BK] loads, 16 steps per K block). Under fp32
# inputs (fp32 FMA products) the loop stays in bwd_intra either way: without it ptxas (Triton 3.9, offline) gives that
# bwd_intra 32 registers and 7 KB of spill, against 255 and 1.2 KB with it. H100, 32K: 41.9 ms with it, 44.4 without.
INTRA_DIAG_KERNEL = 1
# The diagonal kernels' rows per program under the interpreter (CPU tensors): a whole chunk (the same code; one program
# per sub-chunk doubles the op's interpreted time). bench/kernel_resources.py sets 0 (LAUNCH's BR) while recording.
INTERPRETER_BR = BT
# The backward's h and vn: 0, recomputed (state_fwd again); 1, kept from the forward (no recomputation; the saved
# activations grow by h [B, NT, H, K, V] and vn [B, Tp, H, V] in fp32: 1.5 GiB at 32K tokens of 32 heads of 128,
# per layer unless the layer is recomputed anyway). H100, 32K: fwd + bwd 39.3 ms with 1, 41.9 with 0 (the op's own
# peak the same, 10.5 GiB: the recomputed h lives in its backward either way).
SAVE_STATES = 0
# The decayed operands wy_fwd stores for the state and output kernels (fp32 [B, Tp, H, K] each, kept for the backward):
# 0, none (each state / output program forms k e^{gl - gam} and q e^{gam} from k, q and gam: every V block of a head
# re-reads the three and recomputes the exponentials); 1, Kt = k e^{gl - gam} (state_fwd, state_bwd) and
# Qg = q e^{gam} (out_fwd, state_bwd). The same fp32 arithmetic either way (the results agree bitwise). Offline
# (sm_90, bf16, DECAYED 1): state_fwd 111,104 -> 77,824 bytes of shared memory, state_bwd 184,832 -> 118,784 and its
# spill 336 -> 108 bytes; wy_fwd's spill 384 -> 752 bytes. On an H100 (Kimi-Linear's 32 heads of 128, bf16, 32K,
# `gpu_checks.sh kda_ab`, 2026-12-07): fwd + bwd 40.21 ms with 0, 37.54 with 1 (state_bwd 6.71 -> 5.20 ms, state_fwd
# 5.25 -> 4.81, out_fwd 3.21 -> 2.30, wy_fwd 5.73 -> 6.13), the op's peak 10.52 -> 11.52 GiB (Kt and Qg kept for the
# backward: 0.5 GiB each); the op's 12 GPU tests pass with 1 (and INVERSE 1).
DECAYED = 1
# wy_fwd's inverse of the diagonal 16 x 16 blocks (`_inverse`), forward substitution in 15 steps: 0, a 64 x 64 x 64
# product per step (`_dot`: three tf32 passes under COMPOUND_PREC); 1, 64 x 64 x 16 (the four blocks side by side),
# a quarter of the work (offline sm_90, bf16: the same 384 bytes of spill; the blocks as one [4, 16, 16] tensor in
# elementwise fp32 products spilled 1.2 KB, from the reshapes, and was dropped unmeasured). H100, 32K, as DECAYED's:
# wy_fwd 5.73 -> 5.37 ms alone, 6.13 -> 5.75 with DECAYED 1; the op 40.21 -> 39.88 ms alone, 37.07 with both.
INVERSE = 1
# wy_fwd's products after the inverse (W = Tm (k e^gam beta), U = Tm (v beta), and Kt, Qg): 0, in wy_fwd, Tm held in
# registers from the inverse; 1, in their own kernel after it (wu_fwd: Tm read back, [BT, BT] in gam's dtype; the
# same products on the same values: the results agree bitwise). Nsight Compute on an H100 (2026-12-07, 32K,
# Kimi-Linear's shape): wy_fwd 6.86 ms at 255 registers with 2.5 M spill requests, where FLA's recompute_w_u, the
# same products alone (bf16 operands), takes 0.73 ms. Offline (`bench/kernel_resources.py`, sm_90, bf16, the
# table's launches): wy_fwd 255 registers and 328 / 752 bytes of spill (without / with q) fused, 228 / 255 registers
# and 0 / 88 bytes split; wu_fwd 141-151 registers, no spill. H100, 32K (2026-12-07, `KDA_AB="WY_SPLIT=1"
# gpu_checks.sh kda_ab`, NOTES.md): wy_fwd 5.74 ms fused against 3.55 + 1.93 (wu_fwd) split; the op 32.91 -> 32.78 ms.
WY_SPLIT = 1
# The dtype of W, Kt and Qg (wy_fwd / wu_fwd store them; the state kernels and out_fwd read them) under bf16 / fp16
# inputs with q and k l2-normalised in the op (`chunk.operand_dtype`): 0, the accumulator's (fp32); 1, fp16: half the
# bytes of the state kernels' largest reads, and exact operands of a one-pass tf32 product (fp16 keeps tf32's 10-bit
# mantissa, rounded to nearest where a tf32 product truncates an fp32 operand). The values are bounded: |Kt|, |Qg| <= 1
# (unit rows times factors <= 1, q scaled) and W is Tm times such rows; below fp16's normal range (6.1e-5) a term keeps
# fewer bits, below 6e-8 it is 0. The summary's M keeps fp32 W (it cancels strongly). Under STATE_PREC 1 the state
# kernels' three tf32 products become two (`_dot`'s 4: the fp16 operand has no low part). Offline
# (`bench/kernel_resources.py`, sm_90, Triton 3.9, bf16, the table's launches), with STATE_PREC 0 and OPERANDS16 1
# against the source: state_fwd 90,112 -> 32,768 bytes of shared memory, 255 -> 242 registers, spill 124 -> 0 bytes;
# state_bwd 139,264 -> 24,576 bytes, spill 372 -> 64 (4 warps, V blocks of 32; at blocks of 64 they spill 400-800
# bytes). H100, 32K, Kimi-Linear's shape (2026-12-07, NOTES.md, sixteenth set): fwd + bwd 33.10 ms with 0, 31.13 with
# 1 (the two-pass form; state_fwd 4.13 -> 3.34 ms, state_bwd 3.50 -> 2.42, wu_fwd 1.91 -> 1.62, out_fwd 1.91 -> 2.00),
# the op's peak 11.59 -> 10.84 GiB; worst rel-L2 against float64 at 4K 2.44e-3 / 2.53e-3 / 2.55e-3 (fast / slow /
# near-frozen) with 0, 2.4e-3 / 2.5e-3 / 2.6e-3 with 1 (three tf32 passes on the fp16 operands: 2.57e-3 near-frozen),
# the final state's 3e-7 -> 2e-4 to 3e-4 (fp16's rounding of the operands; still 8x below the worst); the op's bf16
# GPU tests and Kimi-Linear's mixer under CP2 pass with 1 (the mixer's figures unchanged to three digits). With
# STATE_PREC 0 as well: 30.90 ms, but 2.72e-3 near-frozen: not taken.
OPERANDS16 = 1
# What the state kernels store for the per-chunk kernels that read it (out_fwd, bwd_wy): the states h (state_fwd) and
# dh (state_bwd) [B, NT, H, K, V], and vn (state_fwd) and dvn (state_bwd) [B, Tp, H, V]; 3 GiB in fp32 at 32K tokens
# of 32 heads of 128, h and vn written twice (the backward recomputes them) and each read once or twice. Under bf16 /
# fp16 inputs (`chunk.scaled_states`): 0, all in the accumulator dtype; 1, h and dh in fp16; 2, vn and dvn too. In fp16
# each program's block ([K, BV] of a state, [BT, BV] of a chunk's rows) is stored times 2^(14 - e), e the exponent of
# its largest |entry| (int32 [B, NT, H, V / BV], `Stored`): every entry under 2^15, so nothing overflows whatever the
# scale, and rounded to nearest within 2^-11 of the block's largest entry. The readers' products are one tf32 pass
# (PREC 0), which keeps each fp32 entry within 2^-10 of itself: the fp16 blocks are finer for the largest entries,
# coarser for those under half of it; bwd_wy's rowsum(h dh) (dgl, fp32 products) reads h and dh at the fp16 blocks'
# precision. The recurrences themselves (the state carried from chunk to chunk), ht, dh0 and the summary stay fp32.
# Half the bytes of the largest tensors the state kernels write and bwd_wy reads: about 1 GiB (1) or 1.5 GiB (2) off
# the backward's peak at 32K. Offline (sm_90, Triton 3.9, bf16, the table's launches; bytes spilled a thread, the
# source's / 1 / 2): state_fwd storing h 24 / 0 / 28, state_bwd 176 / 88 / 156, bwd_wy 12 / 12 / 84; out_fwd's shared
# memory 53,248 / 32,768 / 32,768 bytes. Off until timed on a GPU (`KDA_AB="STATE16=1 STATE16=2" bash
# scripts/gpu_checks.sh kda_ab`: the op's GPU tests on each, then its time beside the source's).
STATE16 = 0
L2NORM_EPS = 1e-6  # transformers' / FLA's KDA l2norm: x / sqrt(sum x² + eps) (`eager.l2norm`)


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b, operands in the accumulator dtype. PREC 0: one tf32 product (bf16 / fp16 inputs); 1: three tf32
    products, about fp32; 2: fp64 (fp64 inputs, the interpreter tests); 3: fp32 FMA products ("ieee"); 4: two tf32
    products, b split into its tf32 part and the rest, for an `a` that tf32 holds exactly (fp16-stored, OPERANDS16):
    tf32x3's arithmetic without its a_lo b term, which is 0 there."""
    if PREC == 2:
        return tl.dot(a, b, out_dtype=tl.float64)
    elif PREC == 1:
        return tl.dot(a, b, input_precision="tf32x3")
    elif PREC == 3:
        return tl.dot(a, b, input_precision="ieee")
    elif PREC == 4:
        b_hi = (b.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)  # 10 mantissa bits kept
        return tl.dot(a, b_hi, input_precision="tf32") + tl.dot(a, b - b_hi, input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _chunk_head(H: tl.constexpr):
    """(chunk, row, head) of a per-chunk program (grid: chunks, rows * heads)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    return i_c, (i_bh // H).to(tl.int64), i_bh % H


@triton.jit
def _at(ptr, i_b, i_c, i_h, Tp, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr):
    """The address of chunk i_c's first row, head i_h, of a [B, Tp, H, D] tensor (int64 scalar arithmetic: the
    offsets inside a chunk, at most BT * H * D, are int32)."""
    return ptr + ((i_b * Tp + i_c * BT) * H + i_h).to(tl.int64) * D


@triton.jit
def _load(ptr, o_r, o_d, i_b, i_c, i_h, Tp, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, acc: tl.constexpr):
    """[len(o_r), len(o_d)]: rows o_r (inside chunk i_c), columns o_d of head i_h of a [B, Tp, H, D] tensor, in the
    accumulator dtype."""
    return tl.load(_at(ptr, i_b, i_c, i_h, Tp, H, D, BT) + o_r[:, None] * (H * D) + o_d[None, :]).to(acc)


@triton.jit
def _load_t(ptr, o_r, o_d, i_b, i_c, i_h, Tp, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, acc: tl.constexpr):
    """[len(o_d), len(o_r)]: the transpose of `_load`'s tile, read transposed."""
    return tl.load(_at(ptr, i_b, i_c, i_h, Tp, H, D, BT) + o_r[None, :] * (H * D) + o_d[:, None]).to(acc)


@triton.jit
def _store(ptr, x, o_d, i_b, i_c, i_h, Tp, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr):
    """x [BT, len(o_d)] into the rows of chunk i_c, columns o_d of head i_h of a [B, Tp, H, D] tensor."""
    o_t = tl.arange(0, BT)
    tl.store(_at(ptr, i_b, i_c, i_h, Tp, H, D, BT) + o_t[:, None] * (H * D) + o_d[None, :], x.to(ptr.dtype.element_ty))


@triton.jit
def _store_rows(ptr, x, o_r, o_d, i_b, i_c, i_h, Tp, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr):
    """x [len(o_r), len(o_d)] into rows o_r (inside chunk i_c), columns o_d of head i_h of a [B, Tp, H, D] tensor."""
    tl.store(_at(ptr, i_b, i_c, i_h, Tp, H, D, BT) + o_r[:, None] * (H * D) + o_d[None, :], x.to(ptr.dtype.element_ty))


@triton.jit
def _row(ptr, j, o_d, i_b, i_c, i_h, Tp, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, acc: tl.constexpr):
    """Row j of chunk i_c, columns o_d ([len(o_d)]) of a [B, Tp, H, D] tensor."""
    return tl.load(_at(ptr, i_b, i_c, i_h, Tp, H, D, BT) + j * (H * D) + o_d).to(acc)


@triton.jit
def _vec_at(ptr, o_r, o_d, i_b, i_c, i_h, Tp, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, acc: tl.constexpr):
    """[len(o_r)]: elements (o_r, o_d) (rows of chunk i_c, head i_h) of a [B, Tp, H, D] tensor; D = 1: rows o_r of a
    [B, Tp, H] tensor (o_d 0)."""
    return tl.load(_at(ptr, i_b, i_c, i_h, Tp, H, D, BT) + o_r * (H * D) + o_d).to(acc)


@triton.jit
def _vec(ptr, o_r, i_b, i_c, i_h, Tp, H: tl.constexpr, BT: tl.constexpr, acc: tl.constexpr):
    """[len(o_r)]: rows o_r of chunk i_c, head i_h of a [B, Tp, H] tensor."""
    return _vec_at(ptr, o_r, 0, i_b, i_c, i_h, Tp, H, 1, BT, acc)


@triton.jit
def _state_ptrs(ptr, i_n, o_k, o_v, K: tl.constexpr, V: tl.constexpr):
    """Pointers to rows o_k, columns o_v of state i_n of a [N, K, V] stack of states."""
    return ptr + i_n.to(tl.int64) * (K * V) + (o_k[:, None] * V + o_v[None, :])


@triton.jit
def _pow2(e):
    """2^e in fp32 for int32 e in [-126, 127] (its exponent bits: exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _exponent(m):
    """The exponent of fp32 m >= 0 (its exponent bits), clamped to [-100, 127] (0 gives -100)."""
    return tl.minimum(tl.maximum(((m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -100), 127)


@triton.jit
def _unscaled(b, exps, i_n, o_v, V: tl.constexpr, EB: tl.constexpr):
    """b [rows, len(o_v)] of state or chunk i_n stored scaled (`_store_state`, `_store_chunk`) in blocks of EB
    columns: each column times 2^(e - 14) of its block; b as it is for EB 0 (stored unscaled)."""
    if EB > 0:
        b = b * _pow2(tl.load(exps + i_n.to(tl.int64) * (V // EB) + o_v // EB) - 14)[None, :]
    return b


@triton.jit
def _store_state(ptr, exps, i_n, i_e, b_1, b_2, o_k1, o_k2, o_v, K: tl.constexpr, V: tl.constexpr,
                 TWO: tl.constexpr, SCALED: tl.constexpr):
    """Rows o_k1 (and o_k2 when TWO) of state i_n, columns o_v: as they are, or (SCALED, STATE16) in fp16 times
    2^(14 - e), e the exponent of the block's largest |entry| (clamped to [-100, 127]: a zero block is stored as 0),
    stored at exps[i_e]."""
    if SCALED:
        m = tl.max(tl.abs(b_1))
        if TWO:
            m = tl.maximum(m, tl.max(tl.abs(b_2)))
        e = _exponent(m)
        tl.store(exps + i_e, e)
        b_1, b_2 = b_1 * _pow2(14 - e), b_2 * _pow2(14 - e)
    tl.store(_state_ptrs(ptr, i_n, o_k1, o_v, K, V), b_1.to(ptr.dtype.element_ty))
    if TWO:
        tl.store(_state_ptrs(ptr, i_n, o_k2, o_v, K, V), b_2.to(ptr.dtype.element_ty))


@triton.jit
def _load_state(ptr, exps, i_n, o_k, o_v, K: tl.constexpr, V: tl.constexpr, EB: tl.constexpr, acc: tl.constexpr):
    """Rows o_k, columns o_v of state i_n in acc: as stored, or (EB > 0: `_store_state`'s scaled fp16, in blocks of EB
    columns) each column times 2^(e - 14) of its block."""
    return _unscaled(tl.load(_state_ptrs(ptr, i_n, o_k, o_v, K, V)).to(acc), exps, i_n, o_v, V, EB)


@triton.jit
def _store_chunk(ptr, exps, i_e, x, o_v, i_b, i_c, i_h, Tp, H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                 SCALED: tl.constexpr):
    """x [BT, len(o_v)] into chunk i_c, columns o_v of head i_h of a [B, Tp, H, V] tensor (vn, dvn): as it is, or
    (SCALED, STATE16) in fp16 times 2^(14 - e), e the exponent of its largest |entry| stored at exps[i_e] (as
    `_store_state`)."""
    if SCALED:
        e = _exponent(tl.max(tl.abs(x)))
        tl.store(exps + i_e, e)
        x = x * _pow2(14 - e)
    _store(ptr, x, o_v, i_b, i_c, i_h, Tp, H, V, BT)


@triton.jit
def _load_chunk(ptr, exps, o_t, o_v, i_b, i_c, i_h, NT, Tp, H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                EB: tl.constexpr, acc: tl.constexpr):
    """`_load` of a tensor `_store_chunk` stored (EB > 0: scaled, in blocks of EB columns)."""
    return _unscaled(_load(ptr, o_t, o_v, i_b, i_c, i_h, Tp, H, V, BT, acc), exps, (i_b * NT + i_c) * H + i_h, o_v,
                     V, EB)


@triton.jit
def _through(b_g, gam, jb, o_k, i_b, i_c, i_h, Tp, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
             BS: tl.constexpr, acc: tl.constexpr):
    """The two factors of e^{gam_i - gam_j}, i after sub-chunk jb, j inside it, through its last row e: ([BT, BK]
    e^{gam_i - gam_e} on rows i > e, [BT, BK] e^{gam_e - gam_j} on the rows j of sub-chunk jb; 0 elsewhere). Both
    exponents are <= 0 (masked before the exp)."""
    o_t = tl.arange(0, BT)
    e = jb * BS + BS - 1
    g_e = _row(gam, e, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)[None, :]
    up = tl.exp(tl.where((o_t > e)[:, None], b_g - g_e, float("-inf")))
    down = tl.exp(tl.where((o_t // BS == jb)[:, None], g_e - b_g, float("-inf")))
    return up, down


@triton.jit
def _diag(b_d, BT: tl.constexpr, BS: tl.constexpr):
    """[BT, BS] (row i, column j % BS of i's sub-chunk) -> [BT, BT] with those values in the BS x BS diagonal
    blocks, 0 elsewhere."""
    o_t = tl.arange(0, BT)
    b_w = tl.reshape(tl.broadcast_to(b_d[:, None, :], (BT, BT // BS, BS)), (BT, BT))
    return tl.where((o_t[:, None] // BS) == (o_t[None, :] // BS), b_w, 0.)


@triton.jit(do_not_specialize=["Tp"])
def kda_wy_diag_kernel(q, k, gam, ad, pd, Tp, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                       BR: tl.constexpr, BK: tl.constexpr, HAS_Q: tl.constexpr):
    """The diagonal BS x BS blocks of A (before beta) and P, BR rows (whole sub-chunks) per program (grid: chunks x
    row blocks, rows * heads): ad[i, j % BS] = sum_c k_ic k_jc e^{gam_ic - gam_jc} for j <= i in i's sub-chunk, pd
    the same with q_i; 0 for j > i. Step jj: row x = jj of each sub-chunk (BR = BS, the GPU's: one row of k and gam;
    more rows, the interpreter's: [BR, BK] gathered at x(i)), column jj of each block."""
    i_cr, i_bh = tl.program_id(0), tl.program_id(1)
    i_c, i_r = i_cr // (BT // BR), i_cr % (BT // BR)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    acc = gam.dtype.element_ty
    o_s = tl.arange(0, BS)
    o_r = i_r * BR + tl.arange(0, BR)
    b_ad = tl.zeros([BR, BS], dtype=acc)
    b_pd = tl.zeros([BR, BS], dtype=acc)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = _load(k, o_r, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_g = _load(gam, o_r, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        if HAS_Q:
            b_q = _load(q, o_r, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        for jj in range(BS):
            if BR == BS:  # one sub-chunk: x one row (scalar)
                o_x = i_r * BR + jj
                b_kx = _row(k, o_x, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)[None, :]
                b_gx = _row(gam, o_x, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)[None, :]
            else:  # whole sub-chunks: x per row
                o_x = o_r // BS * BS + jj
                b_kx = _load(k, o_x, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
                b_gx = _load(gam, o_x, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
            b_e = b_kx * tl.exp(tl.where((o_x <= o_r)[:, None], b_g - b_gx, float("-inf")))
            sel = (o_s == jj)[None, :]
            b_ad += tl.where(sel, tl.sum(b_k * b_e, axis=1)[:, None], 0.)
            if HAS_Q:
                b_pd += tl.where(sel, tl.sum(b_q * b_e, axis=1)[:, None], 0.)
    tl.store(_at(ad, i_b, i_c, i_h, Tp, H, BS, BT) + o_r[:, None] * (H * BS) + o_s[None, :], b_ad)
    if HAS_Q:
        tl.store(_at(pd, i_b, i_c, i_h, Tp, H, BS, BT) + o_r[:, None] * (H * BS) + o_s[None, :], b_pd)


@triton.jit
def _inverse(b_a, BT: tl.constexpr, BS: tl.constexpr, INVERSE: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 of a strictly lower [BT, BT] A. D = the inverse of its BS x BS diagonal blocks by forward
    substitution, row i of every block per step (INVERSE): 0, a [BT, BT] x [BT, BT] product per step (`_dot`); 1,
    [BT, BT] x [BT, BS] with D's blocks side by side (row i, column j % BS: BT / BS times less work), spread to
    [BT, BT] at the end. Then with N = D A_o (A_o the blocks below the diagonal, N strictly block-lower: N^4 = 0 for
    four blocks), (I + A)^-1 = (I + N)^-1 D = (I - N)(I + N^2) D."""
    o_t = tl.arange(0, BT)
    same = (o_t[:, None] // BS) == (o_t[None, :] // BS)
    a_d = tl.where(same, b_a, 0.)
    if INVERSE:
        o_s = tl.arange(0, BS)
        b_d2 = tl.where((o_t % BS)[:, None] == o_s[None, :], 1., 0.).to(b_a.dtype)  # [BT, BS]: D's blocks
        for i in range(1, BS):
            sel = (o_t % BS) == i
            b_d2 -= _dot(tl.where(sel[:, None], a_d, 0.), b_d2, PREC)  # rows j < i of each block are final
        # spread to [BT, BT] by a product with the 0/1 matrix E[c, j] = (j % BS == c) (a reshape spills here)
        b_e = tl.where(o_s[:, None] == (o_t % BS)[None, :], 1., 0.).to(b_a.dtype)
        b_d = tl.where(same, _dot(b_d2, b_e, PREC), 0.)
    else:
        b_d = tl.where(o_t[:, None] == o_t[None, :], 1., 0.).to(b_a.dtype)
        for i in range(1, BS):
            sel = (o_t % BS) == i
            b_d -= _dot(tl.where(sel[:, None], a_d, 0.), b_d, PREC)  # rows j < i of each block are final
    b_n = _dot(b_d, tl.where(same, 0., b_a), PREC)
    eye = tl.where(o_t[:, None] == o_t[None, :], 1., 0.).to(b_a.dtype)
    return _dot(eye - b_n, _dot(eye + _dot(b_n, b_n, PREC), b_d, PREC), PREC)


@triton.jit(do_not_specialize=["Tp"])
def kda_wy_fwd_kernel(q, k, v, gam, beta, tm, p, w, u, ad, pd, kt, qg, Tp, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_Q: tl.constexpr, STORE_KT: tl.constexpr, STORE_QG: tl.constexpr,
                      INVERSE: tl.constexpr, PREC: tl.constexpr, STORE_WU: tl.constexpr):
    """Tm, W, U and (HAS_Q) P of one chunk; A and P summed over K blocks (off-diagonal sub-chunk blocks by tl.dot
    through `_through`), started from the diagonal blocks wy_diag wrote to ad, pd. STORE_KT: the decayed keys
    Kt = k e^{gl - gam} too, STORE_QG: the decayed queries Qg = q e^{gam} (the state and output kernels' operands).
    STORE_WU 0 (WY_SPLIT): Tm and P only, W, U, Kt and Qg left to wu_fwd."""
    i_c, i_b, i_h = _chunk_head(H)
    acc = gam.dtype.element_ty
    o_t = tl.arange(0, BT)
    b_beta = _vec(beta, o_t, i_b, i_c, i_h, Tp, H, BT, acc)
    b_a = tl.zeros([BT, BT], dtype=acc)
    b_p = tl.zeros([BT, BT], dtype=acc)
    o_s = tl.arange(0, BS)  # wy_diag's blocks as the accumulators' start
    b_a += _diag(_load(ad, o_t, o_s, i_b, i_c, i_h, Tp, H, BS, BT, acc), BT, BS)
    if HAS_Q:
        b_p += _diag(_load(pd, o_t, o_s, i_b, i_c, i_h, Tp, H, BS, BT, acc), BT, BS)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = _load(k, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_g = _load(gam, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        if HAS_Q:
            b_q = _load(q, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        for jb in range(BT // BS - 1):  # a loop, not unrolled: one sub-chunk's factors live at a time
            up, down = _through(b_g, gam, jb, o_k, i_b, i_c, i_h, Tp, H, K, BT, BS, acc)
            b_kd = tl.trans(b_k * down)
            b_a += _dot(b_k * up, b_kd, PREC)
            if HAS_Q:
                b_p += _dot(b_q * up, b_kd, PREC)
    if HAS_Q:  # stored first: P is not live through the inverse
        _store(p, b_p, o_t, i_b, i_c, i_h, Tp, H, BT, BT)
    b_t = _inverse(tl.where(o_t[:, None] > o_t[None, :], b_a, 0.) * b_beta[:, None], BT, BS, INVERSE, PREC)
    _store(tm, b_t, o_t, i_b, i_c, i_h, Tp, H, BT, BT)
    if STORE_WU:
        _wu(b_t, b_beta, q, k, v, gam, w, u, kt, qg, i_b, i_c, i_h, Tp, H, K, V, BT, BK, BV, STORE_KT, STORE_QG, acc,
            PREC)


@triton.jit
def _wu(b_t, b_beta, q, k, v, gam, w, u, kt, qg, i_b, i_c, i_h, Tp, H: tl.constexpr, K: tl.constexpr,
        V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, STORE_KT: tl.constexpr,
        STORE_QG: tl.constexpr, acc: tl.constexpr, PREC: tl.constexpr):
    """W = Tm (k e^gam beta) and U = Tm (v beta) of one chunk from its Tm (b_t), and the decayed operands Kt =
    k e^{gl - gam} (STORE_KT) and Qg = q e^gam (STORE_QG)."""
    o_t = tl.arange(0, BT)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = _load(k, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_g = _load(gam, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_eg = tl.exp(b_g)
        _store(w, _dot(b_t, b_k * b_eg * b_beta[:, None], PREC), o_k, i_b, i_c, i_h, Tp, H, K, BT)
        if STORE_KT:
            b_gl = _row(gam, BT - 1, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
            _store(kt, b_k * tl.exp(b_gl[None, :] - b_g), o_k, i_b, i_c, i_h, Tp, H, K, BT)
        if STORE_QG:
            _store(qg, _load(q, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc) * b_eg, o_k, i_b, i_c, i_h, Tp, H, K, BT)
    for i_v in range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_y = _load(v, o_t, o_v, i_b, i_c, i_h, Tp, H, V, BT, acc) * b_beta[:, None]
        _store(u, _dot(b_t, b_y, PREC), o_v, i_b, i_c, i_h, Tp, H, V, BT)


@triton.jit(do_not_specialize=["Tp"])
def kda_wu_fwd_kernel(q, k, v, gam, beta, tm, w, u, kt, qg, Tp, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, STORE_KT: tl.constexpr,
                      STORE_QG: tl.constexpr, PREC: tl.constexpr):
    """W, U (and Kt, Qg) of one chunk from the Tm wy_fwd stored (WY_SPLIT)."""
    i_c, i_b, i_h = _chunk_head(H)
    acc = gam.dtype.element_ty
    o_t = tl.arange(0, BT)
    b_t = _load(tm, o_t, o_t, i_b, i_c, i_h, Tp, H, BT, BT, acc)
    b_beta = _vec(beta, o_t, i_b, i_c, i_h, Tp, H, BT, acc)
    _wu(b_t, b_beta, q, k, v, gam, w, u, kt, qg, i_b, i_c, i_h, Tp, H, K, V, BT, BK, BV, STORE_KT, STORE_QG, acc,
        PREC)


@triton.jit
def _state_in(b_h, k, gam, kt, b_vn, o_k, i_b, i_c, i_h, Tp, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
              HAS_KT: tl.constexpr, acc: tl.constexpr, PREC: tl.constexpr):
    """Rows o_k of e^{gl} h + (k e^{gl - gam})ᵀ vn: the state leaving the chunk (the transposed factor read
    transposed: no transpose in registers; HAS_KT: read from wy_fwd's Kt, else formed from k and gam)."""
    o_t = tl.arange(0, BT)
    b_gl = _row(gam, BT - 1, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
    if HAS_KT:
        b_kt = _load_t(kt, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
    else:
        b_kt = _load_t(k, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc) \
            * tl.exp(b_gl[:, None] - _load_t(gam, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc))
    return b_h * tl.exp(b_gl)[:, None] + _dot(b_kt, b_vn, PREC)


@triton.jit(do_not_specialize=["NT"])
def kda_state_fwd_kernel(w, u, k, gam, kt, h0, h, hexp, vn, vnexp, ht, resets, NT, H: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr,
                         HAS_U: tl.constexpr, HAS_KT: tl.constexpr, STORE_H: tl.constexpr, STORE_VN: tl.constexpr,
                         STORE_HT: tl.constexpr, RESETS: tl.constexpr, SCALED: tl.constexpr, SCALED_ROWS: tl.constexpr,
                         PREC: tl.constexpr):
    """h [K, BV] through the chunks, as two [BK, BV] row blocks when K = 2 BK (h1, h2). V: the state's columns (the
    values; K for the summary's M, HAS_U False). SCALED, SCALED_ROWS: h, vn stored as scaled fp16 (`_store_state`,
    `_store_chunk`: STATE16)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    acc = gam.dtype.element_ty
    Tp = NT * BT
    o_t = tl.arange(0, BT)
    o_k1 = tl.arange(0, BK)
    o_k2 = BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    TWO: tl.constexpr = K == 2 * BK
    b_h1 = tl.zeros([BK, BV], dtype=acc)
    b_h2 = tl.zeros([BK, BV], dtype=acc)
    if USE_H0:
        b_h1 += tl.load(_state_ptrs(h0, i_b * H + i_h, o_k1, o_v, K, V)).to(acc)
        if TWO:
            b_h2 += tl.load(_state_ptrs(h0, i_b * H + i_h, o_k2, o_v, K, V)).to(acc)
    for i_c in range(NT):
        if RESETS:
            reset = tl.load(resets + i_c) != 0
            b_h1 = tl.where(reset, 0., b_h1)
            b_h2 = tl.where(reset, 0., b_h2)
        if STORE_H:
            i_n = (i_b * NT + i_c) * H + i_h
            _store_state(h, hexp, i_n, i_n * (V // BV) + i_v, b_h1, b_h2, o_k1, o_k2, o_v, K, V, TWO, SCALED)
        b_vn = -_dot(_load(w, o_t, o_k1, i_b, i_c, i_h, Tp, H, K, BT, acc), b_h1, PREC)
        if TWO:
            b_vn -= _dot(_load(w, o_t, o_k2, i_b, i_c, i_h, Tp, H, K, BT, acc), b_h2, PREC)
        if HAS_U:
            b_vn += _load(u, o_t, o_v, i_b, i_c, i_h, Tp, H, V, BT, acc)
        if STORE_VN:
            _store_chunk(vn, vnexp, ((i_b * NT + i_c) * H + i_h) * (V // BV) + i_v, b_vn, o_v, i_b, i_c, i_h, Tp, H,
                         V, BT, SCALED_ROWS)
        b_h1 = _state_in(b_h1, k, gam, kt, b_vn, o_k1, i_b, i_c, i_h, Tp, H, K, BT, HAS_KT, acc, PREC)
        if TWO:
            b_h2 = _state_in(b_h2, k, gam, kt, b_vn, o_k2, i_b, i_c, i_h, Tp, H, K, BT, HAS_KT, acc, PREC)
    if STORE_HT:
        tl.store(_state_ptrs(ht, i_b * H + i_h, o_k1, o_v, K, V), b_h1)
        if TWO:
            tl.store(_state_ptrs(ht, i_b * H + i_h, o_k2, o_v, K, V), b_h2)


@triton.jit(do_not_specialize=["NT"])
def kda_out_fwd_kernel(q, gam, qg, p, h, hexp, vn, vnexp, do, o, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DVL: tl.constexpr,
                       HAS_QG: tl.constexpr, HEB: tl.constexpr, VEB: tl.constexpr, PREC: tl.constexpr):
    """One V block of o = (q e^{gam}) h_c + P vn (HAS_QG: q e^{gam} read from wy_fwd's Qg; HEB, VEB: h's and vn's
    scale blocks, `_load_state`, `_load_chunk`); DVL: of Pᵀ dO instead (q, gam, qg, h, vn unused)."""
    i_c, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    acc = p.dtype.element_ty
    Tp = NT * BT
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    b_p = _load(p, o_t, o_t, i_b, i_c, i_h, Tp, H, BT, BT, acc)
    if DVL:
        b_o = _dot(tl.trans(b_p), _load(do, o_t, o_v, i_b, i_c, i_h, Tp, H, V, BT, acc), PREC)
    else:
        b_o = _dot(b_p, _load_chunk(vn, vnexp, o_t, o_v, i_b, i_c, i_h, NT, Tp, H, V, BT, VEB, acc), PREC)
        for i_k in range(K // BK):
            o_k = i_k * BK + tl.arange(0, BK)
            if HAS_QG:
                b_qg = _load(qg, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
            else:
                b_qg = _load(q, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc) \
                    * tl.exp(_load(gam, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc))
            b_h = _load_state(h, hexp, (i_b * NT + i_c) * H + i_h, o_k, o_v, K, V, HEB, acc)
            b_o += _dot(b_qg, b_h, PREC)
    _store(o, b_o, o_v, i_b, i_c, i_h, Tp, H, V, BT)


@triton.jit
def _kt_dh(b_dh, k, gam, kt, o_k, i_b, i_c, i_h, Tp, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
           HAS_KT: tl.constexpr, acc: tl.constexpr, PREC: tl.constexpr):
    """(k e^{gl - gam})[:, o_k] dh[o_k]: the part of dvn through rows o_k of the state leaving the chunk (HAS_KT:
    the factor read from wy_fwd's Kt)."""
    o_t = tl.arange(0, BT)
    if HAS_KT:
        b_kt = _load(kt, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
    else:
        b_gl = _row(gam, BT - 1, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_kt = _load(k, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc) \
            * tl.exp(b_gl[None, :] - _load(gam, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc))
    return _dot(b_kt, b_dh, PREC)


@triton.jit
def _state_out_grad(b_dh, q, gam, qg, w, b_do, b_dvn, o_k, i_b, i_c, i_h, Tp, H: tl.constexpr, K: tl.constexpr,
                    BT: tl.constexpr, HAS_QG: tl.constexpr, acc: tl.constexpr, PREC: tl.constexpr):
    """Rows o_k of e^{gl} dh + (q e^{gam})ᵀ dO - Wᵀ dvn: the gradient of the state entering the chunk (HAS_QG:
    q e^{gam} read from wy_fwd's Qg)."""
    o_t = tl.arange(0, BT)
    if HAS_QG:
        b_qg = _load_t(qg, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
    else:
        b_qg = _load_t(q, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc) \
            * tl.exp(_load_t(gam, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc))
    b_dh = b_dh * tl.exp(_row(gam, BT - 1, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc))[:, None] \
        + _dot(b_qg, b_do, PREC)
    return b_dh - _dot(_load_t(w, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc), b_dvn, PREC)


@triton.jit(do_not_specialize=["NT"])
def kda_state_bwd_kernel(q, k, gam, kt, qg, w, do, dvl, dht, dh, dhexp, dvn, dvnexp, dh0, resets, NT, H: tl.constexpr,
                         K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         USE_DHT: tl.constexpr, STORE: tl.constexpr, STORE_DH0: tl.constexpr, RESETS: tl.constexpr,
                         HAS_KT: tl.constexpr, HAS_QG: tl.constexpr, SCALED: tl.constexpr,
                         SCALED_ROWS: tl.constexpr, PREC: tl.constexpr):
    """dh [K, BV] back through the chunks, as two [BK, BV] row blocks when K = 2 BK (dh1, dh2); SCALED, SCALED_ROWS:
    dh, dvn stored as scaled fp16 (`_store_state`, `_store_chunk`: STATE16)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    acc = gam.dtype.element_ty
    Tp = NT * BT
    o_t = tl.arange(0, BT)
    o_k1 = tl.arange(0, BK)
    o_k2 = BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    TWO: tl.constexpr = K == 2 * BK
    b_dh1 = tl.zeros([BK, BV], dtype=acc)
    b_dh2 = tl.zeros([BK, BV], dtype=acc)
    if USE_DHT:
        b_dh1 += tl.load(_state_ptrs(dht, i_b * H + i_h, o_k1, o_v, K, V)).to(acc)
        if TWO:
            b_dh2 += tl.load(_state_ptrs(dht, i_b * H + i_h, o_k2, o_v, K, V)).to(acc)
    for i_s in range(NT):
        i_c = NT - 1 - i_s
        if STORE:
            i_n = (i_b * NT + i_c) * H + i_h
            _store_state(dh, dhexp, i_n, i_n * (V // BV) + i_v, b_dh1, b_dh2, o_k1, o_k2, o_v, K, V, TWO, SCALED)
        b_dvn = _load(dvl, o_t, o_v, i_b, i_c, i_h, Tp, H, V, BT, acc) \
            + _kt_dh(b_dh1, k, gam, kt, o_k1, i_b, i_c, i_h, Tp, H, K, BT, HAS_KT, acc, PREC)
        if TWO:
            b_dvn += _kt_dh(b_dh2, k, gam, kt, o_k2, i_b, i_c, i_h, Tp, H, K, BT, HAS_KT, acc, PREC)
        if STORE:
            _store_chunk(dvn, dvnexp, i_n * (V // BV) + i_v, b_dvn, o_v, i_b, i_c, i_h, Tp, H, V, BT, SCALED_ROWS)
        b_do = _load(do, o_t, o_v, i_b, i_c, i_h, Tp, H, V, BT, acc)
        b_dh1 = _state_out_grad(b_dh1, q, gam, qg, w, b_do, b_dvn, o_k1, i_b, i_c, i_h, Tp, H, K, BT, HAS_QG, acc,
                                PREC)
        if TWO:
            b_dh2 = _state_out_grad(b_dh2, q, gam, qg, w, b_do, b_dvn, o_k2, i_b, i_c, i_h, Tp, H, K, BT, HAS_QG,
                                    acc, PREC)
        if RESETS:
            reset = tl.load(resets + i_c) != 0
            b_dh1 = tl.where(reset, 0., b_dh1)
            b_dh2 = tl.where(reset, 0., b_dh2)
    if STORE_DH0:
        tl.store(_state_ptrs(dh0, i_b * H + i_h, o_k1, o_v, K, V), b_dh1)
        if TWO:
            tl.store(_state_ptrs(dh0, i_b * H + i_h, o_k2, o_v, K, V), b_dh2)


@triton.jit(do_not_specialize=["NT"])
def kda_bwd_wy_kernel(q, k, v, gam, beta, tm, h, hexp, dh, dhexp, vn, vnexp, dvn, dvnexp, do, dq, dk, dv, dbeta,
                      dgam, da, dp, NT,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, HEB: tl.constexpr, DHEB: tl.constexpr, VEB: tl.constexpr,
                      DVEB: tl.constexpr, PREC: tl.constexpr):
    """One chunk's gradients outside the pair products. With Qg = q e^{gam}, Kt = k e^{gl - gam}, X = beta k e^{gam},
    Y = beta v:
        dq = e^{gam} (dO h_cᵀ)                 dk = e^{gl - gam} (vn dh_{c+1}ᵀ) + beta e^{gam} dX
        dX = Tmᵀ dW, dW = -dvn h_cᵀ;  dY = Tmᵀ dvn;  dv = beta dY;  dA = -Tmᵀ (dW Xᵀ + dvn Yᵀ) Tmᵀ (j < i)
        dP = dO vnᵀ (j <= i);  dbeta = rowsum(dY v + dX k e^{gam})
        dgam = Qg ∘ (dO h_cᵀ) - Kt ∘ (vn dh_{c+1}ᵀ) + X ∘ dX, its last row plus
               dgl = e^{gl} rowsum(h_c dh_{c+1}) + colsum(Kt ∘ (vn dh_{c+1}ᵀ))
    (elementwise: a factor e^{+gam_i} on an operand gives operand ∘ its gradient, e^{-gam_j} minus it). dA, dP go
    to bwd_intra, which adds the pair products' terms. h, dh, vn, dvn read by `_load_state`, `_load_chunk` (HEB,
    DHEB, VEB, DVEB: their scale blocks)."""
    i_c, i_b, i_h = _chunk_head(H)
    acc = gam.dtype.element_ty
    Tp = NT * BT
    o_t = tl.arange(0, BT)
    b_beta = _vec(beta, o_t, i_b, i_c, i_h, Tp, H, BT, acc)
    b_tm = _load(tm, o_t, o_t, i_b, i_c, i_h, Tp, H, BT, BT, acc)
    b_dtm = tl.zeros([BT, BT], dtype=acc)
    b_dp = tl.zeros([BT, BT], dtype=acc)
    b_dbeta = tl.zeros([BT], dtype=acc)
    for i_v in range(V // BV):  # dv, dvn Yᵀ, dO vnᵀ
        o_v = i_v * BV + tl.arange(0, BV)
        b_dvn = _load_chunk(dvn, dvnexp, o_t, o_v, i_b, i_c, i_h, NT, Tp, H, V, BT, DVEB, acc)
        b_v = _load(v, o_t, o_v, i_b, i_c, i_h, Tp, H, V, BT, acc)
        b_dy = _dot(tl.trans(b_tm), b_dvn, PREC)
        _store(dv, b_dy * b_beta[:, None], o_v, i_b, i_c, i_h, Tp, H, V, BT)
        b_dbeta += tl.sum(b_dy * b_v, axis=1)
        b_dtm += _dot(b_dvn, tl.trans(b_v * b_beta[:, None]), PREC)
        b_dp += _dot(_load(do, o_t, o_v, i_b, i_c, i_h, Tp, H, V, BT, acc),
                     tl.trans(_load_chunk(vn, vnexp, o_t, o_v, i_b, i_c, i_h, NT, Tp, H, V, BT, VEB, acc)), PREC)
    for i_k in range(K // BK):  # the state's terms and W's, one K block at a time
        o_k = i_k * BK + tl.arange(0, BK)
        b_doh = tl.zeros([BT, BK], dtype=acc)
        b_vdh = tl.zeros([BT, BK], dtype=acc)
        b_dw = tl.zeros([BT, BK], dtype=acc)
        b_hdh = tl.zeros([BK], dtype=acc)
        for i_v in range(V // BV):
            o_v = i_v * BV + tl.arange(0, BV)
            b_h = _load_state(h, hexp, (i_b * NT + i_c) * H + i_h, o_k, o_v, K, V, HEB, acc)
            b_dh = _load_state(dh, dhexp, (i_b * NT + i_c) * H + i_h, o_k, o_v, K, V, DHEB, acc)
            b_doh += _dot(_load(do, o_t, o_v, i_b, i_c, i_h, Tp, H, V, BT, acc), tl.trans(b_h), PREC)
            b_vdh += _dot(_load_chunk(vn, vnexp, o_t, o_v, i_b, i_c, i_h, NT, Tp, H, V, BT, VEB, acc),
                          tl.trans(b_dh), PREC)
            b_dw -= _dot(_load_chunk(dvn, dvnexp, o_t, o_v, i_b, i_c, i_h, NT, Tp, H, V, BT, DVEB, acc),
                         tl.trans(b_h), PREC)
            b_hdh += tl.sum(b_h * b_dh, axis=1)
        b_q = _load(q, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_k = _load(k, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_g = _load(gam, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_gl = _row(gam, BT - 1, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_eg = tl.exp(b_g)
        b_dq = b_doh * b_eg
        b_dk = b_vdh * tl.exp(b_gl[None, :] - b_g)
        b_dgl = tl.exp(b_gl) * b_hdh + tl.sum(b_k * b_dk, axis=0)
        b_dgam = b_q * b_dq - b_k * b_dk + tl.where(o_t[:, None] == BT - 1, b_dgl[None, :], 0.)
        b_x = b_k * b_eg * b_beta[:, None]
        b_dx = _dot(tl.trans(b_tm), b_dw, PREC)
        b_dbeta += tl.sum(b_dx * b_k * b_eg, axis=1)
        b_dk += b_dx * b_eg * b_beta[:, None]
        b_dgam += b_x * b_dx
        b_dtm += _dot(b_dw, tl.trans(b_x), PREC)
        _store(dq, b_dq, o_k, i_b, i_c, i_h, Tp, H, K, BT)
        _store(dk, b_dk, o_k, i_b, i_c, i_h, Tp, H, K, BT)
        _store(dgam, b_dgam, o_k, i_b, i_c, i_h, Tp, H, K, BT)
    b_da = -_dot(tl.trans(b_tm), _dot(b_dtm, tl.trans(b_tm), PREC), PREC)
    _store(da, tl.where(o_t[:, None] > o_t[None, :], b_da, 0.), o_t, i_b, i_c, i_h, Tp, H, BT, BT)
    _store(dp, tl.where(o_t[:, None] >= o_t[None, :], b_dp, 0.), o_t, i_b, i_c, i_h, Tp, H, BT, BT)
    tl.store(_at(dbeta, i_b, i_c, i_h, Tp, H, 1, BT) + o_t * H, b_dbeta)


@triton.jit
def _diag_step(b_fp, b_fa, b_gk, da, dp, o_r, o_x, b_g, b_gx, b_kx, b_qx, b_bx, i_b, i_c, i_h, Tp, H: tl.constexpr,
               BT: tl.constexpr, acc: tl.constexpr):
    """One step of bwd_intra's diagonal-block terms (formulas at bwd_intra) for rows o_r, x = o_x (one row, or one per
    row) with its rows of gam, k, q and its beta, added to F's dP and dA parts (column x of row i) and to G (row x of
    column j); the pair factors e^{gam_i - gam_x} (x <= i) and e^{gam_x - gam_j} (x >= j), exponents <= 0. Each part
    is added as soon as it is formed (fewer live registers)."""
    b_ef = tl.exp(tl.where((o_x <= o_r)[:, None], b_g - b_gx, float("-inf")))
    b_eg = tl.exp(tl.where((o_x >= o_r)[:, None], b_gx - b_g, float("-inf")))
    m_p = _vec_at(dp, o_r, o_x, i_b, i_c, i_h, Tp, H, BT, BT, acc)  # dP[i, x(i)], read back from memory
    m_a = _vec_at(da, o_r, o_x, i_b, i_c, i_h, Tp, H, BT, BT, acc)
    b_fp += m_p[:, None] * b_kx * b_ef
    b_fa += m_a[:, None] * b_kx * b_ef
    m_p = _vec_at(dp, o_x, o_r, i_b, i_c, i_h, Tp, H, BT, BT, acc)  # dP[x(j), j]
    m_a = _vec_at(da, o_x, o_r, i_b, i_c, i_h, Tp, H, BT, BT, acc) * b_bx
    b_gk += (m_p[:, None] * b_qx + m_a[:, None] * b_kx) * b_eg
    return b_fp, b_fa, b_gk


@triton.jit(do_not_specialize=["NT"])
def kda_bwd_intra_kernel(q, k, gam, beta, da, dp, dq, dk, dgam, dbeta, NT, H: tl.constexpr, K: tl.constexpr,
                         BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, DIAG: tl.constexpr,
                         PREC: tl.constexpr):
    """The pair products' terms of one chunk, added to bwd_wy's dq, dk, dgam, dbeta:
        dq += F(dP, k);  dk += beta F(dA, k) + Gk;  dbeta += rowsum(k F(dA, k))
        dgam += q ∘ F(dP, k) + beta k ∘ F(dA, k) - k ∘ Gk,   Gk = G(dP, q) + G(beta dA, k)
    where F(M, b)_i = sum_j M_ij b_j e^{gam_i - gam_j}, G(M, a)_j = sum_i M_ij a_i e^{gam_i - gam_j} (i >= j; M is
    zero above its diagonal): across sub-chunks F = sum_jb up ∘ (M (b ∘ down)), G = sum_jb down ∘ (Mᵀ (a ∘ up))
    (`_through`), inside them one column (F) or row (G) of every diagonal block per step (DIAG: not here, in
    intra_diag)."""
    i_c, i_b, i_h = _chunk_head(H)
    acc = gam.dtype.element_ty
    Tp = NT * BT
    o_t = tl.arange(0, BT)
    b_beta = _vec(beta, o_t, i_b, i_c, i_h, Tp, H, BT, acc)
    b_dp = _load(dp, o_t, o_t, i_b, i_c, i_h, Tp, H, BT, BT, acc)
    b_da = _load(da, o_t, o_t, i_b, i_c, i_h, Tp, H, BT, BT, acc)
    b_dbeta = _vec(dbeta, o_t, i_b, i_c, i_h, Tp, H, BT, acc)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_q = _load(q, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_k = _load(k, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_g = _load(gam, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_kb = b_k * b_beta[:, None]
        b_fp = tl.zeros([BT, BK], dtype=acc)
        b_fa = tl.zeros([BT, BK], dtype=acc)
        b_gk = tl.zeros([BT, BK], dtype=acc)
        for jb in range(BT // BS - 1):  # a loop, not unrolled: one sub-chunk's factors live at a time
            up, down = _through(b_g, gam, jb, o_k, i_b, i_c, i_h, Tp, H, K, BT, BS, acc)
            b_kd = b_k * down
            b_fp += up * _dot(b_dp, b_kd, PREC)
            b_fa += up * _dot(b_da, b_kd, PREC)
            b_gk += down * (_dot(tl.trans(b_dp), b_q * up, PREC) + _dot(tl.trans(b_da), b_kb * up, PREC))
        if not DIAG:
            for jj in range(BS):  # x = row jj of each sub-chunk: column x of F's row i, row x of G's column j
                o_x = o_t // BS * BS + jj
                b_gx = _load(gam, o_x, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
                b_kx = _load(k, o_x, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
                b_qx = _load(q, o_x, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
                b_bx = _vec(beta, o_x, i_b, i_c, i_h, Tp, H, BT, acc)
                b_fp, b_fa, b_gk = _diag_step(b_fp, b_fa, b_gk, da, dp, o_t, o_x, b_g, b_gx, b_kx, b_qx, b_bx, i_b,
                                              i_c, i_h, Tp, H, BT, acc)
        b_dbeta += tl.sum(b_k * b_fa, axis=1)
        _store(dq, _load(dq, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc) + b_fp, o_k, i_b, i_c, i_h, Tp, H, K, BT)
        _store(dk, _load(dk, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc) + b_beta[:, None] * b_fa + b_gk,
               o_k, i_b, i_c, i_h, Tp, H, K, BT)
        _store(dgam, _load(dgam, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
               + b_q * b_fp + b_kb * b_fa - b_k * b_gk, o_k, i_b, i_c, i_h, Tp, H, K, BT)
    tl.store(_at(dbeta, i_b, i_c, i_h, Tp, H, 1, BT) + o_t * H, b_dbeta)


@triton.jit(do_not_specialize=["NT"])
def kda_intra_diag_kernel(q, k, gam, beta, da, dp, dq, dk, dgam, dbeta, NT, H: tl.constexpr, K: tl.constexpr,
                          BT: tl.constexpr, BS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """bwd_intra's terms of the diagonal BS x BS blocks (F and G inside each sub-chunk; formulas at bwd_intra), BR rows
    (whole sub-chunks) per program (grid: chunks x row blocks, rows * heads), added in place to dq, dk, dgam,
    dbeta: a sub-chunk's rows need only its own rows. Step jj as wy_diag's (BR = BS: one row x; more: gathered)."""
    i_cr, i_bh = tl.program_id(0), tl.program_id(1)
    i_c, i_r = i_cr // (BT // BR), i_cr % (BT // BR)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    acc = gam.dtype.element_ty
    Tp = NT * BT
    o_r = i_r * BR + tl.arange(0, BR)
    b_beta = _vec(beta, o_r, i_b, i_c, i_h, Tp, H, BT, acc)
    b_dbeta = _vec(dbeta, o_r, i_b, i_c, i_h, Tp, H, BT, acc)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_q = _load(q, o_r, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_k = _load(k, o_r, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_g = _load(gam, o_r, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_fp = tl.zeros([BR, BK], dtype=acc)
        b_fa = tl.zeros([BR, BK], dtype=acc)
        b_gk = tl.zeros([BR, BK], dtype=acc)
        for jj in range(BS):  # x = row jj of each sub-chunk: column x of F's row i, row x of G's column j
            if BR == BS:  # one sub-chunk: x one row (scalar), its rows of k, gam, q loaded once
                o_x = i_r * BR + jj
                b_kx = _row(k, o_x, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)[None, :]
                b_gx = _row(gam, o_x, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)[None, :]
                b_qx = _row(q, o_x, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)[None, :]
                b_bx = tl.load(_at(beta, i_b, i_c, i_h, Tp, H, 1, BT) + o_x * H).to(acc)
            else:  # whole sub-chunks: x per row
                o_x = o_r // BS * BS + jj
                b_kx = _load(k, o_x, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
                b_gx = _load(gam, o_x, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
                b_qx = _load(q, o_x, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
                b_bx = _vec(beta, o_x, i_b, i_c, i_h, Tp, H, BT, acc)
            b_fp, b_fa, b_gk = _diag_step(b_fp, b_fa, b_gk, da, dp, o_r, o_x, b_g, b_gx, b_kx, b_qx, b_bx, i_b, i_c,
                                          i_h, Tp, H, BT, acc)
        b_dbeta += tl.sum(b_k * b_fa, axis=1)
        _store_rows(dq, _load(dq, o_r, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc) + b_fp, o_r, o_k, i_b, i_c, i_h, Tp, H, K,
                    BT)
        _store_rows(dk, _load(dk, o_r, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc) + b_beta[:, None] * b_fa + b_gk, o_r, o_k,
                    i_b, i_c, i_h, Tp, H, K, BT)
        _store_rows(dgam, _load(dgam, o_r, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
                    + (b_q * b_fp + b_k * b_beta[:, None] * b_fa - b_k * b_gk), o_r, o_k, i_b, i_c, i_h, Tp, H, K, BT)
    tl.store(_at(dbeta, i_b, i_c, i_h, Tp, H, 1, BT) + o_r * H, b_dbeta)


@triton.jit(do_not_specialize=["Tp"])
def kda_prep_kernel(q, k, g, qn, kn, gam, rq, rk, sc, Tp, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                    HAS_Q: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr):
    """One chunk and head of the op's inputs (laid out, any float dtype) -> the kernels' (accumulator dtype):
    gam = the chunk-local cumsum of g; kn = k r_k, qn = q r_q sc with r = 1 / sqrt(sum x² + EPS) per row (NORM;
    r stored for the backward) or 1; sc the query scale (a one-element tensor: a float argument would be fp32)."""
    i_c, i_b, i_h = _chunk_head(H)
    acc = gam.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    _store(gam, tl.cumsum(_load(g, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc), axis=0), o_k, i_b, i_c, i_h, Tp, H,
           K, BT)
    b_k = _load(k, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
    if NORM:
        b_r = 1. / tl.sqrt(tl.sum(b_k * b_k, axis=1) + EPS)
        tl.store(_at(rk, i_b, i_c, i_h, Tp, H, 1, BT) + o_t * H, b_r)
        b_k = b_k * b_r[:, None]
    _store(kn, b_k, o_k, i_b, i_c, i_h, Tp, H, K, BT)
    if HAS_Q:
        b_q = _load(q, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_s = tl.load(sc).to(acc)
        if NORM:
            b_r = 1. / tl.sqrt(tl.sum(b_q * b_q, axis=1) + EPS)
            tl.store(_at(rq, i_b, i_c, i_h, Tp, H, 1, BT) + o_t * H, b_r)
            b_q = b_q * (b_r * b_s)[:, None]
        else:
            b_q = b_q * b_s
        _store(qn, b_q, o_k, i_b, i_c, i_h, Tp, H, K, BT)


@triton.jit(do_not_specialize=["Tp"])
def kda_prep_bwd_kernel(qn, kn, rq, rk, sc, dqn, dkn, dgam, dq, dk, dg, Tp, H: tl.constexpr, K: tl.constexpr,
                        BT: tl.constexpr, NORM: tl.constexpr):
    """The prep's backward, written in the inputs' dtypes: dg = the suffix sum of dgam within the chunk; with y = x r
    (kn, or qn / sc), dx = r (dy - y (y . dy)) (NORM) or dy, times sc for q."""
    i_c, i_b, i_h = _chunk_head(H)
    acc = dgam.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    _store(dg, tl.cumsum(_load(dgam, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc), axis=0, reverse=True), o_k, i_b,
           i_c, i_h, Tp, H, K, BT)
    b_dy = _load(dkn, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
    if NORM:
        b_y = _load(kn, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_r = _vec(rk, o_t, i_b, i_c, i_h, Tp, H, BT, acc)
        b_dy = b_r[:, None] * (b_dy - b_y * tl.sum(b_y * b_dy, axis=1)[:, None])
    _store(dk, b_dy, o_k, i_b, i_c, i_h, Tp, H, K, BT)
    b_s = tl.load(sc).to(acc)
    b_dy = _load(dqn, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)
    if NORM:
        b_y = _load(qn, o_t, o_k, i_b, i_c, i_h, Tp, H, K, BT, acc)  # = sc y
        b_r = _vec(rq, o_t, i_b, i_c, i_h, Tp, H, BT, acc)
        b_dy = b_r[:, None] * (b_dy * b_s - b_y * (tl.sum(b_y * b_dy, axis=1) / b_s)[:, None])
    else:
        b_dy = b_dy * b_s
    _store(dq, b_dy, o_k, i_b, i_c, i_h, Tp, H, K, BT)


def _prec(acc: torch.dtype, inputs: torch.dtype, compounds: bool = False, state: bool = False,
          exact_a: bool = False) -> int:
    """The products' precision (`_dot`) for inputs of dtype `inputs`: 2 with fp64 accumulators; for the kernels whose
    errors compound across chunks (`compounds`: wy_fwd's Tm and W, the summary's M; `state`: the state kernels) 1
    (three tf32 products) under fp32 inputs and COMPOUND_PREC (STATE_PREC) under bf16 / fp16 inputs; for the
    per-chunk output and gradient kernels 0 (one tf32 product) under bf16 / fp16 inputs and 3 (fp32 FMA) under fp32
    inputs. Not three tf32 products there: Triton 3.6 compiled bwd_wy's tf32x3 products to out-of-bounds
    shared-memory reads on an H100 (compute-sanitizer, 2026-12-06; the same kernels' tf32 products under bf16 inputs
    ran clean). `exact_a`: the state kernels' first operands are fp16 (OPERANDS16), so three tf32 products are two
    (4)."""
    if acc == torch.float64:
        return 2
    if compounds or state:
        prec = 1 if inputs == torch.float32 else (STATE_PREC if state else COMPOUND_PREC)
        return 4 if prec == 1 and exact_a else prec
    return 3 if inputs == torch.float32 else 0


def _launch(name: str, K: int, V: int, inputs: torch.dtype | None = None) -> dict[str, int]:
    """LAUNCH[name] (its "/fp32" entry for fp32 / fp64 `inputs` where there is one) with its blocks clipped to the head
    dims."""
    if inputs in (torch.float32, torch.float64) and f"{name}/fp32" in LAUNCH:
        name = f"{name}/fp32"
    cfg = dict(LAUNCH[name])
    if "BK" in cfg:
        cfg["BK"] = min(cfg["BK"], K)
    if "BV" in cfg:
        cfg["BV"] = min(cfg["BV"], V)
    return cfg


def _rows(cfg: dict[str, int], t: torch.Tensor) -> dict[str, int]:
    """cfg with BR = INTERPRETER_BR for CPU tensors (the interpreter, the tests: its time is per program)."""
    if t.device.type != "cuda" and INTERPRETER_BR:
        cfg["BR"] = INTERPRETER_BR
    return cfg


def _shape(k, v):
    B, Tp, H, K = k.shape
    return B, Tp, H, K, v.shape[3], Tp // BT


def wy_fwd(q, k, v, gam, beta, operands: torch.dtype | None = None):
    """-> Tm, P [B, Tp, H, BT] (P None without q), W [B, Tp, H, K], U [B, Tp, H, V], and the decayed operands Kt,
    Qg [B, Tp, H, K] (DECAYED; None when not stored, Qg without q too), in gam's dtype; W, Kt, Qg in `operands`
    when given (OPERANDS16)."""
    B, Tp, H, K, V, NT = _shape(k, v)
    tm = torch.empty(B, Tp, H, BT, device=k.device, dtype=gam.dtype)
    p = None if q is None else torch.empty_like(tm)
    w = torch.empty(B, Tp, H, K, device=k.device, dtype=operands or gam.dtype)
    kt = torch.empty_like(w) if DECAYED else None
    qg = torch.empty_like(w) if DECAYED and q is not None else None
    u = torch.empty(B, Tp, H, V, device=k.device, dtype=gam.dtype)
    ad = torch.empty(B, Tp, H, BS, device=k.device, dtype=gam.dtype)
    pd = None if q is None else torch.empty_like(ad)
    cfg = _rows(_launch("wy_diag", K, V), k)
    kda_wy_diag_kernel[(NT * (BT // cfg["BR"]), B * H)](q, k, gam, ad, pd, Tp, H=H, K=K, BT=BT, BS=BS,
                                                        HAS_Q=q is not None, **cfg)
    prec = _prec(gam.dtype, v.dtype, True)
    kda_wy_fwd_kernel[(NT, B * H)](q, k, v, gam, beta, tm, p, w, u, ad, pd, kt, qg, Tp, H=H, K=K, V=V, BT=BT, BS=BS,
                                   HAS_Q=q is not None, STORE_KT=kt is not None, STORE_QG=qg is not None,
                                   INVERSE=INVERSE, PREC=prec, STORE_WU=not WY_SPLIT,
                                   **_launch("wy_fwd", K, V, v.dtype))
    if WY_SPLIT:
        kda_wu_fwd_kernel[(NT, B * H)](q, k, v, gam, beta, tm, w, u, kt, qg, Tp, H=H, K=K, V=V, BT=BT,
                                       STORE_KT=kt is not None, STORE_QG=qg is not None, PREC=prec,
                                       **_launch("wu_fwd", K, V, v.dtype))
    return tm, p, w, u, kt, qg


class Stored(NamedTuple):
    """What the state kernels store for out_fwd and bwd_wy: the states h, dh [B, NT, H, K, V] or the chunks' vn, dvn
    [B, Tp, H, V]. `values` in the accumulator dtype (exps None), or (STATE16) fp16 with `exps` [B, NT, H, V / block]
    int32: each state's, or each chunk's, block of columns stored times 2^(14 - e) (`_store_state`,
    `_store_chunk`)."""
    values: torch.Tensor
    exps: torch.Tensor | None = None

    @property
    def block(self) -> int:
        """The scale blocks' columns (the kernels' EB), 0 unscaled."""
        return 0 if self.exps is None else self.values.shape[-1] // self.exps.shape[-1]

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values in `dtype` (for tests)."""
        if self.exps is None:
            return self.values.to(dtype)
        scale = torch.exp2((self.exps - 14).to(dtype)).repeat_interleave(self.block, dim=-1)  # [B, NT, H, V]
        if self.values.dim() == 5:  # states: one scale per state's column
            return self.values.to(dtype) * scale[..., None, :]
        # chunks: one scale per chunk's column, over its BT rows
        return (self.values.to(dtype).unflatten(1, (-1, BT)) * scale[:, :, None]).flatten(1, 2)


def _stored(shape: tuple[int, ...], blocks: int, acc: torch.dtype, scaled: bool, device) -> Stored:
    """An empty `Stored` of `shape` ([B, NT, H, K, V] or [B, Tp, H, V]), `blocks` scale blocks a row of columns."""
    if not scaled:
        return Stored(torch.empty(shape, device=device, dtype=acc))
    B, H = shape[0], shape[2]
    NT = shape[1] if len(shape) == 5 else shape[1] // BT
    return Stored(torch.empty(shape, device=device, dtype=torch.float16),
                  torch.empty(B, NT, H, blocks, device=device, dtype=torch.int32))


def state_fwd(w, u, k, gam, kt, h0=None, *, inputs, cols=None, store_h=True, store_vn=True,
              output_final_state=False, resets=None, scaled=0):
    """-> h (`Stored`: the state entering each chunk, [B, NT, H, K, cols]) or None, vn (`Stored` [B, Tp, H, cols])
    or None, ht or None; `scaled` (STATE16's level): h as scaled fp16 from 1, vn too from 2. u None: no values
    (the summary's M: h0 = I, cols = K). kt: wy_fwd's Kt, or None (formed from k and gam). `inputs`: v's dtype (the
    products' precision)."""
    B, Tp, H, K = k.shape
    NT = Tp // BT
    V = u.shape[3] if u is not None else cols
    acc = gam.dtype
    cfg = _launch("state_fwd", K, V)
    h = _stored((B, NT, H, K, V), V // cfg["BV"], acc, scaled >= 1, k.device) if store_h else None
    vn = _stored((B, Tp, H, V), V // cfg["BV"], acc, scaled >= 2, k.device) if store_vn else None
    ht = torch.empty(B, H, K, V, device=k.device, dtype=acc) if output_final_state else None
    prec = _prec(acc, inputs, compounds=u is None, state=u is not None,
                 exact_a=w.dtype == torch.float16 and kt is not None)
    kda_state_fwd_kernel[(V // cfg["BV"], B * H)](
        w, u, k, gam, kt, h0, *(h or (None, None)), *(vn or (None, None)), ht, resets, NT, H=H, K=K, V=V, BT=BT,
        BK=min(K, 64), USE_H0=h0 is not None, HAS_U=u is not None, HAS_KT=kt is not None, STORE_H=store_h,
        STORE_VN=store_vn, STORE_HT=output_final_state, RESETS=resets is not None,
        SCALED=store_h and scaled >= 1, SCALED_ROWS=store_vn and scaled >= 2, PREC=prec, **cfg)
    return h, vn, ht


def _out(q, gam, qg, p, h: Stored | None, vn: Stored | None, do, out, inputs: torch.dtype):
    """out_fwd (h, vn given) or dv_local (do given)."""
    B, Tp, H, _ = p.shape
    K, V, NT = q.shape[3], out.shape[3], Tp // BT
    cfg = _launch("out_fwd", K, V)
    kda_out_fwd_kernel[(NT, V // cfg["BV"], B * H)](q, gam, qg, p, *(h or (None, None)), *(vn or (None, None)), do,
                                                    out, NT, H=H, K=K, V=V, BT=BT, DVL=do is not None,
                                                    HAS_QG=qg is not None, HEB=h.block if h else 0,
                                                    VEB=vn.block if vn else 0,
                                                    PREC=_prec(p.dtype, inputs), **cfg)
    return out


def out_fwd(q, gam, qg, p, h: Stored, vn: Stored, out_dtype):
    """-> o [B, Tp, H, V] in out_dtype (v's); qg: wy_fwd's Qg, or None (formed from q and gam)."""
    out = torch.empty(vn.values.shape, device=vn.values.device, dtype=out_dtype)
    return _out(q, gam, qg, p, h, vn, None, out, out_dtype)


def dv_local(q, p, do, inputs: torch.dtype):
    """-> Pᵀ dO per chunk [B, Tp, H, V] (P's dtype); `inputs` v's dtype."""
    return _out(q, None, None, p, None, None, do, torch.empty(do.shape, device=do.device, dtype=p.dtype), inputs)


def state_bwd(q, k, gam, kt, qg, w, do, dvl, dht=None, *, inputs, store=True, need_dh0=False, resets=None,
              scaled=0):
    """-> dh (`Stored`: the gradient of the state leaving each chunk, [B, NT, H, K, V]), dvn (`Stored` [B, Tp, H,
    V]), dh0 (or Nones); `scaled` (STATE16's level): dh as scaled fp16 from 1, dvn too from 2. kt, qg: wy_fwd's Kt
    and Qg, or None (formed from k, q and gam). `inputs`: v's dtype (the products' precision)."""
    B, Tp, H, K, V, NT = _shape(k, do)
    acc = gam.dtype
    cfg = _launch("state_bwd", K, V)
    dh = _stored((B, NT, H, K, V), V // cfg["BV"], acc, scaled >= 1, k.device) if store else None
    dvn = _stored((B, Tp, H, V), V // cfg["BV"], acc, scaled >= 2, k.device) if store else None
    dh0 = torch.empty(B, H, K, V, device=k.device, dtype=acc) if need_dh0 else None
    kda_state_bwd_kernel[(V // cfg["BV"], B * H)](
        q, k, gam, kt, qg, w, do, dvl, dht, *(dh or (None, None)), *(dvn or (None, None)), dh0, resets, NT, H=H, K=K,
        V=V, BT=BT, BK=min(K, 64), USE_DHT=dht is not None, STORE=store, STORE_DH0=need_dh0, RESETS=resets is not None,
        HAS_KT=kt is not None, HAS_QG=qg is not None, SCALED=store and scaled >= 1, SCALED_ROWS=store and scaled >= 2,
        PREC=_prec(acc, inputs, state=True, exact_a=w.dtype == torch.float16 and kt is not None and qg is not None),
        **cfg)
    return dh, dvn, dh0


def chunk_bwd(q, k, v, gam, beta, tm, h: Stored, dh: Stored, vn: Stored, dvn: Stored, do):
    """-> dq, dk, dgam [B, Tp, H, K], dv [B, Tp, H, V] (in v's dtype), dbeta [B, Tp, H], the others in gam's dtype:
    bwd_wy, then bwd_intra (and intra_diag) adding the pair products' terms in place."""
    B, Tp, H, K, V, NT = _shape(k, v)
    acc = gam.dtype
    dq, dk, dgam = (torch.empty(B, Tp, H, K, device=k.device, dtype=acc) for _ in range(3))
    dv = torch.empty(B, Tp, H, V, device=k.device, dtype=v.dtype)  # written in v's dtype (one rounding, as a cast)
    dbeta = torch.empty(B, Tp, H, device=k.device, dtype=acc)
    da, dp = (torch.empty(B, Tp, H, BT, device=k.device, dtype=acc) for _ in range(2))
    prec = _prec(acc, v.dtype)
    kda_bwd_wy_kernel[(NT, B * H)](q, k, v, gam, beta, tm, *h, *dh, *vn, *dvn, do, dq, dk, dv, dbeta, dgam, da, dp,
                                   NT, H=H, K=K, V=V, BT=BT, HEB=h.block, DHEB=dh.block, VEB=vn.block,
                                   DVEB=dvn.block, PREC=prec,
                                   **_launch("bwd_wy", K, V))
    diag = bool(INTRA_DIAG_KERNEL) and prec != 3  # fp32 inputs: the loop stays in bwd_intra (INTRA_DIAG_KERNEL)
    kda_bwd_intra_kernel[(NT, B * H)](q, k, gam, beta, da, dp, dq, dk, dgam, dbeta, NT, H=H, K=K, BT=BT, BS=BS,
                                      DIAG=diag, PREC=prec, **_launch("bwd_intra", K, V, v.dtype))
    if diag:
        cfg = _rows(_launch("intra_diag", K, V), k)
        kda_intra_diag_kernel[(NT * (BT // cfg["BR"]), B * H)](q, k, gam, beta, da, dp, dq, dk, dgam, dbeta, NT, H=H,
                                                               K=K, BT=BT, BS=BS, **cfg)
    return dq, dk, dv, dbeta, dgam


def prep(q, k, g, scale: float, norm: bool, acc: torch.dtype):
    """Laid-out q (or None), k, g -> qn (or None), kn, gam in acc, and r_q, r_k [B, Tp, H] (None without norm) and
    the scale tensor, for `prep_bwd`."""
    B, Tp, H, K = k.shape
    kn, gam = (torch.empty(B, Tp, H, K, device=k.device, dtype=acc) for _ in range(2))
    qn = None if q is None else torch.empty_like(kn)
    rk = torch.empty(B, Tp, H, device=k.device, dtype=acc) if norm else None
    rq = None if q is None or not norm else torch.empty_like(rk)
    sc = torch.full((1,), scale, device=k.device, dtype=acc)
    kda_prep_kernel[(Tp // BT, B * H)](q, k, g, qn, kn, gam, rq, rk, sc, Tp, H=H, K=K, BT=BT, HAS_Q=q is not None,
                                       NORM=norm, EPS=L2NORM_EPS, **_launch("prep", K, K))
    return qn, kn, gam, rq, rk, sc


def prep_bwd(qn, kn, rq, rk, sc, dqn, dkn, dgam, dtypes):
    """-> dq, dk, dg in dtypes (the inputs')."""
    B, Tp, H, K = kn.shape
    dq, dk, dg = (torch.empty(B, Tp, H, K, device=kn.device, dtype=dt) for dt in dtypes)
    kda_prep_bwd_kernel[(Tp // BT, B * H)](qn, kn, rq, rk, sc, dqn, dkn, dgam, dq, dk, dg, Tp, H=H, K=K, BT=BT,
                                           NORM=rk is not None, **_launch("prep_bwd", K, K))
    return dq, dk, dg
