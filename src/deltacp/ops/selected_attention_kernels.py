"""Triton kernels of the selected attention (`selected_attention.py`): each query reads a short list of key runs
(row positions start .. start + SIZE - 1, keys after the query masked), the same list for the G query heads that
share a KV head. Imports triton: loaded on the CUDA path (or under TRITON_INTERPRET=1, for tests).

One program per (query, batch row x KV head, block of query heads): a block of the G heads as the rows of its tiles
(GP rows, padded to >= 16, tl.dot's least; NG = G / GP blocks), one [*, D] tile per operand (D padded to a power of
two); per run a K / V tile of BN rows (BN = SIZE rounded up to a power of two), scores [GP, BN]:
- forward: online softmax over the runs; o and the log-sum-exp per head;
- backward: dq by the same programs (the scores recomputed from the log-sum-exp); dK and dV by one program per run
  (`selected_dkv_kernel`) over the queries that read it, in query order, and over their head blocks (a stable sort
  of the (run, query) pairs, no host sync): no atomics, bitwise reproducible. Its time follows the most-read run (a
  block every query chooses is a serial loop over every query); on random selections it took half the time of
  adding each run's dK, dV with float32 atomics from the query programs (H100, 2026-12-06: 104 vs 179 ms at 32K,
  NOTES.md).
The rows a program takes (LAUNCH "rows") bound its registers: [GP, D] float32 accumulators. Up to WIDE_DIM every head
of a KV head is one block (Qwen4-Exp's 8 heads of 256); wider head dims (GLM-5.3-Flash's absorbed MLA: 64 heads of q
. latent over 512 dims, the 512-wide latent as the values) take blocks of fewer heads (LAUNCH's
"wide" rows: 32 in 16-bit, 16 in float32): each block's products run once over all D columns, where the column-block
kernels before them (2026-12-06) split the outputs over 4 programs that each recomputed the scores over every column
(the backward 8.2x the forward on an H100). The work and the bytes read
grow with the queries times their runs, not with the prefix: at a 2048-token budget a query reads 33 runs of 64
keys whatever the row's length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WIDE_DIM = 256  # head dims over this take the "wide" launches: fewer rows a program
# every kernel's launch: 16-bit inputs the fastest of warps 4 / 8 / 16 x stages 1-3 on an H100 at 32K (NOTES.md;
# some spilling: 0.3-1.3 KB a thread, bench/kernel_resources.py --ops selected); fp32 inputs (tests, fp32 models)
# twice the warps for their twice-as-wide tiles. "rows": the most query heads a program takes (its tiles' rows).
# The wide entries: chosen offline for sm_90 at GLM-5.3-Flash's shape (bench/kernel_resources.py --ops selected,
# NOTES.md); "16-bit wide" at 4 warps, 2 stages, 32 rows: the GLM GPU tests pass with it on an H100, fwd + bwd of a
# layer 173 / 352 ms at 16K / 32K against 205 / 368 at 16 rows and 276 / 559 at 8 warps and 32 rows (2026-12-07,
# alternated in one process: bench/selected_attention.py --shape glm --launch).
LAUNCH = {"16-bit": {"num_warps": 4, "num_stages": 2, "rows": 64},
          "fp32": {"num_warps": 8, "num_stages": 2, "rows": 64},
          "16-bit wide": {"num_warps": 4, "num_stages": 2, "rows": 32},
          "fp32 wide": {"num_warps": 8, "num_stages": 1, "rows": 16}}


@triton.jit
def _rows(pos, i_t, i_b, i_kh, i_g, s, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr):
    """(this program's head rows [GP] of q / o / dq / dO / lse, their mask, the query's row position)."""
    o_g = i_g * GP + tl.arange(0, GP)
    return (i_b * s + i_t) * H + i_kh * G + o_g, o_g < G, tl.load(pos + i_b * s + i_t)


@triton.jit
def _tile(x, rows, m_rows, D: tl.constexpr, DP: tl.constexpr):
    """x[rows] ([R, DP]; rows of D elements), zero outside m_rows and past D."""
    o_c = tl.arange(0, DP)
    return tl.load(x + rows[:, None] * D + o_c[None, :], mask=m_rows[:, None] & (o_c < D)[None, :], other=0.0)


@triton.jit
def _store(x, rows, m_rows, D: tl.constexpr, DP: tl.constexpr, val):
    o_c = tl.arange(0, DP)
    tl.store(x + rows[:, None] * D + o_c[None, :], val.to(x.dtype.element_ty),
             mask=m_rows[:, None] & (o_c < D)[None, :])


@triton.jit
def _run(st, i_b, i_kh, p, S, KVH: tl.constexpr, SIZE: tl.constexpr, BN: tl.constexpr):
    """The run of keys from row position st: (key mask [BN] (inside the run, not after the query; none when st < 0:
    no run), its rows of k / v). No branch on st: the loop over the runs stays one straight-line body that Triton can
    pipeline."""
    o_n = tl.arange(0, BN)
    j = st + o_n
    m_j = (o_n < SIZE) & (j <= tl.where(st >= 0, p, -1)) & (j >= 0)
    return m_j, (i_b * S + j) * KVH + i_kh


@triton.jit(do_not_specialize=["s", "S"])
def selected_fwd_kernel(q, k, v, pos, starts, o, lse, scale, s, S, J: tl.constexpr, H: tl.constexpr,
                        KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, NG: tl.constexpr, D: tl.constexpr,
                        DP: tl.constexpr, SIZE: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
                        SHARED: tl.constexpr):
    i_t, i_bh, i_g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_kh = i_bh // KVH, i_bh % KVH
    q_rows, m_g, p = _rows(pos, i_t, i_b, i_kh, i_g, s, H, G, GP)
    b_q = _tile(q, q_rows, m_g, D, DP)
    m = tl.full([GP], float("-inf"), tl.float32)
    acc_l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for i in range(J):
        st = tl.load(starts + (i_b * s + i_t) * J + i)
        m_j, kv_rows = _run(st, i_b, i_kh, p, S, KVH, SIZE, BN)
        b_k = _tile(k, kv_rows, m_j, D, DP)
        sc = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
        if SHARED:  # one tensor as the keys and the values: one load
            b_v = b_k
        else:
            b_v = _tile(v, kv_rows, m_j, D, DP)
        sc = tl.where(m_j[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: exp(-inf - 0) = 0, no nan
        alpha = tl.exp(m - m_new)
        b_p = tl.exp(sc - m_new[:, None])
        acc_l = acc_l * alpha + tl.sum(b_p, 1)
        acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PREC)
        m = m_new
    _store(o, q_rows, m_g, D, DP, acc / acc_l[:, None])
    tl.store(lse + q_rows, m + tl.log(acc_l), mask=m_g)


@triton.jit(do_not_specialize=["s", "S"])
def selected_dq_kernel(q, k, v, pos, starts, do, lse, delta, dq, scale, s, S, J: tl.constexpr,
                       H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, NG: tl.constexpr,
                       D: tl.constexpr, DP: tl.constexpr, SIZE: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
                       SHARED: tl.constexpr):
    """dq: the query's runs again, dS = P (dO Vᵀ - delta), dq = scale dS K."""
    i_t, i_bh, i_g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_kh = i_bh // KVH, i_bh % KVH
    q_rows, m_g, p = _rows(pos, i_t, i_b, i_kh, i_g, s, H, G, GP)
    b_q = _tile(q, q_rows, m_g, D, DP)
    b_do = _tile(do, q_rows, m_g, D, DP)
    b_lse = tl.load(lse + q_rows, mask=m_g, other=0.0)
    b_delta = tl.load(delta + q_rows, mask=m_g, other=0.0)
    b_dq = tl.zeros([GP, DP], tl.float32)
    for i in range(J):
        st = tl.load(starts + (i_b * s + i_t) * J + i)
        m_j, kv_rows = _run(st, i_b, i_kh, p, S, KVH, SIZE, BN)
        b_k = _tile(k, kv_rows, m_j, D, DP)
        sc = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
        if SHARED:
            b_v = b_k
        else:
            b_v = _tile(v, kv_rows, m_j, D, DP)
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        b_p = tl.where(m_g[:, None] & m_j[None, :], tl.exp(sc - b_lse[:, None]), 0.0)
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PREC)
    _store(dq, q_rows, m_g, D, DP, b_dq * scale)


@triton.jit(do_not_specialize=["s", "S"])
def selected_dkv_kernel(q, k, v, pos, do, lse, delta, offsets, readers, dk, dv, scale, s, S, H: tl.constexpr,
                        KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, NG: tl.constexpr, D: tl.constexpr,
                        DP: tl.constexpr, SIZE: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
                        SHARED: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    """dK (DK), dV (DV), or with both their sum into dk (one tensor as the keys and the values: GLM-5.3-Flash's
    latent, whose gradient is dK + dV): one program per (run start b * S + st, KV head) sums over the queries that
    read the run (`readers[offsets[key]:offsets[key + 1]]`, ascending) and their NG head blocks, and stores the rows
    they touched; every row belongs to one run of its document, so one program writes it. (dK and dV of separate
    tensors in launches of their own: one [BN, DP] float32 accumulator a program.)"""
    key, i_kh = tl.program_id(0), tl.program_id(1)
    lo, hi = tl.load(offsets + key), tl.load(offsets + key + 1)
    if hi > lo:
        i_b, st = key // S, key % S
        o_n = tl.arange(0, BN)
        j = st + o_n
        kv_rows = (i_b * S + j) * KVH + i_kh
        m_n = (o_n < SIZE) & (j < S)
        b_k = _tile(k, kv_rows, m_n, D, DP)
        if DK:
            if SHARED:
                b_v = b_k
            else:
                b_v = _tile(v, kv_rows, m_n, D, DP)
        acc = tl.zeros([BN, DP], tl.float32)
        touched = tl.zeros([BN], tl.int32)
        for e in range(lo, hi):
            i_t = tl.load(readers + e)
            m_j = (o_n < SIZE) & (j <= tl.load(pos + i_b * s + i_t))
            for i_g in range(NG):  # a loop: unrolled (tl.static_range), GLM-5.3-Flash's 4 blocks spilled (sm_90)
                q_rows, m_g, _ = _rows(pos, i_t, i_b, i_kh, i_g, s, H, G, GP)
                b_lse = tl.load(lse + q_rows, mask=m_g, other=0.0)
                b_q = _tile(q, q_rows, m_g, D, DP)
                b_do = _tile(do, q_rows, m_g, D, DP)
                sc = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
                b_p = tl.where(m_g[:, None] & m_j[None, :], tl.exp(sc - b_lse[:, None]), 0.0)
                if DK:
                    b_delta = tl.load(delta + q_rows, mask=m_g, other=0.0)
                    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
                    b_ds = b_p * (b_dp - b_delta[:, None])
                    acc += tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q, input_precision=PREC) * scale
                if DV:
                    acc += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=PREC)
            touched = tl.maximum(touched, m_j.to(tl.int32))
        _store(dk if DK else dv, kv_rows, (touched > 0) & m_n, D, DP, acc)


def _launch_name(q: torch.Tensor) -> str:
    return ("fp32" if q.dtype == torch.float32 else "16-bit") + (" wide" if q.shape[-1] > WIDE_DIM else "")


def _launch(q: torch.Tensor) -> dict:
    """num_warps / num_stages for q's dtype and head dim (LAUNCH)."""
    return {k: v for k, v in LAUNCH[_launch_name(q)].items() if k in ("num_warps", "num_stages")}


def _meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, size: int) -> dict:
    H, D = q.shape[2], q.shape[3]
    KVH = k.shape[2]
    G = H // KVH
    GP = max(16, triton.next_power_of_2(min(G, LAUNCH[_launch_name(q)]["rows"])))
    return dict(J=starts.shape[-1], H=H, KVH=KVH, G=G, GP=GP, NG=triton.cdiv(G, GP), D=D,
                DP=max(16, triton.next_power_of_2(D)), SIZE=size, BN=max(16, triton.next_power_of_2(size)),
                PREC="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 inputs: fp32 products
                SHARED=k is v)  # one tensor as the keys and the values (GLM's latent): loaded once


def forward(q, k, v, pos, starts, scale: float, size: int):
    """(o [B, s, H, D] in q's dtype, lse [B, s, H] float32); inputs contiguous."""
    B, s, H, D = q.shape
    meta = _meta(q, k, v, starts, size)
    o = torch.empty_like(q)
    lse = torch.empty(B, s, H, dtype=torch.float32, device=q.device)
    grid = (s, B * meta["KVH"], meta["NG"])
    selected_fwd_kernel[grid](q, k, v, pos, starts, o, lse, scale, s, k.shape[1], **meta, **_launch(q))
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
    """(dq, dk, dv) in the inputs' dtypes: dq by `selected_dq_kernel`, dk and dv by `selected_dkv_kernel`; k and v one
    tensor (`k is v`): dk is that tensor's whole gradient (dK + dV, one launch) and dv None."""
    B, s, _, D = q.shape
    S = k.shape[1]
    meta = _meta(q, k, v, starts, size)
    shared = meta["SHARED"]
    delta = (o.float() * do.float()).sum(-1).contiguous()
    dq = torch.empty_like(q)
    selected_dq_kernel[(s, B * meta["KVH"], meta["NG"])](q, k, v, pos, starts, do, lse, delta, dq, scale, s, S,
                                                         **meta, **_launch(q))
    offsets, readers = _readers(starts, S)
    meta.pop("J")
    dk, dv = torch.zeros_like(k), (None if shared else torch.zeros_like(v))
    for flags in ((True, True),) if shared else ((True, False), (False, True)):
        selected_dkv_kernel[(B * S, meta["KVH"])](q, k, v, pos, do, lse, delta, offsets, readers, dk,
                                                  dk if shared else dv, scale, s, S, **meta, DK=flags[0],
                                                  DV=flags[1], **_launch(q))
    return dq, dk, dv
