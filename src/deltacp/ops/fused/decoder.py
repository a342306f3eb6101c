"""Decoder-layer glue as Triton kernels, one forward and one backward kernel per op, with transformers' Qwen3.5
numerics (`Qwen3_5RMSNorm`, `Qwen3_5MLP`'s silu(gate) * up, the decoder layer's residual adds):

    rms_norm(x, w, eps, offset=1.0)     y = (x~ * rsqrt(mean(x~^2) + eps) * (offset + w~)).to(x.dtype)
    add_rms_norm(x, residual, w, eps)   s = (x + residual) rounded to the dtype as torch's add rounds it;
                                        returns (rms_norm(s, w, eps), s)
    swiglu(gate, up)                    z = (silu(gate) rounded to the dtype) * up, rounded to the dtype

x~ is x in float32 (float64 for float64 inputs: then everything is float64; transformers' module computes a
float64 input in float32). The arithmetic follows the eager chain step by step: the same operations in the same
order, the mean as sum * (1/H) (CUDA's mean), silu as gate / (1 + exp(-gate)) with IEEE division and, on the GPU,
libdevice's expf (what PyTorch's CUDA silu calls; Triton's own exp is ex2.approx-based); the products of bf16
values are exact in fp32, so SwiGLU's forward is bitwise the eager chain's wherever exp agrees. What can differ
from PyTorch is the order of the fp32 sum over the hidden dimension (RMSNorm forward and backward) and FMA
contraction: last-bit fp32 differences that rarely change a bf16 rounding.

Backward:
  - rms_norm: dx = r (g - x^ mean(g x^)),  g = dy (offset + w), x^ = x r; dw = sum over rows of dy x^, reduced
    deterministically: per-program fp32 partials [programs, H] then one fixed-order torch sum, no atomics. Saved:
    x (the sum s for add_rms_norm) and the per-row rstd (fp32), nothing [rows, H] beyond the input.
  - add_rms_norm takes both incoming gradients: ds = round(norm's dx) + d_residual, rounded again, the two
    roundings autograd's accumulation of the eager chain makes; dx = dresidual = ds.
  - swiglu saves gate and up only; silu and sigmoid are recomputed. ds = round(dz up), dup = round(dz s),
    dgate = round(ds sig (1 + gate (1 - sig))): PyTorch's silu_backward on the rounded ds.

Inputs are [..., H] (any leading shape; the last dimension contiguous, else copied). Importing this module
imports triton; on the CPU the kernels run under TRITON_INTERPRET=1 (set before triton is imported).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from triton.language.extra import libdevice

from deltacp.ops.precision import compute_dtype

# libdevice's exp (__nv_expf / __nv_exp: the expf PyTorch's CUDA silu calls) on the GPU; the interpreter has no
# libdevice and runs numpy's exp through tl.exp
PRECISE_EXP = os.environ.get("TRITON_INTERPRET") != "1"

MAX_HIDDEN = 32768  # one row per block


@triton.jit
def _rms_norm_fwd_kernel(X, RES, W, Y, S, RSTD, H, stride_x, stride_res, stride_y, stride_s, eps, inv_h, offset,
                         HAS_RES: tl.constexpr, FP64: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    CDT = tl.float64 if FP64 else tl.float32
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.)
    if HAS_RES:  # torch's add: in the compute type, rounded to the dtype
        res = tl.load(RES + row * stride_res + cols, mask=mask, other=0.)
        x = (x.to(CDT) + res.to(CDT)).to(S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, x, mask=mask)
    xf = x.to(CDT)
    if FP64:
        var = tl.sum(xf * xf, axis=0) / H
    else:
        var = tl.sum(xf * xf, axis=0) * inv_h
    rstd = tl.math.rsqrt(var + eps)
    w = tl.load(W + cols, mask=mask, other=0.).to(CDT)
    y = (xf * rstd) * (offset + w)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_bwd_kernel(X, W, RSTD, DY, DRES, DX, DWP, n_rows, H, stride_x, stride_dy, stride_dres, stride_dx,
                         inv_h, offset, HAS_DRES: tl.constexpr, FP64: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    CDT = tl.float64 if FP64 else tl.float32
    wp = offset + tl.load(W + cols, mask=mask, other=0.).to(CDT)
    dw = tl.zeros((BLOCK_H,), dtype=CDT)
    for row in range(pid.to(tl.int64), n_rows, n_prog):  # int64 rows (the interpreter gives Python ints)
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.).to(CDT)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.).to(CDT)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        g = dy * wp
        dw += dy * xhat
        if FP64:
            c = tl.sum(g * xhat, axis=0) / H
        else:
            c = tl.sum(g * xhat, axis=0) * inv_h
        dx = ((g - xhat * c) * rstd).to(DX.dtype.element_ty)
        if HAS_DRES:  # autograd's accumulation of the two gradients of the sum, in the dtype
            dres = tl.load(DRES + row * stride_dres + cols, mask=mask, other=0.).to(CDT)
            dx = (dx.to(CDT) + dres).to(DX.dtype.element_ty)
        tl.store(DX + row * stride_dx + cols, dx, mask=mask)
    tl.store(DWP + pid.to(tl.int64) * H + cols, dw, mask=mask)


@triton.jit
def _silu_parts(g, FP64: tl.constexpr, PRECISE: tl.constexpr):
    """(silu(g), sigmoid(g)) as PyTorch computes them: g / (1 + exp(-g)) and 1 / (1 + exp(-g)), IEEE division."""
    if PRECISE:
        d = 1.0 + libdevice.exp(-g)
    else:
        d = 1.0 + tl.exp(-g)
    if FP64:
        s = g / d
        sig = 1.0 / d
    else:
        s = tl.math.div_rn(g, d)
        sig = tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), d)
    return s, sig


@triton.jit(do_not_specialize=["N"])
def _swiglu_fwd_kernel(G, U, Z, N, FP64: tl.constexpr, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    CDT = tl.float64 if FP64 else tl.float32
    g = tl.load(G + offs, mask=mask, other=0.).to(CDT)
    u = tl.load(U + offs, mask=mask, other=0.).to(CDT)
    s, _ = _silu_parts(g, FP64, PRECISE)
    s = s.to(Z.dtype.element_ty).to(CDT)  # rounding 1: silu's output in the dtype
    tl.store(Z + offs, (s * u).to(Z.dtype.element_ty), mask=mask)  # rounding 2: the product


@triton.jit(do_not_specialize=["N"])
def _swiglu_bwd_kernel(G, U, DZ, DG, DU, N, FP64: tl.constexpr, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    CDT = tl.float64 if FP64 else tl.float32
    g = tl.load(G + offs, mask=mask, other=0.).to(CDT)
    u = tl.load(U + offs, mask=mask, other=0.).to(CDT)
    dz = tl.load(DZ + offs, mask=mask, other=0.).to(CDT)
    s, sig = _silu_parts(g, FP64, PRECISE)
    s = s.to(DU.dtype.element_ty).to(CDT)
    ds = (dz * u).to(DG.dtype.element_ty).to(CDT)  # the product's backward, in the dtype
    tl.store(DU + offs, (dz * s).to(DU.dtype.element_ty), mask=mask)
    dg = ds * sig * (1.0 + g * (1.0 - sig))  # silu_backward(ds, g)
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_launch(H: int) -> tuple[int, int]:
    if H > MAX_HIDDEN:
        raise ValueError(f"fused rms_norm: hidden size {H} > {MAX_HIDDEN} (one row per block)")
    block = triton.next_power_of_2(H)
    return block, 4 if block <= 1024 else 8 if block <= 4096 else 16


def _bwd_programs(n_rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        return max(1, min(n_rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(n_rows, 3))  # the interpreter: several rows per program, partials from several programs


def _norm_forward(x, residual, weight, eps, offset):
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"fused rms_norm: weight of shape {tuple(weight.shape)} for hidden size {H}")
    x2 = _rows(x)
    n = x2.shape[0]
    cdt = compute_dtype(x)
    y = torch.empty_like(x2, memory_format=torch.contiguous_format)
    rstd = torch.empty(n, device=x.device, dtype=cdt)
    s = r2 = None
    if residual is not None:
        r2 = _rows(residual)
        s = torch.empty_like(y)
    w = weight.contiguous()
    if n > 0:
        block, warps = _norm_launch(H)
        _rms_norm_fwd_kernel[(n,)](x2, r2 if r2 is not None else x2, w, y, s if s is not None else y, rstd, H,
                                   x2.stride(0), r2.stride(0) if r2 is not None else 0, y.stride(0),
                                   s.stride(0) if s is not None else 0, float(eps), 1.0 / H, float(offset),
                                   HAS_RES=residual is not None, FP64=cdt == torch.float64, BLOCK_H=block,
                                   num_warps=warps)
    return x2, y, s, rstd


def _norm_backward(xs, weight, rstd, dy, dres, offset, shape, need_dw):
    H = xs.shape[-1]
    n = xs.shape[0]
    cdt = rstd.dtype
    dy2 = _rows(dy)
    dx = torch.empty(xs.shape, device=xs.device, dtype=xs.dtype)  # contiguous rows, whatever xs's strides
    dres2 = _rows(dres) if dres is not None else None
    programs = _bwd_programs(n, xs.device)
    dwp = torch.empty(programs, H, device=xs.device, dtype=cdt)
    if n > 0:
        block, warps = _norm_launch(H)
        _rms_norm_bwd_kernel[(programs,)](xs, weight.contiguous(), rstd, dy2, dres2 if dres2 is not None else dy2,
                                          dx, dwp, n, H, xs.stride(0), dy2.stride(0),
                                          dres2.stride(0) if dres2 is not None else 0, dx.stride(0), 1.0 / H,
                                          float(offset), HAS_DRES=dres is not None, FP64=cdt == torch.float64,
                                          BLOCK_H=block, num_warps=warps)
    else:
        dwp.zero_()
    dw = dwp.sum(0).to(weight.dtype) if need_dw else None
    return dx.view(shape), dw


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        x2, y, _, rstd = _norm_forward(x, None, weight, eps, offset)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.offset, ctx.shape = offset, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _norm_backward(x2, weight, rstd, dy, None, ctx.offset, ctx.shape, ctx.needs_input_grad[1])
        return dx, dw, None, None


class AddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset):
        ctx.set_materialize_grads(False)
        _, y, s, rstd = _norm_forward(x, residual, weight, eps, offset)
        ctx.save_for_backward(s, weight, rstd)
        ctx.offset, ctx.shape = offset, x.shape
        return y.view(x.shape), s.view(x.shape)

    @staticmethod
    def backward(ctx, dy, ds):
        s2, weight, rstd = ctx.saved_tensors
        if dy is None:  # only the new residual is used: the add's gradient, no norm
            return ds, ds, None, None, None
        dx, dw = _norm_backward(s2, weight, rstd, dy, ds, ctx.offset, ctx.shape, ctx.needs_input_grad[2])
        return dx, dx, dw, None, None


SWIGLU_BLOCK = 1024


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g, u = gate.contiguous(), up.contiguous()
        z = torch.empty_like(g)
        N = g.numel()
        if N > 0:
            _swiglu_fwd_kernel[(triton.cdiv(N, SWIGLU_BLOCK),)](g, u, z, N, FP64=g.dtype == torch.float64,
                                                               PRECISE=PRECISE_EXP, BLOCK=SWIGLU_BLOCK, num_warps=4)
        ctx.save_for_backward(g, u)
        return z

    @staticmethod
    def backward(ctx, dz):
        g, u = ctx.saved_tensors
        dz = dz.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        N = g.numel()
        if N > 0:
            _swiglu_bwd_kernel[(triton.cdiv(N, SWIGLU_BLOCK),)](g, u, dz, dg, du, N, FP64=g.dtype == torch.float64,
                                                               PRECISE=PRECISE_EXP, BLOCK=SWIGLU_BLOCK, num_warps=4)
        return dg, du


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 1.0) -> torch.Tensor:
    """Qwen3.5's RMSNorm, (x * rsqrt(mean(x^2) + eps) * (offset + w)) in fp32, returned in x's dtype."""
    return RMSNormFunction.apply(x, weight, eps, offset)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add then the next norm in one pass. The sum is in
    torch's promoted dtype of the two, rounded as torch's add rounds it."""
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    dtype = torch.result_type(x, residual)
    return AddRMSNormFunction.apply(x.to(dtype), residual.to(dtype), weight, eps, offset)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with the eager chain's two roundings to the dtype (silu's output, then the product)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
    return SwiGLUFunction.apply(gate, up)
