"""Per-chunk (fully parallel) kernels: outputs, the local dVn, and dq/dk/dW/dg.

Per chunk (g chunk-local cumulative gate, Gamma_ij = e^{g_i - g_j} for i >= j, scale folded into q):
    O = scale (e^g * Q) H_c + scale (Q K^T * Gamma) Vn
Backward (dH' = gradient of the state leaving the chunk):
    dVn_local = scale (Q K^T * Gamma)^T dO
    dQ = scale e^g dO H_c^T + Ds K,  Ds = scale (dO Vn^T * Gamma)
    dK = e^{gC - g} (Vn dH'^T) + Ds^T Q          (the WY part is added by wy_bwd)
    dW = -dVn H_c^T
    dg = sum(Q dQ) - sum(K dK) + [last row] (e^{gC} <H_c, dH'> + sum(K * e^{gC-g} Vn dH'^T))

Token tensors (q, k, do, o, dq) and per-chunk tensors (vn, h, dh, dvn, gc, dvl, dk before wy_bwd, dw, dg): indexing.py.
The last-row term of dg goes on row BT - 1 of the chunk, a padding row for a document's partial last chunk (the
gate cumsum's backward, per chunk, sums it into every row as the zero-padded layout did).
Head dims: q, k tiles span KP = padded(K) columns, V (and dqkwg's K) in blocks, the columns past the head dim masked
(indexing.py); at K = V = 128 nothing is masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltacp.ops.gdn.triton.indexing import BT, chunk_rows, chunk_tokens, load_tile, padded, store_tile
from deltacp.ops.gdn.triton.launch import launch_config


@triton.jit(do_not_specialize=["T", "NT"])
def o_fwd_kernel(
    q, k, vn, h, gc, o, cidx,
    scale, T, NT,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BV: tl.constexpr, VARLEN: tl.constexpr,
):
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = (i_bh // Hv).to(tl.int64), i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    o_k = tl.arange(0, KP)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    o_r = i_t * BT + o_t
    x0, rx, n = chunk_tokens(cidx, i_t, 0, i_t * BT, BT, VARLEN)
    o_x = rx + o_t  # token rows x0 + o_x
    m_x = (o_x < n)[:, None]
    MK: tl.constexpr = KP != K
    MV: tl.constexpr = V % BV != 0
    m_kc, m_v = (o_k < K)[None, :], (o_v < V)[None, :]

    b_q = load_tile(q + (i_b * T * Hk + i_hk) * K + x0 * (Hk * K) + o_x[:, None] * (Hk * K) + o_k[None, :], m_x, m_kc,
                    VARLEN, MK)
    b_k = load_tile(k + (i_b * T * Hk + i_hk) * K + x0 * (Hk * K) + o_x[:, None] * (Hk * K) + o_k[None, :], m_x, m_kc,
                    VARLEN, MK)
    b_h = load_tile(h + ((i_b * NT + i_t) * Hv + i_h) * K * V + o_k[:, None] * V + o_v[None, :], (o_k < K)[:, None],
                    m_v, MK, MV)
    b_vn = load_tile(vn + (i_b * T * Hv + i_h) * V + o_r[:, None] * (Hv * V) + o_v[None, :], m_v, m_v, False, MV)
    b_g = tl.load(gc + (i_b * T + o_r) * Hv + i_h)

    b_o = tl.dot(b_q, b_h.to(b_q.dtype)) * tl.exp(b_g)[:, None]
    b_a = tl.dot(b_q, tl.trans(b_k))
    b_a = tl.where(o_t[:, None] >= o_t[None, :], b_a * tl.exp(b_g[:, None] - b_g[None, :]), 0.)
    b_o = (b_o + tl.dot(b_a.to(b_vn.dtype), b_vn)) * scale
    p_o = o + (i_b * T * Hv + i_h) * V + x0 * (Hv * V) + o_x[:, None] * (Hv * V) + o_v[None, :]
    store_tile(p_o, b_o.to(o.dtype.element_ty), m_x, m_v, VARLEN, MV)


@triton.jit(do_not_specialize=["T"])
def dv_local_kernel(
    q, k, gc, do, dvl, cidx,
    scale, T,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BV: tl.constexpr, VARLEN: tl.constexpr,
):
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = (i_bh // Hv).to(tl.int64), i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    o_k = tl.arange(0, KP)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    o_r = i_t * BT + o_t
    x0, rx, n = chunk_tokens(cidx, i_t, 0, i_t * BT, BT, VARLEN)
    o_x = rx + o_t  # token rows x0 + o_x
    m_x = (o_x < n)[:, None]
    MK: tl.constexpr = KP != K
    MV: tl.constexpr = V % BV != 0
    m_kc, m_v = (o_k < K)[None, :], (o_v < V)[None, :]

    b_q = load_tile(q + (i_b * T * Hk + i_hk) * K + x0 * (Hk * K) + o_x[:, None] * (Hk * K) + o_k[None, :], m_x, m_kc,
                    VARLEN, MK)
    b_k = load_tile(k + (i_b * T * Hk + i_hk) * K + x0 * (Hk * K) + o_x[:, None] * (Hk * K) + o_k[None, :], m_x, m_kc,
                    VARLEN, MK)
    b_g = tl.load(gc + (i_b * T + o_r) * Hv + i_h)
    b_do = load_tile(do + (i_b * T * Hv + i_h) * V + x0 * (Hv * V) + o_x[:, None] * (Hv * V) + o_v[None, :], m_x, m_v,
                     VARLEN, MV)
    # transposed scores: row j (key), column i (query), kept where i >= j
    b_at = tl.dot(b_k, tl.trans(b_q))
    b_at = tl.where(o_t[:, None] <= o_t[None, :], b_at * tl.exp(b_g[None, :] - b_g[:, None]), 0.) * scale
    b_dv = tl.dot(b_at.to(b_do.dtype), b_do)
    store_tile(dvl + (i_b * T * Hv + i_h) * V + o_r[:, None] * (Hv * V) + o_v[None, :], b_dv.to(dvl.dtype.element_ty),
               m_v, m_v, False, MV)


@triton.jit(do_not_specialize=["T", "NT"])
def dqkwg_kernel(
    q, k, vn, h, dh, do, dvn, gc, dq, dk, dw, dg, cidx,
    scale, T, NT, B,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VARLEN: tl.constexpr,
):
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = (i_bh // Hv).to(tl.int64), i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    o_k = i_k * BK + tl.arange(0, BK)
    o_t = tl.arange(0, BT)
    o_r = i_t * BT + o_t
    x0, rx, n = chunk_tokens(cidx, i_t, 0, i_t * BT, BT, VARLEN)
    o_x = rx + o_t  # token rows x0 + o_x
    m_x = (o_x < n)[:, None]
    MK: tl.constexpr = K % BK != 0  # the last K block partial (its columns >= K masked)
    MV: tl.constexpr = V % BV != 0
    m_kr, m_kc = (o_k < K)[:, None], (o_k < K)[None, :]
    p_h = h + ((i_b * NT + i_t) * Hv + i_h) * K * V
    p_dh = dh + ((i_b * NT + i_t) * Hv + i_h) * K * V
    p_vn = vn + (i_b * T * Hv + i_h) * V
    p_dvn = dvn + (i_b * T * Hv + i_h) * V

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_hdh = tl.zeros([BK, BV], dtype=tl.float32)
    for i_v in range((V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = (o_v < V)[None, :]
        b_h = load_tile(p_h + o_k[:, None] * V + o_v[None, :], m_kr, m_v, MK, MV)
        b_dh = load_tile(p_dh + o_k[:, None] * V + o_v[None, :], m_kr, m_v, MK, MV)
        b_vn = load_tile(p_vn + o_r[:, None] * (Hv * V) + o_v[None, :], m_v, m_v, False, MV)
        b_dvn = load_tile(p_dvn + o_r[:, None] * (Hv * V) + o_v[None, :], m_v, m_v, False, MV)
        b_dk += tl.dot(b_vn, tl.trans(b_dh.to(b_vn.dtype)))
        b_dw += tl.dot(b_dvn.to(b_vn.dtype), tl.trans(b_h.to(b_vn.dtype)))
        b_hdh += b_h.to(tl.float32) * b_dh.to(tl.float32)
        b_do = load_tile(do + (i_b * T * Hv + i_h) * V + x0 * (Hv * V) + o_x[:, None] * (Hv * V) + o_v[None, :], m_x,
                         m_v, VARLEN, MV)
        b_dq += tl.dot(b_do, tl.trans(b_h.to(b_do.dtype)))
        b_ds += tl.dot(b_do, tl.trans(b_vn.to(b_do.dtype)))

    b_g = tl.load(gc + (i_b * T + o_r) * Hv + i_h)
    b_gl = tl.load(gc + (i_b * T + i_t * BT + BT - 1) * Hv + i_h)
    b_k = load_tile(k + (i_b * T * Hk + i_hk) * K + x0 * (Hk * K) + o_x[:, None] * (Hk * K) + o_k[None, :], m_x, m_kc,
                    VARLEN, MK)
    b_kf = b_k.to(tl.float32)
    b_dk = b_dk * tl.exp(b_gl - b_g)[:, None]
    b_dgl = tl.sum(tl.sum(b_hdh, 1), 0) * tl.exp(b_gl) + tl.sum(tl.sum(b_dk * b_kf, 1), 0)
    b_dg = -tl.sum(b_dk * b_kf, 1)
    b_q = load_tile(q + (i_b * T * Hk + i_hk) * K + x0 * (Hk * K) + o_x[:, None] * (Hk * K) + o_k[None, :], m_x, m_kc,
                    VARLEN, MK)
    b_qf = b_q.to(tl.float32)
    b_dq = b_dq * (tl.exp(b_g) * scale)[:, None]
    b_ds = tl.where(o_t[:, None] >= o_t[None, :], b_ds * tl.exp(b_g[:, None] - b_g[None, :]), 0.) * scale
    b_dq += tl.dot(b_ds.to(b_k.dtype), b_k)
    # tl.trans of an MMA-layout tensor: miscompiled on Hopper (Triton 3.4-3.7.0) for some launch shapes; the
    # configuration in launch.py is the one found reproducible (bench/determinism.py, --sweep)
    b_dki = tl.dot(tl.trans(b_ds).to(b_q.dtype), b_q)
    b_dk += b_dki
    b_dg += tl.sum(b_dq * b_qf, 1) - tl.sum(b_dki * b_kf, 1)
    p_dq = dq + (i_b * T * Hv + i_h) * K + x0 * (Hv * K) + o_x[:, None] * (Hv * K) + o_k[None, :]
    store_tile(p_dq, b_dq.to(dq.dtype.element_ty), m_x, m_kc, VARLEN, MK)
    b_dg += tl.where(o_t == BT - 1, b_dgl, 0.)
    store_tile(dk + (i_b * T * Hv + i_h) * K + o_r[:, None] * (Hv * K) + o_k[None, :], b_dk, m_kc, m_kc, False, MK)
    store_tile(dw + (i_b * T * Hv + i_h) * K + o_r[:, None] * (Hv * K) + o_k[None, :], -b_dw, m_kc, m_kc, False, MK)
    tl.store(dg + ((i_k * B + i_b) * T + o_r) * Hv + i_h, b_dg)


def o_fwd(q, k, vn, h, gc, scale, chunks=None):
    """-> o with the rows of q (the packed row's under `chunks`, the chunk table of packed documents)."""
    B, Tq, Hk, K = q.shape
    Hv, V = vn.shape[2], vn.shape[3]
    T, varlen = chunk_rows(gc, chunks)
    o = torch.empty(B, Tq, Hv, V, device=q.device, dtype=vn.dtype)
    blocks, opts = launch_config("o_fwd", V=V)
    o_fwd_kernel[(triton.cdiv(V, blocks["BV"]), T // BT, B * Hv)](q, k, vn, h, gc, o, chunks, scale, T, T // BT, Hk=Hk,
                                                                   Hv=Hv, K=K, KP=padded(K), V=V, BT=BT, VARLEN=varlen,
                                                                   **blocks, **opts)
    return o


def dv_local(q, k, gc, do, scale, out_dtype=torch.float32, chunks=None):
    """-> dVn_local [B,Tc,Hv,V] per chunk (q, k, do: the packed row under `chunks`)."""
    B, _, Hk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    T, varlen = chunk_rows(gc, chunks)
    dvl = torch.empty(B, T, Hv, V, device=q.device, dtype=out_dtype)
    blocks, opts = launch_config("dv_local", V=V)
    dv_local_kernel[(triton.cdiv(V, blocks["BV"]), T // BT, B * Hv)](q, k, gc, do, dvl, chunks, scale, T, Hk=Hk, Hv=Hv,
                                                                      K=K, KP=padded(K), V=V, BT=BT, VARLEN=varlen,
                                                                      **blocks, **opts)
    return dvl


def dqkwg(q, k, vn, h, dh, do, dvn, gc, scale, dq_dtype=torch.float32, chunks=None):
    """-> dq [B,Tq,Hv,K] (dq_dtype, rows of q), dk [B,Tc,Hv,K] fp32, dw [B,Tc,Hv,K] fp32, dg [B,Tc,Hv] fp32
    (chunk-local); dk, dw, dg per chunk (`chunks`: the chunk table of packed documents, q, k, do the packed row)."""
    B, Tq, Hk, K = k.shape
    Hv, V = vn.shape[2], vn.shape[3]
    T, varlen = chunk_rows(gc, chunks)
    blocks, opts = launch_config("dqkwg", K=K, V=V)
    NK = triton.cdiv(K, blocks["BK"])
    dev = k.device
    dq = torch.empty(B, Tq, Hv, K, device=dev, dtype=dq_dtype)
    dk = torch.empty(B, T, Hv, K, device=dev, dtype=torch.float32)
    dw = torch.empty(B, T, Hv, K, device=dev, dtype=torch.float32)
    dg = torch.empty(NK, B, T, Hv, device=dev, dtype=torch.float32)
    dqkwg_kernel[(NK, T // BT, B * Hv)](q, k, vn, h, dh, do, dvn, gc, dq, dk, dw, dg, chunks, scale, T, T // BT, B,
                                        Hk=Hk, Hv=Hv, K=K, V=V, BT=BT, VARLEN=varlen, **blocks, **opts)
    return dq, dk, dw, dg.sum(0)
