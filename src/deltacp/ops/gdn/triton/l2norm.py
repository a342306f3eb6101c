"""Row-wise L2 normalisation of q/k over the head dim, as transformers' `l2norm`: y = x * rsqrt(sum(x^2) + eps),
computed in fp32 and returned in the input dtype. Backward: dx = r dy - x r^3 sum(dy * x).
A row is one tile of BD = the next power of two >= D columns, those >= D masked (D = 96, 192)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltacp.ops.gdn.triton.indexing import load_tile, padded, store_tile


@triton.jit(do_not_specialize=["N"])
def l2norm_fwd_kernel(x, y, r, N, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r = o_r < N
    m_d = (o_d < D)[None, :]
    b_x = load_tile(x + o_r[:, None] * D + o_d[None, :], m_r[:, None], m_d, True, BD != D).to(tl.float32)
    b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) + eps)
    store_tile(y + o_r[:, None] * D + o_d[None, :], (b_x * b_r[:, None]).to(y.dtype.element_ty), m_r[:, None], m_d,
               True, BD != D)
    tl.store(r + o_r, b_r, mask=m_r)


@triton.jit(do_not_specialize=["N"])
def l2norm_bwd_kernel(x, r, dy, dx, N, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r = o_r < N
    m_d = (o_d < D)[None, :]
    b_x = load_tile(x + o_r[:, None] * D + o_d[None, :], m_r[:, None], m_d, True, BD != D).to(tl.float32)
    b_dy = load_tile(dy + o_r[:, None] * D + o_d[None, :], m_r[:, None], m_d, True, BD != D).to(tl.float32)
    b_r = tl.load(r + o_r, mask=m_r, other=0.)
    b_dx = b_dy * b_r[:, None] - b_x * (b_r * b_r * b_r * tl.sum(b_dy * b_x, 1))[:, None]
    store_tile(dx + o_r[:, None] * D + o_d[None, :], b_dx.to(dx.dtype.element_ty), m_r[:, None], m_d, True, BD != D)


BR = 16


class L2NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        x = x.contiguous()
        D = x.shape[-1]
        N = x.numel() // D
        y = torch.empty_like(x)
        r = torch.empty(N, device=x.device, dtype=torch.float32)
        l2norm_fwd_kernel[(triton.cdiv(N, BR),)](x, y, r, N, eps, D=D, BD=padded(D), BR=BR, num_warps=4)
        ctx.save_for_backward(x, r)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, r = ctx.saved_tensors
        D = x.shape[-1]
        N = x.numel() // D
        dx = torch.empty_like(x)
        l2norm_bwd_kernel[(triton.cdiv(N, BR),)](x, r, dy.contiguous(), dx, N, D=D, BD=padded(D), BR=BR,
                                                  num_warps=4)
        return dx, None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return L2NormFunction.apply(x, eps)
