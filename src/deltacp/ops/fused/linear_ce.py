"""The two Triton kernels of the fused linear cross entropy (`deltacp.ops.lm_head.cross_entropy`, two passes,
gradients in the forward): per token chunk the loss rows, their logsumexp and the scaled logits gradient (pass 1);
per vocabulary chunk the scaled logits gradient again, from the stored logsumexp (pass 2).

    ce_rows_(logits, targets, loss_rows, lse, scale, *, ignore_index, compute_grad)          # pass 1, [n, vocab]
    ce_grad_cols_(logits, targets, lse, scale, col0, *, ignore_index)                        # pass 2, [T, width]

Both overwrite the logits in their own dtype by (softmax - onehot(target)) * scale, 0 on ignored rows, computed in
fp32 and rounded once; `scale` is a 0-d fp32 tensor read on the device (no host sync). Imported only on the Triton
path (CUDA tensors, or a test under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 16384
"""Pass 1 columns per step: 16K fp32 values over 16 warps are 32 registers a thread (vocab 248,320: 16 steps)."""

COLS_BLOCK = 2048
"""Pass 2 columns per program (one row each): an elementwise pass, 8 warps, 8 values a thread."""


@triton.jit
def _ce_rows_kernel(X, stride_x, T, LOSS, LSE, SCALE, V, ignore_index, COMPUTE_GRAD: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    target = tl.load(T + row).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if target == ignore_index:
        tl.store(LOSS + row, 0.0)
        tl.store(LSE + row, 0.0)
        if COMPUTE_GRAD:
            zero = tl.zeros([BLOCK], dtype=tl.float32).to(X.dtype.element_ty)
            for start in range(0, V, BLOCK):
                tl.store(x_row + start + cols, zero, mask=start + cols < V)
    else:
        # read 1: running max m and sum of exp(x - m), in fp32
        m = -float("inf")
        s = 0.0
        for start in range(0, V, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < V, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        x_target = tl.load(x_row + target).to(tl.float32)
        tl.store(LOSS + row, lse - x_target)
        tl.store(LSE + row, lse)
        if COMPUTE_GRAD:
            # read 2: (softmax - onehot) * scale over the logits (each element read before it is overwritten)
            scale = tl.load(SCALE).to(tl.float32)
            for start in range(0, V, BLOCK):
                idx = start + cols
                x = tl.load(x_row + idx, mask=idx < V, other=0.0).to(tl.float32)
                p = tl.exp(x - lse)
                p = tl.where(idx == target, p - 1.0, p) * scale
                tl.store(x_row + idx, p.to(X.dtype.element_ty), mask=idx < V)


@triton.jit
def _ce_grad_cols_kernel(X, stride_x, T, LSE, SCALE, width, col0, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < width
    ptr = X + row * stride_x + idx
    target = tl.load(T + row).to(tl.int64)
    if target == ignore_index:
        tl.store(ptr, tl.zeros([BLOCK], dtype=tl.float32).to(X.dtype.element_ty), mask=mask)
    else:
        lse = tl.load(LSE + row)
        scale = tl.load(SCALE).to(tl.float32)
        x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        p = tl.where(col0 + idx == target, p - 1.0, p) * scale
        tl.store(ptr, p.to(X.dtype.element_ty), mask=mask)


def _check_rows(name: str, x: torch.Tensor, n: int, what: str) -> None:
    if x.dtype != torch.float32 or not x.is_contiguous() or x.shape != (n,):
        raise ValueError(f"{name}: {what} must be a contiguous float32 [{n}], got {x.dtype} {tuple(x.shape)}")


def _check_scale(name: str, scale: torch.Tensor) -> None:
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"{name}: scale must be a one-element float32 tensor, got {scale.dtype} "
                         f"{tuple(scale.shape)}")


def ce_rows_(logits: torch.Tensor, targets: torch.Tensor, loss_rows: torch.Tensor, lse: torch.Tensor,
             scale: torch.Tensor, *, ignore_index: int, compute_grad: bool) -> None:
    """Pass 1. Fill loss_rows [n] and lse [n] (fp32; both 0 on ignored rows) and, with compute_grad, overwrite
    logits [n, vocab] by scale * d sum(loss_rows) / d logits.

    targets [n] integer, each in [0, vocab) or ignore_index (the caller checks the bounds); scale a one-element
    float32 tensor (read only with compute_grad).
    """
    n, vocab = logits.shape
    if n == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("ce_rows_: the logits' rows must be contiguous")
    _check_rows("ce_rows_", loss_rows, n, "loss_rows")
    _check_rows("ce_rows_", lse, n, "lse")
    _check_scale("ce_rows_", scale)
    block = min(MAX_BLOCK, triton.next_power_of_2(vocab))
    _ce_rows_kernel[(n,)](logits, logits.stride(0), targets.contiguous(), loss_rows, lse, scale, vocab,
                          ignore_index, COMPUTE_GRAD=compute_grad, BLOCK=block,
                          num_warps=16 if block >= 4096 else 4)


def ce_grad_cols_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                  col0: int, *, ignore_index: int) -> None:
    """Pass 2. logits [T, width] are the columns [col0, col0 + width) of every row's logits; overwrite them by
    (exp(logits - lse[:, None]) - [targets[:, None] == col0 + column]) * scale, 0 on ignored rows.

    lse [T] fp32 from pass 1 (`ce_rows_`), targets [T] as there, scale a one-element float32 tensor.
    """
    n, width = logits.shape
    if n == 0 or width == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("ce_grad_cols_: the logits' rows must be contiguous")
    _check_rows("ce_grad_cols_", lse, n, "lse")
    _check_scale("ce_grad_cols_", scale)
    block = min(COLS_BLOCK, triton.next_power_of_2(width))
    _ce_grad_cols_kernel[(n, triton.cdiv(width, block))](
        logits, logits.stride(0), targets.contiguous(), lse, scale, width, col0, ignore_index, BLOCK=block,
        num_warps=8 if block >= 1024 else 4)
