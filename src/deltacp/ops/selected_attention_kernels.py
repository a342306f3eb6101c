"""Triton kernels of the selected attention (`selected_attention.py`): each query reads a short list of key runs
(row positions start .. start + SIZE - 1, keys after the query masked), the same list for the G query heads that
share a KV head. Imports triton: loaded on the CUDA path (or under TRITON_INTERPRET=1, for tests).

One program per (query, batch row x KV head), the G heads as the rows of its tiles (padded to GP >= 16, tl.dot's
least): q [GP, D]; per run a K / V tile [BN, D] (BN = SIZE rounded up to a power of two), scores [GP, BN]:
- forward: online softmax over the runs; o and the log-sum-exp per head;
- backward: dq by the same programs (the scores recomputed from the log-sum-exp); dK and dV by one program per run
  (`selected_dkv_kernel`) over the queries that read it, in query order (a stable sort of the (run, query) pairs,
  no host sync): no atomics, bitwise reproducible. Its time follows the most-read run (a block every query
  chooses is a serial loop over every query); on random selections it took half the time of adding each run's
  dK, dV with float32 atomics from the query programs (H100, 2026-12-06: 104 vs 179 ms at 32K, NOTES.md).
The work and the bytes read grow with the queries times their runs, not with the prefix: at a 2048-token budget a
query reads 33 runs of 64 keys whatever the row's length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# every kernel's launch: 16-bit inputs the fastest of warps 4 / 8 / 16 x stages 1-3 on an H100 at 32K (NOTES.md;
# some spilling: 0.3-1.3 KB a thread, bench/kernel_resources.py --ops selected); fp32 inputs (tests, fp32 models)
# twice the warps for their twice-as-wide tiles
LAUNCH = {"16-bit": {"num_warps": 4, "num_stages": 2}, "fp32": {"num_warps": 8, "num_stages": 2}}


@triton.jit
def _tiles(q, pos, i_t, i_b, i_kh, s, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
           BD: tl.constexpr):
    """(offsets [GP, BD] of this program's heads in q / o / dq / dO, their mask, the q tile, the query's row
    position)."""
    o_g, o_d = tl.arange(0, GP), tl.arange(0, BD)
    m_q = (o_g < G)[:, None] & (o_d < D)[None, :]
    q_off = ((i_b * s + i_t) * H + i_kh * G + o_g)[:, None] * D + o_d[None, :]
    return q_off, m_q, tl.load(q + q_off, mask=m_q, other=0.0), tl.load(pos + i_b * s + i_t)


@triton.jit
def _run(k, v, st, i_b, i_kh, p, S, KVH: tl.constexpr, D: tl.constexpr, SIZE: tl.constexpr, BN: tl.constexpr,
         BD: tl.constexpr):
    """The run of keys from row position st: (key mask [BN] (inside the run, not after the query; none when st < 0:
    no run), K tile, V tile). No branch on st: the loop over the
    runs stays one straight-line body that Triton can pipeline."""
    o_n, o_d = tl.arange(0, BN), tl.arange(0, BD)
    j = st + o_n
    m_j = (o_n < SIZE) & (j <= tl.where(st >= 0, p, -1)) & (j >= 0)
    kv_off = ((i_b * S + j) * KVH + i_kh)[:, None] * D + o_d[None, :]
    m_kv = m_j[:, None] & (o_d < D)[None, :]
    return m_j, tl.load(k + kv_off, mask=m_kv, other=0.0), tl.load(v + kv_off, mask=m_kv, other=0.0)


@triton.jit(do_not_specialize=["s", "S"])
def selected_fwd_kernel(q, k, v, pos, starts, o, lse, scale, s, S, J: tl.constexpr, H: tl.constexpr,
                        KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                        SIZE: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_kh = i_bh // KVH, i_bh % KVH
    q_off, m_q, b_q, p = _tiles(q, pos, i_t, i_b, i_kh, s, H, G, GP, D, BD)
    m = tl.full([GP], float("-inf"), tl.float32)
    acc_l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BD], tl.float32)
    for i in range(J):
        st = tl.load(starts + (i_b * s + i_t) * J + i)
        m_j, b_k, b_v = _run(k, v, st, i_b, i_kh, p, S, KVH, D, SIZE, BN, BD)
        sc = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
        sc = tl.where(m_j[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: exp(-inf - 0) = 0, no nan
        alpha = tl.exp(m - m_new)
        b_p = tl.exp(sc - m_new[:, None])
        acc_l = acc_l * alpha + tl.sum(b_p, 1)
        acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PREC)
        m = m_new
    tl.store(o + q_off, (acc / acc_l[:, None]).to(o.dtype.element_ty), mask=m_q)
    o_g = tl.arange(0, GP)
    tl.store(lse + (i_b * s + i_t) * H + i_kh * G + o_g, m + tl.log(acc_l), mask=o_g < G)


@triton.jit(do_not_specialize=["s", "S"])
def selected_dq_kernel(q, k, v, pos, starts, do, lse, delta, dq, scale, s, S, J: tl.constexpr,
                        H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                        BD: tl.constexpr, SIZE: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    """dq: the query's runs again, dS = P (dO Vᵀ - delta), dq = scale dS K."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_kh = i_bh // KVH, i_bh % KVH
    q_off, m_q, b_q, p = _tiles(q, pos, i_t, i_b, i_kh, s, H, G, GP, D, BD)
    b_do = tl.load(do + q_off, mask=m_q, other=0.0)
    o_g = tl.arange(0, GP)
    h_off = (i_b * s + i_t) * H + i_kh * G + o_g
    b_lse = tl.load(lse + h_off, mask=o_g < G, other=0.0)
    b_delta = tl.load(delta + h_off, mask=o_g < G, other=0.0)
    b_dq = tl.zeros([GP, BD], tl.float32)
    for i in range(J):
        st = tl.load(starts + (i_b * s + i_t) * J + i)
        m_j, b_k, b_v = _run(k, v, st, i_b, i_kh, p, S, KVH, D, SIZE, BN, BD)
        sc = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
        b_p = tl.where((o_g < G)[:, None] & m_j[None, :], tl.exp(sc - b_lse[:, None]), 0.0)
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PREC)
    tl.store(dq + q_off, (b_dq * scale).to(dq.dtype.element_ty), mask=m_q)


@triton.jit(do_not_specialize=["s", "S"])
def selected_dkv_kernel(q, k, v, pos, do, lse, delta, offsets, readers, dk, dv, scale, s, S, H: tl.constexpr,
                        KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                        SIZE: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, DK: tl.constexpr):
    """dK (DK) or dV: one program per (run start b * S + st, KV head) sums over the queries that read the run
    (`readers[offsets[key]:offsets[key + 1]]`, ascending) and stores the rows they touched; every row belongs to
    one run of its document, so one program writes it. (dK and dV in launches of their own: one [BN, BD] float32
    accumulator a program.)"""
    key, i_kh = tl.program_id(0), tl.program_id(1)
    lo, hi = tl.load(offsets + key), tl.load(offsets + key + 1)
    if hi > lo:
        i_b, st = key // S, key % S
        o_g, o_n, o_d = tl.arange(0, GP), tl.arange(0, BN), tl.arange(0, BD)
        j = st + o_n
        kv_off = ((i_b * S + j) * KVH + i_kh)[:, None] * D + o_d[None, :]
        m_kv = ((o_n < SIZE) & (j < S))[:, None] & (o_d < D)[None, :]
        b_k = tl.load(k + kv_off, mask=m_kv, other=0.0)
        b_v = tl.load(v + kv_off, mask=m_kv, other=0.0)
        acc = tl.zeros([BN, BD], tl.float32)
        touched = tl.zeros([BN], tl.int32)
        for e in range(lo, hi):
            i_t = tl.load(readers + e)
            q_off, m_q, b_q, p = _tiles(q, pos, i_t, i_b, i_kh, s, H, G, GP, D, BD)
            b_do = tl.load(do + q_off, mask=m_q, other=0.0)
            b_lse = tl.load(lse + (i_b * s + i_t) * H + i_kh * G + o_g, mask=o_g < G, other=0.0)
            m_j = (o_n < SIZE) & (j <= p)
            sc = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
            b_p = tl.where((o_g < G)[:, None] & m_j[None, :], tl.exp(sc - b_lse[:, None]), 0.0)
            if DK:
                b_delta = tl.load(delta + (i_b * s + i_t) * H + i_kh * G + o_g, mask=o_g < G, other=0.0)
                b_ds = b_p * (tl.dot(b_do, tl.trans(b_v), input_precision=PREC) - b_delta[:, None])
                acc += tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q, input_precision=PREC) * scale
            else:
                acc += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=PREC)
            touched = tl.maximum(touched, m_j.to(tl.int32))
        m_out = (touched > 0)[:, None] & m_kv
        if DK:
            tl.store(dk + kv_off, acc.to(dk.dtype.element_ty), mask=m_out)
        else:
            tl.store(dv + kv_off, acc.to(dv.dtype.element_ty), mask=m_out)


def _launch(q: torch.Tensor) -> dict:
    return LAUNCH["fp32" if q.dtype == torch.float32 else "16-bit"]


def _meta(q: torch.Tensor, k: torch.Tensor, starts: torch.Tensor, size: int) -> dict:
    H, D = q.shape[2], q.shape[3]
    KVH = k.shape[2]
    G = H // KVH
    return dict(J=starts.shape[-1], H=H, KVH=KVH, G=G, GP=max(16, triton.next_power_of_2(G)), D=D,
                BD=max(16, triton.next_power_of_2(D)), SIZE=size, BN=max(16, triton.next_power_of_2(size)),
                PREC="ieee" if q.dtype == torch.float32 else "tf32")  # fp32 inputs: fp32 products


def forward(q, k, v, pos, starts, scale: float, size: int):
    """(o [B, s, H, D] in q's dtype, lse [B, s, H] float32); inputs contiguous."""
    B, s, H, _ = q.shape
    meta = _meta(q, k, starts, size)
    o = torch.empty_like(q)
    lse = torch.empty(B, s, H, dtype=torch.float32, device=q.device)
    selected_fwd_kernel[(s, B * meta["KVH"])](q, k, v, pos, starts, o, lse, scale, s, k.shape[1], **meta,
                                              **_launch(q))
    return o, lse


def _readers(starts: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets [B * S + 1], readers) int32: the local queries reading the run that starts at row position st of
    batch row b are readers[offsets[b * S + st]:offsets[b * S + st + 1]], ascending (a stable sort; no host sync)."""
    B, s, J = starts.shape
    key = (torch.arange(B, device=starts.device)[:, None, None] * S + starts.long()).view(-1)
    query = torch.arange(s, device=starts.device, dtype=torch.int32)[None, :, None].expand(B, s, J).reshape(-1)
    key = torch.where(starts.view(-1) >= 0, key, B * S)  # unused runs sort past every start
    key, order = torch.sort(key, stable=True)
    offsets = torch.searchsorted(key, torch.arange(B * S + 1, device=starts.device)).to(torch.int32)
    return offsets, query[order].contiguous()


def backward(q, k, v, pos, starts, o, lse, do, scale: float, size: int):
    """(dq, dk, dv) in the inputs' dtypes: dq by `selected_dq_kernel`, dk and dv by `selected_dkv_kernel`."""
    B, s, H, _ = q.shape
    S = k.shape[1]
    meta = _meta(q, k, starts, size)
    delta = (o.float() * do.float()).sum(-1).contiguous()
    dq = torch.empty_like(q)
    selected_dq_kernel[(s, B * meta["KVH"])](q, k, v, pos, starts, do, lse, delta, dq, scale, s, S, **meta,
                                             **_launch(q))
    offsets, readers = _readers(starts, S)
    meta.pop("J")
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for is_dk in (True, False):
        selected_dkv_kernel[(B * S, meta["KVH"])](q, k, v, pos, do, lse, delta, offsets, readers, dk, dv, scale, s,
                                                  S, **meta, DK=is_dk, **_launch(q))
    return dq, dk, dv
