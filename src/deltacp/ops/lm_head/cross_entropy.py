"""The fused linear cross entropy of one rank: scale x the summed cross entropy of h W^T (+ b) against the targets,
with its gradients computed in the FORWARD, chunk by chunk (`chunks.chunk_loop`), never [tokens, vocab] logits.
The CP mean around it is `deltacp.losses.cp_linear_cross_entropy`.

    total = linear_cross_entropy_sum(hidden, weight, bias, targets, chunk_size, scale=1 / count)
"""

from __future__ import annotations

import torch

from deltacp.ops.lm_head.checks import check_weight_grad
from deltacp.ops.lm_head.chunks import chunk_loop, chunk_sizes, wants_grad
from deltacp.ops.lm_head.kernels import ce_kernels


def _linear_ce_two_pass(hidden, weight, bias, targets, scale, chunk_size, vocab_chunk_size, *, need_hidden,
                        need_weight, need_bias, kernels, weight_grad="accumulate"):
    """The one algorithm. Returns (scale x the sum of the loss terms in the accumulation dtype, dh, dW, db): the
    gradients of that value (None where not wanted), each rounded once to its input's dtype.

    `chunk_loop` with the cross entropy's kernels: pass 1's row kernel forms the loss terms, each row's logsumexp
    into lse [tokens] and (with a gradient wanted) scale x (softmax - onehot) over the logits; pass 2's column
    kernel scale x (exp(logits - lse) - onehot) from that lse. With no gradient wanted only pass 1 runs, no
    gradient buffer exists and the logits are not overwritten. weight_grad="accumulate" skips pass 2 (d weight
    summed in place over the token chunks in the weight's dtype: three head-sized matmuls instead of four).
    """
    tokens = hidden.shape[0]
    acc = torch.promote_types(hidden.dtype, torch.float32)
    rows_kernel, cols_kernel = kernels
    loss_rows = torch.empty(tokens, dtype=acc, device=hidden.device)
    lse = torch.empty(tokens, dtype=acc, device=hidden.device)

    def rows_fn(logits, rows, compute_grad):
        rows_kernel(logits, targets[rows], loss_rows[rows], lse[rows], scale, compute_grad=compute_grad)

    def cols_fn(logits, col0):
        cols_kernel(logits, targets, lse, scale, col0)

    grads = chunk_loop(hidden, weight, bias, rows_fn, chunk_size=chunk_size, need_hidden=need_hidden,
                       need_weight=need_weight, need_bias=need_bias, weight_grad=weight_grad, cols_fn=cols_fn,
                       vocab_chunk_size=vocab_chunk_size)
    return (loss_rows.sum() * scale, *grads)


class _LinearCrossEntropy(torch.autograd.Function):
    """scale x (sum over valid rows of logsumexp(h W^T + b) - (h W^T + b)[target]), with its gradients computed in
    the FORWARD (`_linear_ce_two_pass`, scale folded in before rounding); backward only multiplies them by
    grad_output (1.0 for the plain loss.backward(): exact), no logits recompute.

    The gradients are held on ctx until the one backward, which hands them over (in place scaled) and drops
    them: a second backward through the same graph (retain_graph=True) raises, and so does a backward with
    create_graph=True (double backward: the gradients are constants of the forward).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, chunk_size, vocab_chunk_size, impl, weight_grad, softcap):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        total, d_hidden, d_weight, d_bias = _linear_ce_two_pass(
            hidden, weight, bias, targets, scale, chunk_size, vocab_chunk_size, need_hidden=need_h,
            need_weight=need_w, need_bias=need_b, kernels=ce_kernels(hidden.device, hidden.dtype, impl, softcap),
            weight_grad=weight_grad)
        ctx.grads = (d_hidden, d_weight, d_bias)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if torch.is_grad_enabled():  # create_graph=True: the gradients are constants here, their own would be 0
            raise RuntimeError("cp_linear_cross_entropy computes its gradients in the forward: backward with "
                               "create_graph=True (double backward, gradient penalties) is not supported; use "
                               "cp_cross_entropy on full logits for that")
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("cp_linear_cross_entropy computes its gradients in the forward and hands them to the "
                               "first backward: backward through the same loss twice (retain_graph=True) is not "
                               "supported; run the forward again")
        ctx.grads = None
        # d (g * value) = g * d value, in place (no second [vocab, hidden] buffer), a device op (no host sync)
        for g in grads:
            if g is not None:
                g.mul_(grad_total)
        return (*grads, None, None, None, None, None, None, None)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, chunk_size: int | None = None, *,
                             vocab_chunk_size: int | None = None, scale: torch.Tensor | None = None,
                             impl: str = "auto", weight_grad: str = "accumulate",
                             softcap: float | None = None) -> torch.Tensor:
    """scale x the sum over valid rows of cross_entropy(hidden @ weight.T + bias, targets), one rank, no checks
    (callers check).

    hidden [tokens, hidden], targets [tokens] (IGNORE_INDEX rows count 0); scale a one-element tensor on hidden's
    device (None: 1), folded into every gradient before it is rounded (1 / count for a mean). With gradients
    wanted (grad mode on and an input requiring grad) they are computed in this call; otherwise only the loss.
    `chunk_size` / `vocab_chunk_size`: pass 1's token chunk / pass 2's vocabulary chunk (None: `chunk_sizes`).
    `impl`: the kernels (`kernels.KERNELS`: "auto", Triton for CUDA tensors; "torch"; "triton"). `weight_grad`:
    "two_pass" (dW rounded once) or "accumulate" (dW summed in place over token chunks in the weight's dtype; see
    `chunks.chunk_loop`). `softcap`: the logits are cap * tanh(logits / cap) (`kernels.soft_capped`), or None.
    """
    check_weight_grad("linear cross entropy", weight_grad)
    chunk_size, vocab_chunk_size = chunk_sizes(hidden.shape[0], hidden.shape[1], weight.shape[0], hidden.dtype,
                                               chunk_size, vocab_chunk_size, weight_grad)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    if scale is None:
        scale = torch.ones((), dtype=acc, device=hidden.device)
    else:
        scale = scale.detach().to(device=hidden.device, dtype=acc).reshape(())
    if not wants_grad(hidden, weight, bias):
        with torch.no_grad():
            total, *_ = _linear_ce_two_pass(hidden, weight, bias, targets, scale, chunk_size, vocab_chunk_size,
                                            need_hidden=False, need_weight=False, need_bias=False,
                                            kernels=ce_kernels(hidden.device, hidden.dtype, impl, softcap))
        return total
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, scale, chunk_size, vocab_chunk_size, impl,
                                     weight_grad, softcap)
