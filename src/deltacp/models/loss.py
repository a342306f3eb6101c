"""The losses under CP: each the mean over every valid target of the GLOBAL batch on every rank, each rank's
gradient its share (so gradients summed over the mesh are the single-device gradients).

    loss = cp_cross_entropy(logits, target_ids, cp_mesh)                            # from this rank's logits
    loss = cp_causal_lm_loss(model, target_ids, cp_mesh, **inputs, use_cache=False)   # no logits; FSDP2 too
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    loss = cp_linear_cross_entropy(hidden, model.lm_head.weight, target_ids, cp_mesh)

The linear cross entropy never builds [tokens, vocab] logits (at 32K tokens and Qwen3.5's vocabulary of 248,320
they are 16 GB in bf16, their gradient as much again): it computes the loss and its gradients in the forward,
token chunk by token chunk; the head's weight gradient is summed over the chunks in its dtype (`weight_grad=
"accumulate"`, the default) or rounded once from a second pass over vocabulary chunks (`"two_pass"`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deltacp.distributed.mesh import batch_group_of

IGNORE_INDEX = -100
"""Targets with this value are not trained on (transformers' convention): padding, each document's last token."""

LOGITS_CHUNK_BUDGET = 256 * 2**20
"""Bytes of a logits buffer when the chunk sizes are not given: pass 1's [chunk, vocab] buffer (vocab 248,320 in
bf16: 512 tokens, 243 MiB); pass 2's [tokens, columns] buffer gets the smaller of this and the hidden states' bytes
(`vocab_budget_bytes`)."""

CHUNK_MULTIPLE = 256
"""The budgeted token chunk (pass 1) and vocabulary chunk (pass 2) are multiples of this (and at least one)."""

FP32_MATMUL_REDUCTIONS = True
"""On CUDA, bf16 / fp16 matmuls of the loss run with cuBLAS's reduced-precision split-K reductions disallowed
(`torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False` for the call): every gradient
element is one fp32 sum over the whole reduced dimension, rounded once. False: the global setting applies."""


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


def cp_global_mean(local_sum: torch.Tensor, n_valid: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """`local_sum` (this rank's summed loss) -> the mean over every valid target of every rank of the mesh: the CP
    group, or dp x cp for a ("dp", "cp") mesh (each dp group holds other rows of the global batch). This
    all-reduce is the one place the loss is scaled for dp x cp: FSDP2 / `all_reduce_cp_grads` then sum.

    The value is the global sum over the global count on every rank (0 when nothing is valid anywhere); the
    gradient reaches only this rank's `local_sum`, scaled by 1 / global count, so gradients summed over the CP
    ranks are the single-device gradients. (`cp_linear_cross_entropy` does the same in two all-reduces, the count
    first, so that its gradients are scaled before they are rounded.)
    """
    stats = torch.stack([local_sum.detach(), n_valid.to(local_sum.dtype)])
    dist.all_reduce(stats, group=batch_group_of(cp_mesh))
    global_sum, count = stats[0], stats[1].clamp(min=1)
    return (local_sum + (global_sum - local_sum.detach())) / count


def cp_cross_entropy(logits: torch.Tensor, target_ids: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Mean cross entropy over every valid target of the global batch, from this rank's logits.

    The value is the global mean on every rank; the gradient is this rank's share only, so gradients summed over
    CP ranks are the single-device gradients (see `fully_shard_cp` for FSDP). It needs the full [tokens, vocab]
    logits, upcast: at a large vocabulary use `cp_linear_cross_entropy` / `cp_causal_lm_loss` (below: the same
    value and gradients from the hidden states, chunk by chunk).
    """
    # float32 for bf16/fp16/fp32 logits, float64 stays float64 (the precision policy of every deltacp op)
    logits = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))
    local_sum = F.cross_entropy(logits, target_ids.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return cp_global_mean(local_sum, (target_ids != IGNORE_INDEX).sum(), cp_mesh)


# ---- the two kernels over the logits, each in two implementations of one contract -------------------------------
# rows_(logits [n, vocab], targets [n], loss_rows [n], lse [n], scale, *, compute_grad)  (pass 1)
#   loss_rows[i] = lse_i - logits[i, t_i] and lse[i] = lse_i in the accumulation dtype (0 on ignored rows) and,
#   with compute_grad, the logits overwritten in their own dtype by (softmax - onehot) * scale (0 on ignored
#   rows): scale x the gradient of sum(loss_rows) with respect to the logits.
# cols_(logits [T, width], targets [T], lse [T], scale, col0)  (pass 2)
#   logits holding the columns [col0, col0 + width) overwritten by (exp(logits - lse) - onehot) * scale, 0 on
#   ignored rows: the same gradient, for those columns, from pass 1's lse.

def _ce_rows_torch_(logits: torch.Tensor, targets: torch.Tensor, loss_rows: torch.Tensor, lse: torch.Tensor,
                    scale: torch.Tensor, *, compute_grad: bool) -> None:
    """PyTorch pass 1 (CPU, float64, any device): the logits upcast to loss_rows' dtype, then written back."""
    x = logits.to(loss_rows.dtype)  # the logits themselves for float32 / float64 (the gradient then in place)
    valid = targets != IGNORE_INDEX
    row_lse = torch.logsumexp(x, dim=-1)
    safe_t = targets.clamp(min=0)[:, None]
    target_logit = x.gather(1, safe_t).squeeze(1)
    loss_rows.copy_(torch.where(valid, row_lse - target_logit, 0))
    lse.copy_(torch.where(valid, row_lse, 0))
    if compute_grad:
        grad = x.sub_(row_lse[:, None]).exp_()
        grad.scatter_add_(1, safe_t, torch.full_like(row_lse[:, None], -1.0))
        grad.mul_(scale).masked_fill_(~valid[:, None], 0)
        if grad is not logits:
            logits.copy_(grad)


def _ce_grad_cols_torch_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                         col0: int) -> None:
    """PyTorch pass 2 (CPU, float64, any device): the logits upcast to lse's dtype, then written back."""
    grad = logits.to(lse.dtype).sub_(lse[:, None]).exp_()  # ignored rows (lse 0) are overwritten below
    valid = targets != IGNORE_INDEX
    col = targets - col0
    hit = valid & (col >= 0) & (col < logits.shape[1])
    grad.scatter_add_(1, torch.where(hit, col, 0)[:, None], -hit.to(grad.dtype)[:, None])
    grad.mul_(scale).masked_fill_(~valid[:, None], 0)
    if grad is not logits:
        logits.copy_(grad)


def _ce_rows_triton_(logits, targets, loss_rows, lse, scale, *, compute_grad):
    from deltacp.ops.fused.linear_ce import ce_rows_  # imports triton: only on this path

    ce_rows_(logits, targets, loss_rows, lse, scale, ignore_index=IGNORE_INDEX, compute_grad=compute_grad)


def _ce_grad_cols_triton_(logits, targets, lse, scale, col0):
    from deltacp.ops.fused.linear_ce import ce_grad_cols_

    ce_grad_cols_(logits, targets, lse, scale, col0, ignore_index=IGNORE_INDEX)


def _ce_kernels(device: torch.device, dtype: torch.dtype, impl: str | None):
    """(pass 1, pass 2) kernels: Triton for CUDA bf16 / fp16 / fp32 logits, PyTorch otherwise; `impl` ("torch" /
    "triton") forces one (tests: "triton" on CPU tensors under TRITON_INTERPRET=1)."""
    if impl is None:
        impl = "triton" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16, torch.float32) \
            else "torch"
    if impl not in ("torch", "triton"):
        raise ValueError(f"linear cross entropy: unknown kernel {impl!r} (torch or triton)")
    if impl == "triton" and dtype == torch.float64:
        raise ValueError("linear cross entropy: the Triton kernels take bf16 / fp16 / fp32 logits, not float64")
    if impl == "triton":
        return _ce_rows_triton_, _ce_grad_cols_triton_
    return _ce_rows_torch_, _ce_grad_cols_torch_


@contextlib.contextmanager
def _fp32_matmul_reductions(device: torch.device):
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


def _linear_(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = h weight^T (+ bias), in out's (the input) dtype, as nn.Linear."""
    if bias is None:
        torch.mm(h, weight.T, out=out)
    else:
        torch.addmm(bias, h, weight.T, out=out)


WEIGHT_GRAD_MODES = ("two_pass", "accumulate")


def _linear_ce_two_pass(hidden, weight, bias, targets, scale, chunk_size, vocab_chunk_size, *, need_hidden,
                        need_weight, need_bias, kernels, weight_grad="accumulate"):
    """The one algorithm. Returns (scale x the sum of the loss terms in the accumulation dtype, dh, dW, db): the
    gradients of that value (None where not wanted), each rounded once to its input's dtype.

    Pass 1, token chunks of `chunk_size` (one reused [chunk, vocab] buffer): logits = h W^T (+ b) in the input
    dtype, the rows kernel (loss terms, each row's logsumexp into lse [tokens]; the logits become scale x
    (softmax - onehot)), then dh rows = dlogits W (one fp32-accumulating matmul straight into dh) and db += column
    sums (fp32). Pass 2, only for dW, vocabulary chunks of `vocab_chunk_size` (one reused [tokens, columns]
    buffer): logits_c = h W_c^T (+ b_c), the columns kernel (scale x (exp(logits - lse) - onehot)), then
    dW[cols] = dlogits_c^T h, one matmul over all tokens accumulating in fp32, written into dW's rows. With no
    gradient wanted only pass 1 runs, no gradient buffer exists and the logits are not overwritten.

    weight_grad="accumulate" skips pass 2: pass 1 adds each chunk's dlogits^T h into dW in place, in the weight's
    dtype (liger-kernel's scheme: three head-sized matmuls instead of four, one rounding of the running sum per
    chunk instead of one in all).
    """
    tokens, vocab = hidden.shape[0], weight.shape[0]
    acc = torch.promote_types(hidden.dtype, torch.float32)
    device = hidden.device
    rows_kernel, cols_kernel = kernels
    loss_rows = torch.empty(tokens, dtype=acc, device=device)
    lse = torch.empty(tokens, dtype=acc, device=device)
    d_hidden = torch.empty_like(hidden) if need_hidden else None
    d_bias = torch.zeros(vocab, dtype=acc, device=device) if need_bias else None
    accumulate = need_weight and weight_grad == "accumulate"
    d_weight = torch.zeros(weight.shape, dtype=weight.dtype, device=device) if accumulate else None
    with _fp32_matmul_reductions(device):
        chunk = max(1, min(chunk_size, tokens))
        buffer, logits = torch.empty(chunk * vocab, dtype=hidden.dtype, device=device), None
        for start in range(0, tokens, chunk):
            rows = slice(start, min(start + chunk, tokens))
            h = hidden[rows]
            logits = buffer[: h.shape[0] * vocab].view(h.shape[0], vocab)
            _linear_(h, weight, bias, out=logits)
            rows_kernel(logits, targets[rows], loss_rows[rows], lse[rows], scale,
                        compute_grad=need_hidden or need_bias or accumulate)
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
                _linear_(hidden, weight[cols], None if bias is None else bias[cols], out=logits)
                cols_kernel(logits, targets, lse, scale, col0)
                torch.mm(logits.T, hidden, out=d_weight[cols])
            del buffer, logits
    return (loss_rows.sum() * scale, d_hidden, d_weight, None if d_bias is None else d_bias.to(bias.dtype))


class _LinearCrossEntropy(torch.autograd.Function):
    """scale x (sum over valid rows of logsumexp(h W^T + b) - (h W^T + b)[target]), with its gradients computed in
    the FORWARD (`_linear_ce_two_pass`, scale folded in before rounding); backward only multiplies them by
    grad_output (1.0 for the plain loss.backward(): exact), no logits recompute.

    The gradients are held on ctx until the one backward, which hands them over (in place scaled) and drops
    them: a second backward through the same graph (retain_graph=True) raises, and so does a backward with
    create_graph=True (double backward: the gradients are constants of the forward).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, chunk_size, vocab_chunk_size, impl, weight_grad):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        total, d_hidden, d_weight, d_bias = _linear_ce_two_pass(
            hidden, weight, bias, targets, scale, chunk_size, vocab_chunk_size, need_hidden=need_h,
            need_weight=need_w, need_bias=need_b, kernels=_ce_kernels(hidden.device, hidden.dtype, impl),
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
        return (*grads, None, None, None, None, None, None)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, chunk_size: int | None = None, *,
                             vocab_chunk_size: int | None = None, scale: torch.Tensor | None = None,
                             impl: str | None = None, weight_grad: str = "accumulate") -> torch.Tensor:
    """scale x the sum over valid rows of cross_entropy(hidden @ weight.T + bias, targets), one rank, no checks
    (callers check).

    hidden [tokens, hidden], targets [tokens] (IGNORE_INDEX rows count 0); scale a one-element tensor on hidden's
    device (None: 1), folded into every gradient before it is rounded (1 / count for a mean). With gradients
    wanted (grad mode on and an input requiring grad) they are computed in this call; otherwise only the loss.
    `chunk_size` / `vocab_chunk_size`: pass 1's token chunk / pass 2's vocabulary chunk (None: `chunk_sizes`).
    `impl`: the kernels ("torch" / "triton"; None: Triton for CUDA tensors). `weight_grad`: "two_pass" (dW rounded
    once) or "accumulate" (dW summed in place over token chunks in the weight's dtype; see `_linear_ce_two_pass`).
    """
    if weight_grad not in WEIGHT_GRAD_MODES:
        raise ValueError(f"linear cross entropy: weight_grad={weight_grad!r}; expected one of {WEIGHT_GRAD_MODES}")
    chunk_size, vocab_chunk_size = chunk_sizes(hidden.shape[0], hidden.shape[1], weight.shape[0], hidden.dtype,
                                               chunk_size, vocab_chunk_size, weight_grad)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    if scale is None:
        scale = torch.ones((), dtype=acc, device=hidden.device)
    else:
        scale = scale.detach().to(device=hidden.device, dtype=acc).reshape(())
    wants_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    if not wants_grad:
        with torch.no_grad():
            total, *_ = _linear_ce_two_pass(hidden, weight, bias, targets, scale, chunk_size, vocab_chunk_size,
                                            need_hidden=False, need_weight=False, need_bias=False,
                                            kernels=_ce_kernels(hidden.device, hidden.dtype, impl))
        return total
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, scale, chunk_size, vocab_chunk_size, impl,
                                     weight_grad)


def _check_chunk(name: str, value) -> None:
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"cp_linear_cross_entropy: {name} must be a positive integer, got {value!r}")


def _checked_num_items(value, device: torch.device) -> torch.Tensor:
    """num_items_in_batch as a one-element tensor on `device`; a negative, non-integral or multi-element value raises."""
    count = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value).reshape(-1).to(device)
    if count.numel() != 1 or count.is_floating_point() and not bool(count == count.round()) or bool(count < 0):
        raise ValueError(f"cp_linear_cross_entropy: num_items_in_batch must be one count >= 0, got {value!r}")
    return count


def cp_linear_cross_entropy(hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, target_ids: torch.Tensor,
                            cp_mesh: DeviceMesh, *, chunk_size: int | None = None,
                            vocab_chunk_size: int | None = None,
                            lm_head_bias: torch.Tensor | None = None, weight_grad: str = "accumulate",
                            num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross entropy of `hidden_states @ lm_head_weight.T (+ lm_head_bias)` over every valid target of the
    global batch, without ever holding [tokens, vocab] logits.

    num_items_in_batch: the count the summed loss is divided by, the same number on every rank (transformers'
    name and meaning: every valid target of every micro-batch of a gradient-accumulation step, over the whole batch
    group); None (the default): this call's valid targets over the batch group, counted here. With it the value is
    the batch group's summed loss of this call / num_items_in_batch (a micro-batch's share of the step's mean: the
    shares of the step's micro-batches add up to its mean), the gradients scaled alike; 0 counts as 1.

    hidden_states: this rank's last hidden states [..., hidden] (after the final norm), e.g. [B, s, hidden];
    target_ids: this rank's targets [...] (`shard_batch_for_cp(...)["target_ids"]`; IGNORE_INDEX = -100 is
    ignored); lm_head_weight [vocab, hidden], lm_head_bias [vocab] or None, in the dtype of hidden_states.

    Same value and gradients as `cp_cross_entropy(model(...).logits, target_ids, cp_mesh)`: the value is the
    global mean on every rank (0 when every target is ignored), the gradient this rank's share, so gradients
    summed over the CP ranks (FSDP2 via `fully_shard_cp`, or `all_reduce_cp_grads`) are the
    single-device gradients. Two small all-reduces over the batch group: the valid-target count first (its
    inverse scales the gradients before they are rounded, on the device: no host sync), then the loss sum.

    The gradients are computed in the FORWARD (the loss is the last op of a training step); backward only multiplies
    them by its grad_output (1.0 for loss.backward(): exact), no recompute. Once: a second backward through the
    same loss (retain_graph) raises, double backward too. Without gradients (torch.no_grad, no input requiring
    grad) only the loss is computed. The logits are computed in the input dtype (as nn.Linear), `chunk_size` tokens
    at a time into one reused buffer; one kernel (Triton on CUDA) forms the loss terms and each row's logsumexp
    (float32; float64 stays float64) and, over the logits, (softmax - onehot) / count; then the chunk's
    d hidden_states rows (one matmul accumulating in fp32, rounded once) and d bias (column sums in fp32). The
    weight's gradient, by `weight_grad`:
      "accumulate" (default): each chunk's dlogits^T @ hidden_states is added in place into d weight, in the
        weight's dtype (the matmul accumulates in fp32, the running sum is rounded once per chunk): 3 matmuls of
        tokens x vocab x hidden, as liger-kernel's fused linear cross entropy, with its chunk rule
        (`accumulate_chunk_size`: 256 tokens at 16K, 1024 at 64K for vocab 248,320, hidden 2048) and so its
        buffers: peak above the inputs 2 V H (d weight) + 2 T H (d hidden) + the logits chunk (about 2 T H);
      "two_pass": a second pass over `vocab_chunk_size` vocabulary rows at a time (default: as many as fit
        min(256 MiB, the hidden states' bytes)) recomputes those logits for all tokens and writes those rows of
        d weight with one matmul over all tokens, rounded once, as nn.Linear's backward: 4 matmuls, the first pass
        `chunk_size` (default: as many tokens as fit 256 MiB) freed before d weight exists; peak 2 V H + 2 T H +
        min(256 MiB, 2 T H) + 8 T bytes. Slower at long rows, more exact (NOTES.md, the loss op).

    From a Qwen3_5ForCausalLM (CP'd): the text model's last hidden state (after the final norm) and the head,
    `hidden = model.model(**kwargs).last_hidden_state` and `model.lm_head.weight` (tied embeddings work the
    same: the weight is the embedding matrix, both uses' gradients add up). Under FSDP2 the head's weight is
    sharded outside the root module's forward: use `cp_causal_lm_loss(model, target_ids, cp_mesh, **kwargs)`,
    which computes this loss inside the model's forward in place of the head (also fine without FSDP).
    """
    from torch.distributed.tensor import DTensor

    if isinstance(lm_head_weight, DTensor):
        raise ValueError("cp_linear_cross_entropy: lm_head_weight is a DTensor (a sharded parameter); pass the "
                         "unsharded weight: under FSDP2 use cp_causal_lm_loss(model, target_ids, cp_mesh, "
                         "**inputs), which computes the loss inside the root module's forward")
    _check_chunk("chunk_size", chunk_size)
    _check_chunk("vocab_chunk_size", vocab_chunk_size)
    if weight_grad not in WEIGHT_GRAD_MODES:
        raise ValueError(f"cp_linear_cross_entropy: weight_grad={weight_grad!r}; expected one of {WEIGHT_GRAD_MODES}")
    hidden = hidden_states.flatten(0, -2)
    targets = target_ids.flatten().to(hidden.device)
    vocab = lm_head_weight.shape[0]
    if targets.numel() != hidden.shape[0]:
        raise ValueError(f"cp_linear_cross_entropy: {hidden.shape[0]} hidden states but {targets.numel()} targets "
                         f"(hidden_states {tuple(hidden_states.shape)}, target_ids {tuple(target_ids.shape)})")
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"cp_linear_cross_entropy: lm_head_weight must be [vocab, {hidden.shape[1]}], got "
                         f"{tuple(lm_head_weight.shape)}")
    dtypes = {hidden.dtype, lm_head_weight.dtype} | ({lm_head_bias.dtype} if lm_head_bias is not None else set())
    if len(dtypes) != 1:
        raise ValueError(f"cp_linear_cross_entropy: hidden_states, lm_head_weight and lm_head_bias must share one "
                         f"dtype, got {hidden.dtype}, {lm_head_weight.dtype}"
                         f"{'' if lm_head_bias is None else f', {lm_head_bias.dtype}'}")
    valid = targets != IGNORE_INDEX
    if bool(((targets < 0) & valid).any() | (targets >= vocab).any()):
        bad = targets[((targets < 0) & valid) | (targets >= vocab)][0].item()
        raise ValueError(f"cp_linear_cross_entropy: target {bad} is out of bounds for vocab {vocab} (ignored: "
                         f"{IGNORE_INDEX})")
    group = batch_group_of(cp_mesh)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    if num_items_in_batch is None:
        count = valid.sum().reshape(1)  # int64: exact at any batch size
        dist.all_reduce(count, group=group)
    else:
        count = _checked_num_items(num_items_in_batch, hidden.device)
    scale = (1.0 / count.clamp(min=1).to(acc)).reshape(())  # on the device
    local = linear_cross_entropy_sum(hidden, lm_head_weight, lm_head_bias, targets, chunk_size,
                                     vocab_chunk_size=vocab_chunk_size, scale=scale, weight_grad=weight_grad)  # this rank's sum / count
    global_mean = local.detach().clone()
    dist.all_reduce(global_mean, group=group)
    # the value: the global mean on every rank; the gradient: this rank's share (local's, already scaled)
    return local + (global_mean - local.detach())


def cp_causal_lm_loss(model: nn.Module, target_ids: torch.Tensor, cp_mesh: DeviceMesh, *,
                      chunk_size: int | None = None, vocab_chunk_size: int | None = None,
                      weight_grad: str = "accumulate", num_items_in_batch: int | torch.Tensor | None = None,
                      **model_kwargs) -> torch.Tensor:
    """`cp_linear_cross_entropy` of a causal LM (Qwen3_5ForCausalLM, CP'd, with or without FSDP2): no logits.
    `num_items_in_batch`: the normaliser of the summed loss (see `cp_linear_cross_entropy`; None: this call's count).

    Runs the model's own forward with `model_kwargs` (the CP input hook, FSDP2's hooks and activation
    checkpointing act as usual) with its output head replaced, for this call only, by the loss of the last
    hidden state against `target_ids` with the head's weight and bias. Inside the forward the head's weight is
    the unsharded one under FSDP2 (the root module holds it): FSDP2 frees it after the forward and gathers it
    again before the loss's backward, exactly as for nn.Linear. Tied embeddings work the same. The loss's
    gradients are computed in this forward: activation checkpointing of the decoder layers (the trainer's) leaves
    the head outside every checkpointed region, so nothing recomputes them; do not checkpoint the whole model
    forward around this call (a recompute would run the loss, gradients included, a second time).

    With routed experts whose forward returns `aux_loss` (output_router_logits), the result is the loss plus
    `router_aux_loss_coef * aux_loss` (the global auxiliary loss, `models/moe.py`), as transformers adds it.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"cp_causal_lm_loss: the model's output head must be an nn.Linear, got "
                        f"{type(head).__name__}")

    def loss_head(hidden: torch.Tensor) -> torch.Tensor:
        return cp_linear_cross_entropy(hidden, head.weight, target_ids, cp_mesh, chunk_size=chunk_size,
                                       vocab_chunk_size=vocab_chunk_size, lm_head_bias=head.bias,
                                       weight_grad=weight_grad, num_items_in_batch=num_items_in_batch)

    own_forward = head.__dict__.get("forward")
    head.forward = loss_head
    try:
        output = model(**model_kwargs)
        loss = output.logits
        aux = getattr(output, "aux_loss", None)
        if aux is not None:
            cfg = model.config
            coef = getattr(cfg, "router_aux_loss_coef", None)
            if coef is None:  # a multimodal config keeps it in its text config
                coef = cfg.get_text_config().router_aux_loss_coef
            loss = loss + coef * aux.to(loss.dtype)
        return loss
    finally:
        if own_forward is None:
            del head.forward
        else:
            head.forward = own_forward
