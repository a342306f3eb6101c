"""Triton kernels of KDA (Kimi delta attention, `ops/kda/eager.py` is the reference) and their launchers. Imports
triton: only on the Triton path (`deltacp.ops.kda.triton` loads this module on first use).

Per chunk of BT = 64 tokens and head, gam the chunk-local inclusive cumsum of g (per key channel), gl its last row,
q already l2-normalised and scaled, k l2-normalised, h_c the state [K, V] entering chunk c:
    wy_fwd     A_ij = beta_i sum_c k_ic k_jc e^{gam_ic - gam_jc} (j < i),  Tm = (I + A)^-1 (16 x 16 diagonal blocks
               by forward substitution, then (I - N)(I + N^2) D, `_inverse`),
               W = Tm (beta k e^{gam}),  U = Tm (beta v)
    state_fwd  vn = U - W h_c,  h_{c+1} = e^{gl} h_c + (k e^{gl - gam})ᵀ vn    (h_c, vn stored; with no U and
               h_0 = I it is the summary's M, one K-column block of it per program)
    out_fwd    o = (q e^{gam}) h_c + P vn,  P_ij = sum_c q_ic k_jc e^{gam_ic - gam_jc} (j <= i)
               (DVL: dvl = Pᵀ dO instead, the part of dvn the outputs of the chunk itself give)
    state_bwd  dvn = dvl + (k e^{gl - gam}) dh_{c+1},  dh_c = e^{gl} dh_{c+1} + (q e^{gam})ᵀ dO - Wᵀ dvn
               (dh_{c+1} and dvn stored; dh_0 the entering state's gradient)
    chunk_bwd  dq, dk, dv, dbeta, dgam of one chunk from h_c, dh_{c+1}, vn, dvn and the kept Tm (formulas below)
dgam is the gradient of the chunk-local cumsum; g's is its suffix sum within the chunk (torch autograd, chunk.py).

Decayed pair products (A, P and their backward): every factor e^{gam_ic - gam_jc} is formed per element with
i >= j, where gam non-increasing (g <= 0) makes the exponent <= 0; e^{gam} and e^{gl - gam} are <= 1 as well. No
exponent is ever positive, so nothing overflows for any finite g <= 0 however fast (Kimi's unbounded gate and
Bailing's g >= kda_lower_bound alike); an underflow drops only a term below e^{-87} (fp32) times the products of
unit vectors. The pair products step over the chunk's columns j, BJ at a time ([BT, BJ, K] elementwise tiles; BJ =
64, one step, under the interpreter, PAIR_BJ on a GPU, `_bj`): exact, but without tensor cores (the state and WY
products use tl.dot).

Layouts (every tensor contiguous, Tp = NT * 64 rows per sequence: padded, or a packed row laid out chunk-aligned,
`ops/gdn/varlen.py`; a zero token leaves the state unchanged): q, k, gam, W [B, Tp, H, K]; v, U, vn, dvl, dvn, o,
dO [B, Tp, H, V]; beta [B, Tp, H]; Tm [B, Tp, H, BT]; h, dh [B, NT, H, K, V]; h0, ht, dht, dh0 [B, H, K, V].
Everything the kernels compute and store is in the accumulator dtype (fp32; fp64 for fp64 inputs, the interpreter
tests), except o (v's dtype); loads are cast to it. `resets` [NT] int32 (packed rows only): the state entering those
chunks is zero (backward: no gradient crosses them).

Grids: per-chunk kernels (wy_fwd, out_fwd, chunk_bwd) one program per (chunk, row * head), whole K and V in a tile;
state kernels one program per (V block, row * head), sequential over chunks, [K, BV] state tile. Names start
with kda_.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BT = 64
BV = 32  # the state kernels' column block (clipped to V)
PAIR_BJ = 4  # columns per step of the decayed pair products on a GPU (see _bj)

# Launch configurations. The state kernels pipeline two chunks at most: three stages of their fp32 [64, K] tiles
# need 246,784 bytes of shared memory at K = 128, over a Hopper program's 232,448 (Triton 3.6 refused to launch
# them on an H100, 2026-12-06; bench/kernel_resources.py finds the same offline).
LAUNCH: dict[str, dict[str, int]] = {
    "wy_fwd": dict(num_warps=4, num_stages=3),
    "state_fwd": dict(num_warps=4, num_stages=2),
    "out_fwd": dict(num_warps=4, num_stages=3),
    "state_bwd": dict(num_warps=4, num_stages=2),
    "chunk_bwd": dict(num_warps=8, num_stages=3),
}


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b, operands in the accumulator dtype. PREC 1: fp32 (three tf32 products, about fp32); 2: fp64."""
    if PREC == 2:
        return tl.dot(a, b, out_dtype=tl.float64)
    else:
        return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _rows(ptr, i_b, i_c, i_h, Tp, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, acc: tl.constexpr):
    """The [BT, D] tile of a [B, Tp, H, D] tensor at chunk i_c, head i_h, in the accumulator dtype."""
    o_t = tl.arange(0, BT).to(tl.int64)
    o_d = tl.arange(0, D)
    r = i_b * Tp + i_c * BT + o_t
    return tl.load(ptr + (r[:, None] * H + i_h) * D + o_d[None, :]).to(acc)


@triton.jit
def _store_rows(ptr, x, i_b, i_c, i_h, Tp, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr):
    o_t = tl.arange(0, BT).to(tl.int64)
    o_d = tl.arange(0, D)
    r = i_b * Tp + i_c * BT + o_t
    tl.store(ptr + (r[:, None] * H + i_h) * D + o_d[None, :], x.to(ptr.dtype.element_ty))


@triton.jit
def _row(ptr, i_b, i_c, j, i_h, Tp, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, acc: tl.constexpr):
    """Row j of chunk i_c ([D]) of a [B, Tp, H, D] tensor."""
    r = (i_b * Tp + i_c * BT + j).to(tl.int64)
    return tl.load(ptr + (r * H + i_h) * D + tl.arange(0, D)).to(acc)


@triton.jit
def _rows_at(ptr, o_j, i_b, i_c, i_h, Tp, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, acc: tl.constexpr):
    """Rows o_j of chunk i_c ([BJ, D]) of a [B, Tp, H, D] tensor."""
    r = (i_b * Tp + i_c * BT + o_j).to(tl.int64)
    return tl.load(ptr + (r[:, None] * H + i_h) * D + tl.arange(0, D)[None, :]).to(acc)


@triton.jit
def _decay_to(b_g, g_j, o_j, BT: tl.constexpr):
    """[BT, BJ, K]: e^{gam_i - gam_j} for rows i >= j (exponent <= 0 for g <= 0), 0 above."""
    o_t = tl.arange(0, BT)
    keep = (o_t[:, None] >= o_j[None, :])[:, :, None]
    return tl.exp(tl.where(keep, b_g[:, None, :] - g_j[None, :, :], float("-inf")))


@triton.jit
def _cols(m, o_j, BT: tl.constexpr, BJ: tl.constexpr):
    """m[:, o_j] ([BT, BJ]) of a [BT, BT] tile, exactly."""
    if BJ == BT:
        return m
    else:
        sel = (o_j[:, None] == tl.arange(0, BT)[None, :]).to(m.dtype)  # [BJ, BT]
        return tl.sum(m[:, None, :] * sel[None, :, :], axis=2)


@triton.jit
def _at_cols(x, o_j, BT: tl.constexpr, BJ: tl.constexpr):
    """[BT, BJ] -> [BT, BT] with x in columns o_j, zeros elsewhere."""
    if BJ == BT:
        return x
    else:
        sel = (o_j[:, None] == tl.arange(0, BT)[None, :]).to(x.dtype)  # [BJ, BT]
        return tl.sum(x[:, :, None] * sel[None, :, :], axis=1)


@triton.jit
def _at_rows(x, o_j, BT: tl.constexpr, BJ: tl.constexpr):
    """[BJ, D] -> [BT, D] with x in rows o_j, zeros elsewhere."""
    if BJ == BT:
        return x
    else:
        sel = (tl.arange(0, BT)[:, None] == o_j[None, :]).to(x.dtype)  # [BT, BJ]
        return tl.sum(sel[:, :, None] * x[None, :, :], axis=1)


@triton.jit
def _pairs(a, b_ptr, gam, b_g, i_b, i_c, i_h, Tp, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
           BJ: tl.constexpr, acc: tl.constexpr, STRICT: tl.constexpr):
    """[BT, BT]: X_ij = sum_c a_ic b_jc e^{gam_ic - gam_jc} for j < i (STRICT) or j <= i, else 0; b read from
    memory BJ rows at a time ([BT, BJ, K] elementwise products)."""
    o_t = tl.arange(0, BT)
    x = tl.zeros([BT, BT], dtype=acc)
    for j0 in range(0, BT, BJ):
        o_j = j0 + tl.arange(0, BJ)
        b_j = _rows_at(b_ptr, o_j, i_b, i_c, i_h, Tp, H, K, BT, acc)
        g_j = _rows_at(gam, o_j, i_b, i_c, i_h, Tp, H, K, BT, acc)
        blk = tl.sum(a[:, None, :] * b_j[None, :, :] * _decay_to(b_g, g_j, o_j, BT), axis=2)
        x += _at_cols(blk, o_j, BT, BJ)
    if STRICT:
        x = tl.where(o_t[:, None] > o_t[None, :], x, 0.)
    return x


@triton.jit
def _inverse(b_a, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 of a strictly lower [BT, BT] A: the 16 x 16 diagonal blocks by forward substitution (all four
    at once, row i of each per step), D = their inverse; then with N = D A_o (A_o the blocks below the diagonal,
    N strictly block-lower: N^4 = 0), (I + A)^-1 = (I + N)^-1 D = (I - N)(I + N^2) D."""
    o_t = tl.arange(0, BT)
    same = (o_t[:, None] // 16) == (o_t[None, :] // 16)
    a_d = tl.where(same, b_a, 0.)
    b_d = tl.where(o_t[:, None] == o_t[None, :], 1., 0.).to(b_a.dtype)
    for i in range(1, 16):
        sel = (o_t % 16) == i
        b_d -= _dot(tl.where(sel[:, None], a_d, 0.), b_d, PREC)  # rows j < i of each block are final
    b_n = _dot(b_d, tl.where(same, 0., b_a), PREC)
    eye = tl.where(o_t[:, None] == o_t[None, :], 1., 0.).to(b_a.dtype)
    return _dot(eye - b_n, _dot(eye + _dot(b_n, b_n, PREC), b_d, PREC), PREC)


@triton.jit(do_not_specialize=["Tp"])
def kda_wy_fwd_kernel(k, v, gam, beta, tm, w, u, Tp, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BJ: tl.constexpr, PREC: tl.constexpr):
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    acc = gam.dtype.element_ty
    o_t = tl.arange(0, BT)
    b_k = _rows(k, i_b, i_c, i_h, Tp, H, K, BT, acc)
    b_g = _rows(gam, i_b, i_c, i_h, Tp, H, K, BT, acc)
    b_beta = tl.load(beta + ((i_b * Tp + i_c * BT + o_t) * H + i_h)).to(acc)
    b_a = _pairs(b_k, k, gam, b_g, i_b, i_c, i_h, Tp, H, K, BT, BJ, acc, True) * b_beta[:, None]
    b_t = _inverse(b_a, BT, PREC)
    _store_rows(tm, b_t, i_b, i_c, i_h, Tp, H, BT, BT)
    b_w = _dot(b_t, b_k * tl.exp(b_g) * b_beta[:, None], PREC)
    _store_rows(w, b_w, i_b, i_c, i_h, Tp, H, K, BT)
    b_u = _dot(b_t, _rows(v, i_b, i_c, i_h, Tp, H, V, BT, acc) * b_beta[:, None], PREC)
    _store_rows(u, b_u, i_b, i_c, i_h, Tp, H, V, BT)


@triton.jit(do_not_specialize=["NT"])
def kda_state_fwd_kernel(w, u, k, gam, h0, h, vn, ht, resets, NT, H: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr,
                         HAS_U: tl.constexpr, STORE_H: tl.constexpr, STORE_VN: tl.constexpr,
                         STORE_HT: tl.constexpr, RESETS: tl.constexpr, PREC: tl.constexpr):
    """h [K, BV] through the chunks. V: the state's columns (the values; K for the summary's M, HAS_U False)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    acc = gam.dtype.element_ty
    Tp = NT * BT
    o_t = tl.arange(0, BT).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_state = (i_b * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([K, BV], dtype=acc)
    if USE_H0:
        b_h += tl.load(h0 + p_state).to(acc)
    for i_c in range(NT):
        if RESETS:
            b_h = tl.where(tl.load(resets + i_c) != 0, 0., b_h)
        if STORE_H:
            tl.store(h + ((i_b * NT + i_c) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], b_h)
        r = i_b * Tp + i_c * BT + o_t
        p_v = (r[:, None] * H + i_h) * V + o_v[None, :]
        b_vn = -_dot(_rows(w, i_b, i_c, i_h, Tp, H, K, BT, acc), b_h, PREC)
        if HAS_U:
            b_vn += tl.load(u + p_v).to(acc)
        if STORE_VN:
            tl.store(vn + p_v, b_vn)
        b_g = _rows(gam, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_gl = _row(gam, i_b, i_c, BT - 1, i_h, Tp, H, K, BT, acc)
        b_kt = _rows(k, i_b, i_c, i_h, Tp, H, K, BT, acc) * tl.exp(b_gl[None, :] - b_g)
        b_h = b_h * tl.exp(b_gl)[:, None] + _dot(tl.trans(b_kt), b_vn, PREC)
    if STORE_HT:
        tl.store(ht + p_state, b_h)


@triton.jit(do_not_specialize=["NT"])
def kda_out_fwd_kernel(q, k, gam, h, vn, do, o, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BJ: tl.constexpr, DVL: tl.constexpr, PREC: tl.constexpr):
    """o = (q e^{gam}) h_c + P vn; DVL: o <- Pᵀ dO (h, vn unused)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    acc = gam.dtype.element_ty
    Tp = NT * BT
    b_q = _rows(q, i_b, i_c, i_h, Tp, H, K, BT, acc)
    b_g = _rows(gam, i_b, i_c, i_h, Tp, H, K, BT, acc)
    b_p = _pairs(b_q, k, gam, b_g, i_b, i_c, i_h, Tp, H, K, BT, BJ, acc, False)
    if DVL:
        b_o = _dot(tl.trans(b_p), _rows(do, i_b, i_c, i_h, Tp, H, V, BT, acc), PREC)
    else:
        o_k = tl.arange(0, K)
        o_v = tl.arange(0, V)
        b_h = tl.load(h + ((i_b * NT + i_c) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :])
        b_o = _dot(b_q * tl.exp(b_g), b_h, PREC) + _dot(b_p, _rows(vn, i_b, i_c, i_h, Tp, H, V, BT, acc), PREC)
    _store_rows(o, b_o, i_b, i_c, i_h, Tp, H, V, BT)


@triton.jit(do_not_specialize=["NT"])
def kda_state_bwd_kernel(q, k, gam, w, do, dvl, dht, dh, dvn, dh0, resets, NT, H: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr,
                         STORE: tl.constexpr, STORE_DH0: tl.constexpr, RESETS: tl.constexpr, PREC: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    acc = gam.dtype.element_ty
    Tp = NT * BT
    o_t = tl.arange(0, BT).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_state = (i_b * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([K, BV], dtype=acc)
    if USE_DHT:
        b_dh += tl.load(dht + p_state).to(acc)
    for i_s in range(NT):
        i_c = NT - 1 - i_s
        if STORE:
            tl.store(dh + ((i_b * NT + i_c) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], b_dh)
        r = i_b * Tp + i_c * BT + o_t
        p_v = (r[:, None] * H + i_h) * V + o_v[None, :]
        b_g = _rows(gam, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_gl = _row(gam, i_b, i_c, BT - 1, i_h, Tp, H, K, BT, acc)
        b_kt = _rows(k, i_b, i_c, i_h, Tp, H, K, BT, acc) * tl.exp(b_gl[None, :] - b_g)
        b_dvn = tl.load(dvl + p_v).to(acc) + _dot(b_kt, b_dh, PREC)
        if STORE:
            tl.store(dvn + p_v, b_dvn)
        b_qg = _rows(q, i_b, i_c, i_h, Tp, H, K, BT, acc) * tl.exp(b_g)
        b_w = _rows(w, i_b, i_c, i_h, Tp, H, K, BT, acc)
        b_dh = b_dh * tl.exp(b_gl)[:, None] + _dot(tl.trans(b_qg), tl.load(do + p_v).to(acc), PREC) \
            - _dot(tl.trans(b_w), b_dvn, PREC)
        if RESETS:
            b_dh = tl.where(tl.load(resets + i_c) != 0, 0., b_dh)
    if STORE_DH0:
        tl.store(dh0 + p_state, b_dh)


@triton.jit(do_not_specialize=["NT"])
def kda_chunk_bwd_kernel(q, k, v, gam, beta, tm, h, dh, vn, dvn, do, dq, dk, dv, dbeta, dgam, NT,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BJ: tl.constexpr,
                         PREC: tl.constexpr):
    """One chunk's gradients. With Qg = q e^{gam}, Kt = k e^{gl - gam}, X = beta k e^{gam}, Y = beta v:
        dq = e^{gam} (dO h_cᵀ) + F(dP, k)                         dP = dO vnᵀ (j <= i)
        dk = e^{gl - gam} (vn dh_{c+1}ᵀ) + G(dP, q) + beta F(dA, k) + G(beta dA, k) + beta e^{gam} dX
        dX = Tmᵀ dW, dW = -dvn h_cᵀ;  dY = Tmᵀ dvn;  dv = beta dY;  dA = -Tmᵀ (dW Xᵀ + dvn Yᵀ) Tmᵀ (j < i)
        dbeta = rowsum(dY v + dX k e^{gam} + k F(dA, k))
        dgam = Qg ∘ (dO h_cᵀ) - Kt ∘ (vn dh_{c+1}ᵀ) + X ∘ dX + q ∘ F(dP, k) - k ∘ G(dP, q)
               + beta k ∘ F(dA, k) - k ∘ G(beta dA, k)
               (elementwise: a factor e^{+gam_i} on an operand gives operand ∘ its gradient, e^{-gam_j} minus it)
    where F(M, b)_i = sum_j M_ij b_j e^{gam_i - gam_j}, G(M, a)_j = sum_i M_ij a_i e^{gam_i - gam_j} (i >= j), and
    the last row of dgam adds dgl = e^{gl} rowsum(h_c dh_{c+1}) + colsum(Kt ∘ (vn dh_{c+1}ᵀ))."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    acc = gam.dtype.element_ty
    Tp = NT * BT
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    b_q = _rows(q, i_b, i_c, i_h, Tp, H, K, BT, acc)
    b_k = _rows(k, i_b, i_c, i_h, Tp, H, K, BT, acc)
    b_g = _rows(gam, i_b, i_c, i_h, Tp, H, K, BT, acc)
    b_gl = _row(gam, i_b, i_c, BT - 1, i_h, Tp, H, K, BT, acc)
    b_v = _rows(v, i_b, i_c, i_h, Tp, H, V, BT, acc)
    b_vn = _rows(vn, i_b, i_c, i_h, Tp, H, V, BT, acc)
    b_dvn = _rows(dvn, i_b, i_c, i_h, Tp, H, V, BT, acc)
    b_do = _rows(do, i_b, i_c, i_h, Tp, H, V, BT, acc)
    b_tm = _rows(tm, i_b, i_c, i_h, Tp, H, BT, BT, acc)
    b_beta = tl.load(beta + ((i_b * Tp + i_c * BT + o_t) * H + i_h)).to(acc)
    p_s = ((i_b * NT + i_c) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.load(h + p_s)
    b_dh = tl.load(dh + p_s)

    b_eg = tl.exp(b_g)
    b_et = tl.exp(b_gl[None, :] - b_g)
    # the entering state's read: o += Qg h_c
    b_dq = _dot(b_do, tl.trans(b_h), PREC) * b_eg
    b_dgam = b_q * b_dq
    # the state update: h_{c+1} = e^{gl} h_c + Ktᵀ vn
    b_dkt = _dot(b_vn, tl.trans(b_dh), PREC)
    b_dk = b_dkt * b_et
    b_dgam -= b_k * b_dk
    b_dgl = tl.exp(b_gl) * tl.sum(b_h * b_dh, axis=1) + tl.sum(b_k * b_dk, axis=0)
    # the WY form: vn = U - W h_c, W = Tm X, U = Tm Y, Tm = (I + A)^-1
    b_x = b_k * b_eg * b_beta[:, None]
    b_dw = -_dot(b_dvn, tl.trans(b_h), PREC)
    b_dx = _dot(tl.trans(b_tm), b_dw, PREC)
    b_dy = _dot(tl.trans(b_tm), b_dvn, PREC)
    b_dv = b_dy * b_beta[:, None]
    b_dbeta = tl.sum(b_dy * b_v, axis=1) + tl.sum(b_dx * b_k * b_eg, axis=1)
    b_dk += b_dx * b_eg * b_beta[:, None]
    b_dgam += b_x * b_dx
    b_dtm = _dot(b_dw, tl.trans(b_x), PREC) + _dot(b_dvn, tl.trans(b_v * b_beta[:, None]), PREC)
    b_da = -_dot(tl.trans(b_tm), _dot(b_dtm, tl.trans(b_tm), PREC), PREC)
    b_da = tl.where(o_t[:, None] > o_t[None, :], b_da, 0.)
    b_dp = tl.where(o_t[:, None] >= o_t[None, :], _dot(b_do, tl.trans(b_vn), PREC), 0.)
    # the decayed pair products, column by column: F(dP, k), F(dA, k), G(dP, q) + G(beta dA, k)
    b_fp = tl.zeros([BT, K], dtype=acc)
    b_fa = tl.zeros([BT, K], dtype=acc)
    b_gk = tl.zeros([BT, K], dtype=acc)
    b_qda = b_beta[:, None] * b_k
    for j0 in range(0, BT, BJ):
        o_j = j0 + tl.arange(0, BJ)
        k_j = _rows_at(k, o_j, i_b, i_c, i_h, Tp, H, K, BT, acc)
        e = _decay_to(b_g, _rows_at(gam, o_j, i_b, i_c, i_h, Tp, H, K, BT, acc), o_j, BT)  # [BT, BJ, K]
        c_p = _cols(b_dp, o_j, BT, BJ)[:, :, None]
        c_a = _cols(b_da, o_j, BT, BJ)[:, :, None]
        b_fp += tl.sum(c_p * k_j[None, :, :] * e, axis=1)
        b_fa += tl.sum(c_a * k_j[None, :, :] * e, axis=1)
        b_gk += _at_rows(tl.sum((c_p * b_q[:, None, :] + c_a * b_qda[:, None, :]) * e, axis=0), o_j, BT, BJ)
    b_dq += b_fp
    b_dgam += b_q * b_fp
    b_dk += b_beta[:, None] * b_fa + b_gk
    b_dgam += b_k * (b_beta[:, None] * b_fa - b_gk)
    b_dbeta += tl.sum(b_k * b_fa, axis=1)
    b_dgam += tl.where(o_t[:, None] == BT - 1, b_dgl[None, :], 0.)
    _store_rows(dq, b_dq, i_b, i_c, i_h, Tp, H, K, BT)
    _store_rows(dk, b_dk, i_b, i_c, i_h, Tp, H, K, BT)
    _store_rows(dv, b_dv, i_b, i_c, i_h, Tp, H, V, BT)
    _store_rows(dgam, b_dgam, i_b, i_c, i_h, Tp, H, K, BT)
    tl.store(dbeta + ((i_b * Tp + i_c * BT + o_t) * H + i_h), b_dbeta)


def _bj() -> int:
    """Columns of the decayed pair products per step: the whole chunk under the interpreter (one numpy step), PAIR_BJ
    on a GPU ([BT, BJ, K] elementwise tiles; not tuned on a GPU yet). DELTACP_KDA_PAIR_BJ overrides (tests of the
    stepped path)."""
    env = os.environ.get("DELTACP_KDA_PAIR_BJ")
    if env:
        return int(env)
    return BT if os.environ.get("TRITON_INTERPRET") == "1" else PAIR_BJ


def _prec(acc: torch.dtype) -> int:
    return 2 if acc == torch.float64 else 1


def _shape(k, v):
    B, Tp, H, K = k.shape
    return B, Tp, H, K, v.shape[3], Tp // BT


def wy_fwd(k, v, gam, beta):
    """-> Tm [B, Tp, H, BT], W [B, Tp, H, K], U [B, Tp, H, V] (gam's dtype)."""
    B, Tp, H, K, V, NT = _shape(k, v)
    tm = torch.empty(B, Tp, H, BT, device=k.device, dtype=gam.dtype)
    w = torch.empty(B, Tp, H, K, device=k.device, dtype=gam.dtype)
    u = torch.empty(B, Tp, H, V, device=k.device, dtype=gam.dtype)
    kda_wy_fwd_kernel[(NT, B * H)](k, v, gam, beta, tm, w, u, Tp, H=H, K=K, V=V, BT=BT, BJ=_bj(), PREC=_prec(gam.dtype),
                                   **LAUNCH["wy_fwd"])
    return tm, w, u


def state_fwd(w, u, k, gam, h0=None, *, cols=None, store_h=True, store_vn=True, output_final_state=False,
              resets=None):
    """-> h [B, NT, H, K, cols] (the state entering each chunk) or None, vn [B, Tp, H, cols] or None, ht or None.
    u None: no values (the summary's M: h0 = I, cols = K)."""
    B, Tp, H, K = k.shape
    NT = Tp // BT
    V = u.shape[3] if u is not None else cols
    acc = gam.dtype
    h = torch.empty(B, NT, H, K, V, device=k.device, dtype=acc) if store_h else None
    vn = torch.empty(B, Tp, H, V, device=k.device, dtype=acc) if store_vn else None
    ht = torch.empty(B, H, K, V, device=k.device, dtype=acc) if output_final_state else None
    bv = min(BV, V)
    kda_state_fwd_kernel[(triton.cdiv(V, bv), B * H)](
        w, u, k, gam, h0, h, vn, ht, resets, NT, H=H, K=K, V=V, BT=BT, BV=bv, USE_H0=h0 is not None,
        HAS_U=u is not None, STORE_H=store_h, STORE_VN=store_vn, STORE_HT=output_final_state,
        RESETS=resets is not None, PREC=_prec(acc), **LAUNCH["state_fwd"])
    return h, vn, ht


def out_fwd(q, k, gam, h, vn, out_dtype):
    """-> o [B, Tp, H, V] in out_dtype."""
    B, Tp, H, K, V, NT = _shape(k, vn)
    o = torch.empty(B, Tp, H, V, device=k.device, dtype=out_dtype)
    kda_out_fwd_kernel[(NT, B * H)](q, k, gam, h, vn, None, o, NT, H=H, K=K, V=V, BT=BT, BJ=_bj(), DVL=False,
                                    PREC=_prec(gam.dtype), **LAUNCH["out_fwd"])
    return o


def dv_local(q, k, gam, do):
    """-> Pᵀ dO per chunk [B, Tp, H, V] (gam's dtype)."""
    B, Tp, H, K, V, NT = _shape(k, do)
    dvl = torch.empty(B, Tp, H, V, device=k.device, dtype=gam.dtype)
    kda_out_fwd_kernel[(NT, B * H)](q, k, gam, None, None, do, dvl, NT, H=H, K=K, V=V, BT=BT, BJ=_bj(), DVL=True,
                                    PREC=_prec(gam.dtype), **LAUNCH["out_fwd"])
    return dvl


def state_bwd(q, k, gam, w, do, dvl, dht=None, *, store=True, need_dh0=False, resets=None):
    """-> dh [B, NT, H, K, V] (the gradient of the state leaving each chunk), dvn [B, Tp, H, V], dh0 (or Nones)."""
    B, Tp, H, K, V, NT = _shape(k, do)
    acc = gam.dtype
    dh = torch.empty(B, NT, H, K, V, device=k.device, dtype=acc) if store else None
    dvn = torch.empty(B, Tp, H, V, device=k.device, dtype=acc) if store else None
    dh0 = torch.empty(B, H, K, V, device=k.device, dtype=acc) if need_dh0 else None
    bv = min(BV, V)
    kda_state_bwd_kernel[(triton.cdiv(V, bv), B * H)](
        q, k, gam, w, do, dvl, dht, dh, dvn, dh0, resets, NT, H=H, K=K, V=V, BT=BT, BV=bv,
        USE_DHT=dht is not None, STORE=store, STORE_DH0=need_dh0, RESETS=resets is not None, PREC=_prec(acc),
        **LAUNCH["state_bwd"])
    return dh, dvn, dh0


def chunk_bwd(q, k, v, gam, beta, tm, h, dh, vn, dvn, do):
    """-> dq, dk, dgam [B, Tp, H, K], dv [B, Tp, H, V], dbeta [B, Tp, H], all in gam's dtype."""
    B, Tp, H, K, V, NT = _shape(k, v)
    acc = gam.dtype
    dq, dk, dgam = (torch.empty(B, Tp, H, K, device=k.device, dtype=acc) for _ in range(3))
    dv = torch.empty(B, Tp, H, V, device=k.device, dtype=acc)
    dbeta = torch.empty(B, Tp, H, device=k.device, dtype=acc)
    kda_chunk_bwd_kernel[(NT, B * H)](q, k, v, gam, beta, tm, h, dh, vn, dvn, do, dq, dk, dv, dbeta, dgam, NT,
                                      H=H, K=K, V=V, BT=BT, BJ=_bj(), PREC=_prec(acc), **LAUNCH["chunk_bwd"])
    return dq, dk, dv, dbeta, dgam
