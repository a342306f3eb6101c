"""The chunk budgets and the one chunk loop of the output-head ops (cross entropy, token log-probabilities): the
logits h W^T (+ b) exist only as one [chunk, vocab] (or [tokens, columns]) buffer at a time.

    chunk, vocab_chunk = chunk_sizes(tokens, hidden, vocab, dtype, chunk_size, vocab_chunk_size, weight_grad)
    d_hidden, d_weight, d_bias = chunk_loop(hidden, weight, bias, rows_fn, chunk_size=chunk, ...)

`chunk_loop` computes the logits chunk by chunk and hands each to the op's row function, which reads them and,
when a gradient is wanted, overwrites them by the gradient of the op's output with respect to them (dlogits);
the loop then forms d hidden, d weight and d bias from dlogits. The ops differ only in their row (and column)
functions: the cross entropy runs the loop in its forward (its gradient is known there), the log-probabilities
in their backward (from the upstream per-token gradients).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

LOGITS_CHUNK_BUDGET = 256 * 2**20
"""Bytes of a logits buffer when the chunk sizes are not given: pass 1's [chunk, vocab] buffer (vocab 248,320 in
bf16: 512 tokens, 243 MiB); pass 2's [tokens, columns] buffer gets the smaller of this and the hidden states' bytes
(`vocab_budget_bytes`)."""

CHUNK_MULTIPLE = 256
"""The budgeted token chunk (pass 1) and vocabulary chunk (pass 2) are multiples of this (and at least one)."""

FP32_MATMUL_REDUCTIONS = True
"""On CUDA, bf16 / fp16 matmuls of the head ops run with cuBLAS's reduced-precision split-K reductions disallowed
(`torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False` for the call): every gradient
element is one fp32 sum over the whole reduced dimension, rounded once. False: the global setting applies."""

WEIGHT_GRAD_MODES = ("two_pass", "accumulate")
"""How d weight is formed: "accumulate" adds each token chunk's dlogits^T h into it in place, in the weight's
dtype; "two_pass" writes each vocabulary chunk's rows once from a second pass over all tokens (rounded once)."""


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def budget_chunk_size(vocab: int, dtype: torch.dtype, budget_bytes: int = LOGITS_CHUNK_BUDGET) -> int:
    """Tokens per pass-1 chunk so that chunk x vocab logits in `dtype` fit `budget_bytes`: rounded down to a
    multiple of CHUNK_MULTIPLE, at least CHUNK_MULTIPLE (vocab 248,320: 512 tokens in bf16, 256 in fp32)."""
    rows = budget_bytes // (vocab * _element_size(dtype))
    return max(CHUNK_MULTIPLE, rows // CHUNK_MULTIPLE * CHUNK_MULTIPLE)


def vocab_budget_bytes(tokens: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes of pass 2's buffer by default: min(LOGITS_CHUNK_BUDGET, tokens x hidden x element size), the hidden
    states' own size at most. The op's peak is d weight + d hidden + this buffer (pass 1's buffer is freed before
    d weight exists), so it stays below liger-kernel's (whose logits chunk is about tokens x hidden, or up to
    twice that)."""
    return min(LOGITS_CHUNK_BUDGET, max(tokens, 1) * hidden * _element_size(dtype))


def budget_vocab_chunk_size(tokens: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """Vocabulary columns per pass-2 chunk so that tokens x columns logits in `dtype` fit `budget_bytes`: rounded
    down to a multiple of CHUNK_MULTIPLE, at least CHUNK_MULTIPLE. bf16, hidden 2048: 2048 columns (16K tokens,
    64 MiB) to 2048 (64K tokens, 256 MiB); hidden 4096: 4096 at 16K, 2048 at 32K and 64K."""
    cols = budget_bytes // (max(tokens, 1) * _element_size(dtype))
    return max(CHUNK_MULTIPLE, cols // CHUNK_MULTIPLE * CHUNK_MULTIPLE)


def accumulate_chunk_size(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk of weight_grad="accumulate": a chunk's logits about the hidden states' size, the token count
    rounded up to a power of two, at least CHUNK_MULTIPLE (liger-kernel's rule, so that both hold the same
    buffers: vocab 248,320, hidden 2048: 256 tokens at 16K, 512 at 32K, 1024 at 64K)."""
    rows = -(-max(tokens, 1) // -(-vocab // hidden))
    return max(CHUNK_MULTIPLE, 1 << (rows - 1).bit_length())


def chunk_sizes(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, chunk_size: int | None = None,
                vocab_chunk_size: int | None = None, weight_grad: str = "accumulate") -> tuple[int, int]:
    """(token chunk of pass 1, vocabulary chunk of pass 2): the given ones, or the defaults (pass 1:
    `accumulate_chunk_size` for weight_grad="accumulate", the LOGITS_CHUNK_BUDGET rule for "two_pass")."""
    if chunk_size is None:
        chunk_size = (accumulate_chunk_size(tokens, hidden, vocab) if weight_grad == "accumulate"
                      else budget_chunk_size(vocab, dtype))
    if vocab_chunk_size is None:
        vocab_chunk_size = budget_vocab_chunk_size(tokens, dtype, vocab_budget_bytes(tokens, hidden, dtype))
    return chunk_size, vocab_chunk_size


@contextlib.contextmanager
def fp32_matmul_reductions(device: torch.device):
    """cuBLAS without reduced-precision (bf16 / fp16) split-K reductions, for this block (see
    FP32_MATMUL_REDUCTIONS); nothing elsewhere."""
    if device.type != "cuda" or not FP32_MATMUL_REDUCTIONS:
        yield
        return
    m = torch.backends.cuda.matmul
    names = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
    # newer torch keeps a split-K flag beside each (a bool set resets it to True): restore both
    saved = [(getattr(m, n), getattr(m, n + "_split_k", None)) for n in names]
    for n in names:
        setattr(m, n, False)
    try:
        yield
    finally:
        for n, (allow, split_k) in zip(names, saved):
            setattr(m, n, allow if split_k is None else (allow, split_k))


def linear_into(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = h weight^T (+ bias), in out's (the input) dtype, as nn.Linear."""
    if bias is None:
        torch.mm(h, weight.T, out=out)
    else:
        torch.addmm(bias, h, weight.T, out=out)


def wants_grad(*inputs: torch.Tensor | None) -> bool:
    """Grad mode on and an input requiring grad."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)


RowsFn = Callable[[torch.Tensor, slice, bool], None]
"""rows_fn(logits [n, vocab], rows, compute_grad): the logits of the token rows `rows`; with compute_grad it must
overwrite them by dlogits (their dtype)."""
ColsFn = Callable[[torch.Tensor, int], None]
"""cols_fn(logits [tokens, width], col0): the columns [col0, col0 + width) of every token's logits, to be
overwritten by those columns of dlogits."""


def chunk_loop(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows_fn: RowsFn, *,
               chunk_size: int, need_hidden: bool = False, need_weight: bool = False, need_bias: bool = False,
               weight_grad: str = "accumulate", cols_fn: ColsFn | None = None, vocab_chunk_size: int | None = None,
               rows_only_for_grad: bool = False) -> tuple[torch.Tensor | None, ...]:
    """(d hidden, d weight, d bias) of an op over the logits h W^T (+ b) whose dlogits the row / column functions
    write, each rounded once to its input's dtype (None where not wanted); hidden [tokens, H], weight [V, H].

    Pass 1, token chunks of `chunk_size` (one reused [chunk, vocab] buffer): logits in the input dtype (as
    nn.Linear), `rows_fn` (which, with a gradient wanted, leaves dlogits), then d hidden rows = dlogits W (one
    fp32-accumulating matmul straight into d hidden), d bias += column sums (fp32) and, for weight_grad=
    "accumulate", d weight += dlogits^T h in place in the weight's dtype (liger-kernel's scheme: one rounding of
    the running sum per chunk). rows_only_for_grad: pass 1 runs only when it yields a gradient (rows_fn
    computes nothing else). Pass 2, only for d weight under "two_pass", vocabulary chunks of `vocab_chunk_size`
    (one reused [tokens, columns] buffer): those logits for all tokens, `cols_fn`, then d weight[cols] =
    dlogits_c^T h, one matmul over all tokens accumulating in fp32, written into d weight's rows. Pass 1's buffer
    is freed before pass 2's d weight exists.
    """
    tokens, vocab = hidden.shape[0], weight.shape[0]
    acc = torch.promote_types(hidden.dtype, torch.float32)
    device = hidden.device
    accumulate = need_weight and weight_grad == "accumulate"
    compute_grad = need_hidden or need_bias or accumulate
    d_hidden = torch.empty_like(hidden) if need_hidden else None
    d_bias = torch.zeros(vocab, dtype=acc, device=device) if need_bias else None
    d_weight = torch.zeros(weight.shape, dtype=weight.dtype, device=device) if accumulate else None
    with fp32_matmul_reductions(device):
        if compute_grad or not rows_only_for_grad:
            chunk = max(1, min(chunk_size, tokens))
            buffer, logits = torch.empty(chunk * vocab, dtype=hidden.dtype, device=device), None
            for start in range(0, tokens, chunk):
                rows = slice(start, min(start + chunk, tokens))
                h = hidden[rows]
                logits = buffer[: h.shape[0] * vocab].view(h.shape[0], vocab)
                linear_into(h, weight, bias, out=logits)
                rows_fn(logits, rows, compute_grad)
                if need_hidden:
                    torch.mm(logits, weight, out=d_hidden[rows])
                if accumulate:
                    d_weight.addmm_(logits.T, h)
                if need_bias:
                    d_bias += logits.sum(0, dtype=acc)
            del buffer, logits  # pass 1's buffer is freed before pass 2's d weight exists
        if need_weight and not accumulate:
            d_weight = torch.empty(weight.shape, dtype=weight.dtype, device=device)
            width = max(1, min(vocab_chunk_size, vocab))
            buffer = torch.empty(tokens * width, dtype=hidden.dtype, device=device)
            for col0 in range(0, vocab, width):
                cols = slice(col0, min(col0 + width, vocab))
                n = cols.stop - col0
                logits = buffer[: tokens * n].view(tokens, n)
                linear_into(hidden, weight[cols], None if bias is None else bias[cols], out=logits)
                cols_fn(logits, col0)
                torch.mm(logits.T, hidden, out=d_weight[cols])
            del buffer
    return d_hidden, d_weight, None if d_bias is None else d_bias.to(bias.dtype)
