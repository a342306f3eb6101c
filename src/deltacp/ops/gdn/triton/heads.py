"""GVA head sum: gradients of q and k come out of the kernels per value head (fp32, [N, G, D] with G value heads
per key head); the key head's gradient is their sum, rounded once to the output dtype. One pass reads the fp32
rows and writes the result (a PyTorch sum and a cast are two passes and an fp32 [N, D] in between). The heads are
added in a fixed order, so the result is deterministic."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BR = 16


@triton.jit(do_not_specialize=["N"])
def group_sum_kernel(x, y, N, G: tl.constexpr, D: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, D)
    m_r = o_r[:, None] < N
    p_x = x + o_r[:, None] * (G * D) + o_d[None, :]
    b_y = tl.load(p_x, mask=m_r, other=0.)
    for i in tl.static_range(1, G):
        b_y += tl.load(p_x + i * D, mask=m_r, other=0.)
    tl.store(y + o_r[:, None] * D + o_d[None, :], b_y.to(y.dtype.element_ty), mask=m_r)


def group_sum(dx: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """dx [B, T, Hk * groups, D] fp32 -> [B, T, Hk, D] in `dtype`: consecutive value heads summed onto their key
    head (value head j belongs to key head j // groups)."""
    B, T, Hv, D = dx.shape
    if Hv % groups:
        raise ValueError(f"{Hv} value heads do not split into groups of {groups}")
    dx = dx.contiguous()
    y = torch.empty(B, T, Hv // groups, D, device=dx.device, dtype=dtype)
    N = y.numel() // D
    group_sum_kernel[(triton.cdiv(N, BR),)](dx, y, N, G=groups, D=D, BR=BR, num_warps=4)
    return y
