"""Triton kernels of the scalar-decay recurrence (Mamba2's SSD) and their launchers. Imports triton: only on the
Triton path (`deltacp.ops.ssd.triton` loads this module on first use).

Per head h (q, k read from group h // (H / G)), in chunks of BT = 64 tokens, gam the chunk-local cumulative log
decay (inclusive), gl its last value, h_c the state entering chunk c:
    state_fwd   h_{c+1} = e^{gl} h_c + (e^{gl - gam} * k)ᵀ v                      (h_c stored per chunk)
    out_fwd     o = e^{gam} * (q h_c) + (D ∘ q kᵀ) v,  D_ij = e^{gam_i - gam_j} (j <= i)
    state_bwd   dh_c = e^{gl} dh_{c+1} + (e^{gam} * q)ᵀ dO                         (dh_{c+1} stored per chunk)
    chunk_bwd   dq = e^{gam} * (dO h_cᵀ) + (D ∘ dO vᵀ) k
                dk = (D ∘ dO vᵀ)ᵀ q + e^{gl - gam} * (v dh_{c+1}ᵀ)
                dv = (D ∘ q kᵀ)ᵀ dO + e^{gl - gam} * (k dh_{c+1})
                dgam_i = q_i·dq_i - k_i·dk_i  (+ dgl on the chunk's last row)
                dgl = e^{gl} <h_c, dh_{c+1}> + sum_j k_j·(e^{gl - gam_j} dh_{c+1} v_j)
(state_fwd and state_bwd are the two directions of one kernel, state_scan.)
dgam is the gradient of the chunk-local cumsum; g's gradient is its suffix sum within the chunk (torch autograd of
the cumsum, chunk.py). Why dgam_i = q_i·dq_i - k_i·dk_i: every term of o and of the next state is linear in q_i
with the factor e^{gam_i}, and linear in k_j with e^{-gam_j}, so the derivative of a term in +gam_i (-gam_j) is
the term itself, summed: q_i·dq_i (-k_j·dk_j); the only other place the gates enter is e^{gl} and e^{gl - gam_j}
of the state update, whose derivative in gl is <dh_{c+1}, h_{c+1}> = dgl.

Layouts: q, k [B, Tp, G, N]; v, o, dO [B, Tp, H, P]; gam [B, Tp, H] (fp32, fp64 for fp64 inputs); h, dh
[B, NT, H, N, P] in the input dtype; h0, ht, dht, dh0 [B, H, N, P] in the accumulator dtype. Tp = NT * 64: the
wrapper pads every sequence (packed documents: lays them out chunk-aligned, `ops/gdn/varlen.py`), a zero token
(q = k = v = 0, g = 0) leaving the state unchanged. `resets` [NT] int32 (packed rows only): the state entering
those chunks is zero (in the backward, no gradient crosses them).

Accumulation: fp32 (fp64 for fp64 inputs, the interpreter tests). Products: the operands in the input dtype (a
factor applied to a loaded tile is rounded back to it, as the tensor cores take it); fp32 inputs multiply with
tf32x3 (about fp32; plain tf32 would cost ~1e-3). The per-chunk states h, dh are stored in the input dtype: their
only readers are products that round them to that dtype anyway (o, dq, dk, dv), and bf16 halves their bytes
(N = 128, P = 64: 16 KiB per chunk and head in bf16, twice v's chunk).

Tiles: the state kernels (one kernel, ssd_state_scan, both directions) run one program per (P block, N block,
row * head), sequential over chunks (a state row depends only on its own row: the N blocks are independent); the
chunk kernels one program per chunk and head (ssd_out_fwd also per P block), looping over N and P blocks, so no
tile is wider than 64 whatever N, P are. Every kernel's name starts with ssd_ (profiles group them by it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BT = 64

# Fixed launch configurations (block widths clipped to N, P); not tuned on a GPU yet.
LAUNCH: dict[str, dict[str, int]] = {
    "state_fwd": dict(BN=32, BP=32, num_warps=4, num_stages=2),
    "state_bwd": dict(BN=32, BP=32, num_warps=4, num_stages=2),
    "out_fwd": dict(BN=64, BP=64, num_warps=4, num_stages=2),
    "chunk_bwd": dict(BN=64, BP=64, num_warps=8, num_stages=1),
}


def _config(name: str, N: int, P: int) -> tuple[dict[str, int], dict[str, int]]:
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
def ssd_state_scan_kernel(x, y, gam, s0, s, st, resets, NT,
                      G: tl.constexpr, H: tl.constexpr, N: tl.constexpr, P: tl.constexpr, BT: tl.constexpr,
                      BN: tl.constexpr, BP: tl.constexpr, REVERSE: tl.constexpr, USE_S0: tl.constexpr,
                      STORE_S: tl.constexpr, STORE_ST: tl.constexpr, RESETS: tl.constexpr, PREC: tl.constexpr):
    """Both state recurrences, one [BN, BP] tile of the state per program, sequential over chunks.
    Forward (x = k, y = v): per chunk, zero on a reset, store the entering state, then S = e^{gl} S +
    (e^{gl - gam} * k)ᵀ v; s0 the entering state of the row, st the final one.
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
        b_xw = (b_x.to(acc) * b_w[:, None]).to(b_x.dtype)
        b_s = b_s * tl.exp(b_gl) + _mm(tl.trans(b_xw), tl.load(p_y + o_r[:, None] * (H * P)), PREC).to(acc)
        if RESETS and REVERSE:
            b_s = tl.where(tl.load(resets + i_c) != 0, 0., b_s)
    if STORE_ST:
        tl.store(st + p_state, b_s)


@triton.jit
def _chunk_head(gam, i_c, i_bh, NT, H: tl.constexpr, G: tl.constexpr, BT: tl.constexpr):
    """What a chunk kernel's program (chunk i_c, row * head i_bh) starts from: row, head, group, rows in the chunk,
    token rows, gam [BT], gl, and the causal decay D [BT, BT], D_ij = e^{gam_i - gam_j} (j <= i), else 0."""
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    T = NT * BT
    o_t = tl.arange(0, BT)
    o_r = (i_c * BT + o_t).to(tl.int64)  # token rows (int64: T * H * P may pass 2^31)
    b_g = tl.load(gam + (i_b * T + o_r) * H + i_h)
    b_gl = tl.load(gam + (i_b * T + i_c * BT + BT - 1) * H + i_h)
    b_d = tl.where(o_t[:, None] >= o_t[None, :], tl.exp(b_g[:, None] - b_g[None, :]), 0.)
    return i_b, i_h, i_h // (H // G), o_t, o_r, b_g, b_gl, b_d


@triton.jit(do_not_specialize=["NT"])
def ssd_out_fwd_kernel(q, k, v, gam, h, o, NT,
                   G: tl.constexpr, H: tl.constexpr, N: tl.constexpr, P: tl.constexpr, BT: tl.constexpr,
                   BN: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr):
    i_p, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h, i_g, o_t, o_r, b_g, _, b_d = _chunk_head(gam, i_c, i_bh, NT, H, G, BT)
    acc = gam.dtype.element_ty
    T = NT * BT
    o_p = i_p * BP + tl.arange(0, BP)
    p_q = q + (i_b * T * G + i_g) * N + o_r[:, None] * (G * N)
    p_k = k + (i_b * T * G + i_g) * N + o_r[:, None] * (G * N)
    p_h = h + ((i_b * NT + i_c) * H + i_h) * N * P + o_p[None, :]
    b_qk = tl.zeros([BT, BT], dtype=acc)
    b_o = tl.zeros([BT, BP], dtype=acc)
    for i_n in range(0, N, BN):
        o_n = i_n + tl.arange(0, BN)
        b_q = tl.load(p_q + o_n[None, :])
        b_k = tl.load(p_k + o_n[None, :])
        b_qk += _mm(b_q, tl.trans(b_k), PREC).to(acc)
        b_o += _mm(b_q, tl.load(p_h + o_n[:, None] * P), PREC).to(acc)
    b_v = tl.load(v + (i_b * T * H + i_h) * P + o_r[:, None] * (H * P) + o_p[None, :])
    b_o = b_o * tl.exp(b_g)[:, None] + _mm((b_qk * b_d).to(b_v.dtype), b_v, PREC).to(acc)
    tl.store(o + (i_b * T * H + i_h) * P + o_r[:, None] * (H * P) + o_p[None, :], b_o.to(o.dtype.element_ty))


@triton.jit(do_not_specialize=["NT"])
def ssd_chunk_bwd_kernel(q, k, v, gam, h, dh, do, dq, dk, dv, dgam, NT,
                     G: tl.constexpr, H: tl.constexpr, N: tl.constexpr, P: tl.constexpr, BT: tl.constexpr,
                     BN: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr):
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, i_g, o_t, o_r, b_g, b_gl, b_d = _chunk_head(gam, i_c, i_bh, NT, H, G, BT)
    acc = gam.dtype.element_ty
    T = NT * BT
    b_tail = tl.exp(b_gl - b_g)  # e^{gl - gam_j}
    p_q = q + (i_b * T * G + i_g) * N + o_r[:, None] * (G * N)
    p_k = k + (i_b * T * G + i_g) * N + o_r[:, None] * (G * N)
    p_v = v + (i_b * T * H + i_h) * P + o_r[:, None] * (H * P)
    p_do = do + (i_b * T * H + i_h) * P + o_r[:, None] * (H * P)
    p_h = h + ((i_b * NT + i_c) * H + i_h) * N * P
    p_dh = dh + ((i_b * NT + i_c) * H + i_h) * N * P
    dt = v.dtype.element_ty

    # dv, P block by P block: (D ∘ q kᵀ)ᵀ dO + e^{gl - gam} * (k dh)
    b_qk = tl.zeros([BT, BT], dtype=acc)
    for i_n in range(0, N, BN):
        o_n = i_n + tl.arange(0, BN)
        b_qk += _mm(tl.load(p_q + o_n[None, :]), tl.trans(tl.load(p_k + o_n[None, :])), PREC).to(acc)
    b_dqk = tl.trans((b_qk * b_d).to(dt))
    for i_p in range(0, P, BP):
        o_p = i_p + tl.arange(0, BP)
        b_do = tl.load(p_do + o_p[None, :])
        b_kdh = tl.zeros([BT, BP], dtype=acc)
        for i_n in range(0, N, BN):
            o_n = i_n + tl.arange(0, BN)
            b_kdh += _mm(tl.load(p_k + o_n[None, :]), tl.load(p_dh + o_n[:, None] * P + o_p[None, :]), PREC).to(acc)
        b_dv = _mm(b_dqk, b_do, PREC).to(acc) + b_kdh * b_tail[:, None]
        tl.store(dv + (i_b * T * H + i_h) * P + o_r[:, None] * (H * P) + o_p[None, :], b_dv.to(dv.dtype.element_ty))

    # dq, dk, N block by N block; dgam and dgl along
    b_a = tl.zeros([BT, BT], dtype=acc)
    for i_p in range(0, P, BP):
        o_p = i_p + tl.arange(0, BP)
        b_a += _mm(tl.load(p_do + o_p[None, :]), tl.trans(tl.load(p_v + o_p[None, :])), PREC).to(acc)
    b_da = (b_a * b_d).to(dt)
    b_dat = tl.trans(b_da)
    b_dgam = tl.zeros([BT], dtype=acc)
    b_hdh = tl.zeros([BN, BP], dtype=acc)  # elementwise h_c ∘ dh_{c+1}, summed at the end
    b_kdk = tl.zeros([BT], dtype=acc)  # k_j · (state part of dk_j)
    for i_n in range(0, N, BN):
        o_n = i_n + tl.arange(0, BN)
        b_q = tl.load(p_q + o_n[None, :])
        b_k = tl.load(p_k + o_n[None, :])
        b_doh = tl.zeros([BT, BN], dtype=acc)
        b_vdh = tl.zeros([BT, BN], dtype=acc)
        for i_p in range(0, P, BP):
            o_p = i_p + tl.arange(0, BP)
            b_h = tl.load(p_h + o_n[:, None] * P + o_p[None, :])
            b_dhc = tl.load(p_dh + o_n[:, None] * P + o_p[None, :])
            b_doh += _mm(tl.load(p_do + o_p[None, :]), tl.trans(b_h), PREC).to(acc)
            b_vdh += _mm(tl.load(p_v + o_p[None, :]), tl.trans(b_dhc), PREC).to(acc)
            b_hdh += b_h.to(acc) * b_dhc.to(acc)
        b_dq = _mm(b_da, b_k, PREC).to(acc) + b_doh * tl.exp(b_g)[:, None]
        b_dks = b_vdh * b_tail[:, None]
        b_dk = _mm(b_dat, b_q, PREC).to(acc) + b_dks
        b_qa, b_ka = b_q.to(acc), b_k.to(acc)
        b_kdk += tl.sum(b_ka * b_dks, axis=1)
        b_dgam += tl.sum(b_qa * b_dq, axis=1) - tl.sum(b_ka * b_dk, axis=1)
        p_x = (i_b * T * H + i_h) * N + o_r[:, None] * (H * N) + o_n[None, :]
        tl.store(dq + p_x, b_dq.to(dq.dtype.element_ty))
        tl.store(dk + p_x, b_dk.to(dk.dtype.element_ty))
    b_dgl = tl.exp(b_gl) * tl.sum(tl.sum(b_hdh, axis=1), axis=0) + tl.sum(b_kdk, axis=0)
    b_dgam += tl.where(o_t == BT - 1, b_dgl, 0.)
    tl.store(dgam + (i_b * T + o_r) * H + i_h, b_dgam)


def _flags(x: torch.Tensor) -> dict:
    return {"PREC": {torch.float32: 1, torch.float64: 2}.get(x.dtype, 0)}


def _scan(x, y, gam, s0, *, reverse, store_s, output_st, resets):
    B, Tp, G, N = x.shape
    H, P = y.shape[2], y.shape[3]
    NT = Tp // BT
    s = torch.empty(B, NT, H, N, P, device=x.device, dtype=x.dtype) if store_s else None
    st = torch.empty(B, H, N, P, device=x.device, dtype=gam.dtype) if output_st else None
    blocks, opts = _config("state_bwd" if reverse else "state_fwd", N, P)
    grid = (triton.cdiv(P, blocks["BP"]), triton.cdiv(N, blocks["BN"]), B * H)
    ssd_state_scan_kernel[grid](x, y, gam, s0, s, st, resets, NT, G=G, H=H, N=N, P=P, BT=BT, REVERSE=reverse,
                            USE_S0=s0 is not None, STORE_S=store_s, STORE_ST=output_st, RESETS=resets is not None,
                            **_flags(y), **blocks, **opts)
    return s, st


def state_fwd(k, v, gam, h0=None, *, store_h=True, output_final_state=False, resets=None):
    """-> h [B, NT, H, N, P] (input dtype; the state entering each chunk) or None, ht [B, H, N, P] (gam's dtype)
    or None."""
    return _scan(k, v, gam, h0, reverse=False, store_s=store_h, output_st=output_final_state, resets=resets)


def out_fwd(q, k, v, gam, h):
    """-> o [B, Tp, H, P] in v's dtype (without the skip term)."""
    B, Tp, G, N = k.shape
    H, P = v.shape[2], v.shape[3]
    NT = Tp // BT
    o = torch.empty_like(v)
    blocks, opts = _config("out_fwd", N, P)
    ssd_out_fwd_kernel[(triton.cdiv(P, blocks["BP"]), NT, B * H)](q, k, v, gam, h, o, NT, G=G, H=H, N=N, P=P, BT=BT,
                                                              **_flags(v), **blocks, **opts)
    return o


def state_bwd(q, gam, do, dht=None, *, store_dh=True, need_dh0=False, resets=None):
    """-> dh [B, NT, H, N, P] (input dtype; the gradient of the state leaving each chunk) or None, dh0 [B, H, N, P]
    (gam's dtype) or None."""
    return _scan(q, do, gam, dht, reverse=True, store_s=store_dh, output_st=need_dh0, resets=resets)


def chunk_bwd(q, k, v, gam, h, dh, do):
    """-> dq, dk per head [B, Tp, H, N] (the input dtype when G = H, else the accumulator dtype: summed over the
    group's heads by the caller), dv [B, Tp, H, P] (v's dtype), dgam [B, Tp, H] (gam's dtype)."""
    B, Tp, G, N = k.shape
    H, P = v.shape[2], v.shape[3]
    NT = Tp // BT
    qk_dtype = q.dtype if G == H else gam.dtype
    dq = torch.empty(B, Tp, H, N, device=q.device, dtype=qk_dtype)
    dk = torch.empty(B, Tp, H, N, device=q.device, dtype=qk_dtype)
    dv = torch.empty_like(v)
    dgam = torch.empty_like(gam)
    blocks, opts = _config("chunk_bwd", N, P)
    ssd_chunk_bwd_kernel[(NT, B * H)](q, k, v, gam, h, dh, do, dq, dk, dv, dgam, NT, G=G, H=H, N=N, P=P, BT=BT,
                                  **_flags(v), **blocks, **opts)
    return dq, dk, dv, dgam
