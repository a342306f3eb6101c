"""The GDN gates as one forward and one backward Triton kernel (the eager reference: `deltacp.ops.gdn.eager.gdn_gates`):

    g    = -exp(A_log) * softplus(a + dt_bias)     compute dtype of a (fp32; fp64 for fp64), out in that dtype
    beta = sigmoid(b)                              computed in b's compute dtype, rounded to b's dtype

softplus as torch's (beta 1, threshold 20): x above 20 is returned as is, else log1p(exp(x)); log1p(u) is
computed as log(1 + u) * u / ((1 + u) - 1) (exact to a few ulp where 1 + u rounds, u itself where 1 + u == 1),
so that it needs no libdevice. a, b: [..., H] (strided views of a projection output are read through their
strides), A_log, dt_bias: [H].

Backward (one kernel): da = dg * (-exp(A_log)) * (x > 20 ? 1 : e^x / (e^x + 1)), db = dbeta (1 - beta) beta
with the rounded beta (as torch's sigmoid backward uses the saved output); dA_log = -exp(A_log) * sum_t dg
softplus(x) and ddt_bias = sum_t da (before its rounding) are reduced deterministically: G programs (G fixed by
the token count) each sum their tokens, then the [G, H] partials are summed in a fixed order; no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltacp.ops.fused.jit_common import up as _up
from deltacp.ops.precision import compute_dtype

BLOCK_ELEMENTS = 4096  # tokens per block * padded heads
MAX_PROGRAMS_BWD = 1024  # G = min(blocks, this): fixed by the token count, so the reduction order is too


@triton.jit
def _softplus(x, u):
    """torch's softplus (threshold 20) of x, given u = exp(x)."""
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit(do_not_specialize=["T"])
def gates_fwd_kernel(a, b, A_log, dt_bias, g, beta, T, H, sa_t, sa_h, sb_t, sb_h, BT: tl.constexpr,
                     BH: tl.constexpr, A64: tl.constexpr, B64: tl.constexpr):
    o_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    o_h = tl.arange(0, BH)
    m_h = o_h < H
    m = (o_t < T)[:, None] & m_h[None, :]
    b_A = _up(tl.load(A_log + o_h, mask=m_h, other=0.), A64)
    b_dtb = _up(tl.load(dt_bias + o_h, mask=m_h, other=0.), A64)
    b_x = _up(tl.load(a + o_t[:, None] * sa_t + o_h[None, :] * sa_h, mask=m, other=0.), A64) + b_dtb[None, :]
    b_g = -tl.exp(b_A)[None, :] * _softplus(b_x, tl.exp(b_x))
    p_out = o_t[:, None] * H + o_h[None, :]
    tl.store(g + p_out, b_g.to(g.dtype.element_ty), mask=m)
    b_b = _up(tl.load(b + o_t[:, None] * sb_t + o_h[None, :] * sb_h, mask=m, other=0.), B64)
    tl.store(beta + p_out, (1.0 / (1.0 + tl.exp(-b_b))).to(beta.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T"])
def gates_bwd_kernel(a, b, A_log, dt_bias, dg, dbeta, da, db, dA_part, ddt_part, T, H, sa_t, sa_h, sb_t, sb_h,
                     BT: tl.constexpr, BH: tl.constexpr, A64: tl.constexpr, B64: tl.constexpr):
    pid = tl.program_id(0)
    o_h = tl.arange(0, BH)
    m_h = o_h < H
    b_A = _up(tl.load(A_log + o_h, mask=m_h, other=0.), A64)
    b_dtb = _up(tl.load(dt_bias + o_h, mask=m_h, other=0.), A64)
    b_neg = -tl.exp(b_A)
    b_sA = _up(tl.zeros([BH], dtype=tl.float32), A64)  # sum_t dg * softplus
    b_sdt = _up(tl.zeros([BH], dtype=tl.float32), A64)  # sum_t dx
    for blk in range(pid, tl.cdiv(T, BT), tl.num_programs(0)):
        o_t = (blk + tl.zeros([BT], dtype=tl.int64)) * BT + tl.arange(0, BT)
        m = (o_t < T)[:, None] & m_h[None, :]
        p_out = o_t[:, None] * H + o_h[None, :]
        b_x = _up(tl.load(a + o_t[:, None] * sa_t + o_h[None, :] * sa_h, mask=m, other=0.), A64) + b_dtb[None, :]
        b_u = tl.exp(b_x)
        b_dg = _up(tl.load(dg + p_out, mask=m, other=0.), A64)
        b_dsp = b_dg * b_neg[None, :]
        b_dx = tl.where(b_x > 20.0, b_dsp, b_dsp * b_u / (b_u + 1.0))  # softplus backward as torch writes it
        tl.store(da + p_out, b_dx.to(da.dtype.element_ty), mask=m)
        b_sA += tl.sum(b_dg * _softplus(b_x, b_u), 0)
        b_sdt += tl.sum(b_dx, 0)
        b_b = _up(tl.load(b + o_t[:, None] * sb_t + o_h[None, :] * sb_h, mask=m, other=0.), B64)
        b_beta = _up((1.0 / (1.0 + tl.exp(-b_b))).to(db.dtype.element_ty), B64)
        b_db = _up(tl.load(dbeta + p_out, mask=m, other=0.), B64) * (1.0 - b_beta) * b_beta
        tl.store(db + p_out, b_db.to(db.dtype.element_ty), mask=m)
    tl.store(dA_part + pid * BH + o_h, b_sA)
    tl.store(ddt_part + pid * BH + o_h, b_sdt)


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> a [T, H] view when the leading dims merge (a copy only when they do not)."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.contiguous().view(-1, t.shape[-1])


def _blocks(H: int) -> tuple[int, int]:
    BH = triton.next_power_of_2(H)
    return max(1, BLOCK_ELEMENTS // BH), BH


class GDNGatesFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, A_log, dt_bias):
        if a.shape != b.shape or A_log.shape != a.shape[-1:] or dt_bias.shape != a.shape[-1:]:
            raise ValueError(f"fused GDN gates: a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(A_log.shape)} "
                             f"and dt_bias {tuple(dt_bias.shape)} must be [..., H], [..., H], [H], [H]")
        a2, b2 = _tokens(a), _tokens(b)
        A, dtb = A_log.contiguous(), dt_bias.contiguous()
        T, H = a2.shape
        BT, BH = _blocks(H)
        g = torch.empty(a.shape, dtype=compute_dtype(a), device=a.device)
        beta = torch.empty(b.shape, dtype=b.dtype, device=b.device)
        a64, b64 = a.dtype == torch.float64, b.dtype == torch.float64
        if T:
            gates_fwd_kernel[(triton.cdiv(T, BT),)](a2, b2, A, dtb, g, beta, T, H, *a2.stride(), *b2.stride(), BT=BT,
                                                    BH=BH, A64=a64, B64=b64, num_warps=4)
        ctx.save_for_backward(a2, b2, A, dtb)
        ctx.flags, ctx.shapes, ctx.param_dtypes = (a64, b64), (a.shape, b.shape), (A_log.dtype, dt_bias.dtype)
        return g, beta

    @staticmethod
    def backward(ctx, dg, dbeta):
        a2, b2, A, dtb = ctx.saved_tensors
        a64, b64 = ctx.flags
        T, H = a2.shape
        BT, BH = _blocks(H)
        dg, dbeta = dg.contiguous(), dbeta.contiguous()
        da = torch.empty(ctx.shapes[0], dtype=a2.dtype, device=a2.device)
        db = torch.empty(ctx.shapes[1], dtype=b2.dtype, device=b2.device)
        G = max(1, min(triton.cdiv(T, BT), MAX_PROGRAMS_BWD))
        acc = compute_dtype(a2)
        dA_part = torch.zeros(G, BH, dtype=acc, device=a2.device)
        ddt_part = torch.zeros(G, BH, dtype=acc, device=a2.device)
        if T:
            gates_bwd_kernel[(G,)](a2, b2, A, dtb, dg, dbeta, da, db, dA_part, ddt_part, T, H, *a2.stride(),
                                   *b2.stride(), BT=BT, BH=BH, A64=a64, B64=b64, num_warps=4)
        dA = (-A.to(acc).exp() * dA_part[:, :H].sum(0)).to(ctx.param_dtypes[0])
        ddt = ddt_part[:, :H].sum(0).to(ctx.param_dtypes[1])
        return da, db, dA, ddt


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta): g = -exp(A_log) softplus(a + dt_bias) in a's compute dtype, beta = sigmoid(b) in b's dtype."""
    return GDNGatesFunction.apply(a, b, A_log, dt_bias)
