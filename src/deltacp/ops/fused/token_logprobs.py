"""The two Triton kernels of the token log-probabilities (`deltacp.ops.lm_head.logprobs`): per token chunk of logits
the tempered logsumexp, the target's log-probability and the entropy (forward, one read of the logits); over any
rectangle of logits (a token chunk, or a vocabulary chunk of every token) the gradient for per-token upstream
gradients, written over the logits (backward, elementwise).

    lp_rows_(logits, targets, lse, logp, ent, temperature, *, ignore_index)                         # [n, vocab]
    lp_grad_(logits, targets, lse, ent, g_lp, g_ent, temperature, col0, *, ignore_index)              # [n, width]

The contract (and the PyTorch implementation the tests compare against) is in `ops/lm_head/kernels.py`: s = logits
/ T in fp32, p = softmax(s); lse, logp (0 on ignored rows), entropy = sum_j p_j (lse - s_j) on every row; backward
dz = (g_lp (onehot - p) - g_ent p (log p + entropy)) / T, rounded once to the logits' dtype. Imported only on the
Triton path (CUDA tensors, or a test under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 16384
"""Forward columns per step: 16K fp32 values over 16 warps are 32 registers a thread (vocab 248,320: 16 steps)."""

COLS_BLOCK = 2048
"""Backward columns per program (one row each): an elementwise pass, 8 warps, 8 values a thread."""


@triton.jit
def _lp_rows_kernel(X, stride_x, T, LSE, LOGP, ENT, V, temperature, ignore_index, HAS_ENT: tl.constexpr,
                    BLOCK: tl.constexpr):
    i_row = tl.program_id(0).to(tl.int64)
    p_x = X + i_row * stride_x
    o_col = tl.arange(0, BLOCK)
    # one read: running max m, s1 = sum exp(s - m), s2 = sum exp(s - m) (s - m), all in fp32
    m = -float("inf")
    s1 = 0.0
    s2 = 0.0
    for start in range(0, V, BLOCK):
        m_x = start + o_col < V
        b_s = tl.load(p_x + start + o_col, mask=m_x, other=-float("inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(b_s, axis=0))
        alpha = tl.exp(m - m_new)
        b_e = tl.exp(b_s - m_new)
        if HAS_ENT:
            shift = (tl.where(s1 > 0, m, m_new) - m_new) * s1  # s1 = 0 while m = -inf
            s2 = alpha * (s2 + shift) + tl.sum(b_e * tl.where(m_x, b_s - m_new, 0.0), axis=0)
        s1 = s1 * alpha + tl.sum(b_e, axis=0)
        m = m_new
    log_s1 = tl.log(s1)
    lse = m + log_s1
    tl.store(LSE + i_row, lse)
    if HAS_ENT:
        tl.store(ENT + i_row, log_s1 - s2 / s1)
    target = tl.load(T + i_row).to(tl.int64)
    if target == ignore_index:
        tl.store(LOGP + i_row, 0.0)
    else:
        tl.store(LOGP + i_row, tl.load(p_x + target).to(tl.float32) / temperature - lse)


@triton.jit
def _lp_grad_kernel(X, stride_x, T, LSE, ENT, G_LP, G_ENT, width, col0, temperature, ignore_index,
                    HAS_LP: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
    i_row = tl.program_id(0).to(tl.int64)
    o_col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m_col = o_col < width
    p_x = X + i_row * stride_x + o_col
    b_logp = tl.load(p_x, mask=m_col, other=0.0).to(tl.float32) / temperature - tl.load(LSE + i_row)
    b_p = tl.exp(b_logp)
    b_dz = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_ENT:
        b_dz -= tl.load(G_ENT + i_row) * b_p * (b_logp + tl.load(ENT + i_row))
    if HAS_LP:
        target = tl.load(T + i_row).to(tl.int64)
        if target != ignore_index:
            g = tl.load(G_LP + i_row)
            b_dz += g * (tl.where(col0 + o_col == target, 1.0, 0.0) - b_p)
    tl.store(p_x, (b_dz / temperature).to(X.dtype.element_ty), mask=m_col)


def _check_rows(name: str, n: int, **rows: torch.Tensor | None) -> None:
    for what, x in rows.items():
        if x is not None and (x.dtype != torch.float32 or not x.is_contiguous() or x.shape != (n,)):
            raise ValueError(f"{name}: {what} must be a contiguous float32 [{n}], got {x.dtype} {tuple(x.shape)}")


def lp_rows_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, logp: torch.Tensor,
             ent: torch.Tensor | None, temperature: float, *, ignore_index: int) -> None:
    """Forward. Fill lse [n], logp [n] (0 on ignored rows) and, given, ent [n] (fp32) from logits [n, vocab] / T;
    the logits are only read. targets [n] integer, each in [0, vocab) or ignore_index (the caller checks)."""
    n, vocab = logits.shape
    if n == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("lp_rows_: the logits' rows must be contiguous")
    _check_rows("lp_rows_", n, lse=lse, logp=logp, ent=ent)
    block = min(MAX_BLOCK, triton.next_power_of_2(vocab))
    _lp_rows_kernel[(n,)](logits, logits.stride(0), targets.contiguous(), lse, logp, lse if ent is None else ent,
                          vocab, float(temperature), ignore_index, HAS_ENT=ent is not None, BLOCK=block,
                          num_warps=16 if block >= 4096 else 4)


def lp_grad_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
             g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, temperature: float, col0: int, *,
             ignore_index: int) -> None:
    """Backward. logits [n, width] are the columns [col0, col0 + width) of n rows' logits; overwrite them by
    (g_lp (onehot - p) - g_ent p (log p + ent)) / T (g_lp counts 0 on ignored rows; a None term is absent), from
    the forward's lse and ent [n] (fp32; ent needed with g_ent). g_lp, g_ent [n] fp32."""
    n, width = logits.shape
    if n == 0 or width == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("lp_grad_: the logits' rows must be contiguous")
    if g_ent is not None and ent is None:
        raise ValueError("lp_grad_: g_ent needs the forward's entropy (ent)")
    _check_rows("lp_grad_", n, lse=lse, ent=ent, g_lp=g_lp, g_ent=g_ent)
    block = min(COLS_BLOCK, triton.next_power_of_2(width))
    _lp_grad_kernel[(n, triton.cdiv(width, block))](
        logits, logits.stride(0), targets.contiguous(), lse, lse if ent is None else ent,
        lse if g_lp is None else g_lp, lse if g_ent is None else g_ent, width, col0, float(temperature),
        ignore_index, HAS_LP=g_lp is not None, HAS_ENT=g_ent is not None, BLOCK=block,
        num_warps=8 if block >= 1024 else 4)
