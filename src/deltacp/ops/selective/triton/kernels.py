"""Triton kernels of the selective scan (Mamba1) and their launchers. Imports triton: only on the Triton path
(`deltacp.ops.selective.triton` loads this module on first use).

Per row r, channel d and state index n (a decay per channel AND state index: nothing to share over a tensor core),
in chunks of BT tokens, with a_t = exp(dt_t[d] A[d, n]) (0 at a document start), b_t = dt_t[d] x_t[d] B_t[n]:
    h_t = a_t h_{t-1} + b_t                         y_t[d] = (sum_n C_t[n] h_t[d, n] + D[d] x_t[d]) silu(z_t[d])
The log decay of a span is A[d, n] times the sum of dt over it, so a chunk's transition needs no product:
    chunk_state (fwd)   S_c = sum_t exp(A (dts_c - cdt_t)) b_t   (tokens after the chunk's last reset only),
                        dts_c = sum of dt over chunk c, cdt_t the in-chunk inclusive cumsum; exponents <= 0
    chunk_state (bwd)   dS_c = sum_t exp(A cdt_t) C_t[n] gy_t     (tokens before the chunk's first reset only),
                        gy = dy silu(z): the gradient reaching the chunk's entering state from its own outputs
    state_pass          M_c = exp(A dts_c) (0 if a document starts in chunk c); forward h_{c+1} = M_c h_c + S_c
                        (H_c stored: the state entering chunk c; the final state); reverse dH_{c-1} = M_c dH_c +
                        dS_c (dH_c stored: the gradient of the state leaving chunk c; dh0)
    chunk_out           per n, the in-chunk scan of (a_t, b_t) from H_c (folded into the first token's b), y
                        accumulated over n in registers, then + D x and the gate; each input read once per n tile
    chunk_bwd           per n, two in-chunk scans of pairs of affine maps (below): forward, h_t and h_{t-1} from
                        H_c; reverse, W_t = a_t dh_t (the gradient reaching h_{t-1}) and W_{t+1}, from dH_c; then
                        dh_t = C_t gy_t + W_{t+1} and
                          dx   = dt sum_n B_n dh + D gy         ddt = x sum_n B_n dh + sum_n A_n a h_{t-1} dh
                          dA   = sum_t dt a h_{t-1} dh          dD  = sum_t gy x          dz = dy y_pre silu'(z)
                          dB_t = sum_d dt x dh                  dC_t = sum_d gy h
The pair scan: the scan's element is the affine map of a token (h -> a h + b) AND the map of all but its last
token (identity for one token); composing (F1, G1) then (F2, G2) gives (F2 F1, G2 F1), so the inclusive scan yields
the state after each token and the state before it in one pass, with no division by a decay (which may be 0) and
no subtraction h_t - b_t (which cancels when a_t h_{t-1} << b_t). The reverse scan is the same combine run from the
chunk's end. No [T, I, N] tensor exists: the states live per (BT tokens x BD channels) tile of one n, the chunk
states H, dH are [rows, chunks, N, I] (one state per BT tokens), and dB, dC leave chunk_bwd as partial sums over
its channel group ([rows, NG, Tp, N], summed by the caller).

Layouts: x, dt, z, dy, y, dx, ddt, dz [R, T, I] with unit channel stride (row and token strides passed); B, C, dB, dC
[R, T, N] and A [R, I, N] with all three strides passed (A's row stride 0 when expanded, as the Mamba view passes it;
the launchers may pass token-major copies: BC_TOKEN_MAJOR), D [R, I]; h0, ht, dht,
dh0 [R, I, N] in the accumulator dtype; S, H, dS, dH [R, NC, N, I] and dts [R, NC, I] in the accumulator dtype.
T is never a compile-time constant (one compilation for every length): the last chunk is masked (a masked token
has dt = x = 0: decay 1, input 0). `resets` [T] int32 (packed rows only): the state entering those tokens is zero.

Accumulation and states: fp32 (fp64 for fp64 inputs, the interpreter tests); inputs are read in their dtype and
widened. Every kernel's name starts with sel_ (profiles group them by it).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deltacp.ops.gdn.triton.launch import sm_count
from deltacp.ops.gdn.triton.version import parse_triton_version

# Launch configurations. BT: the chunk (tokens per program, the granularity of the stored chunk states: [T / BT,
# I, N] fp32, 1 / BT of a [T, I, N] tensor); BD: channels per program (contiguous: BD bf16 = 64 bytes at 32);
# NG (chunk_bwd): channel groups per chunk, each program looping over its group's blocks (the partial dB, dC are
# NG x [T, N]); HS (chunk_out, chunk_bwd): the chunk's token segments, each scanned alone inside a thread, then
# joined (`_carry`): offline (sm_90, bf16, `bench/variants/README.md`) chunk_bwd's loop over n takes 2,354
# instructions a block of 16 channels at HS 1 with Triton 3.6 (1,154 warp shuffles: the token scans cross threads),
# 1,892 at HS 2 (826); chunk_out's 689 (96) and 553 (3); with Triton 3.9 chunk_bwd 1,812 (642) and 1,253 (272);
# yet timed on an H100 (2026-12-07) each kernel ran 52-59 % longer at HS 2 (chunk_bwd 53.0 against 34.9 ms at 32K),
# so the table keeps HS 1 (its PTX the same instructions as before HS existed);
# BS (state_pass): state entries per program; an entry may cap the registers a thread (maxnreg, ptxas'
# .maxnreg; none in the table). Measured on an H100 (Falcon-Mamba-7B's I = 8192, N = 16, bf16, 32K tokens): two
# passes of `bench/launch_sweep.py --op selective` (4 and 8 warps, 2026-12-06) took one fwd+bwd from 120.7 ms (the
# offline table) to 70.8 ms; then one warp a program (2026-12-07, `gpu_checks.sh selective_ab` with
# bench/variants/ tables, the op's GPU tests passing on each): 50.1 ms. At one warp the token-axis scans are warp
# shuffles with no cross-warp step through shared memory; chunk_bwd at BD 64 and 4 warps had 255 registers, 1.1 KB
# spilled a thread and 12.5 % occupancy (Nsight Compute: 190 M local-memory requests, L1 73 % busy), at BD 16 and
# one warp 768 bytes spill and it takes 33.0 ms against 50.9 (chunk_state 6.7 -> 4.0 ms, chunk_out 11.0 -> 10.5).
LAUNCH: dict[str, dict[str, int]] = {
    "chunk": dict(BT=32),
    "chunk_state": dict(BD=16, num_warps=1, num_stages=3),
    "state_pass": dict(BS=256, num_warps=4, num_stages=3),
    "chunk_out": dict(BD=16, HS=1, num_warps=1, num_stages=3),
    "chunk_bwd": dict(BD=16, NG=8, HS=1, num_warps=1, num_stages=3),
}


# The layout each launcher passes B, C and A in (the kernels read one state index n at a time: a column of each):
# as given ([R, T, N] with N contiguous, A [R, I, N]: a column's BT tokens or BD channels one sector each, read again
# from L1 for every n; dB, dC partials [R, NG, Tp, N] likewise), or, for the launchers named in BC_TOKEN_MAJOR (any of
# TOKEN_MAJOR_KERNELS), token-major copies (storage [R, N, T rounded up to 16]: a column contiguous; B and C are
# R x T x N, 1 / I of x's size), chunk_bwd then storing its partials [R, NG, N, Tp].
# Measured on an H100 (2026-12-07, Falcon-Mamba-7B's shape, bf16, `gpu_checks.sh selective_ab` with
# bench/variants-style tables, NOTES.md), fwd+bwd at 32K / 8K: none 52.54 / 13.71 ms, chunk_bwd 49.40 / 12.84,
# chunk_state and chunk_bwd 49.75 / 13.05, all four 51.89 / 13.64 (the forward 2.3 ms slower). Under Nsight Compute
# chunk_bwd's excessive global sectors fell from 79 % to 54 % of its sectors, its spill requests by half.
BC_TOKEN_MAJOR: tuple[str, ...] = ("chunk_bwd",)
TOKEN_MAJOR_KERNELS = ("chunk_state", "state_pass", "chunk_out", "chunk_bwd")

# chunk_bwd's channel groups at short rows: its grid is (chunks, NG, rows), one warp a program, so at the lengths a
# rank holds under CP it leaves the GPU idle (2K tokens of one row: 64 chunks x 8 groups = 512 programs, where an H100
# holds about 1,056 of them: RESIDENT_CHUNK_BWD a SM, 65,536 registers / (32 x 255)); on an H100 the op took 2.3x
# mamba_ssm's time at 2K against 1.43x at 32K (NOTES.md, seventeenth set). FILL_NG 1: NG doubles from the table's
# (`fill_groups`) while the grid still fits one wave, more dB, dC partials summed after the kernel (the same sums in
# another order). Off until timed on a GPU (`SELECTIVE_LENGTHS="2048 4096 8192" SELECTIVE_AB="FILL_NG=1" bash
# scripts/gpu_checks.sh selective_ab`).
FILL_NG = 0
RESIDENT_CHUNK_BWD = 8


def fill_groups(ng: int, blocks: int, programs: int, sms: int, resident: int) -> int:
    """chunk_bwd's channel groups: `ng` doubled, up to the channel blocks, while twice the grid (`programs` per group:
    chunks x rows) still fits one wave of `resident` programs on each of `sms` SMs."""
    while 2 * ng <= blocks and 2 * ng * programs <= sms * resident:
        ng *= 2
    return ng


def chunk_len() -> int:
    return LAUNCH["chunk"]["BT"]


def _columns(t: torch.Tensor, kernel: str) -> torch.Tensor:
    """t [R, L, N] (B, C over tokens; A over channels) as launcher `kernel` passes it (BC_TOKEN_MAJOR): itself, or
    the same values with the L axis contiguous, in storage [R, N, L rounded up to 16] (the N stride a multiple of 16
    at every length, as the kernels' specialisation wants: one compilation for every T); a row stride of 0 (an
    expanded A) kept."""
    if not set(BC_TOKEN_MAJOR) <= set(TOKEN_MAJOR_KERNELS):
        raise ValueError(f"BC_TOKEN_MAJOR={BC_TOKEN_MAJOR!r}: each name one of {TOKEN_MAJOR_KERNELS}")
    if kernel not in BC_TOKEN_MAJOR or t.stride(1) == 1:
        return t
    R, L, N = t.shape
    rows = 1 if t.stride(0) == 0 else R
    out = torch.empty(rows, N, triton.cdiv(L, 16) * 16, dtype=t.dtype, device=t.device)[:, :, :L]
    out.copy_(t[:rows].transpose(1, 2))
    return out.transpose(1, 2).expand(t.shape)


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


@triton.jit
def _pair(a1, b1, ga1, gb1, a2, b2, ga2, gb2):
    """(F, G) of segment 1 then segment 2: F = F2 F1, G = G2 F1 (affine maps h -> a h + b)."""
    return a1 * a2, a2 * b1 + b2, a1 * ga2, ga2 * b1 + gb2


@triton.jit
def _affine(a1, b1, a2, b2):
    """h -> a1 h + b1, then h -> a2 h + b2."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _tile(p, i_r, s_r, s_t, o_t, o_d, m, acc: tl.constexpr):
    """A [BT, BD] tile of a [R, T, I] tensor (unit channel stride) in the accumulator dtype, 0 where masked."""
    return tl.load(p + i_r * s_r + o_t[:, None] * s_t + o_d[None, :], mask=m, other=0.).to(acc)


@triton.jit
def _col(p, i_r, s_r, s_t, s_n, o_t, n, m_t, acc: tl.constexpr):
    """Column n [BT] of a [R, T, N] tensor (B, C), 0 where masked."""
    return tl.load(p + i_r * s_r + o_t * s_t + n * s_n, mask=m_t, other=0.).to(acc)


@triton.jit
def _acol(A, i_r, sa_r, sa_d, sa_n, o_d, n, m_d, acc: tl.constexpr):
    """A[:, n] [BD] of the channels o_d (A [R, I, N]), 0 where masked."""
    return tl.load(A + i_r * sa_r + o_d * sa_d + n * sa_n, mask=m_d, other=0.).to(acc)


@triton.jit
def _tile3(p, i_r, s_r, s_t, o_t, o_d, m, acc: tl.constexpr):
    """_tile's 3-D form (chunk_out, chunk_bwd): o_t the chunk's tokens as a 2-D grid (`_segments`), o_d [BD]."""
    return tl.load(p + i_r * s_r + o_t[:, :, None] * s_t + o_d[None, None, :], mask=m, other=0.).to(acc)


@triton.jit
def _segments(J: tl.constexpr, HS: tl.constexpr, SEG_FIRST: tl.constexpr):
    """The chunk's BT = HS x J tokens as a 2-D grid of their positions in the chunk: [HS, J] (SEG_FIRST) or [J, HS],
    segment s holding the consecutive tokens s J ... s J + J - 1 along the token axis (1, or 0)."""
    if SEG_FIRST:
        o_l = tl.arange(0, HS)[:, None] * J + tl.arange(0, J)[None, :]
    else:
        o_l = tl.arange(0, HS)[None, :] * J + tl.arange(0, J)[:, None]
    return o_l


@triton.jit
def _carry(la, lb, J: tl.constexpr, HS: tl.constexpr, REVERSE: tl.constexpr, SEG_FIRST: tl.constexpr):
    """The state entering each of HS token segments (shaped to broadcast over the tile), from a scan run on each
    segment alone (la, lb: the maps' a and b components, tiles laid out as `_segments` says): the segments' totals
    (the row of a segment's last token; its first under REVERSE) scanned across the segments and shifted by one (0
    entering the first). The b components are states (the chunk's entering state is folded into its first token,
    or its last under REVERSE), so the whole chunk's scan is b + a carry for every map of the tuple (F and G)."""
    TA: tl.constexpr = 1 if SEG_FIRST else 0  # the token axis
    o_j = tl.arange(0, J)
    o_h = tl.arange(0, HS)
    row = o_j == (0 if REVERSE else J - 1)
    if SEG_FIRST:
        sel = row[None, :, None]
    else:
        sel = row[:, None, None]
    ta = tl.sum(tl.where(sel, la, 0.), TA)  # [HS, BD] the segments' totals
    tb = tl.sum(tl.where(sel, lb, 0.), TA)
    _, ends = tl.associative_scan((ta, tb), 0, _affine, reverse=REVERSE)  # the state at each segment's end
    if REVERSE:
        src = o_h + 1  # the segment whose end enters segment s
    else:
        src = o_h - 1
    pick = (o_h[None, :] == src[:, None])[:, :, None]  # [HS (s), HS (the source), 1]
    c = tl.sum(tl.where(pick, ends[None, :, :], 0.), 1)  # [HS, BD]
    if SEG_FIRST:
        c = c[:, None, :]
    else:
        c = c[None, :, :]
    return c


@triton.jit(do_not_specialize=["T", "sx_r", "sd_r", "sg_r", "sb_r"])
def sel_chunk_state_kernel(x, dt, z, A, Bm, resets, s, dts, T, I, sx_r, sx_t, sd_r, sd_t, sg_r, sg_t, sa_r, sa_d,
                           sa_n, sb_r, sb_t, sb_n, N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                           REVERSE: tl.constexpr, USE_Z: tl.constexpr, RESETS: tl.constexpr):
    """One (chunk, channel block, row) of S_c (forward: x = x, Bm = B) or dS_c (REVERSE: x = dy, z the gate, Bm = C),
    stored [R, NC, N, I]; dts_c [R, NC, I] (the sum of dt over the chunk)."""
    i_c, i_b, i_r = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    NC = tl.cdiv(T, BT)
    acc = s.dtype.element_ty
    o_t = (i_c * BT + tl.arange(0, BT)).to(tl.int64)
    o_d = i_b * BD + tl.arange(0, BD)
    m_t, m_d = o_t < T, o_d < I
    m = m_t[:, None] & m_d[None, :]
    b_dt = _tile(dt, i_r, sd_r, sd_t, o_t, o_d, m, acc)
    b_x = _tile(x, i_r, sx_r, sx_t, o_t, o_d, m, acc)
    c_dt = tl.cumsum(b_dt, 0)
    b_tot = tl.sum(b_dt, 0)
    if REVERSE:
        if USE_Z:
            b_z = _tile(z, i_r, sg_r, sg_t, o_t, o_d, m, acc)
            b_x = b_x * b_z * tl.sigmoid(b_z)  # gy = dy silu(z)
        b_e = c_dt  # exp(A cdt_t): the entering state's reach to token t
    else:
        b_x = b_x * b_dt  # dt x
        b_e = b_tot[None, :] - c_dt  # exp(A (dts - cdt_t)): token t's reach to the chunk's end
    if RESETS:
        b_rs = tl.load(resets + o_t, mask=m_t, other=0)
        c_rs = tl.cumsum(b_rs, 0)
        if REVERSE:
            keep = c_rs == 0  # no document start at or before t
        else:
            keep = c_rs == tl.sum(b_rs, 0)  # no document start after t
        b_x = tl.where(keep[:, None], b_x, 0.)
    p_s = s + ((i_r * NC + i_c) * N) * I + o_d
    for n in range(N):
        b_a = _acol(A, i_r, sa_r, sa_d, sa_n, o_d, n, m_d, acc)
        b_col = _col(Bm, i_r, sb_r, sb_t, sb_n, o_t, n, m_t, acc)
        b_s = tl.sum(tl.exp(b_e * b_a[None, :]) * b_x * b_col[:, None], 0)
        tl.store(p_s + n * I, b_s, mask=m_d)
    tl.store(dts + (i_r * NC + i_c) * I + o_d, b_tot, mask=m_d)


@triton.jit(do_not_specialize=["T"])
def sel_state_pass_kernel(A, dts, creset, s, s0, st, h, T, I, sa_r, sa_d, sa_n, N: tl.constexpr, BT: tl.constexpr,
                          BS: tl.constexpr, REVERSE: tl.constexpr, USE_S0: tl.constexpr, STORE_H: tl.constexpr,
                          STORE_ST: tl.constexpr, RESETS: tl.constexpr):
    """BS entries (n, d) of one row's state, sequential over the chunks: forward h = M_c h + S_c from s0 (h0),
    storing the entering state H_c and the final one st; REVERSE from the last chunk, dh = M_c dh + dS_c from
    s0 (dht), storing the gradient leaving each chunk and st (dh0). M_c = exp(A dts_c), 0 on a chunk with a reset."""
    i_s, i_r = tl.program_id(0), tl.program_id(1).to(tl.int64)
    NC = tl.cdiv(T, BT)
    acc = s.dtype.element_ty
    o = i_s * BS + tl.arange(0, BS)  # n * I + d
    m = o < N * I
    o_n, o_d = o // I, o % I
    p_io = i_r * I * N + o_d * N + o_n  # [R, I, N] (h0, ht, dht, dh0)
    b_a = tl.load(A + i_r * sa_r + o_d * sa_d + o_n * sa_n, mask=m, other=0.).to(acc)
    b_h = tl.zeros([BS], dtype=acc)
    if USE_S0:
        b_h += tl.load(s0 + p_io, mask=m, other=0.).to(acc)
    for i_i in range(NC):
        i_c = NC - 1 - i_i if REVERSE else i_i
        p_c = (i_r * NC + i_c) * N * I + o
        if STORE_H:
            tl.store(h + p_c, b_h, mask=m)
        b_m = tl.exp(b_a * tl.load(dts + (i_r * NC + i_c) * I + o_d, mask=m, other=0.))
        if RESETS:
            b_m = tl.where(tl.load(creset + i_c) != 0, 0., b_m)
        b_h = b_m * b_h + tl.load(s + p_c, mask=m, other=0.)
    if STORE_ST:
        tl.store(st + p_io, b_h, mask=m)


@triton.jit(do_not_specialize=["T", "sx_r", "sd_r", "sz_r", "sb_r", "sc_r"])
def sel_chunk_out_kernel(x, dt, z, A, Bm, Cm, Dv, resets, h, y, T, I, sx_r, sx_t, sd_r, sd_t, sz_r, sz_t, sa_r,
                         sa_d, sa_n, sb_r, sb_t, sb_n, sc_r, sc_t, sc_n, sdv_r, N: tl.constexpr, BT: tl.constexpr,
                         BD: tl.constexpr, HS: tl.constexpr, SEG_FIRST: tl.constexpr, USE_D: tl.constexpr,
                         USE_Z: tl.constexpr, RESETS: tl.constexpr):
    """One (chunk, channel block, row) of y: per n the scan of (a_t, b_t) from the entering state H_c (folded into
    the chunk's first token), C_t[n] h_t summed over n in registers; + D x; the silu(z) gate; y stored once.
    The tiles hold HS segments of J = BT / HS tokens, as in chunk_bwd (`_segments`, `_carry`)."""
    J: tl.constexpr = BT // HS
    TA: tl.constexpr = 1 if SEG_FIRST else 0  # the token axis of the tiles
    i_c, i_b, i_r = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    NC = tl.cdiv(T, BT)
    acc = h.dtype.element_ty
    o_l = _segments(J, HS, SEG_FIRST)  # the token within the chunk
    o_t = (i_c * BT + o_l).to(tl.int64)
    o_d = i_b * BD + tl.arange(0, BD)
    m_t, m_d = o_t < T, o_d < I
    m = m_t[:, :, None] & m_d[None, None, :]
    b_dt = _tile3(dt, i_r, sd_r, sd_t, o_t, o_d, m, acc)
    b_x = _tile3(x, i_r, sx_r, sx_t, o_t, o_d, m, acc)
    b_u = b_dt * b_x
    first = (o_l == 0)[:, :, None]
    if RESETS:
        is_rs = (tl.load(resets + o_t, mask=m_t, other=0) != 0)[:, :, None]
    if USE_D:  # D x first: x is not held across the loop
        b_y = b_x * tl.load(Dv + i_r * sdv_r + o_d, mask=m_d, other=0.).to(acc)[None, None, :]
    else:
        b_y = tl.zeros(b_x.shape, dtype=acc)
    p_h = h + ((i_r * NC + i_c) * N) * I + o_d
    for n in range(N):
        b_an = _acol(A, i_r, sa_r, sa_d, sa_n, o_d, n, m_d, acc)
        b_a = tl.exp(b_dt * b_an[None, None, :])
        if RESETS:
            b_a = tl.where(is_rs, 0., b_a)
        b_hin = tl.load(p_h + n * I, mask=m_d, other=0.)
        b_b = b_u * _col(Bm, i_r, sb_r, sb_t, sb_n, o_t, n, m_t, acc)[:, :, None]
        b_b = tl.where(first, b_b + b_a * b_hin[None, None, :], b_b)
        b_fa, b_hs = tl.associative_scan((b_a, b_b), TA, _affine)
        if HS > 1:
            b_hs += b_fa * _carry(b_fa, b_hs, J, HS, False, SEG_FIRST)
        b_y += b_hs * _col(Cm, i_r, sc_r, sc_t, sc_n, o_t, n, m_t, acc)[:, :, None]
    if USE_Z:
        b_z = _tile3(z, i_r, sz_r, sz_t, o_t, o_d, m, acc)
        b_y = b_y * b_z * tl.sigmoid(b_z)
    tl.store(y + i_r * T * I + o_t[:, :, None] * I + o_d[None, None, :], b_y.to(y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T", "NG", "sx_r", "sd_r", "sz_r", "so_r", "sb_r", "sc_r"])
def sel_chunk_bwd_kernel(x, dt, z, do, A, Bm, Cm, Dv, resets, h, dh, dx, ddt, dz, dA, dD, dB, dC, T, I,
                         sx_r, sx_t, sd_r, sd_t, sz_r, sz_t, so_r, so_t, sa_r, sa_d, sa_n, sb_r, sb_t, sb_n, sc_r,
                         sc_t, sc_n, sdv_r, sp_r, sp_g, sp_t, sp_n, N: tl.constexpr, BT: tl.constexpr,
                         BD: tl.constexpr, NG, HS: tl.constexpr, SEG_FIRST: tl.constexpr,
                         USE_D: tl.constexpr, USE_Z: tl.constexpr, RESETS: tl.constexpr):
    """One (chunk, channel group, row): for each channel block of the group, every gradient of the chunk's tokens
    (module docstring) from the entering state H_c and the gradient dH_c of the state leaving the chunk. dx, ddt,
    dz stored once; dA, dD per chunk ([R, NC, N, I], [R, NC, I]: summed over the chunks by the caller); dB, dC
    summed over the group's blocks in place ([R, NG, Tp, N], strides sp_*, zeroed by the caller; each element has
    one program). NG is a runtime argument, not specialised (FILL_NG changes it with the length: one compilation).
    The chunk's tokens are HS segments of J = BT / HS consecutive tokens, the tiles [HS, J, BD] (SEG_FIRST) or [J,
    HS, BD] (`_segments`): each segment is scanned alone along its J tokens, then the segments' totals join them
    (`_carry`). With HS = 2 at one warp the compiler can give each thread one channel and one segment, its J tokens
    in registers: the token scans then run inside a thread (Triton's scan of a [BT, BD] tile at one warp spreads
    the tokens over threads: warp shuffles at every step). Which of the two layouts gets it depends on the Triton
    version (`seg_first`). HS = 1: the one segment is the chunk."""
    J: tl.constexpr = BT // HS
    TA: tl.constexpr = 1 if SEG_FIRST else 0  # the token axis of the tiles
    i_c, i_g, i_r = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    NC = tl.cdiv(T, BT)
    acc = h.dtype.element_ty
    o_l = _segments(J, HS, SEG_FIRST)  # the token within the chunk
    o_t = (i_c * BT + o_l).to(tl.int64)
    m_t = o_t < T
    first, last = (o_l == 0)[:, :, None], (o_l == BT - 1)[:, :, None]
    if RESETS:
        is_rs = (tl.load(resets + o_t, mask=m_t, other=0) != 0)[:, :, None]
    NB = tl.cdiv(I, BD)
    per = tl.cdiv(NB, NG)
    p_bc = i_r * sp_r + i_g * sp_g + o_t * sp_t  # dB, dC [R, NG, Tp, N]
    for i_j in range(per):
        o_d = (i_g * per + i_j) * BD + tl.arange(0, BD)
        m_d = o_d < I
        m = m_t[:, :, None] & m_d[None, None, :]
        b_dt = _tile3(dt, i_r, sd_r, sd_t, o_t, o_d, m, acc)
        b_x = _tile3(x, i_r, sx_r, sx_t, o_t, o_d, m, acc)
        b_do = _tile3(do, i_r, so_r, so_t, o_t, o_d, m, acc)
        if USE_Z:
            b_z = _tile3(z, i_r, sz_r, sz_t, o_t, o_d, m, acc)
            b_sg = tl.sigmoid(b_z)
            b_gy = b_do * b_z * b_sg
            b_dzf = b_do * b_sg * (1. + b_z * (1. - b_sg))  # dz = dy silu'(z) y_pre
        else:
            b_gy = b_do
        b_u = b_dt * b_x
        b_yp = tl.zeros(b_x.shape, dtype=acc)  # sum_n C h (the gate's input, less D x)
        b_bdh = tl.zeros(b_x.shape, dtype=acc)  # sum_n B dh
        b_adt = tl.zeros(b_x.shape, dtype=acc)  # sum_n A a h_{t-1} dh
        p_hc = ((i_r * NC + i_c) * N) * I + o_d
        for n in range(N):
            b_an = _acol(A, i_r, sa_r, sa_d, sa_n, o_d, n, m_d, acc)[None, None, :]
            b_a = tl.exp(b_dt * b_an)
            if RESETS:
                b_a = tl.where(is_rs, 0., b_a)
            b_bn = _col(Bm, i_r, sb_r, sb_t, sb_n, o_t, n, m_t, acc)[:, :, None]
            b_cn = _col(Cm, i_r, sc_r, sc_t, sc_n, o_t, n, m_t, acc)[:, :, None]
            b_g = b_gy * b_cn
            b_hin = tl.load(h + p_hc + n * I, mask=m_d, other=0.)[None, None, :]
            b_dhe = tl.load(dh + p_hc + n * I, mask=m_d, other=0.)[None, None, :]
            b_b = b_u * b_bn
            one = tl.full(b_x.shape, 1., acc)
            b_fa, b_hs, b_ga, b_hp = tl.associative_scan(
                (b_a, tl.where(first, b_b + b_a * b_hin, b_b), tl.where(first, 0., one),
                 tl.where(first, b_hin, 0.)), TA, _pair)
            b_ra, b_rb, b_rga, b_wn = tl.associative_scan(
                (b_a, tl.where(last, b_a * (b_g + b_dhe), b_a * b_g), tl.where(last, 0., one),
                 tl.where(last, b_dhe, 0.)), TA, _pair, reverse=True)
            if HS > 1:
                c = _carry(b_fa, b_hs, J, HS, False, SEG_FIRST)
                b_hs, b_hp = b_hs + b_fa * c, b_hp + b_ga * c
                b_wn += b_rga * _carry(b_ra, b_rb, J, HS, True, SEG_FIRST)
            b_dhs = b_g + b_wn  # dh_t = C_t gy_t + a_{t+1} dh_{t+1}
            b_yp += b_hs * b_cn
            b_bdh += b_dhs * b_bn
            b_ahd = b_a * b_hp * b_dhs
            b_adt += b_ahd * b_an
            tl.store(dA + p_hc + n * I, tl.sum(tl.sum(b_ahd * b_dt, 0), 0), mask=m_d)
            p_b = p_bc + n * sp_n
            tl.store(dB + p_b, tl.load(dB + p_b) + tl.sum(b_u * b_dhs, 2))
            tl.store(dC + p_b, tl.load(dC + p_b) + tl.sum(b_gy * b_hs, 2))
        b_dx = b_dt * b_bdh
        if USE_D:
            b_dv = tl.load(Dv + i_r * sdv_r + o_d, mask=m_d, other=0.).to(acc)[None, None, :]
            b_dx += b_dv * b_gy
            b_yp += b_dv * b_x
            tl.store(dD + (i_r * NC + i_c) * I + o_d, tl.sum(tl.sum(b_gy * b_x, 0), 0), mask=m_d)
        p_o = i_r * T * I + o_t[:, :, None] * I + o_d[None, None, :]
        tl.store(dx + p_o, b_dx.to(dx.dtype.element_ty), mask=m)
        tl.store(ddt + p_o, (b_x * b_bdh + b_adt).to(ddt.dtype.element_ty), mask=m)
        if USE_Z:
            tl.store(dz + p_o, (b_dzf * b_yp).to(dz.dtype.element_ty), mask=m)


# --- launchers -------------------------------------------------------------------------------------------------

def _opts(name: str) -> tuple[dict[str, int], dict[str, int]]:
    cfg = dict(LAUNCH[name])
    hs, bt = cfg.get("HS", 1), chunk_len()
    if hs < 1 or hs & (hs - 1) or bt % hs:
        raise ValueError(f"LAUNCH[{name!r}]['HS'] = {hs}: the token segments must be a power of two dividing the "
                         f"chunk (BT = {bt})")
    return cfg, {o: cfg.pop(o) for o in ("num_warps", "num_stages", "maxnreg") if o in cfg}


@functools.cache
def seg_first() -> bool:
    """The layout of chunk_out's and chunk_bwd's tiles ([HS, J, BD] or [J, HS, BD]) in which this Triton gives a
    thread the consecutive tokens of one segment. Its coalescing pass lays out a tile's channels (the contiguous
    axis) first, then the axes of equal contiguity (the segment and token axes) in ascending order up to 3.6 and in
    descending order from 3.7 (PTX compiled for sm_90 with 3.5-3.9, `bench/variants/README.md`); the threads that
    BD channels leave go to the axis laid out next, which must be the segment axis."""
    return parse_triton_version(triton.__version__) < (3, 7)


def _rt_strides(t: torch.Tensor | None) -> tuple[int, int]:
    """(row, token) strides of a [R, T, ...] tensor with a unit last stride (0, 0 for None)."""
    return (0, 0) if t is None else (t.stride(0), t.stride(1))


def chunk_state(x, dt, z, A, Bm, resets, *, reverse: bool, acc: torch.dtype):
    """(S or dS [R, NC, N, I], dts [R, NC, I]) in `acc` (module docstring: chunk_state)."""
    R, T, I = x.shape
    N = A.shape[-1]
    BT = chunk_len()
    NC = triton.cdiv(T, BT)
    cfg, opts = _opts("chunk_state")
    A, Bm = _columns(A, "chunk_state"), _columns(Bm, "chunk_state")
    s = torch.empty(R, NC, N, I, dtype=acc, device=x.device)
    dts = torch.empty(R, NC, I, dtype=acc, device=x.device)
    grid = (NC, triton.cdiv(I, cfg["BD"]), R)
    sel_chunk_state_kernel[grid](x, dt, z, A, Bm, resets, s, dts, T, I, *_rt_strides(x), *_rt_strides(dt),
                                 *_rt_strides(z), *_strides3(A), *_strides3(Bm), N=N, BT=BT, BD=cfg["BD"],
                                 REVERSE=reverse, USE_Z=z is not None, RESETS=resets is not None, **opts)
    return s, dts


def state_pass(A, dts, creset, s, s0, *, T: int, reverse: bool, store_h: bool = True, store_st: bool = True):
    """(H or dH [R, NC, N, I] or None, final state / dh0 [R, I, N] or None) (module docstring: state_pass)."""
    R, NC, N, I = s.shape
    cfg, opts = _opts("state_pass")
    A = _columns(A, "state_pass")
    h = torch.empty_like(s) if store_h else None
    st = torch.empty(R, I, N, dtype=s.dtype, device=s.device) if store_st else None
    sel_state_pass_kernel[(triton.cdiv(N * I, cfg["BS"]), R)](
        A, dts, creset, s, s0, st, h, T, I, *_strides3(A), N=N, BT=chunk_len(), BS=cfg["BS"], REVERSE=reverse,
        USE_S0=s0 is not None, STORE_H=store_h, STORE_ST=store_st, RESETS=creset is not None, **opts)
    return h, st


def chunk_out(x, dt, z, A, Bm, Cm, D, resets, h):
    """y [R, T, I] in x's dtype (module docstring: chunk_out)."""
    R, T, I = x.shape
    N = A.shape[-1]
    cfg, opts = _opts("chunk_out")
    A, Bm, Cm = (_columns(t, "chunk_out") for t in (A, Bm, Cm))
    y = torch.empty(R, T, I, dtype=x.dtype, device=x.device)
    grid = (h.shape[1], triton.cdiv(I, cfg["BD"]), R)
    sel_chunk_out_kernel[grid](x, dt, z, A, Bm, Cm, D, resets, h, y, T, I, *_rt_strides(x), *_rt_strides(dt),
                               *_rt_strides(z), *_strides3(A), *_strides3(Bm), *_strides3(Cm),
                               0 if D is None else D.stride(0), N=N, BT=chunk_len(), BD=cfg["BD"], HS=cfg["HS"],
                               SEG_FIRST=seg_first(), USE_D=D is not None, USE_Z=z is not None,
                               RESETS=resets is not None, **opts)
    return y


def chunk_bwd(x, dt, z, do, A, Bm, Cm, D, resets, h, dh):
    """(dx, ddt, dz or None, dA [R, I, N], dD [R, I] or None, dB, dC [R, T, N]) in the accumulator dtype for the
    reductions and the inputs' dtypes for the rest (module docstring: chunk_bwd)."""
    R, T, I = x.shape
    N = A.shape[-1]
    acc = h.dtype
    BT = chunk_len()
    NC = h.shape[1]
    cfg, opts = _opts("chunk_bwd")
    NB = triton.cdiv(I, cfg["BD"])
    NG = max(1, min(cfg["NG"], NB))
    if FILL_NG and (sms := sm_count(x.device)) is not None:  # no wave to fill on the CPU interpreter
        NG = fill_groups(NG, NB, NC * R, sms, RESIDENT_CHUNK_BWD)
    dx = torch.empty(R, T, I, dtype=x.dtype, device=x.device)
    ddt = torch.empty(R, T, I, dtype=dt.dtype, device=x.device)
    dz = None if z is None else torch.empty(R, T, I, dtype=z.dtype, device=x.device)
    dA = torch.empty(R, NC, N, I, dtype=acc, device=x.device)
    dD = None if D is None else torch.empty(R, NC, I, dtype=acc, device=x.device)
    A, Bm, Cm = (_columns(t, "chunk_bwd") for t in (A, Bm, Cm))
    if "chunk_bwd" in BC_TOKEN_MAJOR:
        dB = torch.zeros(R, NG, N, NC * BT, dtype=acc, device=x.device).transpose(2, 3)
        dC = torch.zeros(R, NG, N, NC * BT, dtype=acc, device=x.device).transpose(2, 3)
    else:
        dB = torch.zeros(R, NG, NC * BT, N, dtype=acc, device=x.device)
        dC = torch.zeros_like(dB)
    sel_chunk_bwd_kernel[(NC, NG, R)](
        x, dt, z, do, A, Bm, Cm, D, resets, h, dh, dx, ddt, dz, dA, dD, dB, dC, T, I, *_rt_strides(x),
        *_rt_strides(dt), *_rt_strides(z), *_rt_strides(do), *_strides3(A), *_strides3(Bm), *_strides3(Cm),
        0 if D is None else D.stride(0), *dB.stride(), N=N, BT=BT, BD=cfg["BD"], NG=NG, HS=cfg["HS"],
        SEG_FIRST=seg_first(), USE_D=D is not None, USE_Z=z is not None, RESETS=resets is not None,
        **opts)
    return (dx, ddt, dz, dA.sum(1).transpose(1, 2), None if dD is None else dD.sum(1), dB.sum(1)[:, :T],
            dC.sum(1)[:, :T])
