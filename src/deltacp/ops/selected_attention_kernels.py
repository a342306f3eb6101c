"""Triton kernels of the selected attention (`selected_attention.py`): each query reads a short list of key runs
(row positions start .. start + SIZE - 1, keys after the query masked), the same list for the G query heads that
share a KV head. Imports triton: loaded on the CUDA path (or under TRITON_INTERPRET=1, for tests).

One program per (query, batch row x KV head, column block), the G heads as the rows of its tiles (padded to GP >= 16,
tl.dot's least); per run a K / V tile of BN rows (BN = SIZE rounded up to a power of two), scores [GP, BN]:
- forward: online softmax over the runs; o and the log-sum-exp per head;
- backward: dq by the same programs (the scores recomputed from the log-sum-exp); dK and dV by one program per run
  (`selected_dkv_kernel`) over the queries that read it, in query order (a stable sort of the (run, query) pairs,
  no host sync): no atomics, bitwise reproducible. Its time follows the most-read run (a block every query
  chooses is a serial loop over every query); on random selections it took half the time of adding each run's
  dK, dV with float32 atomics from the query programs (H100, 2026-12-06: 104 vs 179 ms at 32K, NOTES.md).
Head dims up to TILE_DIM: one [*, D] tile per operand, one column block (the programs Qwen4-Exp's 256 was tuned
with). Wider ones (GLM-5.3-Flash's absorbed MLA: q . latent over 512 dims, the 512-wide latent as the values) are
`wide`: each product over D summed over ND blocks of BD columns (q and K, or dO and V, loaded a block at a time),
and the D output columns (o, dq, dK, dV) split over NV programs of BV columns each, every one recomputing the
scores: a [GP, BV] float32 accumulator a program where [GP, D] would not fit the registers (the one-tile branches
are those with ND == 1 and BD == BV). The same additions in the same order in every run: bitwise reproducible too.
The work and the bytes read grow with the queries times their runs, not with the prefix: at a 2048-token budget a
query reads 33 runs of 64 keys whatever the row's length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_DIM = 256  # head dims up to this: one tile per operand; wider: blocks of BD (products) and BV (outputs)
# every kernel's launch: 16-bit inputs the fastest of warps 4 / 8 / 16 x stages 1-3 on an H100 at 32K (NOTES.md;
# some spilling: 0.3-1.3 KB a thread, bench/kernel_resources.py --ops selected); fp32 inputs (tests, fp32 models)
# twice the warps for their twice-as-wide tiles. Wide head dims: the blocks BD / BV and a launch that neither
# spills nor nears the shared memory limit on sm_90 at GLM-5.3-Flash's 64 heads over its latent (offline, Triton
# 3.9: 99-181 registers, 16-20 KB; 4 warps spilled in dq, NOTES.md); not timed on a GPU yet
LAUNCH = {"16-bit": {"num_warps": 4, "num_stages": 2}, "fp32": {"num_warps": 8, "num_stages": 2},
          "16-bit wide": {"num_warps": 8, "num_stages": 2, "BD": 64, "BV": 128},
          "fp32 wide": {"num_warps": 8, "num_stages": 2, "BD": 32, "BV": 64}}


@triton.jit
def _rows(pos, i_t, i_b, i_kh, s, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr):
    """(this program's head rows [GP] of q / o / dq / dO / lse, their mask, the query's row position)."""
    o_g = tl.arange(0, GP)
    return (i_b * s + i_t) * H + i_kh * G + o_g, o_g < G, tl.load(pos + i_b * s + i_t)


@triton.jit
def _tile(x, rows, m_rows, c0, D: tl.constexpr, BC: tl.constexpr):
    """x[rows, c0:c0 + BC] ([R, BC]; rows of D elements), zero outside m_rows and past D."""
    o_c = c0 + tl.arange(0, BC)
    return tl.load(x + rows[:, None] * D + o_c[None, :], mask=m_rows[:, None] & (o_c < D)[None, :], other=0.0)


@triton.jit
def _store(x, rows, m_rows, c0, D: tl.constexpr, BC: tl.constexpr, val):
    o_c = c0 + tl.arange(0, BC)
    tl.store(x + rows[:, None] * D + o_c[None, :], val.to(x.dtype.element_ty),
             mask=m_rows[:, None] & (o_c < D)[None, :])


@triton.jit
def _dot_t(a, a_rows, m_a, b, b_rows, m_b, D: tl.constexpr, BD: tl.constexpr, ND: tl.constexpr, PREC: tl.constexpr,
           RA: tl.constexpr, RB: tl.constexpr):
    """[RA, RB] float32: a[a_rows] b[b_rows]ᵀ over the D columns, BD at a time (the wide head dims)."""
    acc = tl.zeros([RA, RB], tl.float32)
    for c in range(ND):  # a loop, not unrolled: unrolled, Triton hoisted every block of q and dO out of the runs'
        # loop (sm_90, Triton 3.9: spills at bf16, fp32 over the shared memory limit)
        acc += tl.dot(_tile(a, a_rows, m_a, c * BD, D, BD), tl.trans(_tile(b, b_rows, m_b, c * BD, D, BD)),
                      input_precision=PREC)
    return acc


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
                        KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                        ND: tl.constexpr, BV: tl.constexpr, SIZE: tl.constexpr, BN: tl.constexpr,
                        PREC: tl.constexpr):
    i_t, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_kh = i_bh // KVH, i_bh % KVH
    q_rows, m_g, p = _rows(pos, i_t, i_b, i_kh, s, H, G, GP)
    if ND == 1 and BD == BV:
        b_q = _tile(q, q_rows, m_g, 0, D, BD)
    m = tl.full([GP], float("-inf"), tl.float32)
    acc_l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BV], tl.float32)
    for i in range(J):
        st = tl.load(starts + (i_b * s + i_t) * J + i)
        m_j, kv_rows = _run(st, i_b, i_kh, p, S, KVH, SIZE, BN)
        if ND == 1 and BD == BV:
            sc = tl.dot(b_q, tl.trans(_tile(k, kv_rows, m_j, 0, D, BD)), input_precision=PREC) * scale
        else:
            sc = _dot_t(q, q_rows, m_g, k, kv_rows, m_j, D, BD, ND, PREC, GP, BN) * scale
        b_v = _tile(v, kv_rows, m_j, i_v * BV, D, BV)
        sc = tl.where(m_j[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: exp(-inf - 0) = 0, no nan
        alpha = tl.exp(m - m_new)
        b_p = tl.exp(sc - m_new[:, None])
        acc_l = acc_l * alpha + tl.sum(b_p, 1)
        acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PREC)
        m = m_new
    _store(o, q_rows, m_g, i_v * BV, D, BV, acc / acc_l[:, None])
    m_lse = m_g & (tl.full([GP], 0, tl.int32) == i_v)  # every column block has the lse: the first stores it
    tl.store(lse + q_rows, m + tl.log(acc_l), mask=m_lse)


@triton.jit(do_not_specialize=["s", "S"])
def selected_dq_kernel(q, k, v, pos, starts, do, lse, delta, dq, scale, s, S, J: tl.constexpr,
                        H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                        BD: tl.constexpr, ND: tl.constexpr, BV: tl.constexpr, SIZE: tl.constexpr, BN: tl.constexpr,
                        PREC: tl.constexpr):
    """dq (columns i_v * BV ..): the query's runs again, dS = P (dO Vᵀ - delta), dq = scale dS K."""
    i_t, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_kh = i_bh // KVH, i_bh % KVH
    q_rows, m_g, p = _rows(pos, i_t, i_b, i_kh, s, H, G, GP)
    if ND == 1 and BD == BV:
        b_q = _tile(q, q_rows, m_g, 0, D, BD)
        b_do = _tile(do, q_rows, m_g, 0, D, BD)
    b_lse = tl.load(lse + q_rows, mask=m_g, other=0.0)
    b_delta = tl.load(delta + q_rows, mask=m_g, other=0.0)
    b_dq = tl.zeros([GP, BV], tl.float32)
    for i in range(J):
        st = tl.load(starts + (i_b * s + i_t) * J + i)
        m_j, kv_rows = _run(st, i_b, i_kh, p, S, KVH, SIZE, BN)
        if ND == 1 and BD == BV:
            b_k = _tile(k, kv_rows, m_j, 0, D, BD)
            sc = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
            b_dp = tl.dot(b_do, tl.trans(_tile(v, kv_rows, m_j, 0, D, BD)), input_precision=PREC)
        else:
            sc = _dot_t(q, q_rows, m_g, k, kv_rows, m_j, D, BD, ND, PREC, GP, BN) * scale
            b_dp = _dot_t(do, q_rows, m_g, v, kv_rows, m_j, D, BD, ND, PREC, GP, BN)
            b_k = _tile(k, kv_rows, m_j, i_v * BV, D, BV)
        b_p = tl.where(m_g[:, None] & m_j[None, :], tl.exp(sc - b_lse[:, None]), 0.0)
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PREC)
    _store(dq, q_rows, m_g, i_v * BV, D, BV, b_dq * scale)


@triton.jit(do_not_specialize=["s", "S"])
def selected_dkv_kernel(q, k, v, pos, do, lse, delta, offsets, readers, dk, dv, scale, s, S, H: tl.constexpr,
                        KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                        ND: tl.constexpr, BV: tl.constexpr, SIZE: tl.constexpr, BN: tl.constexpr,
                        PREC: tl.constexpr, DK: tl.constexpr):
    """dK (DK) or dV, columns i_v * BV ..: one program per (run start b * S + st, KV head, column block) sums over the
    queries that read the run (`readers[offsets[key]:offsets[key + 1]]`, ascending) and stores the rows they touched;
    every row belongs to one run of its document, so one program writes it. (dK and dV in launches of their own: one
    [BN, BV] float32 accumulator a program.)"""
    key, i_kh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo, hi = tl.load(offsets + key), tl.load(offsets + key + 1)
    if hi > lo:
        i_b, st = key // S, key % S
        o_n = tl.arange(0, BN)
        j = st + o_n
        kv_rows = (i_b * S + j) * KVH + i_kh
        m_n = (o_n < SIZE) & (j < S)
        if ND == 1 and BD == BV:
            b_k = _tile(k, kv_rows, m_n, 0, D, BD)
            b_v = _tile(v, kv_rows, m_n, 0, D, BD)
        acc = tl.zeros([BN, BV], tl.float32)
        touched = tl.zeros([BN], tl.int32)
        for e in range(lo, hi):
            i_t = tl.load(readers + e)
            q_rows, m_g, p = _rows(pos, i_t, i_b, i_kh, s, H, G, GP)
            b_lse = tl.load(lse + q_rows, mask=m_g, other=0.0)
            m_j = (o_n < SIZE) & (j <= p)
            if ND == 1 and BD == BV:
                b_q = _tile(q, q_rows, m_g, 0, D, BD)
                sc = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
            else:
                sc = _dot_t(q, q_rows, m_g, k, kv_rows, m_n, D, BD, ND, PREC, GP, BN) * scale
            b_p = tl.where(m_g[:, None] & m_j[None, :], tl.exp(sc - b_lse[:, None]), 0.0)
            if DK:
                b_delta = tl.load(delta + q_rows, mask=m_g, other=0.0)
                if ND == 1 and BD == BV:
                    b_dp = tl.dot(_tile(do, q_rows, m_g, 0, D, BD), tl.trans(b_v), input_precision=PREC)
                    b_qc = b_q
                else:
                    b_dp = _dot_t(do, q_rows, m_g, v, kv_rows, m_n, D, BD, ND, PREC, GP, BN)
                    b_qc = _tile(q, q_rows, m_g, i_v * BV, D, BV)
                b_ds = b_p * (b_dp - b_delta[:, None])
                acc += tl.dot(tl.trans(b_ds.to(b_qc.dtype)), b_qc, input_precision=PREC) * scale
            else:
                b_do = _tile(do, q_rows, m_g, i_v * BV, D, BV)
                acc += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=PREC)
            touched = tl.maximum(touched, m_j.to(tl.int32))
        _store(dk if DK else dv, kv_rows, (touched > 0) & m_n, i_v * BV, D, BV, acc)


def _launch(q: torch.Tensor) -> dict:
    """num_warps / num_stages for q's dtype and head dim (LAUNCH; its wide entries also hold the blocks)."""
    name = ("fp32" if q.dtype == torch.float32 else "16-bit") + (" wide" if q.shape[-1] > TILE_DIM else "")
    return {k: v for k, v in LAUNCH[name].items() if k in ("num_warps", "num_stages")}


def _meta(q: torch.Tensor, k: torch.Tensor, starts: torch.Tensor, size: int) -> dict:
    H, D = q.shape[2], q.shape[3]
    KVH = k.shape[2]
    G = H // KVH
    if D > TILE_DIM:
        blocks = LAUNCH["fp32 wide" if q.dtype == torch.float32 else "16-bit wide"]
        BD, BV = blocks["BD"], blocks["BV"]
    else:
        BD = BV = max(16, triton.next_power_of_2(D))
    return dict(J=starts.shape[-1], H=H, KVH=KVH, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BD=BD,
                ND=triton.cdiv(D, BD), BV=BV, SIZE=size, BN=max(16, triton.next_power_of_2(size)),
                PREC="ieee" if q.dtype == torch.float32 else "tf32")  # fp32 inputs: fp32 products


def forward(q, k, v, pos, starts, scale: float, size: int):
    """(o [B, s, H, D] in q's dtype, lse [B, s, H] float32); inputs contiguous."""
    B, s, H, D = q.shape
    meta = _meta(q, k, starts, size)
    o = torch.empty_like(q)
    lse = torch.empty(B, s, H, dtype=torch.float32, device=q.device)
    grid = (s, B * meta["KVH"], triton.cdiv(D, meta["BV"]))
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
    """(dq, dk, dv) in the inputs' dtypes: dq by `selected_dq_kernel`, dk and dv by `selected_dkv_kernel`."""
    B, s, _, D = q.shape
    S = k.shape[1]
    meta = _meta(q, k, starts, size)
    NV = triton.cdiv(D, meta["BV"])
    delta = (o.float() * do.float()).sum(-1).contiguous()
    dq = torch.empty_like(q)
    selected_dq_kernel[(s, B * meta["KVH"], NV)](q, k, v, pos, starts, do, lse, delta, dq, scale, s, S, **meta,
                                                 **_launch(q))
    offsets, readers = _readers(starts, S)
    meta.pop("J")
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for is_dk in (True, False):
        selected_dkv_kernel[(B * S, meta["KVH"], NV)](q, k, v, pos, do, lse, delta, offsets, readers, dk, dv, scale,
                                                      s, S, **meta, DK=is_dk, **_launch(q))
    return dq, dk, dv
