"""GVA head sum: gradients of q and k come out of the kernels per value head (fp32, [N, G, D] with G value heads
per key head); the key head's gradient is their sum, rounded once to the output dtype. One pass reads the fp32
rows and writes the result (a PyTorch sum and a cast are two passes and an fp32 [N, D] in between). The heads are
added in a fixed order, so the result is deterministic. A row is one tile of BD = the next power of two >= D columns
(D = 96, 192: the columns >= D masked)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltacp.ops.gdn.triton.indexing import load_tile, padded, store_tile

BR = 16


@triton.jit(do_not_specialize=["N"])
def group_sum_kernel(x, y, N, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r = o_r[:, None] < N
    m_d = (o_d < D)[None, :]
    p_x = x + o_r[:, None] * (G * D) + o_d[None, :]
    b_y = load_tile(p_x, m_r, m_d, True, BD != D)
    for i in tl.static_range(1, G):
        b_y += load_tile(p_x + i * D, m_r, m_d, True, BD != D)
    store_tile(y + o_r[:, None] * D + o_d[None, :], b_y.to(y.dtype.element_ty), m_r, m_d, True, BD != D)


def group_sum(dx: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """dx [B, T, Hk * groups, D] fp32 -> [B, T, Hk, D] in `dtype`: consecutive value heads summed onto their key
    head (value head j belongs to key head j // groups)."""
    B, T, Hv, D = dx.shape
    if Hv % groups:
        raise ValueError(f"{Hv} value heads do not split into groups of {groups}")
    dx = dx.contiguous()
    y = torch.empty(B, T, Hv // groups, D, device=dx.device, dtype=dtype)
    N = y.numel() // D
    group_sum_kernel[(triton.cdiv(N, BR),)](dx, y, N, G=groups, D=D, BD=padded(D), BR=BR, num_warps=4)
    return y
