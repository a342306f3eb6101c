"""Triton kernels of the scalar-decay recurrence (Mamba2's SSD) and their launchers. Imports triton: only on the
Triton path (`deltacp.ops.ssd.triton` loads this module on first use).

Per head h (q, k read from group h // (H / G)), in chunks of BT = 64 tokens, gam the chunk-local cumulative log
decay (inclusive), gl its last value, h_c the state entering chunk c, v = scale * x the values (scale, skip: one
weight per head and token; Mamba2's dt and D):
    state_fwd   h_{c+1} = e^{gl} h_c + (e^{gl - gam} scale * k)ᵀ x                (h_c stored per chunk)
    out_fwd     o = e^{gam} * (q h_c) + (D ∘ q kᵀ ∘ scaleᵀ) x + skip * x,  D_ij = e^{gam_i - gam_j} (j <= i)
    state_bwd   dh_c = e^{gl} dh_{c+1} + (e^{gam} * q)ᵀ dO                         (dh_{c+1} stored per chunk)
    chunk_dx    dv = (D ∘ q kᵀ)ᵀ dO + e^{gl - gam} * (k dh_{c+1})                  (registers only)
                dx = scale * dv + skip * dO,   dscale = sum_p x * dv,   dskip = sum_p x * dO
                M^h = D ∘ dO xᵀ ∘ scaleᵀ (head h),   dS = sum over the group's heads of M^h
                dgam_i (in-chunk part) = rowsum_i(M^h ∘ q kᵀ) - colsum_i(M^h ∘ q kᵀ)
    chunk_dqk   dq = dS k + sum over the group's heads h of e^{gam} * (dO h_cᵀ)
                dk = dSᵀ q + sum over the group's heads h of e^{gl - gam} scale * (x dh_{c+1}ᵀ)
                dgam_i (state part) = q_i·(e^{gam} dO h_cᵀ)_i - k_i·(e^{gl - gam} scale x dh_{c+1}ᵀ)_i
                                      (+ dgl on the chunk's last row)
                dgl = e^{gl} <h_c, dh_{c+1}> + sum_j k_j·(e^{gl - gam_j} dh_{c+1} v_j)
(state_fwd and state_bwd are the two directions of one kernel, state_scan.) The value scale is folded into the
factor a loaded tile already takes (k's weight, D's columns), so v = scale x and the skip term never exist as
[B, Tp, H, P] tensors, and dscale, dskip leave the kernels per token ([B, Tp, H]: the caller reduces a per-head skip
weight such as Mamba2's D over the tokens, 1 / P of the work of reducing x * dO).
dgam is the gradient of the chunk-local cumsum; g's gradient is its suffix sum within the chunk (torch autograd of
the cumsum, chunk.py). Why dgam_i = q_i·dq_i^h - k_i·dk_i^h (head h's own terms, before the group sum): every term
of o and of the next state is linear in q_i with the factor e^{gam_i}, and linear in k_j with e^{-gam_j}, so the
derivative of a term in +gam_i (-gam_j) is the term itself, summed: q_i·dq_i (-k_j·dk_j); the only other place the
gates enter is e^{gl} and e^{gl - gam_j} of the state update, whose derivative in gl is <dh_{c+1}, h_{c+1}> = dgl.
The in-chunk part of dq^h is M^h k, so q_i·(M^h k)_i = sum_j M^h_ij (q_i·k_j) and k_i·(M^hᵀ q)_i = sum_j M^h_ji
(q_j·k_i): the scores q kᵀ of the group, formed once, give every head's part without dq^h itself; dq and dk need
only the sum dS (the gradient of the scores), one product with k and q per group instead of one per head.

Layouts: q, k, dq, dk [B, Tp, G, N]; x, o, dO, dx [B, Tp, H, P]; gam, scale, skip and their gradients [B, Tp, H]
(fp32, fp64 for fp64 inputs);
h, dh [B, NT, H, N, P] in the input dtype; h0, ht, dht, dh0 [B, H, N, P] in the accumulator dtype. Tp = NT * 64: the
wrapper pads every sequence (packed documents: lays them out chunk-aligned, `ops/gdn/varlen.py`), a zero token
(q = k = x = 0, g = 0) leaving the state unchanged. `resets` [NT] int32 (packed rows only): the state entering
those chunks is zero (in the backward, no gradient crosses them).

Accumulation: fp32 (fp64 for fp64 inputs, the interpreter tests). Products: the operands in the input dtype (a
factor applied to a loaded tile is rounded back to it, as the tensor cores take it); fp32 inputs multiply with
tf32x3 (about fp32; plain tf32 would cost ~1e-3). The per-chunk states h, dh are stored in the input dtype: their
only readers are products that round them to that dtype anyway (o, dq, dk, dx), and bf16 halves their bytes
(N = 128, P = 64: 16 KiB per chunk and head in bf16, twice x's chunk). o adds the skip term in the accumulator dtype
and is rounded once, as the eager op; dx is rounded once, from dv, dO in registers.

Tiles: the state kernels (one kernel, ssd_state_scan, both directions) run one program per (P block, N block, row *
head), sequential over chunks (a state row depends only on its own row: the N blocks are independent). ssd_out_fwd
and ssd_chunk_dx run one program per (chunk, row * group, slice of the group's heads: at most GROUP_HEADS = 16 heads
each, so that a one-group model's 128 heads take 8 programs per chunk): q kᵀ once, then the slice's heads in order;
out_fwd by P blocks, looping over N blocks for q h_c; chunk_dx each by P blocks (dx, and dscale, dskip over the
whole P, looping over N blocks for k dh_{c+1}), dO xᵀ once per head; dS summed in accumulator-dtype registers and
stored once per slice in x's dtype ([slices, B, NT, G, 64, 64]: 1/16 of x's bytes at 16 heads of 64 per slice), the
in-chunk dgam part per head. ssd_chunk_dqk then runs one program per (N block, chunk, row * group) for dq and dk
together (a one-group model's heads all in one program, as before the fusion): dS (its slices summed) k and dSᵀ q
once, then per head in order the two state products (dO h_cᵀ, x dh_{c+1}ᵀ), added into two accumulator-dtype tiles
stored once in the input dtype: deterministic, no atomics, no per-head copy in memory, dO xᵀ never recomputed, h and
dh read once. dgam needs the whole of N, so each dqk program writes its N block's part per head, and the launcher
sums the 1 + N / BN parts in order. No tile is wider than 64 whatever N, P are. Every kernel's name starts with ssd_
(profiles group them by it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BT = 64

# Launch configurations (block widths clipped to N, P); "<name>/fp32": the entry for fp32 (and fp64) inputs where it
# differs; "<name>/n<N>": the 16-bit entry for state size N where it differs (`bench/launch_sweep.py --op ssd --shape`
# proposes them for a shape whose N is not Nemotron-H's 128). The n256 entries: the same sweep at 128 heads of 64,
# one group, state 256 (`SSD_SWEEP_SHAPE=h128-g1-n256 gpu_checks.sh ssd_sweep`, one H100, 2026-12-06): the op's fwd +
# bwd at 32K from 19.6 ms (mamba_ssm's Triton SSD at chunk 256: 15.4) to 13.3 ms; the op's bf16 GPU tests pass with
# them (fp32 inputs keep the plain entries at N = 256: they were not swept). The plain bf16 entries: `bench/launch_sweep.py --op ssd --length 32768` (coordinate descent, Nemotron-H-8B's
# shape, one H100, Triton 3.6, 2026-12-06): state_fwd BN 64, out_fwd and chunk_dqk 4 warps, chunk_dx BP 64 took one
# fwd + bwd at 32K from 18.33 to 11.65 ms (the same call); the op's bf16 GPU tests and the Mamba2 mixers at their
# config shapes pass with it. The fp32 entries were chosen so that no kernel spills registers on sm_90 at N = 128 and
# 256, P = 64 (`bench/kernel_resources.py --ops ssd`; chunk_dx under fp32 inputs spills 76 bytes). chunk_dx/fp32
# keeps BN >= 32: with BN = 16 Triton 3.6 compiled its three-tf32 products to out-of-bounds shared-memory reads on an
# H100 (compute-sanitizer, 2026-12-06: an illegal address in the GPU tests; BN = 32 with BP = 16 or 32 ran clean).
LAUNCH: dict[str, dict[str, int]] = {
    "state_fwd": dict(BN=64, BP=32, num_warps=4, num_stages=2),
    "state_bwd": dict(BN=32, BP=32, num_warps=4, num_stages=2),
    "out_fwd": dict(BN=32, BP=64, num_warps=4, num_stages=2),
    "out_fwd/fp32": dict(BN=32, BP=32, num_warps=8, num_stages=1),
    "chunk_dx": dict(BN=32, BP=64, num_warps=8, num_stages=1),
    "chunk_dx/fp32": dict(BN=32, BP=16, num_warps=8, num_stages=1),
    "chunk_dqk": dict(BN=64, BP=32, num_warps=4, num_stages=1),
    "chunk_dqk/fp32": dict(BN=32, BP=32, num_warps=8, num_stages=1),
    "state_fwd/n256": dict(BN=64, BP=64, num_warps=4, num_stages=2),
    "state_bwd/n256": dict(BN=64, BP=32, num_warps=4, num_stages=2),
    "out_fwd/n256": dict(BN=32, BP=64, num_warps=4, num_stages=3),
    "chunk_dx/n256": dict(BN=32, BP=64, num_warps=8, num_stages=3),
    "chunk_dqk/n256": dict(BN=64, BP=32, num_warps=4, num_stages=3),
}
# Heads of a group one out_fwd or chunk_dx program takes at most (the largest divisor of H / G up to it): a one-group
# model's 128 heads in 8 programs per chunk, not one; chunk_dx's dS then in one part per slice, summed by chunk_dqk.
GROUP_HEADS = 16


def _config(name: str, N: int, P: int, dtype: torch.dtype) -> tuple[dict[str, int], dict[str, int]]:
    """(blocks, num_warps / num_stages) of launch `name` for inputs of `dtype`: fp32 and fp64 inputs take its "/fp32"
    entry where there is one, 16-bit inputs its "/n<N>" entry for state size N where there is one (swept under bf16
    only), else the entry itself."""
    wide = dtype in (torch.float32, torch.float64)
    if wide and f"{name}/fp32" in LAUNCH:
        name = f"{name}/fp32"
    elif not wide and f"{name}/n{N}" in LAUNCH:
        name = f"{name}/n{N}"
    cfg = dict(LAUNCH[name])
    opts = {o: cfg.pop(o) for o in ("num_warps", "num_stages")}
    return {"BN": min(cfg["BN"], N), "BP": min(cfg["BP"], P)}, opts


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    """a @ b in the accumulator dtype. PREC 0: bf16/fp16 operands; 1: fp32 operands, three tf32 products (about
    fp32); 2: fp64 (the interpreter tests)."""
    if PREC == 2:
        return tl.dot(a, b, out_dtype=tl.float64)
    elif PREC == 1:
        return tl.dot(a, b, input_precision="tf32x3")
    else:
        return tl.dot(a, b)


@triton.jit(do_not_specialize=["NT"])
def ssd_state_scan_kernel(x, y, gam, scale, s0, s, st, resets, NT,
                          G: tl.constexpr, H: tl.constexpr, N: tl.constexpr, P: tl.constexpr, BT: tl.constexpr,
                          BN: tl.constexpr, BP: tl.constexpr, REVERSE: tl.constexpr, USE_S0: tl.constexpr,
                          USE_SCALE: tl.constexpr, STORE_S: tl.constexpr, STORE_ST: tl.constexpr,
                          RESETS: tl.constexpr, PREC: tl.constexpr):
    """Both state recurrences, one [BN, BP] tile of the state per program, sequential over chunks.
    Forward (x = k, y = the values x): per chunk, zero on a reset, store the entering state, then S = e^{gl} S +
    (e^{gl - gam} scale * k)ᵀ x (the value scale folded into k's weight: v = scale x is never formed); s0 the entering
    state of the row, st the final one.
    Reverse (x = q, y = dO): per chunk from the last, store the gradient of the state leaving it, then
    S = e^{gl} S + (e^{gam} * q)ᵀ dO, zero on a reset (nothing before a reset gets a gradient); s0 = dht, st = dh0."""
    i_p, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    i_g = i_h // (H // G)
    acc = gam.dtype.element_ty
    o_n = i_n * BN + tl.arange(0, BN)
    o_p = i_p * BP + tl.arange(0, BP)
    o_t = tl.arange(0, BT)
    p_state = (i_b * H + i_h) * N * P + o_n[:, None] * P + o_p[None, :]
    b_s = tl.zeros([BN, BP], dtype=acc)
    if USE_S0:
        b_s += tl.load(s0 + p_state).to(acc)
    T = NT * BT
    p_x = x + (i_b * T * G + i_g) * N + o_n[None, :]
    p_y = y + (i_b * T * H + i_h) * P + o_p[None, :]
    p_g = gam + i_b * T * H + i_h
    for i_s in range(NT):
        i_c = NT - 1 - i_s if REVERSE else i_s
        if RESETS and not REVERSE:
            b_s = tl.where(tl.load(resets + i_c) != 0, 0., b_s)
        if STORE_S:
            tl.store(s + ((i_b * NT + i_c) * H + i_h) * N * P + o_n[:, None] * P + o_p[None, :],
                     b_s.to(s.dtype.element_ty))
        o_r = (i_c * BT + o_t).to(tl.int64)  # token rows (int64: T * H * P may pass 2^31)
        b_g = tl.load(p_g + o_r * H)
        b_gl = tl.load(p_g + (i_c * BT + BT - 1) * H)
        b_x = tl.load(p_x + o_r[:, None] * (G * N))
        b_w = tl.exp(b_g) if REVERSE else tl.exp(b_gl - b_g)
        if USE_SCALE and not REVERSE:
            b_w *= tl.load(scale + i_b * T * H + i_h + o_r * H)
        b_xw = (b_x.to(acc) * b_w[:, None]).to(b_x.dtype)
        b_s = b_s * tl.exp(b_gl) + _mm(tl.trans(b_xw), tl.load(p_y + o_r[:, None] * (H * P)), PREC).to(acc)
        if RESETS and REVERSE:
            b_s = tl.where(tl.load(resets + i_c) != 0, 0., b_s)
    if STORE_ST:
        tl.store(st + p_state, b_s)


@triton.jit
def _gates(gam, i_b, i_h, i_c, NT, H: tl.constexpr, BT: tl.constexpr):
    """Token rows of chunk i_c, gam [BT] and gl of head i_h."""
    T = NT * BT
    o_r = (i_c * BT + tl.arange(0, BT)).to(tl.int64)  # token rows (int64: T * H * P may pass 2^31)
    b_g = _per_token(gam, i_b, i_h, o_r, NT, H, BT)
    b_gl = tl.load(gam + (i_b * T + i_c * BT + BT - 1) * H + i_h)
    return o_r, b_g, b_gl


@triton.jit
def _per_token(w, i_b, i_h, o_r, NT, H: tl.constexpr, BT: tl.constexpr):
    """Head i_h's values [BT] of a per-token, per-head tensor w [B, Tp, H] (gam, scale, skip) at token rows o_r."""
    return tl.load(w + (i_b * NT * BT + o_r) * H + i_h)


@triton.jit
def _decay(b_g, BT: tl.constexpr):
    """The causal decay D [BT, BT], D_ij = e^{gam_i - gam_j} (j <= i), else 0 (formed where it is used: a [BT, BT]
    fp32 tile held across a loop costs registers)."""
    o_t = tl.arange(0, BT)
    return tl.where(o_t[:, None] >= o_t[None, :], tl.exp(b_g[:, None] - b_g[None, :]), 0.)


@triton.jit
def _group_scores(q, k, i_b, i_c, i_g, NT, G: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                  PREC: tl.constexpr, acc: tl.constexpr):
    """q kᵀ [BT, BT] of chunk i_c and group i_g in the accumulator dtype, and the offset of the chunk's and group's
    q, k (rows then N at int32 offsets o_t * G N + o_n from it)."""
    o_t = tl.arange(0, BT)
    o_qk0 = (i_b * NT * BT + i_c * BT) * G * N + i_g * N
    b_qk = tl.zeros([BT, BT], dtype=acc)
    for i_n in range(0, N, BN):
        o_qk = o_t[:, None] * (G * N) + i_n + tl.arange(0, BN)[None, :]
        b_qk += _mm(tl.load(q + o_qk0 + o_qk), tl.trans(tl.load(k + o_qk0 + o_qk)), PREC).to(acc)
    return b_qk, o_qk0


@triton.jit(do_not_specialize=["NT"])
def ssd_out_fwd_kernel(q, k, x, gam, scale, skip, h, o, NT,
                       G: tl.constexpr, H: tl.constexpr, N: tl.constexpr, P: tl.constexpr, BT: tl.constexpr,
                       BN: tl.constexpr, BP: tl.constexpr, HS: tl.constexpr, USE_SCALE: tl.constexpr,
                       USE_SKIP: tl.constexpr, PREC: tl.constexpr):
    """o = e^{gam} * (q h_c) + (D ∘ q kᵀ ∘ scaleᵀ) x (+ skip * x, added in the accumulator dtype), rounded once to
    o's dtype; one chunk and 1 / HS of a group's heads per program (as ssd_chunk_dx), the group's scores q kᵀ formed
    once, each head by [BT, BP] tiles. The value scale multiplies D's columns (before the product rounds it to x's
    dtype), the skip weight the loaded x tile."""
    i_c, i_bgs = tl.program_id(0), tl.program_id(1)
    i_bg, i_s = i_bgs // HS, i_bgs % HS
    i_b, i_g = (i_bg // G).to(tl.int64), i_bg % G
    acc = gam.dtype.element_ty
    dt = x.dtype.element_ty
    T = NT * BT
    o_t = tl.arange(0, BT)
    b_qk, o_qk0 = _group_scores(q, k, i_b, i_c, i_g, NT, G, N, BT, BN, PREC, acc)
    for i_hh in range(H // G // HS):
        i_h = i_g * (H // G) + i_s * (H // G // HS) + i_hh
        o_r, b_g, _ = _gates(gam, i_b, i_h, i_c, NT, H, BT)
        b_a = b_qk * _decay(b_g, BT)
        if USE_SCALE:
            b_a *= _per_token(scale, i_b, i_h, o_r, NT, H, BT)[None, :]
        b_a = b_a.to(dt)
        o_t0 = ((i_b * T + i_c * BT) * H + i_h) * P  # x, o of the chunk and head
        o_s0 = ((i_b * NT + i_c) * H + i_h) * N * P  # h of the chunk and head
        for i_p in range(0, P, BP):
            o_p = i_p + tl.arange(0, BP)
            b_o = tl.zeros([BT, BP], dtype=acc)
            for i_n in range(0, N, BN):
                o_n = i_n + tl.arange(0, BN)
                b_q = tl.load(q + o_qk0 + o_t[:, None] * (G * N) + o_n[None, :])
                b_o += _mm(b_q, tl.load(h + o_s0 + o_n[:, None] * P + o_p[None, :]), PREC).to(acc)
            o_tp = o_t[:, None] * (H * P) + o_p[None, :]
            b_x = tl.load(x + o_t0 + o_tp)
            b_o = b_o * tl.exp(b_g)[:, None] + _mm(b_a, b_x, PREC).to(acc)
            if USE_SKIP:
                b_o += _per_token(skip, i_b, i_h, o_r, NT, H, BT)[:, None] * b_x.to(acc)
            tl.store(o + o_t0 + o_tp, b_o.to(o.dtype.element_ty))


@triton.jit(do_not_specialize=["NT"])
def ssd_chunk_dx_kernel(q, k, x, gam, scale, skip, dh, do, dx, dweights, ds, dgam, NT,
                        G: tl.constexpr, H: tl.constexpr, N: tl.constexpr, P: tl.constexpr, BT: tl.constexpr,
                        BN: tl.constexpr, BP: tl.constexpr, HS: tl.constexpr, USE_SCALE: tl.constexpr,
                        USE_SKIP: tl.constexpr, PREC: tl.constexpr):
    """One chunk and 1 / HS of a group's heads per program (the HS slices of a group in separate programs, so that a
    group of many heads still spreads over the GPU), those heads in order, the group's scores q kᵀ formed once. Per
    head, P block by P block: dv = (D ∘ q kᵀ)ᵀ dO + e^{gl - gam} * (k dh_{c+1}) in registers, dx = scale * dv + skip
    * dO (stored in x's dtype), the per-token weights' gradients dscale = sum_p x * dv and dskip = sum_p x * dO
    (dweights [2, B, Tp, H]), and M^h = D ∘ (dO xᵀ) ∘ scaleᵀ, whose rowsum - colsum against q kᵀ is dgam's in-chunk
    part (part 0 of dgam [1 + NB, B, Tp, H]). The slice's part of dS = sum over the group's heads of M^h, the
    gradient of the group's scores, summed in accumulator-dtype registers and stored once in x's dtype in ds [HS, B,
    NT, G, BT, BT] for ssd_chunk_dqk."""
    i_c, i_bgs = tl.program_id(0), tl.program_id(1)
    i_bg, i_s = i_bgs // HS, i_bgs % HS
    i_b, i_g = (i_bg // G).to(tl.int64), i_bg % G
    acc = gam.dtype.element_ty
    dt = x.dtype.element_ty
    T = NT * BT
    o_t = tl.arange(0, BT)
    b_qk, o_qk0 = _group_scores(q, k, i_b, i_c, i_g, NT, G, N, BT, BN, PREC, acc)
    b_ds = tl.zeros([BT, BT], dtype=acc)
    n_row = (tl.num_programs(1) // (G * HS)).to(tl.int64) * T * H  # one [B, Tp, H]
    for i_hh in range(H // G // HS):
        i_h = i_g * (H // G) + i_s * (H // G // HS) + i_hh
        o_r, b_g, b_gl = _gates(gam, i_b, i_h, i_c, NT, H, BT)
        b_a = (b_qk * _decay(b_g, BT)).to(dt)  # (D ∘ q kᵀ), the in-chunk operand of dv
        b_w = tl.exp(b_gl - b_g)
        o_t0 = ((i_b * T + i_c * BT) * H + i_h) * P  # x, dO, dx of the chunk and head
        o_s0 = ((i_b * NT + i_c) * H + i_h) * N * P  # dh of the chunk and head
        b_m = tl.zeros([BT, BT], dtype=acc)  # dO xᵀ
        b_dsc = tl.zeros([BT], dtype=acc)
        b_dsk = tl.zeros([BT], dtype=acc)
        for i_p in range(0, P, BP):
            o_p = i_p + tl.arange(0, BP)
            o_tp = o_t[:, None] * (H * P) + o_p[None, :]
            b_do = tl.load(do + o_t0 + o_tp)
            b_x = tl.load(x + o_t0 + o_tp)
            b_m += _mm(b_do, tl.trans(b_x), PREC).to(acc)
            b_kdh = tl.zeros([BT, BP], dtype=acc)
            for i_n in range(0, N, BN):
                o_n = i_n + tl.arange(0, BN)
                b_k = tl.load(k + o_qk0 + o_t[:, None] * (G * N) + o_n[None, :])
                b_kdh += _mm(b_k, tl.load(dh + o_s0 + o_n[:, None] * P + o_p[None, :]), PREC).to(acc)
            b_dx = _mm(tl.trans(b_a), b_do, PREC).to(acc) + b_kdh * b_w[:, None]  # dv, then dx
            if USE_SCALE:
                b_dsc += tl.sum(b_x.to(acc) * b_dx, axis=1)
                b_dx *= _per_token(scale, i_b, i_h, o_r, NT, H, BT)[:, None]
            if USE_SKIP:
                b_dsk += tl.sum(b_x.to(acc) * b_do.to(acc), axis=1)
                b_dx += _per_token(skip, i_b, i_h, o_r, NT, H, BT)[:, None] * b_do.to(acc)
            tl.store(dx + o_t0 + o_tp, b_dx.to(dx.dtype.element_ty))
        p_w = (i_b * T + o_r) * H + i_h  # [B, Tp, H] of the chunk's tokens, head i_h
        if USE_SCALE:
            tl.store(dweights + p_w, b_dsc)
        if USE_SKIP:
            tl.store(dweights + n_row + p_w, b_dsk)
        b_m *= _decay(b_g, BT)  # formed again: a [BT, BT] tile held across the P loop costs registers
        if USE_SCALE:
            b_m *= _per_token(scale, i_b, i_h, o_r, NT, H, BT)[None, :]
        b_mqk = b_m * b_qk
        tl.store(dgam + p_w, tl.sum(b_mqk, axis=1) - tl.sum(b_mqk, axis=0))
        b_ds += b_m
    n_ds = (tl.num_programs(1) // HS).to(tl.int64) * NT * BT * BT  # one [B, NT, G, BT, BT]
    tl.store(ds + i_s * n_ds + ((i_b * NT + i_c) * G + i_g) * BT * BT + o_t[:, None] * BT + o_t[None, :],
             b_ds.to(ds.dtype.element_ty))


@triton.jit(do_not_specialize=["NT"])
def ssd_chunk_dqk_kernel(q, k, x, gam, scale, h, dh, do, ds, dq, dk, dgam, NT,
                         G: tl.constexpr, H: tl.constexpr, N: tl.constexpr, P: tl.constexpr, BT: tl.constexpr,
                         BN: tl.constexpr, BP: tl.constexpr, HS: tl.constexpr, USE_SCALE: tl.constexpr,
                         PREC: tl.constexpr):
    """The group's dq and dk on one [BT, BN] tile of one chunk: the in-chunk parts from the summed score gradient,
    dS k and dSᵀ q (dS: the sum of ssd_chunk_dx's HS parts, in the accumulator dtype), plus the state parts summed
    over the group's heads in a fixed order, e^{gam} * (dO h_cᵀ) and e^{gl - gam} scale * (x dh_{c+1}ᵀ), in
    accumulator-dtype registers, stored once in the input dtype. Per head, this N block's part of the state terms of
    dgam, q·e^{gam} (dO h_cᵀ) - k·(the state part of dk) plus dgl on the chunk's last row, in part 1 + i_n of dgam
    [1 + NB, B, Tp, H]."""
    i_n, i_c, i_bg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_g = (i_bg // G).to(tl.int64), i_bg % G
    acc = gam.dtype.element_ty
    T = NT * BT
    o_t = tl.arange(0, BT)
    o_n = i_n * BN + tl.arange(0, BN)
    o_r = (i_c * BT + o_t).to(tl.int64)
    p_x = (i_b * T * G + i_g) * N + o_r[:, None] * (G * N) + o_n[None, :]  # q, k, dq, dk
    p_dgam = dgam + (1 + i_n).to(tl.int64) * (tl.num_programs(2) // G) * T * H
    b_q = tl.load(q + p_x)
    b_k = tl.load(k + p_x)
    p_ds = ds + ((i_b * NT + i_c) * G + i_g) * BT * BT + o_t[:, None] * BT + o_t[None, :]
    n_ds = (tl.num_programs(2) // G).to(tl.int64) * NT * G * BT * BT  # one [B, NT, G, BT, BT]
    b_ds = tl.load(p_ds).to(acc)
    for i_s in range(1, HS):
        b_ds += tl.load(p_ds + i_s * n_ds).to(acc)
    b_ds = b_ds.to(b_k.dtype)
    b_dq = _mm(b_ds, b_k, PREC).to(acc)
    b_dk = _mm(tl.trans(b_ds), b_q, PREC).to(acc)
    for i_hh in range(H // G):
        i_h = i_g * (H // G) + i_hh
        o_r, b_g, b_gl = _gates(gam, i_b, i_h, i_c, NT, H, BT)
        # scalar (int64) bases, int32 offsets within the chunk: fewer registers than int64 offset tiles
        o_t0 = ((i_b * T + i_c * BT) * H + i_h) * P  # x, dO
        o_s0 = ((i_b * NT + i_c) * H + i_h) * N * P  # h, dh
        b_sq = tl.zeros([BT, BN], dtype=acc)  # dO h_cᵀ
        b_sk = tl.zeros([BT, BN], dtype=acc)  # x dh_{c+1}ᵀ
        b_hdh = tl.zeros([BN], dtype=acc)  # <h_c, dh_{c+1}> on this N block, by rows
        for i_p in range(0, P, BP):
            o_p = i_p + tl.arange(0, BP)
            o_tp = o_t[:, None] * (H * P) + o_p[None, :]
            o_sp = o_n[:, None] * P + o_p[None, :]
            b_h = tl.load(h + o_s0 + o_sp)
            b_dhc = tl.load(dh + o_s0 + o_sp)
            b_sq += _mm(tl.load(do + o_t0 + o_tp), tl.trans(b_h), PREC).to(acc)
            b_sk += _mm(tl.load(x + o_t0 + o_tp), tl.trans(b_dhc), PREC).to(acc)
            b_hdh += tl.sum(b_h.to(acc) * b_dhc.to(acc), axis=1)
        b_sq *= tl.exp(b_g)[:, None]
        b_w = tl.exp(b_gl - b_g)
        if USE_SCALE:
            b_w *= _per_token(scale, i_b, i_h, o_r, NT, H, BT)
        b_sk *= b_w[:, None]
        b_ks = tl.sum(b_k.to(acc) * b_sk, axis=1)
        b_dgam = tl.sum(b_q.to(acc) * b_sq, axis=1) - b_ks
        b_dgl = tl.exp(b_gl) * tl.sum(b_hdh, axis=0) + tl.sum(b_ks, axis=0)
        tl.store(p_dgam + (i_b * T + o_r) * H + i_h, b_dgam + tl.where(o_t == BT - 1, b_dgl, 0.))
        b_dq += b_sq
        b_dk += b_sk
    tl.store(dq + p_x, b_dq.to(dq.dtype.element_ty))
    tl.store(dk + p_x, b_dk.to(dk.dtype.element_ty))


def _head_slices(rep: int) -> int:
    """How many programs share the rep heads of a group in out_fwd and chunk_dx: each takes the largest divisor of
    rep up to GROUP_HEADS."""
    return rep // max(d for d in range(1, min(rep, GROUP_HEADS) + 1) if rep % d == 0)


def _flags(x: torch.Tensor) -> dict:
    return {"PREC": {torch.float32: 1, torch.float64: 2}.get(x.dtype, 0)}


def _scan(x, y, gam, scale, s0, *, reverse, store_s, output_st, resets):
    B, Tp, G, N = x.shape
    H, P = y.shape[2], y.shape[3]
    NT = Tp // BT
    s = torch.empty(B, NT, H, N, P, device=x.device, dtype=x.dtype) if store_s else None
    st = torch.empty(B, H, N, P, device=x.device, dtype=gam.dtype) if output_st else None
    blocks, opts = _config("state_bwd" if reverse else "state_fwd", N, P, y.dtype)
    grid = (triton.cdiv(P, blocks["BP"]), triton.cdiv(N, blocks["BN"]), B * H)
    ssd_state_scan_kernel[grid](x, y, gam, scale, s0, s, st, resets, NT, G=G, H=H, N=N, P=P, BT=BT,
                                REVERSE=reverse, USE_S0=s0 is not None, USE_SCALE=scale is not None,
                                STORE_S=store_s, STORE_ST=output_st, RESETS=resets is not None, **_flags(y), **blocks,
                                **opts)
    return s, st


def state_fwd(k, x, gam, scale=None, h0=None, *, store_h=True, output_final_state=False, resets=None):
    """-> h [B, NT, H, N, P] (input dtype; the state entering each chunk) or None, ht [B, H, N, P] (gam's dtype)
    or None. The values are scale * x (scale [B, Tp, H] in gam's dtype, or None: x)."""
    return _scan(k, x, gam, scale, h0, reverse=False, store_s=store_h, output_st=output_final_state, resets=resets)


def out_fwd(q, k, x, gam, h, scale=None, skip=None):
    """-> o [B, Tp, H, P] in x's dtype: the values scale * x, plus skip * x when skip is given (scale, skip
    [B, Tp, H] in gam's dtype, or None)."""
    B, Tp, G, N = k.shape
    H, P = x.shape[2], x.shape[3]
    NT = Tp // BT
    o = torch.empty_like(x)
    HS = _head_slices(H // G)
    blocks, opts = _config("out_fwd", N, P, x.dtype)
    ssd_out_fwd_kernel[(NT, B * G * HS)](q, k, x, gam, scale, skip, h, o, NT, G=G, H=H, N=N, P=P, BT=BT, HS=HS,
                                         USE_SCALE=scale is not None, USE_SKIP=skip is not None, **_flags(x),
                                         **blocks, **opts)
    return o


def state_bwd(q, gam, do, dht=None, *, store_dh=True, need_dh0=False, resets=None):
    """-> dh [B, NT, H, N, P] (input dtype; the gradient of the state leaving each chunk) or None, dh0 [B, H, N, P]
    (gam's dtype) or None."""
    return _scan(q, do, gam, None, dht, reverse=True, store_s=store_dh, output_st=need_dh0, resets=resets)


def chunk_bwd(q, k, x, gam, h, dh, do, scale=None, skip=None):
    """-> dq, dk [B, Tp, G, N] (q's dtype; summed over each group's heads in the kernels), dx [B, Tp, H, P] (x's
    dtype), dgam, dscale, dskip [B, Tp, H] (gam's dtype; dscale, dskip None without scale, skip). Two kernels: dx,
    dscale, dskip, the group's score gradient dS and dgam's in-chunk part per (chunk, group); dq, dk and dgam's
    state part per (N block, chunk, group), one part per N block. dgam's parts are summed here (in order:
    deterministic)."""
    B, Tp, G, N = k.shape
    H, P = x.shape[2], x.shape[3]
    NT = Tp // BT
    dx = torch.empty_like(x)
    dweights = (torch.empty(2, *gam.shape, device=gam.device, dtype=gam.dtype)
                if scale is not None or skip is not None else None)
    NB = triton.cdiv(N, _config("chunk_dqk", N, P, x.dtype)[0]["BN"])
    dgam = torch.empty(1 + NB, *gam.shape, device=gam.device, dtype=gam.dtype)
    HS = _head_slices(H // G)
    ds = torch.empty(HS, B, NT, G, BT, BT, device=x.device, dtype=x.dtype)
    blocks, opts = _config("chunk_dx", N, P, x.dtype)
    ssd_chunk_dx_kernel[(NT, B * G * HS)](q, k, x, gam, scale, skip, dh, do, dx, dweights, ds, dgam, NT, G=G, H=H,
                                          N=N, P=P, BT=BT, HS=HS, USE_SCALE=scale is not None,
                                          USE_SKIP=skip is not None, **_flags(x), **blocks, **opts)
    dscale = None if scale is None else dweights[0]
    dskip = None if skip is None else dweights[1]
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    blocks, opts = _config("chunk_dqk", N, P, x.dtype)
    ssd_chunk_dqk_kernel[(NB, NT, B * G)](q, k, x, gam, scale, h, dh, do, ds, dq, dk, dgam, NT, G=G, H=H, N=N, P=P,
                                          BT=BT, HS=HS, USE_SCALE=scale is not None, **_flags(x), **blocks, **opts)
    return dq, dk, dx, dgam.sum(0), dscale, dskip
