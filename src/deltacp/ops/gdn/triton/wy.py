"""WY representation of a chunk: T = (I + A)^-1, W = T (beta e^g K), U = T (beta V), and its backward.

Layouts (T divisible by BT=64, g is the chunk-local cumulative gate in fp32):
    k [B, T, Hk, K]   v [B, T, Hv, V]   beta, gc [B, T, Hv]
    ai [B, T, Hv, BT] fp32: row t of chunk c holds row (t mod BT) of T_c = (I + A_c)^-1 (upper part zero)
    w [B, T, Hv, K], u [B, T, Hv, V] in the dtype of k / v

Per-chunk and token tensors, packed documents' chunk table, the row helpers and the masks of head dims that are not
a multiple of the block (K = 96: the last BK = 64 block half masked; tiles spanning K are padded(K) wide):
`indexing.py`.

A_c = strict-lower(diag(beta) K K^T * Gamma), Gamma_ij = exp(g_i - g_j). The inverse is built from four
16x16 diagonal blocks (forward substitution in registers) merged by block forward substitution.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltacp.ops.gdn.triton.indexing import (
    BT, chunk_rows, chunk_tokens, load_rows, load_tok_rows, load_tok_vec, load_vec, padded, store_rows, store_tok,
    store_tok_rows)
from deltacp.ops.gdn.triton.launch import launch_config

BS = 16  # diagonal block of the triangular solve


@triton.jit
def _a_block(b_ki, b_kj, b_bi, b_gi, b_gj, DIAG: tl.constexpr, BS: tl.constexpr):
    """A block (rows i, cols j): beta_i k_i.k_j exp(g_i - g_j), strictly lower on the diagonal."""
    b_a = tl.dot(b_ki, tl.trans(b_kj))
    if DIAG:
        o_s = tl.arange(0, BS)
        m_s = o_s[:, None] > o_s[None, :]
        b_a = tl.where(m_s, b_a * tl.exp(b_gi[:, None] - b_gj[None, :]), 0.)
    else:
        b_a = b_a * tl.exp(b_gi[:, None] - b_gj[None, :])
    return b_a * b_bi[:, None]


@triton.jit
def _inv_unit_lower(b_a, BS: tl.constexpr):
    """(I + A)^-1 for a strictly lower BSxBS block A, by forward substitution row by row."""
    o_s = tl.arange(0, BS)
    b_x = -b_a
    for i in range(1, BS):
        b_r = tl.sum(tl.where(o_s[:, None] == i, b_x, 0.), 0)
        b_r = b_r + tl.sum(b_r[:, None] * b_x, 0)
        b_x = tl.where(o_s[:, None] == i, b_r[None, :], b_x)
    return b_x + (o_s[:, None] == o_s[None, :]).to(tl.float32)


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _split_bf16(x):
    """fp32 x -> (hi, lo) bf16 with hi + lo = x to ~16 mantissa bits (tf32 keeps 11)."""
    b_hi = x.to(tl.bfloat16)
    return b_hi, (x - b_hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot_split(a_hi, a_lo, b):
    """(a_hi + a_lo) @ b for b exact in bf16: two bf16 MMAs, more precise than one tf32 MMA on fp32 operands and
    the loaded bf16 operand needs no conversion."""
    return tl.dot(a_lo, b, tl.dot(a_hi, b))


@triton.jit(do_not_specialize=["T"])
def kkt_inv_diag_kernel(
    k, beta, gc, ai, cidx,
    T,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """One 16x16 diagonal block of T per program: (I + A_ss)^-1, written into ai (one warp: cheap reductions)."""
    i_ts, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // Hv).to(tl.int64), i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    i_s = i_ts % (BT // BS)
    r0 = i_ts * BS
    x0, rx, n = chunk_tokens(cidx, i_ts // (BT // BS), i_s * BS, r0, BT, VARLEN)
    b_k = load_tok_rows(k + (i_b * T * Hk + i_hk) * K + x0 * (Hk * K), rx, n, Hk * K, BS, KP, VARLEN, K, KP != K)
    b_g = load_vec(gc + i_b * T * Hv + i_h, r0, Hv, BS)
    b_b = load_tok_vec(beta + i_b * T * Hv + i_h + x0 * Hv, rx, n, Hv, BS, VARLEN)
    b_t = _inv_unit_lower(_a_block(b_k, b_k, b_b, b_g, b_g, True, BS), BS)
    store_rows(ai + (i_b * T * Hv + i_h) * BT + i_s * BS, r0, Hv * BT, b_t, BS, BS)


@triton.jit(do_not_specialize=["T"])
def tril_merge_kernel(
    k, beta, gc, ai, cidx,
    T,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    BT: tl.constexpr, BS: tl.constexpr, MERGE_PREC: tl.constexpr, VARLEN: tl.constexpr,
):
    """T = (I + A)^-1 of one chunk from its four 16x16 diagonal inverses (kkt_inv_diag_kernel wrote them into ai;
    computing them in this kernel is slower at every warp count: NOTES.md).
    MERGE_PREC: product precision of the merge ("ieee" fp32 FMAs, or "tf32x3" tensor-core products)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // Hv).to(tl.int64), i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    t0 = i_t * BT
    x0, rx, n = chunk_tokens(cidx, i_t, 0, t0, BT, VARLEN)

    p_k = k + (i_b * T * Hk + i_hk) * K + x0 * (Hk * K)
    p_g = gc + i_b * T * Hv + i_h
    p_b = beta + i_b * T * Hv + i_h + x0 * Hv

    b_k0 = load_tok_rows(p_k, rx + 0 * BS, n, Hk * K, BS, KP, VARLEN, K, KP != K)
    b_k1 = load_tok_rows(p_k, rx + 1 * BS, n, Hk * K, BS, KP, VARLEN, K, KP != K)
    b_k2 = load_tok_rows(p_k, rx + 2 * BS, n, Hk * K, BS, KP, VARLEN, K, KP != K)
    b_k3 = load_tok_rows(p_k, rx + 3 * BS, n, Hk * K, BS, KP, VARLEN, K, KP != K)
    b_g0 = load_vec(p_g, t0 + 0 * BS, Hv, BS)
    b_g1 = load_vec(p_g, t0 + 1 * BS, Hv, BS)
    b_g2 = load_vec(p_g, t0 + 2 * BS, Hv, BS)
    b_g3 = load_vec(p_g, t0 + 3 * BS, Hv, BS)
    b_b1 = load_tok_vec(p_b, rx + 1 * BS, n, Hv, BS, VARLEN)
    b_b2 = load_tok_vec(p_b, rx + 2 * BS, n, Hv, BS, VARLEN)
    b_b3 = load_tok_vec(p_b, rx + 3 * BS, n, Hv, BS, VARLEN)

    # A blocks (i > j full, i == j strictly lower)
    b_a10 = _a_block(b_k1, b_k0, b_b1, b_g1, b_g0, False, BS)
    b_a20 = _a_block(b_k2, b_k0, b_b2, b_g2, b_g0, False, BS)
    b_a21 = _a_block(b_k2, b_k1, b_b2, b_g2, b_g1, False, BS)
    b_a30 = _a_block(b_k3, b_k0, b_b3, b_g3, b_g0, False, BS)
    b_a31 = _a_block(b_k3, b_k1, b_b3, b_g3, b_g1, False, BS)
    b_a32 = _a_block(b_k3, b_k2, b_b3, b_g3, b_g2, False, BS)

    # T = (I + A)^-1 by block forward substitution (diagonal blocks from kkt_inv_diag_kernel)
    p_ai = ai + (i_b * T * Hv + i_h) * BT
    b_t00 = load_rows(p_ai + 0 * BS, t0 + 0 * BS, Hv * BT, BS, BS)
    b_t11 = load_rows(p_ai + 1 * BS, t0 + 1 * BS, Hv * BT, BS, BS)
    b_t22 = load_rows(p_ai + 2 * BS, t0 + 2 * BS, Hv * BT, BS, BS)
    b_t33 = load_rows(p_ai + 3 * BS, t0 + 3 * BS, Hv * BT, BS, BS)
    b_t10 = -_mm(b_t11, _mm(b_a10, b_t00, MERGE_PREC), MERGE_PREC)
    b_t21 = -_mm(b_t22, _mm(b_a21, b_t11, MERGE_PREC), MERGE_PREC)
    b_t20 = -_mm(b_t22, _mm(b_a20, b_t00, MERGE_PREC) + _mm(b_a21, b_t10, MERGE_PREC), MERGE_PREC)
    b_t32 = -_mm(b_t33, _mm(b_a32, b_t22, MERGE_PREC), MERGE_PREC)
    b_t31 = -_mm(b_t33, _mm(b_a31, b_t11, MERGE_PREC) + _mm(b_a32, b_t21, MERGE_PREC), MERGE_PREC)
    b_t30 = -_mm(b_t33, _mm(b_a30, b_t00, MERGE_PREC) + _mm(b_a31, b_t10, MERGE_PREC)
                 + _mm(b_a32, b_t20, MERGE_PREC), MERGE_PREC)

    b_z = tl.zeros([BS, BS], dtype=tl.float32)
    store_rows(p_ai + 1 * BS, t0 + 0 * BS, Hv * BT, b_z, BS, BS)
    store_rows(p_ai + 2 * BS, t0 + 0 * BS, Hv * BT, b_z, BS, BS)
    store_rows(p_ai + 3 * BS, t0 + 0 * BS, Hv * BT, b_z, BS, BS)
    store_rows(p_ai + 0 * BS, t0 + 1 * BS, Hv * BT, b_t10, BS, BS)
    store_rows(p_ai + 2 * BS, t0 + 1 * BS, Hv * BT, b_z, BS, BS)
    store_rows(p_ai + 3 * BS, t0 + 1 * BS, Hv * BT, b_z, BS, BS)
    store_rows(p_ai + 0 * BS, t0 + 2 * BS, Hv * BT, b_t20, BS, BS)
    store_rows(p_ai + 1 * BS, t0 + 2 * BS, Hv * BT, b_t21, BS, BS)
    store_rows(p_ai + 3 * BS, t0 + 2 * BS, Hv * BT, b_z, BS, BS)
    store_rows(p_ai + 0 * BS, t0 + 3 * BS, Hv * BT, b_t30, BS, BS)
    store_rows(p_ai + 1 * BS, t0 + 3 * BS, Hv * BT, b_t31, BS, BS)
    store_rows(p_ai + 2 * BS, t0 + 3 * BS, Hv * BT, b_t32, BS, BS)



@triton.jit(do_not_specialize=["T"])
def wu_fwd_kernel(
    k, v, beta, gc, ai, w, u, cidx,
    T,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr, DO_U: tl.constexpr, SPLIT: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """W = T (beta e^g K), U = T (beta V) (U only if DO_U) with the full 64x64 T.

    SPLIT (bf16 k, v): the row scales move onto T's columns, W = (T diag(beta e^g)) K, and that fp32 matrix is
    split into hi + lo bf16, so K, V enter the products as loaded (exact). Otherwise fp32 operands with DOT_PREC
    products."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // Hv).to(tl.int64), i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    t0 = i_t * BT
    x0, rx, n = chunk_tokens(cidx, i_t, 0, t0, BT, VARLEN)
    b_T = load_rows(ai + (i_b * T * Hv + i_h) * BT, t0, Hv * BT, BT, BT)
    b_g = load_vec(gc + i_b * T * Hv + i_h, t0, Hv, BT)
    b_b = load_tok_vec(beta + i_b * T * Hv + i_h + x0 * Hv, rx, n, Hv, BT, VARLEN)
    b_s = b_b * tl.exp(b_g)
    if SPLIT:
        b_tw_hi, b_tw_lo = _split_bf16(b_T * b_s[None, :])
    for i_k in range((K + BK - 1) // BK):
        b_k = load_tok_rows(k + (i_b * T * Hk + i_hk) * K + x0 * (Hk * K) + i_k * BK, rx, n, Hk * K, BT, BK,
                             VARLEN, K - i_k * BK, K % BK != 0)
        if SPLIT:
            b_w = _dot_split(b_tw_hi, b_tw_lo, b_k)
        else:
            b_w = tl.dot(b_T, b_k.to(tl.float32) * b_s[:, None], input_precision=DOT_PREC)
        store_rows(w + (i_b * T * Hv + i_h) * K + i_k * BK, t0, Hv * K, b_w, BT, BK, K - i_k * BK, K % BK != 0)
    if DO_U:
        if SPLIT:
            b_tu_hi, b_tu_lo = _split_bf16(b_T * b_b[None, :])
        for i_v in range((V + BV - 1) // BV):
            b_v = load_tok_rows(v + (i_b * T * Hv + i_h) * V + x0 * (Hv * V) + i_v * BV, rx, n, Hv * V, BT, BV,
                                 VARLEN, V - i_v * BV, V % BV != 0)
            if SPLIT:
                b_u = _dot_split(b_tu_hi, b_tu_lo, b_v)
            else:
                b_u = tl.dot(b_T, b_v.to(tl.float32) * b_b[:, None], input_precision=DOT_PREC)
            store_rows(u + (i_b * T * Hv + i_h) * V + i_v * BV, t0, Hv * V, b_u, BT, BV, V - i_v * BV, V % BV != 0)


@triton.jit(do_not_specialize=["T"])
def wy_bwd_kernel(
    k, v, beta, gc, ai, dw, du, dk_in, dk, dv, dbeta, dg, scratch, cidx,
    T,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SPLIT: tl.constexpr, VARLEN: tl.constexpr,
):
    """From dW, dU: dk (dk_in, the non-WY part, plus the WY part), dv, dbeta, dg (chunk-local gate).

    Products: without SPLIT all tf32 on fp32 operands. SPLIT (bf16 k, v, du): bf16 MMAs wherever one operand is
    exact in bf16 as loaded - du v^T exactly, then beta on its columns; dW k^T with dW split hi + lo, then
    beta e^g on its columns; T^T du and dGs k with T^T, dGs split - which is both faster (no fp32 copy of the
    loaded tile, half the shared-memory bytes) and more precise than tf32 - and T^T dW from three bf16 products
    (hi hi + hi lo + lo hi). T^T dT T^T stays tf32.

    dkb = T^T dW is formed once, in the last loop (dbeta and dg take their dW parts there).
    `scratch` holds one BTxBT fp32 block per program: dG^T is read back from it transposed. tl.trans of a
    tensor that comes out of tl.dot (MMA register layout) is miscompiled on Hopper by Triton 3.4-3.7.0 for some
    block shapes (fla-org/flash-linear-attention#640; here: results off by 5e-2 for every shape but BK64/BV64)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // Hv).to(tl.int64), i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    t0 = i_t * BT
    x0, rx, n = chunk_tokens(cidx, i_t, 0, t0, BT, VARLEN)
    MK: tl.constexpr = K % BK != 0  # a partial last block (masked columns)
    MV: tl.constexpr = V % BV != 0

    p_k = k + (i_b * T * Hk + i_hk) * K + x0 * (Hk * K)  # token tensors (rows rx + ...)
    p_v = v + (i_b * T * Hv + i_h) * V + x0 * (Hv * V)
    p_dw = dw + (i_b * T * Hv + i_h) * K
    p_dk_in = dk_in + (i_b * T * Hv + i_h) * K
    p_dk = dk + (i_b * T * Hv + i_h) * K + x0 * (Hv * K)
    p_du = du + (i_b * T * Hv + i_h) * V
    p_dv = dv + (i_b * T * Hv + i_h) * V + x0 * (Hv * V)

    o_t = tl.arange(0, BT)
    b_g = load_vec(gc + i_b * T * Hv + i_h, t0, Hv, BT)
    b_beta = load_tok_vec(beta + i_b * T * Hv + i_h + x0 * Hv, rx, n, Hv, BT, VARLEN)
    b_eg = tl.exp(b_g)
    b_s = b_beta * b_eg  # W's row scale
    b_T = load_rows(ai + (i_b * T * Hv + i_h) * BT, t0, Hv * BT, BT, BT)
    if SPLIT:
        b_tt_hi, b_tt_lo = _split_bf16(tl.trans(b_T))

    # dT = dW (s K)^T + dU (beta V)^T ;  kk = K K^T
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range((K + BK - 1) // BK):
        b_k = load_tok_rows(p_k + i_k * BK, rx, n, Hk * K, BT, BK, VARLEN, K - i_k * BK, MK)
        b_dw = load_rows(p_dw + i_k * BK, t0, Hv * K, BT, BK, K - i_k * BK, MK).to(tl.float32)
        if SPLIT:
            b_dw_hi, b_dw_lo = _split_bf16(b_dw)
            b_dT += _dot_split(b_dw_hi, b_dw_lo, tl.trans(b_k))
        else:
            b_dT += tl.dot(b_dw, tl.trans(b_k.to(tl.float32) * b_s[:, None]))
        b_kk += tl.dot(b_k, tl.trans(b_k))
    if SPLIT:
        b_dT = b_dT * b_s[None, :]
        b_dTv = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_v in range((V + BV - 1) // BV):
        b_v = load_tok_rows(p_v + i_v * BV, rx, n, Hv * V, BT, BV, VARLEN, V - i_v * BV, MV)
        b_du = load_rows(p_du + i_v * BV, t0, Hv * V, BT, BV, V - i_v * BV, MV)
        if SPLIT:
            b_dTv += tl.dot(b_du, tl.trans(b_v))
            b_dvb = _dot_split(b_tt_hi, b_tt_lo, b_du)
        else:
            b_dT += tl.dot(b_du.to(tl.float32), tl.trans(b_v.to(tl.float32) * b_beta[:, None]))
            b_dvb = tl.dot(tl.trans(b_T), b_du.to(tl.float32))
        b_dbeta += tl.sum(b_dvb * b_v.to(tl.float32), 1)
        store_tok_rows(p_dv + i_v * BV, rx, n, Hv * V, b_dvb * b_beta[:, None], BT, BV, VARLEN, V - i_v * BV, MV)
    if SPLIT:
        b_dT += b_dTv * b_beta[None, :]

    m_s = o_t[:, None] > o_t[None, :]
    b_dA = -tl.dot(tl.dot(tl.trans(b_T), b_dT), tl.trans(b_T))
    b_gam = tl.where(m_s, tl.exp(b_g[:, None] - b_g[None, :]), 0.)
    b_dA = tl.where(m_s, b_dA, 0.)
    b_dAg = b_dA * b_gam * b_kk                      # dA_ij * A_ij / beta_i
    b_dbeta += tl.sum(b_dAg, 1)
    b_dAA = b_dAg * b_beta[:, None]
    b_dg = tl.sum(b_dAA, 1) - tl.sum(b_dAA, 0)
    b_dG = b_dA * b_gam * b_beta[:, None]
    p_s = scratch + (i_bh * tl.num_programs(0) + i_t).to(tl.int64) * BT * BT
    tl.store(p_s + o_t[:, None] * BT + o_t[None, :], b_dG)
    tl.debug_barrier()  # the block's stores are visible to all its threads after the barrier
    b_dGs = b_dG + tl.load(p_s + o_t[None, :] * BT + o_t[:, None])
    if SPLIT:
        b_dgs_hi, b_dgs_lo = _split_bf16(b_dGs)
    for i_k in range((K + BK - 1) // BK):
        b_k = load_tok_rows(p_k + i_k * BK, rx, n, Hk * K, BT, BK, VARLEN, K - i_k * BK, MK)
        b_dw = load_rows(p_dw + i_k * BK, t0, Hv * K, BT, BK, K - i_k * BK, MK).to(tl.float32)
        if SPLIT:
            b_dw_hi, b_dw_lo = _split_bf16(b_dw)
            b_dkb = tl.dot(b_tt_lo, b_dw_hi, tl.dot(b_tt_hi, b_dw_lo, tl.dot(b_tt_hi, b_dw_hi)))
        else:
            b_dkb = tl.dot(tl.trans(b_T), b_dw)
        b_r = tl.sum(b_dkb * b_k.to(tl.float32), 1)
        b_dbeta += b_r * b_eg
        b_dg += b_r * b_s
        b_dk = load_rows(p_dk_in + i_k * BK, t0, Hv * K, BT, BK, K - i_k * BK, MK).to(tl.float32) + b_dkb * b_s[:, None]
        if SPLIT:
            b_dk += _dot_split(b_dgs_hi, b_dgs_lo, b_k)
        else:
            b_dk += tl.dot(b_dGs, b_k.to(tl.float32))
        store_tok_rows(p_dk + i_k * BK, rx, n, Hv * K, b_dk, BT, BK, VARLEN, K - i_k * BK, MK)

    o_r = t0 + o_t
    o_x = rx + o_t
    store_tok(dbeta + (i_b * T + x0 + o_x) * Hv + i_h, b_dbeta, o_x < n, VARLEN)
    tl.store(dg + (i_b * T + o_r) * Hv + i_h, b_dg)


def _bf16(*xs: torch.Tensor) -> bool:
    return all(x.dtype == torch.bfloat16 for x in xs)


def wy_fwd(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, gc: torch.Tensor,
           w_dtype: torch.dtype | None = None, dot_precision: str = "tf32", need_u: bool = True, chunks=None):
    """-> ai [B,Tc,Hv,BT] fp32, w [B,Tc,Hv,K] (dtype of k unless w_dtype), u [B,Tc,Hv,V] (None unless need_u).

    chunks: None (k, v, beta have the Tc rows of gc), or the chunk table of packed documents (k, v, beta are the
    packed row; ai, w, u per chunk, as gc)."""
    ai = wy_inverse(k, beta, gc, v.shape[2], chunks=chunks)
    w, u = wu_fwd(k, v, beta, gc, ai, w_dtype=w_dtype, dot_precision=dot_precision, need_u=need_u, chunks=chunks)
    return ai, w, u


def wy_inverse(k: torch.Tensor, beta: torch.Tensor, gc: torch.Tensor, Hv: int, chunks=None) -> torch.Tensor:
    """T = (I + A)^-1 per chunk -> ai [B,Tc,Hv,BT] fp32 (rows of each chunk's T, upper part zero)."""
    B, _, Hk, K = k.shape
    T, varlen = chunk_rows(gc, chunks)
    ai = torch.empty(B, T, Hv, BT, device=k.device, dtype=torch.float32)
    _, opts = launch_config("kkt_inv_diag")
    kkt_inv_diag_kernel[(T // BS, B * Hv)](k, beta, gc, ai, chunks, T, Hk=Hk, Hv=Hv, K=K, KP=padded(K), BT=BT, BS=BS,
                                           VARLEN=varlen, **opts)
    blocks, opts = launch_config("tril_merge")
    tril_merge_kernel[(T // BT, B * Hv)](k, beta, gc, ai, chunks, T, Hk=Hk, Hv=Hv, K=K, KP=padded(K), BT=BT, BS=BS,
                                         VARLEN=varlen, **blocks, **opts)
    return ai


def wu_fwd(k, v, beta, gc, ai, w_dtype=None, dot_precision="tf32", need_u=True, chunks=None):
    """W, U from a T already computed (the forward keeps T for the backward); U is None unless need_u."""
    B, _, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    T, varlen = chunk_rows(gc, chunks)
    w = torch.empty(B, T, Hv, K, device=k.device, dtype=w_dtype or k.dtype)
    u = torch.empty(B, T, Hv, V, device=k.device, dtype=v.dtype) if need_u else None
    # the summary (fp32 W, tf32x3 products) keeps the block shape its accuracy was validated with
    blocks, opts = launch_config("wu_fwd" if dot_precision == "tf32" else "summary_wu_fwd", K=K, V=V)
    # the split needs K, V exact in bf16 and only replaces tf32 products (the summary's tf32x3 W keeps fp32)
    blocks["SPLIT"] = blocks.get("SPLIT", 0) if _bf16(k, v) and dot_precision == "tf32" else 0
    wu_fwd_kernel[(T // BT, B * Hv)](k, v, beta, gc, ai, w, u, chunks, T, Hk=Hk, Hv=Hv, K=K, V=V, BT=BT,
                                     DOT_PREC=dot_precision, DO_U=need_u, VARLEN=varlen, **blocks, **opts)
    return w, u


def wy_bwd(k, v, beta, gc, ai, dw, du, dk_in, dk_dtype=torch.float32, dv_dtype=torch.float32, chunks=None):
    """dk_in [B,Tc,Hv,K] fp32: the non-WY part of dk. -> dk (dk_dtype), dv (dv_dtype), dbeta (fp32) with the rows of
    k (the packed row's under `chunks`), dg (fp32, chunk-local, per chunk).

    The caller picks bf16 outputs where nothing is summed after this kernel (a cast pass less over memory)."""
    B, Tk, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    T, varlen = chunk_rows(gc, chunks)
    dk = torch.empty(B, Tk, Hv, K, device=k.device, dtype=dk_dtype)
    dv = torch.empty(B, Tk, Hv, V, device=k.device, dtype=dv_dtype)
    dbeta = torch.empty(B, Tk, Hv, device=k.device, dtype=torch.float32)
    dg = torch.empty(B, T, Hv, device=k.device, dtype=torch.float32)
    scratch = torch.empty(B * Hv * (T // BT), BT, BT, device=k.device, dtype=torch.float32)
    blocks, opts = launch_config("wy_bwd", K=K, V=V)
    blocks["SPLIT"] = blocks.get("SPLIT", 0) if _bf16(k, v, du) else 0
    wy_bwd_kernel[(T // BT, B * Hv)](k, v, beta, gc, ai, dw, du, dk_in, dk, dv, dbeta, dg, scratch, chunks, T, Hk=Hk,
                                      Hv=Hv, K=K, V=V, BT=BT, VARLEN=varlen, **blocks, **opts)
    return dk, dv, dbeta, dg
