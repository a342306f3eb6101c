"""Fused causal depthwise conv1d + SiLU + [q | k | v] split of the GDN layer (Triton), forward and backward.

For local token t of row b and channel c (kernel K, dilation d, halo H = (K-1)*d):

    a[b, t, c] = round_w( sum_j w[c, j] * x~[b, t - (K-1-j)*d, c] * [t - (K-1-j)*d >= start[t]] + bias[c] )
    y[b, t, c] = round_w( SiLU(a[b, t, c]) )      written to q, k or v by channel (c < n_q, < n_q + n_k, rest)

x~ is x at positions p >= 0, the left context `left[b, p + H]` at -H <= p < 0 (zeros without one); `start[t]` is
the local index of the first token of t's document (packed rows; -inf without documents). round_w rounds to the
weight's dtype, as the eager path (transformers' Qwen3.5) does: it casts x to the weight dtype, convolves
(products accumulated in fp32, or fp64 for fp64 inputs), rounds, applies SiLU in fp32 and rounds again. The
outputs are stored in x's dtype.

Backward recomputes a from x, left and the weights (nothing else is saved), in two streaming passes:
    pass 1 (conv_silu_bwd_dpre_kernel), per output token t:
        da[t] = round_w( dy[t] * SiLU'(a[t]) )        stored to a transient dpre [B, s, C] of the weight's dtype
                                                      (eager's SiLU backward rounds it there too)
        dw[c, j] = sum_{b, t} da[b, t, c] * x~[b, t - (K-1-j)*d, c] * valid,   dbias[c] = sum_{b, t} da[b, t, c]
    pass 2 (conv_silu_bwd_dx_kernel), per position p (p < 0: the left context):
        dx~[p] = sum_j w[c, j] * da[p + (K-1-j)*d] * [p >= start[p + (K-1-j)*d]]      (fp32, rounded once)
Pass 1 makes the forward's K tap loads of x~ plus dy, and K more tap loads (L1 hits) for dw; pass 2 makes K
shifted loads of dpre. HBM traffic: x and dy read, dpre written (pass 1), dpre read and dx written (pass 2): 5
element-sized accesses per element instead of the fused floor's 3. dw and dbias are per-program [BT, BC] running
sums in fp32 (fp64), reduced over tokens once per program, then one fixed-order torch sum over programs: no
atomics, the same bits every run. Only blocks that reach before position 0 read the left context.

The sequence length is a runtime argument (never specialised): a packed stream compiles once per model shape.

Shape legend: B rows, s local tokens, C channels (n_q + n_k + n_v), K kernel width, H halo tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (tokens, channels, warps) per program; channels last, so a row of BC bf16 channels is 2*BC contiguous bytes.
# Forward: chosen from ptxas -v on sm_90 (Triton 3.9, bf16, kernel 4, documents): 165 registers at
# (32, 128, 4), no spills.
FWD_BLOCKS = (32, 128, 4)
# Backward, picked from ptxas -v on sm_90 (Triton 3.9, bf16, kernel 4, left context + documents, C divisible by
# 16 as at launch); tests/gpu/test_fused_conv_gpu.py `test_block_sweep` times the candidates on a GPU.
# Pass 1 (conv_silu_bwd_dpre_kernel) keeps K + 1 [BT, BC] fp32 running sums (dw taps, dbias): at
# (16, 64, 4) 125 registers, no spills (4 programs = 16 warps per SM); (32, 64, 4) needs 242, (16, 64, 8) 79
# (kernel 8: 203 / 127). Its loop body has no cross-warp reduction nor layout conversion (the K + 1 token
# reductions run once, after the loop). Pass 2 (conv_silu_bwd_dx_kernel): K shifted loads of dpre into one fp32
# accumulator: (64, 64, 4) 124 registers, no spills (kernel 8: 194); (32, 64, 4) 80.
BWD_DPRE_BLOCKS = (16, 64, 4)
BWD_DX_BLOCKS = (64, 64, 4)
# Pass 1's token spans: about this many programs in all (B * spans * channel blocks), each looping over its span
# in BT-token blocks and keeping its dw/dbias running sums in registers (C = 8192: 32 spans, 128 channel blocks;
# the partial sums are 32 x [C, K + 1] fp32).
BWD_PROGRAMS = 4096
MAX_KERNEL = 8


@triton.jit
def _load_x(x, left, i_b, p0, o_c, m_c, s, stride_xb, stride_xt, stride_xc, C,
            HALO: tl.constexpr, HAS_LEFT: tl.constexpr, BT: tl.constexpr):
    """x~ [BT, BC] at local positions p = p0 + [0, BT): x for 0 <= p < s, the left context for -H <= p < 0,
    else 0. Only blocks that reach before position 0 read the left context."""
    p = p0 + tl.arange(0, BT)
    in_x = (p >= 0) & (p < s)
    ptr = x + i_b.to(tl.int64) * stride_xb + p.to(tl.int64)[:, None] * stride_xt + o_c[None, :] * stride_xc
    v = tl.load(ptr, mask=in_x[:, None] & m_c[None, :], other=0.)
    if HAS_LEFT:
        if p0 < 0:
            in_l = (p < 0) & (p >= -HALO)
            lrow = i_b.to(tl.int64) * HALO + (p + HALO).to(tl.int64)
            lv = tl.load(left + lrow[:, None] * C + o_c[None, :], mask=in_l[:, None] & m_c[None, :], other=0.)
            v = tl.where(in_l[:, None], lv, v)
    return v


@triton.jit
def _preact(x, left, w, bias, i_b, t0, start, o_c, m_c, s, stride_xb, stride_xt, stride_xc, C,
            KW: tl.constexpr, DIL: tl.constexpr, HALO: tl.constexpr, HAS_LEFT: tl.constexpr,
            HAS_BIAS: tl.constexpr, HAS_DOCS: tl.constexpr, F64: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """The pre-activation a [BT, BC] of output tokens t = t0 + [0, BT) (rounded to the weight dtype, held in
    fp32/fp64); `start` [BT]: their document starts (HAS_DOCS)."""
    if F64:
        acc = tl.zeros([BT, BC], dtype=tl.float64)
    else:
        acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(KW):
        p0 = t0 - (KW - 1 - j) * DIL
        xv = _load_x(x, left, i_b, p0, o_c, m_c, s, stride_xb, stride_xt, stride_xc, C, HALO, HAS_LEFT, BT)
        xv = xv.to(w.dtype.element_ty).to(acc.dtype)
        if HAS_DOCS:
            xv = tl.where((p0 + tl.arange(0, BT) >= start)[:, None], xv, 0.)
        wj = tl.load(w + o_c * KW + j, mask=m_c, other=0.).to(acc.dtype)
        acc += xv * wj[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + o_c, mask=m_c, other=0.).to(acc.dtype)[None, :]
    return acc.to(w.dtype.element_ty).to(acc.dtype)


@triton.jit
def _load_starts(starts, t, m_t, HAS_DOCS: tl.constexpr):
    if HAS_DOCS:
        start = tl.load(starts + t, mask=m_t, other=0)
    else:
        start = t  # unused
    return start


@triton.jit(do_not_specialize=["s", "stride_xb"])
def conv_silu_fwd_kernel(x, left, w, bias, starts, q, k, v, s, stride_xb, stride_xt, stride_xc, C, NQ, NK,
                         KW: tl.constexpr, DIL: tl.constexpr, HALO: tl.constexpr, HAS_LEFT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_DOCS: tl.constexpr, F64: tl.constexpr, BT: tl.constexpr,
                         BC: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_t, m_c = t < s, o_c < C
    start = _load_starts(starts, t, m_t, HAS_DOCS)
    a = _preact(x, left, w, bias, i_b, i_t * BT, start, o_c, m_c, s, stride_xb, stride_xt, stride_xc, C, KW, DIL,
                HALO, HAS_LEFT, HAS_BIAS, HAS_DOCS, F64, BT, BC)
    y = (a / (1. + tl.exp(-a))).to(w.dtype.element_ty).to(q.dtype.element_ty)
    row = (i_b.to(tl.int64) * s + t.to(tl.int64))[:, None]
    m = m_t[:, None] & m_c[None, :]
    tl.store(q + row * NQ + o_c[None, :], y, mask=m & (o_c < NQ)[None, :])
    tl.store(k + row * NK + (o_c - NQ)[None, :], y, mask=m & ((o_c >= NQ) & (o_c < NQ + NK))[None, :])
    tl.store(v + row * (C - NQ - NK) + (o_c - NQ - NK)[None, :], y, mask=m & (o_c >= NQ + NK)[None, :])


@triton.jit(do_not_specialize=["s", "stride_xb", "span"])
def conv_silu_bwd_dpre_kernel(x, left, w, bias, starts, dq, dk, dv, dpre, dw_part, db_part, s, span, stride_xb,
                              stride_xt, stride_xc, C, NQ, NK, KW: tl.constexpr, DIL: tl.constexpr,
                              HALO: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_BIAS: tl.constexpr,
                              HAS_DOCS: tl.constexpr, F64: tl.constexpr, NEED_DW: tl.constexpr, BT: tl.constexpr,
                              BC: tl.constexpr):
    """Backward pass 1 over output tokens [i_s * span, (i_s + 1) * span) of row i_b, BT at a time: recompute a
    (the K tap loads of x~ the forward makes), da = round_w(dy * SiLU'(a)) stored to dpre [B, s, C] (the weight's
    dtype, as eager's SiLU backward rounds it; dw and dbias use that rounded da too), and the dw/dbias partial sums
    sum_t da[t] * x~[t - shift_j] of this program (partial number i_b * num_programs(0) + i_s)."""
    i_s, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    if F64:
        zero = tl.zeros([BT, BC], dtype=tl.float64)
    else:
        zero = tl.zeros([BT, BC], dtype=tl.float32)
    # [BT, BC] running sums of da (db) and of da * tap j (dw[:, j]), one per tap (KW <= 8; the unused ones are
    # never updated and compile away), reduced over tokens once per program: no cross-warp reduction per block
    db, dw0, dw1, dw2, dw3, dw4, dw5, dw6, dw7 = zero, zero, zero, zero, zero, zero, zero, zero, zero
    lo = i_s * span
    hi = tl.minimum(lo + span, s)
    for t0 in range(lo, hi, BT):
        t = t0 + tl.arange(0, BT)
        m_t = t < s
        start = _load_starts(starts, t, m_t, HAS_DOCS)
        a = _preact(x, left, w, bias, i_b, t0, start, o_c, m_c, s, stride_xb, stride_xt, stride_xc, C, KW, DIL,
                    HALO, HAS_LEFT, HAS_BIAS, HAS_DOCS, F64, BT, BC)
        row = (i_b.to(tl.int64) * s + t.to(tl.int64))[:, None]
        m = m_t[:, None] & m_c[None, :]
        dy = tl.load(dq + row * NQ + o_c[None, :], mask=m & (o_c < NQ)[None, :], other=0.).to(a.dtype)
        dy += tl.load(dk + row * NK + (o_c - NQ)[None, :], mask=m & ((o_c >= NQ) & (o_c < NQ + NK))[None, :],
                      other=0.).to(a.dtype)
        dy += tl.load(dv + row * (C - NQ - NK) + (o_c - NQ - NK)[None, :], mask=m & (o_c >= NQ + NK)[None, :],
                      other=0.).to(a.dtype)
        sig = 1. / (1. + tl.exp(-a))
        da = (dy * (sig * (1. + a * (1. - sig)))).to(dpre.dtype.element_ty)
        tl.store(dpre + row * C + o_c[None, :], da, mask=m)
        if NEED_DW:
            da_f = da.to(a.dtype)  # 0 at t >= s (dy masked to 0) and at channels >= C
            db += da_f
            for j in tl.static_range(KW):
                # the tap the forward made (x~ rounded to the weight dtype, document-masked): L1 hits
                p0 = t0 - (KW - 1 - j) * DIL
                xv = _load_x(x, left, i_b, p0, o_c, m_c, s, stride_xb, stride_xt, stride_xc, C, HALO, HAS_LEFT, BT)
                xv = xv.to(w.dtype.element_ty).to(a.dtype)
                if HAS_DOCS:
                    xv = tl.where((p0 + tl.arange(0, BT) >= start)[:, None], xv, 0.)
                if j == 0:
                    dw0 += da_f * xv
                elif j == 1:
                    dw1 += da_f * xv
                elif j == 2:
                    dw2 += da_f * xv
                elif j == 3:
                    dw3 += da_f * xv
                elif j == 4:
                    dw4 += da_f * xv
                elif j == 5:
                    dw5 += da_f * xv
                elif j == 6:
                    dw6 += da_f * xv
                else:
                    dw7 += da_f * xv
    if NEED_DW:
        part = i_b.to(tl.int64) * tl.num_programs(0) + i_s
        tl.store(db_part + part * C + o_c, tl.sum(db, 0), mask=m_c)
        out = dw_part + (part * C + o_c) * KW
        tl.store(out, tl.sum(dw0, 0), mask=m_c)
        if KW > 1:
            tl.store(out + 1, tl.sum(dw1, 0), mask=m_c)
        if KW > 2:
            tl.store(out + 2, tl.sum(dw2, 0), mask=m_c)
        if KW > 3:
            tl.store(out + 3, tl.sum(dw3, 0), mask=m_c)
        if KW > 4:
            tl.store(out + 4, tl.sum(dw4, 0), mask=m_c)
        if KW > 5:
            tl.store(out + 5, tl.sum(dw5, 0), mask=m_c)
        if KW > 6:
            tl.store(out + 6, tl.sum(dw6, 0), mask=m_c)
        if KW > 7:
            tl.store(out + 7, tl.sum(dw7, 0), mask=m_c)


@triton.jit(do_not_specialize=["s"])
def conv_silu_bwd_dx_kernel(dpre, w, starts, dx, dleft, s, C, KW: tl.constexpr, DIL: tl.constexpr,
                            HALO: tl.constexpr, HAS_DOCS: tl.constexpr, F64: tl.constexpr, NL: tl.constexpr,
                            BT: tl.constexpr, BC: tl.constexpr):
    """Backward pass 2: dx~ [BT, BC] at positions p = (i_t - NL) * BT + [0, BT): the first NL programs cover the
    left context -H..-1 (stored to dleft; NL = 0 without one), the rest 0..s-1 (stored to dx).
        dx~[p] = sum_e w[c, K-1-e] * dpre[p + e*d] * [0 <= p + e*d < s] * [p >= start[p + e*d]]
    (output token t = p + e*d reads p through its tap K-1-e, under the forward's document rule), fp32 (fp64)
    accumulation, rounded once."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    p0 = (i_t - NL) * BT
    p = p0 + tl.arange(0, BT)
    if F64:
        acc = tl.zeros([BT, BC], dtype=tl.float64)
    else:
        acc = tl.zeros([BT, BC], dtype=tl.float32)
    for e in tl.static_range(KW):
        t = p + e * DIL
        m_t = (t >= 0) & (t < s)
        if HAS_DOCS:
            m_t = m_t & (p >= tl.load(starts + t, mask=m_t, other=0))
        row = (i_b.to(tl.int64) * s + t.to(tl.int64))[:, None]
        g = tl.load(dpre + row * C + o_c[None, :], mask=m_t[:, None] & m_c[None, :], other=0.).to(acc.dtype)
        wj = tl.load(w + o_c * KW + (KW - 1 - e), mask=m_c, other=0.).to(acc.dtype)
        acc += g * wj[None, :]
    if NL > 0:
        if p0 < 0:
            lrow = (i_b.to(tl.int64) * HALO + (p + HALO).to(tl.int64))[:, None]
            tl.store(dleft + lrow * C + o_c[None, :], acc.to(dleft.dtype.element_ty),
                     mask=((p < 0) & (p >= -HALO))[:, None] & m_c[None, :])
    row = (i_b.to(tl.int64) * s + p.to(tl.int64))[:, None]
    tl.store(dx + row * C + o_c[None, :], acc.to(dx.dtype.element_ty),
             mask=((p >= 0) & (p < s))[:, None] & m_c[None, :])


def _check(x, weight, bias, dilation, left, starts, split):
    if x.dim() != 3:
        raise ValueError(f"conv_silu_split takes x [B, s, C], got shape {tuple(x.shape)}")
    B, s, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"conv weight must be [C={C}, kernel], got {tuple(weight.shape)}")
    kernel = weight.shape[1]
    if not 1 <= kernel <= MAX_KERNEL:
        raise ValueError(f"conv kernel width {kernel} is outside 1..{MAX_KERNEL} (the fused Triton conv)")
    if int(dilation) < 1:
        raise ValueError(f"conv dilation must be >= 1, got {dilation}")
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"conv bias must be [C={C}], got {tuple(bias.shape)}")
    if len(split) != 3 or sum(split) != C or min(split) < 0:
        raise ValueError(f"split {tuple(split)} must be three channel counts summing to C={C}")
    if not (x.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"conv_silu_split needs floating-point x and weight, got {x.dtype}/{weight.dtype}")
    halo = (kernel - 1) * int(dilation)
    if left is not None:
        if tuple(left.shape) != (B, halo, C) or left.dtype != x.dtype or left.device != x.device:
            raise ValueError(f"left context must be [B, (kernel-1)*dilation, C] = {(B, halo, C)} of x's dtype "
                             f"{x.dtype} on {x.device}, got {tuple(left.shape)} {left.dtype} on {left.device}")
    if starts is not None:
        if tuple(starts.shape) != (s,) or starts.dtype not in (torch.int32, torch.int64) or starts.device != x.device:
            raise ValueError(f"doc_start_s must be int32/int64 [s={s}] on {x.device}, got {tuple(starts.shape)} "
                             f"{starts.dtype} on {starts.device}")


def _dummy(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like if t is None else t


def _parts(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The three output (or output-gradient) parts for a launch, a zero-width part replaced by a non-empty one: its
    channel mask stores and loads nothing there, and an empty tensor may have no device address."""
    full = next(t for t in ts if t.numel())
    return [t if t.numel() else full for t in ts]


class _ConvSiluSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, left, starts, dilation: int, split: tuple[int, int, int]):
        B, s, C = x.shape
        KW = weight.shape[1]
        halo = (KW - 1) * dilation
        weight = weight.contiguous()
        left = None if left is None or halo == 0 else left.contiguous()
        bias = None if bias is None else bias.contiguous()
        starts = None if starts is None else starts.contiguous()
        n_q, n_k, n_v = split
        q, k, v = (x.new_empty(B, s, n) for n in (n_q, n_k, n_v))
        f64 = torch.float64 in (x.dtype, weight.dtype)
        BT, BC, warps = FWD_BLOCKS
        grid = (triton.cdiv(s, BT), triton.cdiv(C, BC), B)
        conv_silu_fwd_kernel[grid](
            x, _dummy(left, x), weight, _dummy(bias, weight), _dummy(starts, x), *_parts(q, k, v), s, x.stride(0),
            x.stride(1), x.stride(2), C, n_q, n_k, KW=KW, DIL=dilation, HALO=halo, HAS_LEFT=left is not None,
            HAS_BIAS=bias is not None, HAS_DOCS=starts is not None, F64=f64, BT=BT, BC=BC, num_warps=warps)
        ctx.save_for_backward(x, weight, bias, left, starts)
        ctx.dilation, ctx.split = dilation, split
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, weight, bias, left, starts = ctx.saved_tensors
        B, s, C = x.shape
        KW = weight.shape[1]
        dilation = ctx.dilation
        halo = (KW - 1) * dilation
        n_q, n_k, _ = ctx.split
        dq, dk, dv = (g.contiguous() for g in (dq, dk, dv))
        f64 = torch.float64 in (x.dtype, weight.dtype)
        acc = torch.float64 if f64 else torch.float32
        need_dw = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        # pass 1: da (dpre) and the dw/dbias partial sums
        BT, BC, warps = BWD_DPRE_BLOCKS
        n_c = triton.cdiv(C, BC)
        spans = max(1, min(triton.cdiv(s, BT), triton.cdiv(BWD_PROGRAMS, n_c * B)))
        span = triton.cdiv(triton.cdiv(s, spans), BT) * BT
        spans = triton.cdiv(s, span)
        dpre = torch.empty(B, s, C, dtype=weight.dtype, device=x.device)
        parts = B * spans if need_dw else 1
        dw_part = torch.empty(parts, C, KW, dtype=acc, device=x.device)
        db_part = torch.empty(parts, C, dtype=acc, device=x.device)
        conv_silu_bwd_dpre_kernel[(spans, n_c, B)](
            x, _dummy(left, x), weight, _dummy(bias, weight), _dummy(starts, x), *_parts(dq, dk, dv), dpre, dw_part,
            db_part, s, span, x.stride(0), x.stride(1), x.stride(2), C, n_q, n_k, KW=KW, DIL=dilation, HALO=halo,
            HAS_LEFT=left is not None, HAS_BIAS=bias is not None, HAS_DOCS=starts is not None, F64=f64,
            NEED_DW=need_dw, BT=BT, BC=BC, num_warps=warps)
        # pass 2: dx (and the left context's gradient) from dpre
        dx = dleft = None
        need_dleft = left is not None and ctx.needs_input_grad[3]
        if ctx.needs_input_grad[0] or need_dleft:
            BT, BC, warps = BWD_DX_BLOCKS
            n_left = triton.cdiv(halo, BT) if need_dleft else 0
            dx = torch.empty(B, s, C, dtype=x.dtype, device=x.device)
            dleft = torch.empty_like(left) if need_dleft else None
            conv_silu_bwd_dx_kernel[(n_left + triton.cdiv(s, BT), triton.cdiv(C, BC), B)](
                dpre, weight, _dummy(starts, x), dx, _dummy(dleft, dx), s, C, KW=KW, DIL=dilation, HALO=halo,
                HAS_DOCS=starts is not None, F64=f64, NL=n_left, BT=BT, BC=BC, num_warps=warps)
            if not ctx.needs_input_grad[0]:
                dx = None
        del dpre
        dw = dw_part.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = db_part.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db, dleft, None, None, None


def conv_silu_split(x_BsC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None, dilation: int, *,
                    left_BhC: torch.Tensor | None = None, doc_start_s: torch.Tensor | None = None,
                    split: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SiLU(causal depthwise conv) of x [B, s, C] (any strides), split by channel into three contiguous tensors
    [B, s, n_q], [B, s, n_k], [B, s, n_v] of x's dtype (module docstring). Differentiable w.r.t. x, weight, bias
    and left.

    left_BhC: the (kernel-1)*dilation tokens before x [B, halo, C] (None: zeros). doc_start_s: None, or int [s]:
    the local index of the first token of each token's document (may be negative); a tap reading local position p
    counts only if p >= doc_start_s[t].
    """
    _check(x_BsC, weight_CK, bias_C, dilation, left_BhC, doc_start_s, split)
    return _ConvSiluSplit.apply(x_BsC, weight_CK, bias_C, left_BhC, doc_start_s, int(dilation),
                                tuple(int(n) for n in split))
