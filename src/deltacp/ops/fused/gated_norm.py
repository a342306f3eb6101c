"""Gated RMSNorm of the GDN output as one forward and one backward Triton kernel: transformers'
Qwen3_5RMSNormGated (the eager reference: `deltacp.ops.gdn.eager.gated_rms_norm`),

    n = x * rsqrt(mean(x^2) + eps)          compute dtype (fp32; fp64 for fp64 inputs)
    p = weight * round_X(n)                 rounded to promote(weight, X) when that is bf16/fp16 (= X)
    y = round_X(p * silu(gate))             silu(gate) = gate / (1 + exp(-gate)) in the compute dtype

with X = x.dtype; the roundings are exactly the eager chain's, so bf16 outputs agree with it but for the last
bits of the fp32 arithmetic (reduction order of the mean, exp/rsqrt of the device) that a bf16 rounding may
expose. Rows are [..., H, V] tensors read through their strides (x = the op's o, gate = the projection's z,
possibly a strided view), row r = (token r // H, head r % H).

Backward (one kernel): the exact derivative of that expression with the roundings taken as identity, kept in
the compute dtype until dx, dgate are written (eager autograd also rounds its intermediate gradients dp and
d round_X(n) to X; these kernels do not, so bf16 gradients are at least as close to the fp64 result).
rstd is recomputed from x in the backward rather than saved (one fp32 per row of 2 * V input elements: saving
it would write and read 4 bytes per row for an rsqrt and a row sum of already-loaded data). dweight is reduced
deterministically: each of G programs (G fixed by N alone) sums its rows' contributions in the compute dtype,
then the [G, V] partials are summed in a fixed order; no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltacp.ops.fused.jit_common import up as _up

BR_FWD = 16  # rows per forward program
BR_BWD = 16  # rows per backward block; each backward program loops over blocks pid, pid + G, ...
MAX_PROGRAMS_BWD = 1024  # G = min(blocks, this): fixed by N, so the dweight reduction order is too


@triton.jit
def _rsqrt(x, F64: tl.constexpr):
    if F64:
        return 1.0 / tl.sqrt(x)
    else:
        return tl.rsqrt(x)


@triton.jit
def _forward_terms(x, z, w, o_r, o_v, m, m_v, H, sx_t, sx_h, sx_v, sz_t, sz_h, sz_v, eps, out,
                   V: tl.constexpr, ROUND_P: tl.constexpr, F64: tl.constexpr):
    """x, gate, weight of rows o_r in the compute dtype, rstd, round_X(n), p, sigmoid(gate), silu(gate);
    `out` is a pointer of dtype X (rounding target)."""
    t, h = o_r // H, o_r % H
    b_x = _up(tl.load(x + (t * sx_t + h * sx_h)[:, None] + o_v[None, :] * sx_v, mask=m, other=0.), F64)
    b_z = _up(tl.load(z + (t * sz_t + h * sz_h)[:, None] + o_v[None, :] * sz_v, mask=m, other=0.), F64)
    b_w = _up(tl.load(w + o_v, mask=m_v, other=0.), F64)
    b_r = _rsqrt(tl.sum(b_x * b_x, 1) * (1.0 / V) + eps, F64)
    b_n = _up((b_x * b_r[:, None]).to(out.dtype.element_ty), F64)  # h.to(input_dtype)
    b_p = b_w[None, :] * b_n  # weight * h, in promote(weight, X)
    if ROUND_P:
        b_p = _up(b_p.to(out.dtype.element_ty), F64)
    b_sig = 1.0 / (1.0 + tl.exp(-b_z))
    b_s = b_z / (1.0 + tl.exp(-b_z))  # silu as torch writes it
    return b_x, b_z, b_w, b_r, b_n, b_p, b_sig, b_s


@triton.jit(do_not_specialize=["N"])
def gated_norm_fwd_kernel(x, z, w, y, N, H, sx_t, sx_h, sx_v, sz_t, sz_h, sz_v, eps, V: tl.constexpr,
                          BV: tl.constexpr, BR: tl.constexpr, ROUND_P: tl.constexpr, F64: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    m = (o_r < N)[:, None] & m_v[None, :]
    _, _, _, _, _, b_p, _, b_s = _forward_terms(x, z, w, o_r, o_v, m, m_v, H, sx_t, sx_h, sx_v, sz_t, sz_h, sz_v,
                                                eps, y, V, ROUND_P, F64)
    tl.store(y + o_r[:, None] * V + o_v[None, :], (b_p * b_s).to(y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["N"])
def gated_norm_bwd_kernel(x, z, w, dy, dx, dz, dw_part, N, H, sx_t, sx_h, sx_v, sz_t, sz_h, sz_v, eps,
                          V: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr, ROUND_P: tl.constexpr,
                          F64: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    b_dw = _up(tl.zeros([BV], dtype=tl.float32), F64)
    for blk in range(pid, tl.cdiv(N, BR), n_prog):
        o_r = (blk + tl.zeros([BR], dtype=tl.int64)) * BR + tl.arange(0, BR)
        m = (o_r < N)[:, None] & m_v[None, :]
        b_x, b_z, b_w, b_r, b_n, b_p, b_sig, b_s = _forward_terms(
            x, z, w, o_r, o_v, m, m_v, H, sx_t, sx_h, sx_v, sz_t, sz_h, sz_v, eps, dx, V,
            ROUND_P, F64)
        p_out = o_r[:, None] * V + o_v[None, :]
        b_dy = _up(tl.load(dy + p_out, mask=m, other=0.), F64)
        b_dp = b_dy * b_s
        b_ds = b_dy * b_p
        b_dz = b_ds * b_sig * (1.0 + b_z * (1.0 - b_sig))  # silu backward as torch writes it
        b_dw += tl.sum(b_dp * b_n, 0)
        b_dn = b_dp * b_w[None, :]
        b_c = tl.sum(b_dn * b_x, 1) * (b_r * b_r * b_r) * (1.0 / V)
        b_dx = b_dn * b_r[:, None] - b_x * b_c[:, None]
        tl.store(dx + p_out, b_dx.to(dx.dtype.element_ty), mask=m)
        tl.store(dz + p_out, b_dz.to(dz.dtype.element_ty), mask=m)
    tl.store(dw_part + pid * BV + o_v, b_dw)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H, V] (or [N, V]) -> a [T, H, V] view when the leading dims merge (a copy only when they do not)."""
    V = t.shape[-1]
    if t.ndim < 3:
        return t.reshape(-1, 1, V)
    try:
        return t.view(-1, t.shape[-2], V)
    except RuntimeError:
        return t.contiguous().view(-1, t.shape[-2], V)


def _flags(x: torch.Tensor, weight: torch.Tensor) -> tuple[bool, bool]:
    f64 = x.dtype == torch.float64
    if weight.dtype == torch.float64 and not f64:
        raise ValueError(f"fused gated RMSNorm: a float64 weight with {x.dtype} inputs is not supported "
                         f"(the eager backend computes it)")
    round_p = torch.promote_types(weight.dtype, x.dtype) in (torch.bfloat16, torch.float16)
    return f64, round_p


class GatedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        if x.shape != gate.shape or weight.shape != x.shape[-1:]:
            raise ValueError(f"fused gated RMSNorm: x {tuple(x.shape)}, gate {tuple(gate.shape)} and weight "
                             f"{tuple(weight.shape)} must be [..., V], [..., V], [V]")
        f64, round_p = _flags(x, weight)
        x3, z3, w = _rows(x), _rows(gate), weight.contiguous()
        T, H, V = x3.shape
        N = T * H
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if N:
            gated_norm_fwd_kernel[(triton.cdiv(N, BR_FWD),)](
                x3, z3, w, y, N, H, *x3.stride(), *z3.stride(), eps, V=V, BV=triton.next_power_of_2(V), BR=BR_FWD,
                ROUND_P=round_p, F64=f64, num_warps=4)
        ctx.save_for_backward(x3, z3, w)
        ctx.eps, ctx.f64, ctx.round_p = eps, f64, round_p
        ctx.shapes = (x.shape, gate.shape)
        return y

    @staticmethod
    def backward(ctx, dy):
        x3, z3, w = ctx.saved_tensors
        T, H, V = x3.shape
        N = T * H
        BV = triton.next_power_of_2(V)
        dy = dy.contiguous()
        dx = torch.empty(ctx.shapes[0], dtype=x3.dtype, device=x3.device)
        dz = torch.empty(ctx.shapes[1], dtype=z3.dtype, device=z3.device)
        G = max(1, min(triton.cdiv(N, BR_BWD), MAX_PROGRAMS_BWD))
        dw_part = torch.zeros(G, BV, dtype=torch.float64 if ctx.f64 else torch.float32, device=x3.device)
        if N:
            gated_norm_bwd_kernel[(G,)](x3, z3, w, dy, dx, dz, dw_part, N, H, *x3.stride(), *z3.stride(), ctx.eps,
                                        V=V, BV=BV, BR=BR_BWD, ROUND_P=ctx.round_p, F64=ctx.f64, num_warps=4)
        dw = dw_part[:, :V].sum(0).to(w.dtype)
        return dx, dz, dw, None


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y [..., V] in x's dtype: transformers' Qwen3_5RMSNormGated(x, gate) with this weight and eps."""
    return GatedRMSNormFunction.apply(x, gate, weight, eps)
