"""Cross entropy of one chunk of logits in one Triton pass per row, for the fused linear cross entropy
(`deltacp.models.loss`): the per-row loss and, in place of the logits, their gradient.

    ce_rows_(logits, targets, loss_rows, *, ignore_index, compute_grad)

logits [n, vocab] (bf16 / fp16 / fp32, rows contiguous) are read once for an online max / sum-of-exp in fp32
(logsumexp), loss_rows[i] = lse_i - logits[i, target_i] (fp32; 0 where target_i == ignore_index); with
`compute_grad` a second read writes softmax - onehot(target) over the logits in their dtype (0 on ignored rows,
which are never read). One program per row; the vocabulary goes BLOCK columns at a time, the tail masked.
Imported only on the Triton path (CUDA tensors, or a test under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 16384
"""Columns per step: 16K fp32 values over 16 warps are 32 registers a thread (vocab 248,320: 16 steps a pass)."""


@triton.jit
def _ce_rows_kernel(X, stride_x, T, LOSS, V, ignore_index, COMPUTE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    target = tl.load(T + row).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if target == ignore_index:
        tl.store(LOSS + row, 0.0)
        if COMPUTE_GRAD:
            zero = tl.zeros([BLOCK], dtype=tl.float32).to(X.dtype.element_ty)
            for start in range(0, V, BLOCK):
                tl.store(x_row + start + cols, zero, mask=start + cols < V)
    else:
        # pass 1: running max m and sum of exp(x - m), in fp32
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
        if COMPUTE_GRAD:
            # pass 2: softmax - onehot over the logits (each element read before this program overwrites it)
            for start in range(0, V, BLOCK):
                idx = start + cols
                x = tl.load(x_row + idx, mask=idx < V, other=0.0).to(tl.float32)
                p = tl.exp(x - lse)
                p = tl.where(idx == target, p - 1.0, p)
                tl.store(x_row + idx, p.to(X.dtype.element_ty), mask=idx < V)


def ce_rows_(logits: torch.Tensor, targets: torch.Tensor, loss_rows: torch.Tensor, *, ignore_index: int,
             compute_grad: bool) -> None:
    """Fill loss_rows [n] (fp32) and, with compute_grad, overwrite logits [n, vocab] by d sum(loss_rows) / d logits.

    targets [n] integer, each in [0, vocab) or ignore_index (the caller checks the bounds).
    """
    n, vocab = logits.shape
    if n == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("ce_rows_: the logits' rows must be contiguous")
    if loss_rows.dtype != torch.float32 or not loss_rows.is_contiguous() or loss_rows.shape != (n,):
        raise ValueError(f"ce_rows_: loss_rows must be a contiguous float32 [{n}], got {loss_rows.dtype} "
                         f"{tuple(loss_rows.shape)}")
    block = min(MAX_BLOCK, triton.next_power_of_2(vocab))
    _ce_rows_kernel[(n,)](logits, logits.stride(0), targets.contiguous(), loss_rows, vocab, ignore_index,
                          COMPUTE_GRAD=compute_grad, BLOCK=block, num_warps=16 if block >= 4096 else 4)
