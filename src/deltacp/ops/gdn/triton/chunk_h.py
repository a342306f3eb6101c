"""The chunk-to-chunk state recurrence, forward and backward (sequential over chunks, parallel over V blocks).

Forward, per chunk c (g the chunk-local cumulative gate, gC its last value):
    Vn = U - W H_c ;  H_{c+1} = e^{gC} H_c + K^T (e^{gC - g} * Vn)
Backward, chunks in reverse, dH = dH_{c+1} on entry:
    dVn = dVn_local + (e^{gC - g} * K) dH ;  dH_c = e^{gC} dH + scale (e^g * Q)^T dO - W^T dVn

Layouts: k, q [B,T,Hk,K]; w [B,T,Hv,K]; u, vn, do [B,T,Hv,V]; gc [B,T,Hv];
h, dh [B, NT, Hv, K, V] (state entering chunk c / gradient of the state leaving chunk c); h0, ht [B,Hv,K,V] fp32.
The state width V is generic: the summary runs it on S (width V) and M (width K, values 0). The state tile is
[KP, BV] with KP = padded(K) (K = 96, 192: rows >= K masked, and stay 0: k and w load 0 there); the V blocks are
masked only if BV does not divide V (indexing.py).

Packed documents (`varlen.py`, VARLEN): one program per document and value block, as for a batch of sequences.
The document table `docs` [N + 1, 2] int32 holds each document's first token and first chunk (row N: the totals),
read once per program: within the loop every address is arithmetic, as in the dense kernel. (Reading a chunk
table inside the loop would put a global-memory round trip on the sequential chain, slower even than copying the
row into the chunk-aligned layout: NOTES.md.) A document's chain is only its own chunks. The token
tensors (k, q, do) are the packed row (a document's last chunk partial: its missing rows load as 0); w, u, vn,
dvl, dvn, gc and h, dh are per chunk (indexing.py). h0 enters document 0 and ht is the last document's (dht enters the
last, dh0 leaves document 0); the launchers leave h0 out when document 0 does not continue it.
T and NT are runtime values (`do_not_specialize`) and the document count only sizes the grid: one compiled kernel
serves every length and document mix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltacp.ops.gdn.triton.indexing import BT, chunk_rows, document_span, load_tile, padded, store_tile
from deltacp.ops.gdn.triton.launch import launch_config, sm_count


@triton.jit(do_not_specialize=["T", "NT"])
def state_fwd_kernel(
    k, w, u, gc, h0, h, vn, ht, docs,
    T, NT,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BV: tl.constexpr, USE_H0: tl.constexpr, USE_U: tl.constexpr, STORE_H: tl.constexpr, STORE_VN: tl.constexpr,
    STORE_HT: tl.constexpr, FP32_DOT: tl.constexpr, DOT_PREC: tl.constexpr, VARLEN: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // Hv).to(tl.int64), i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    bos, c0, eos, nc = document_span(docs, i_b, T, NT, VARLEN)
    if VARLEN:  # program row i_b is document i_b of the one packed row
        first, last = i_b == 0, c0 + nc == NT
        i_b, i_bh = i_b * 0, i_h

    o_k = tl.arange(0, KP)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    MK: tl.constexpr = KP != K  # masks of a head dim that is not a power of two / not a multiple of BV
    MV: tl.constexpr = V % BV != 0
    m_kr, m_kc, m_v = (o_k < K)[:, None], (o_k < K)[None, :], (o_v < V)[None, :]
    b_h = tl.zeros([KP, BV], dtype=tl.float32)
    if USE_H0:
        p_h0 = h0 + i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        if VARLEN:
            if first:
                b_h += load_tile(p_h0, m_kr, m_v, MK, MV)
        else:
            b_h += load_tile(p_h0, m_kr, m_v, MK, MV)

    p_k = k + (i_b * T * Hk + i_hk) * K + bos * (Hk * K)
    p_w = w + (i_b * T * Hv + i_h) * K
    p_g = gc + i_b * T * Hv + i_h
    for i_c in range(nc):
        i_t = c0 + i_c
        o_r = i_t * BT + o_t
        if STORE_H:
            p_h = h + ((i_b * NT + i_t) * Hv + i_h) * K * V
            store_tile(p_h + o_k[:, None] * V + o_v[None, :], b_h.to(h.dtype.element_ty), m_kr, m_v, MK, MV)
        b_w = load_tile(p_w + o_r[:, None] * (Hv * K) + o_k[None, :], m_kc, m_kc, False, MK)
        if FP32_DOT:
            b_vn = -tl.dot(b_w.to(tl.float32), b_h, input_precision=DOT_PREC)
        else:
            b_vn = -tl.dot(b_w, b_h.to(b_w.dtype))
        if USE_U:  # U = 0 for the transition M (values 0, entering state I)
            p_u = u + (i_b * T * Hv + i_h) * V
            b_vn += load_tile(p_u + o_r[:, None] * (Hv * V) + o_v[None, :], m_v, m_v, False, MV).to(tl.float32)
        if STORE_VN:
            p_vn = vn + (i_b * T * Hv + i_h) * V
            store_tile(p_vn + o_r[:, None] * (Hv * V) + o_v[None, :], b_vn.to(vn.dtype.element_ty), m_v, m_v, False, MV)
        b_g = tl.load(p_g + o_r * Hv)
        b_gl = tl.load(p_g + (i_t * BT + BT - 1) * Hv)
        o_x = i_c * BT + o_t  # token rows from the document's first token
        b_k = load_tile(p_k + o_x[:, None] * (Hk * K) + o_k[None, :], (o_x < eos - bos)[:, None], m_kc, VARLEN, MK)
        b_vs = b_vn * tl.exp(b_gl - b_g)[:, None]
        if FP32_DOT:
            b_kt = tl.trans(b_k.to(tl.float32))
            b_h = b_h * tl.exp(b_gl) + tl.dot(b_kt, b_vs, input_precision=DOT_PREC)
        else:
            b_h = b_h * tl.exp(b_gl) + tl.dot(tl.trans(b_k), b_vs.to(b_k.dtype))
    if STORE_HT:
        p_ht = ht + i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        if VARLEN:
            if last:
                store_tile(p_ht, b_h, m_kr, m_v, MK, MV)
        else:
            store_tile(p_ht, b_h, m_kr, m_v, MK, MV)


@triton.jit(do_not_specialize=["T", "NT"])
def state_bwd_kernel(
    q, k, w, gc, do, dvl, dht, dh, dvn, dh0, docs,
    scale, T, NT,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, STORE: tl.constexpr, VARLEN: tl.constexpr,
):
    """The gate factors go on the [BT, BV] side (the product k dH, and dO), not on the loaded [BT, K] tiles of k
    and q, which enter the MMAs as loaded (faster: NOTES.md), and k dH is not rounded through a scaled bf16 copy
    of k."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // Hv).to(tl.int64), i_bh % Hv
    i_hk = i_h // (Hv // Hk)
    bos, c0, eos, nc = document_span(docs, i_b, T, NT, VARLEN)
    if VARLEN:  # program row i_b is document i_b of the one packed row
        first, last = i_b == 0, c0 + nc == NT
        i_b, i_bh = i_b * 0, i_h

    o_k = tl.arange(0, KP)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    MK: tl.constexpr = KP != K  # masks of a head dim that is not a power of two / not a multiple of BV
    MV: tl.constexpr = V % BV != 0
    m_kr, m_kc, m_v = (o_k < K)[:, None], (o_k < K)[None, :], (o_v < V)[None, :]
    b_dh = tl.zeros([KP, BV], dtype=tl.float32)
    if USE_DHT:
        p_dht = dht + i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        if VARLEN:
            if last:
                b_dh += load_tile(p_dht, m_kr, m_v, MK, MV)
        else:
            b_dh += load_tile(p_dht, m_kr, m_v, MK, MV)

    p_k = k + (i_b * T * Hk + i_hk) * K + bos * (Hk * K)
    p_w = w + (i_b * T * Hv + i_h) * K
    p_g = gc + i_b * T * Hv + i_h
    for i_s in range(nc):
        i_c = nc - 1 - i_s
        i_t = c0 + i_c
        o_r = i_t * BT + o_t
        if STORE:
            p_dh = dh + ((i_b * NT + i_t) * Hv + i_h) * K * V
            store_tile(p_dh + o_k[:, None] * V + o_v[None, :], b_dh.to(dh.dtype.element_ty), m_kr, m_v, MK, MV)
        b_g = tl.load(p_g + o_r * Hv)
        b_gl = tl.load(p_g + (i_t * BT + BT - 1) * Hv)
        o_x = i_c * BT + o_t  # token rows from the document's first token
        m_x = (o_x < eos - bos)[:, None]
        b_k = load_tile(p_k + o_x[:, None] * (Hk * K) + o_k[None, :], m_x, m_kc, VARLEN, MK)
        b_dvn = tl.dot(b_k, b_dh.to(b_k.dtype)) * tl.exp(b_gl - b_g)[:, None]
        p_dvl = dvl + (i_b * T * Hv + i_h) * V
        b_dvn += load_tile(p_dvl + o_r[:, None] * (Hv * V) + o_v[None, :], m_v, m_v, False, MV).to(tl.float32)
        if STORE:
            p_dvn = dvn + (i_b * T * Hv + i_h) * V
            store_tile(p_dvn + o_r[:, None] * (Hv * V) + o_v[None, :], b_dvn.to(dvn.dtype.element_ty), m_v, m_v, False,
                       MV)
        b_w = load_tile(p_w + o_r[:, None] * (Hv * K) + o_k[None, :], m_kc, m_kc, False, MK)
        b_dh = b_dh * tl.exp(b_gl) - tl.dot(tl.trans(b_w), b_dvn.to(b_w.dtype))
        p_q = q + (i_b * T * Hk + i_hk) * K + bos * (Hk * K)
        p_do = do + (i_b * T * Hv + i_h) * V + bos * (Hv * V)
        b_q = load_tile(p_q + o_x[:, None] * (Hk * K) + o_k[None, :], m_x, m_kc, VARLEN, MK)
        b_do = load_tile(p_do + o_x[:, None] * (Hv * V) + o_v[None, :], m_x, m_v, VARLEN, MV)
        b_dos = (b_do.to(tl.float32) * (tl.exp(b_g) * scale)[:, None]).to(b_q.dtype)
        b_dh += tl.dot(tl.trans(b_q), b_dos)
    if STORE_DH0:
        p_dh0 = dh0 + i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        if VARLEN:
            if first:
                store_tile(p_dh0, b_dh, m_kr, m_v, MK, MV)
        else:
            store_tile(p_dh0, b_dh, m_kr, m_v, MK, MV)


def state_fwd(k, w, u, gc, h0=None, *, store_h=True, store_vn=True, output_final_state=False, fp32_dot=False,
              dot_precision="tf32", chunks=None, docs=None, first_continues=True):
    """-> h [B,NT,Hv,K,V] (or None), vn [B,T,Hv,V] (or None), ht [B,Hv,K,V] fp32 (or None).

    u None: values U = 0 (state width V from h0), the recurrence of the transition M from h0 = I.
    fp32_dot: fp32-operand products (`dot_precision`: tf32 or tf32x3) on the fp32 state, for the summary's M,
    which cancels strongly (bf16 operands cost ~1.5e-2 rel-L2 on M at 8K tokens).
    Packed documents: `chunks` (the chunk table, for its checks) and `docs` (the document table), k the packed row,
    w, u, gc, vn per chunk; the state restarts at each document, h0 enters document 0 only if `first_continues`,
    ht is the last document's."""
    B, _, Hk, K = k.shape
    Hv = w.shape[2]
    V = h0.shape[3] if u is None else u.shape[3]
    T, varlen = chunk_rows(gc, chunks)
    NT = T // BT
    rows = _check_docs(docs, varlen, NT, B)
    if varlen and not first_continues:
        h0 = None  # document 0 starts from 0
    dev = k.device
    h = torch.empty(B, NT, Hv, K, V, device=dev, dtype=k.dtype) if store_h else None
    vn = torch.empty(B, T, Hv, V, device=dev, dtype=w.dtype if u is None else u.dtype) if store_vn else None
    ht = torch.empty(B, Hv, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    blocks, opts = launch_config("summary_state_fwd" if fp32_dot else "state_fwd", V=V, programs=rows * Hv,
                                 sms=sm_count(dev))
    state_fwd_kernel[(triton.cdiv(V, blocks["BV"]), rows * Hv)](
        k, w, u, gc, h0, h, vn, ht, docs, T, NT, Hk=Hk, Hv=Hv, K=K, KP=padded(K), V=V, BT=BT,
        USE_H0=h0 is not None, USE_U=u is not None, STORE_H=store_h, STORE_VN=store_vn, STORE_HT=output_final_state,
        FP32_DOT=fp32_dot, DOT_PREC=dot_precision, VARLEN=varlen, **blocks, **opts)
    return h, vn, ht


def state_bwd(q, k, w, gc, do, dvl, dht, *, scale, V, need_dh0, dvn_dtype=torch.float32, store=True, chunks=None,
              docs=None, first_continues=True):
    """-> dh [B,NT,Hv,K,V] (gradient of the state leaving each chunk), dvn [B,T,Hv,V] (dvn_dtype), dh0 (or None).

    store=False: dh and dvn are neither written nor returned (None), only dh0. chunks, docs, first_continues: as
    in state_fwd (q, k, do are then the packed row; dht enters the last document, dh0 is document 0's, or 0 when
    it does not continue)."""
    B, _, Hk, K = k.shape
    Hv = w.shape[2]
    T, varlen = chunk_rows(gc, chunks)
    NT = T // BT
    rows = _check_docs(docs, varlen, NT, B)
    dev = k.device
    dh = torch.empty(B, NT, Hv, K, V, device=dev, dtype=k.dtype) if store else None
    dvn = torch.empty(B, T, Hv, V, device=dev, dtype=dvn_dtype) if store else None
    dh0 = torch.empty(B, Hv, K, V, device=dev, dtype=torch.float32) if need_dh0 else None
    store_dh0 = need_dh0
    if varlen and not first_continues and need_dh0:
        dh0.zero_()
        store_dh0 = False
    blocks, opts = launch_config("state_bwd", K=K, V=V, programs=rows * Hv, sms=sm_count(dev))
    state_bwd_kernel[(triton.cdiv(V, blocks["BV"]), rows * Hv)](
        q, k, w, gc, do, dvl, dht, dh, dvn, dh0, docs, scale, T, NT, Hk=Hk, Hv=Hv, K=K, KP=padded(K), V=V, BT=BT,
        USE_DHT=dht is not None, STORE_DH0=store_dh0, STORE=store, VARLEN=varlen, **blocks, **opts)
    return dh, dvn, dh0


def _check_docs(docs, varlen, NT, B) -> int:
    """Rows of the launch grid: documents (packed) or sequences."""
    if not varlen:
        return B
    if docs is None or docs.dim() != 2 or docs.shape[1] != 2 or docs.dtype != torch.int32:
        raise ValueError(f"packed documents need the document table [N + 1, 2] int32 with the chunk table; got "
                         f"{None if docs is None else (tuple(docs.shape), docs.dtype)}")
    return docs.shape[0] - 1
