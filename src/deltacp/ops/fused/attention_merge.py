"""The log-sum-exp merge of one attention tile into an accumulator, in place, one pass (the CUDA tile path of
`parallel/attention_tiles.py`):

    new = logaddexp(lse, lse_t)        o = o exp(lse - new) + o_t exp(lse_t - new)        lse = new

o, lse: the accumulator's rows of the tile (float32, float64 for float64 inputs; any strides with the head
dimension contiguous); o_t, lse_t: the tile's output (its kernel's dtype and layout) and log-sum-exp. The eager
form runs six kernels and reads or writes the [rows, heads, D] accumulator five times (mul_, a float32 copy of o_t
times its weight, add_); this reads o and o_t once and writes o once. logaddexp as torch computes it,
max + log1p(exp(-|a - b|)), libdevice's exp and log1p on the GPU (numpy's under the interpreter); the products may
contract to an FMA, so results differ from the eager chain in the last bits of the compute dtype. Two -inf
statistics (a row that sees no key in either, which no tile plan produces) give lse -inf and o 0 where the eager
chain gives NaN.

Importing this module imports triton; on the CPU the kernel runs under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

PRECISE = os.environ.get("TRITON_INTERPRET") != "1"  # libdevice on the GPU; the interpreter has none
BLOCK_ROWS = 16


@triton.jit(do_not_specialize=["L"])  # one compilation whatever the rows' count
def _merge_kernel(O, LSE, OT, LSET, H, L, D, so_b, so_h, so_l, sl_b, sl_h, sl_l, st_b, st_h, st_l, slt_b, slt_h,
                  slt_l, FP64: tl.constexpr, PRECISE_MATH: tl.constexpr, BLOCK_L: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    rows = tl.program_id(0).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < L
    CDT = tl.float64 if FP64 else tl.float32
    a = tl.load(LSE + b * sl_b + h * sl_h + rows * sl_l, mask=rmask, other=float("-inf")).to(CDT)
    c = tl.load(LSET + b * slt_b + h * slt_h + rows * slt_l, mask=rmask, other=float("-inf")).to(CDT)
    m = tl.maximum(a, c)
    empty = m == float("-inf")
    m_safe = tl.where(empty, 0.0, m)
    if PRECISE_MATH:
        new = m_safe + libdevice.log1p(libdevice.exp(-tl.abs(a - c)))
        wa = libdevice.exp(a - new)
        wc = libdevice.exp(c - new)
    else:
        new = m_safe + tl.log(1.0 + tl.exp(-tl.abs(a - c)))
        wa = tl.exp(a - new)
        wc = tl.exp(c - new)
    new = tl.where(empty, float("-inf"), new)
    wa = tl.where(empty, 0.0, wa)
    wc = tl.where(empty, 0.0, wc)
    mask = rmask[:, None] & (cols[None, :] < D)
    o_ptr = O + b * so_b + h * so_h + rows[:, None] * so_l + cols[None, :]
    o = tl.load(o_ptr, mask=mask, other=0.).to(CDT)
    ot = tl.load(OT + b * st_b + h * st_h + rows[:, None] * st_l + cols[None, :], mask=mask, other=0.).to(CDT)
    tl.store(o_ptr, (o * wa[:, None] + ot * wc[:, None]).to(O.dtype.element_ty), mask=mask)
    tl.store(LSE + b * sl_b + h * sl_h + rows * sl_l, new.to(LSE.dtype.element_ty), mask=rmask)


def merge_(o: torch.Tensor, lse: torch.Tensor, o_t: torch.Tensor, lse_t: torch.Tensor) -> None:
    """Merge the tile (o_t [b, H, l, D], lse_t [b, H, l]) into (o, lse) of the same shapes, in place (module doc)."""
    if o.shape != o_t.shape or lse.shape != lse_t.shape or o.shape[:3] != lse.shape:
        raise ValueError(f"merge_: o {tuple(o.shape)}, lse {tuple(lse.shape)}, o_t {tuple(o_t.shape)}, lse_t "
                         f"{tuple(lse_t.shape)} do not match ([b, H, l, D] and [b, H, l])")
    if o.dtype != lse.dtype or o.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"merge_: the accumulator must be float32 or float64 (o {o.dtype}, lse {lse.dtype})")
    if o.stride(-1) != 1:
        raise ValueError("merge_: the accumulator's head dimension must be contiguous (it is written in place)")
    o_t = o_t if o_t.stride(-1) == 1 else o_t.contiguous()
    b, H, L, D = o.shape
    if o.numel() == 0:
        return
    grid = (triton.cdiv(L, BLOCK_ROWS), b * H)
    _merge_kernel[grid](o, lse, o_t, lse_t, H, L, D, *o.stride()[:3], *lse.stride(), *o_t.stride()[:3],
                        *lse_t.stride(), FP64=o.dtype == torch.float64, PRECISE_MATH=PRECISE, BLOCK_L=BLOCK_ROWS,
                        BLOCK_D=triton.next_power_of_2(D), num_warps=4)
