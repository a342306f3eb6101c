"""Cross entropy under CP from the last hidden states: the LM head and the loss in token chunks.

    hidden = model.model(**inputs, use_cache=False).last_hidden_state      # this rank's slice, no logits
    loss = cp_linear_cross_entropy(hidden, model.lm_head.weight, target_ids, cp_mesh)
    loss = cp_causal_lm_loss(model, target_ids, cp_mesh, **inputs, use_cache=False)   # the same; FSDP2 too

Same contract as `cp_cross_entropy` (the mean over every valid target of the GLOBAL batch on every rank, each
rank's gradient its share), same value and gradients, but [tokens, vocab] logits never exist: at 32K tokens and
Qwen3.5's vocabulary (248,320) full logits are 16 GB in bf16 (32 GB in fp32) and their gradient as much again.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deltacp.models.qwen3_5 import IGNORE_INDEX
from deltacp.parallel.style import batch_group_of

LOGITS_CHUNK_BUDGET = 256 * 2**20
"""Bytes of the one logits chunk buffer when `chunk_size` is None (vocab 248,320 in bf16: 512 tokens, 243 MiB)."""

CHUNK_MULTIPLE = 256
"""The budgeted chunk is a multiple of this many tokens (and at least one multiple)."""


def budget_chunk_size(vocab: int, dtype: torch.dtype, budget_bytes: int = LOGITS_CHUNK_BUDGET) -> int:
    """Tokens per chunk so that chunk x vocab logits in `dtype` fit `budget_bytes`: rounded down to a multiple of
    CHUNK_MULTIPLE, at least CHUNK_MULTIPLE (vocab 248,320: 512 tokens in bf16, 256 in fp32)."""
    rows = budget_bytes // (vocab * torch.empty((), dtype=dtype).element_size())
    return max(CHUNK_MULTIPLE, rows // CHUNK_MULTIPLE * CHUNK_MULTIPLE)


def cp_global_mean(local_sum: torch.Tensor, n_valid: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """`local_sum` (this rank's summed loss) -> the mean over every valid target of every rank of the mesh: the CP
    group, or dp x cp for a ("dp", "cp") mesh (each dp group holds other rows of the global batch). This
    all-reduce is the one place the loss is scaled for dp x cp: FSDP2 / `all_reduce_cp_grads` then sum.

    The value is the global sum over the global count on every rank (0 when nothing is valid anywhere); the
    gradient reaches only this rank's `local_sum`, scaled by 1 / global count, so gradients summed over the CP
    ranks are the single-device gradients.
    """
    stats = torch.stack([local_sum.detach(), n_valid.to(local_sum.dtype)])
    dist.all_reduce(stats, group=batch_group_of(cp_mesh))
    global_sum, count = stats[0], stats[1].clamp(min=1)
    return (local_sum + (global_sum - local_sum.detach())) / count


# ---- one chunk's cross entropy: two kernels of one contract ------------------------------------------------------
# ce_rows_(logits [n, vocab], targets [n], loss_rows [n]) writes loss_rows[i] = lse_i - logits[i, t_i] (0 on
# ignored rows) in the accumulation dtype and, with compute_grad, overwrites the logits by softmax - onehot
# (0 on ignored rows) in their own dtype: the gradient of sum(loss_rows) with respect to the logits.

def _ce_rows_torch_(logits: torch.Tensor, targets: torch.Tensor, loss_rows: torch.Tensor, *, compute_grad: bool
                    ) -> None:
    """PyTorch kernel (CPU, float64, any device): the logits upcast to loss_rows' dtype, then written back."""
    x = logits.to(loss_rows.dtype)  # the logits themselves for float32 / float64 (the gradient then in place)
    valid = targets != IGNORE_INDEX
    lse = torch.logsumexp(x, dim=-1)
    safe_t = targets.clamp(min=0)[:, None]
    target_logit = x.gather(1, safe_t).squeeze(1)
    loss_rows.copy_(torch.where(valid, lse - target_logit, 0))
    if compute_grad:
        grad = x.sub_(lse[:, None]).exp_()
        grad.scatter_add_(1, safe_t, torch.full_like(lse[:, None], -1.0))
        grad.mul_(valid[:, None])
        if grad is not logits:
            logits.copy_(grad)


def _ce_rows_triton_(logits: torch.Tensor, targets: torch.Tensor, loss_rows: torch.Tensor, *, compute_grad: bool
                     ) -> None:
    from deltacp.ops.fused.linear_ce import ce_rows_  # imports triton: only on this path

    ce_rows_(logits, targets, loss_rows, ignore_index=IGNORE_INDEX, compute_grad=compute_grad)


def _ce_kernel(device: torch.device, dtype: torch.dtype, impl: str | None):
    """The Triton kernel for CUDA bf16 / fp16 / fp32 logits, PyTorch otherwise; `impl` ("torch" / "triton") forces
    one (tests: "triton" on CPU tensors under TRITON_INTERPRET=1)."""
    if impl is None:
        impl = "triton" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16, torch.float32) \
            else "torch"
    if impl not in ("torch", "triton"):
        raise ValueError(f"linear cross entropy: unknown kernel {impl!r} (torch or triton)")
    if impl == "triton" and dtype == torch.float64:
        raise ValueError("linear cross entropy: the Triton kernel takes bf16 / fp16 / fp32 logits, not float64")
    return _ce_rows_triton_ if impl == "triton" else _ce_rows_torch_


# ---- the weight gradient, accumulated in fp32 in place -------------------------------------------------------

_ADDMM_OUT_DTYPE: dict[str, bool] = {}
"""Per device type: does torch.addmm(acc_fp32, a_bf16, b_bf16, out_dtype=float32, out=acc) run (CUDA, torch >=
2.9)? Learned at the first call; without it the exact fallback upcasts the chunk's operands to fp32."""


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b in acc's dtype, in place: a, b in acc's dtype (plain addmm_), or bf16/fp16 into an fp32 acc.

    bf16/fp16 into fp32: the product accumulates in fp32 inside the matmul and adds to acc in fp32, no
    [vocab, hidden] temporary (CUDA `addmm.dtype_out`). Where that op is missing the operands are upcast to fp32
    (their products are exact in fp32, so this is the same computation, slower, with chunk-sized temporaries),
    never a low-precision product added to acc.
    """
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    kind = acc.device.type
    if kind == "cuda" and _ADDMM_OUT_DTYPE.get(kind, True):
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            _ADDMM_OUT_DTYPE[kind] = True
            return
        except (TypeError, RuntimeError, NotImplementedError) as err:
            if kind in _ADDMM_OUT_DTYPE:  # it ran before: a real error
                raise
            _ADDMM_OUT_DTYPE[kind] = False
            warnings.warn(f"linear cross entropy: torch.addmm(out_dtype=float32) is unavailable here ({err}); the "
                          f"weight gradient accumulates from fp32-upcast operands (exact, slower)", stacklevel=2)
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


class _WeightGrad:
    """The weight gradient [vocab, hidden], summed over chunks in `acc_dtype`, rounded once to the weight's dtype.

    acc_dtype == the weight's dtype (float32, float64, or `grad_accum_dtype=weight.dtype`): one tensor, returned
    as is. Otherwise (bf16/fp16 weight, fp32 accumulation) the accumulator is two fp32 tensors, rows [0, r) and
    [r, vocab) with r >= vocab / 2, so that the rounded result fits in the first one's storage (4 r hidden
    bytes >= 2 vocab hidden): `result()` writes the bf16 rows there block by block, each block read before any
    byte of it is overwritten, and frees the second. Peak: the fp32 accumulator plus one block, not fp32 + bf16.
    """

    BLOCK_BYTES = 32 * 2**20

    def __init__(self, weight: torch.Tensor, acc_dtype: torch.dtype):
        vocab, hidden = weight.shape
        self.shape, self.dtype = (vocab, hidden), weight.dtype
        # the split row r >= vocab / 2, a multiple of 8 (the second part's rows start 16-byte aligned)
        r = vocab if acc_dtype == weight.dtype else min(vocab, ((vocab + 1) // 2 + 7) // 8 * 8)
        self.bounds = [(0, r), (r, vocab)] if r < vocab else [(0, vocab)]
        self.parts = [torch.zeros(hi - lo, hidden, dtype=acc_dtype, device=weight.device) for lo, hi in self.bounds]

    def add_(self, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """+= grad_logits[:, rows].T @ hidden for each part's vocabulary rows."""
        for (lo, hi), part in zip(self.bounds, self.parts):
            _addmm_fp32_(part, grad_logits[:, lo:hi].T, hidden)

    def result(self) -> torch.Tensor:
        parts, self.parts = self.parts, []
        if parts[0].dtype == self.dtype:
            return parts[0]
        vocab, hidden = self.shape
        out = parts[0].view(-1).view(self.dtype)[: vocab * hidden].view(vocab, hidden)  # parts[0]'s storage
        step = max(1, self.BLOCK_BYTES // (hidden * parts[0].element_size()))
        for (lo, hi), part in zip(self.bounds, parts):
            # out rows [lo + i, lo + i + step) are the bytes of parts[0]'s fp32 rows below (lo + i + step) / 2:
            # rows already read (earlier blocks, parts[0] entirely when lo > 0, or this block, read first)
            for i in range(0, hi - lo, step):
                j = min(i + step, hi - lo)
                out[lo + i: lo + j].copy_(part[i:j].to(self.dtype))
        return out  # the second part is freed on return


def _linear_ce_chunks(hidden, weight, bias, targets, chunk_size, *, need_hidden, need_weight, need_bias,
                      ce_rows, grad_accum_dtype=None):
    """The one algorithm: per chunk of tokens, logits = h W^T (+ b) in the input dtype into one reused buffer,
    `ce_rows` (loss terms; the logits become softmax - onehot), then the chunk's contributions to the wanted
    gradients: dh rows = dlogits W, dW += dlogits^T h (fp32 in place), db += column sums (fp32).

    Returns (sum of the loss terms in the accumulation dtype, dh, dW, db): the gradients of that sum (None where not
    wanted); with no gradient wanted no gradient buffer exists and the logits are not overwritten.
    """
    tokens, vocab = hidden.shape[0], weight.shape[0]
    acc = torch.promote_types(hidden.dtype, torch.float32)
    need_grad = need_hidden or need_weight or need_bias
    loss_rows = torch.empty(tokens, dtype=acc, device=hidden.device)
    d_hidden = torch.empty_like(hidden) if need_hidden else None
    d_weight = _WeightGrad(weight, grad_accum_dtype or acc) if need_weight else None
    d_bias = torch.zeros(vocab, dtype=acc, device=hidden.device) if need_bias else None
    chunk = max(1, min(chunk_size, tokens))
    buffer = torch.empty(chunk, vocab, dtype=hidden.dtype, device=hidden.device)
    for start in range(0, tokens, chunk):
        rows = slice(start, min(start + chunk, tokens))
        h = hidden[rows]
        logits = buffer[: h.shape[0]]
        if bias is None:
            torch.mm(h, weight.T, out=logits)
        else:
            torch.addmm(bias, h, weight.T, out=logits)
        ce_rows(logits, targets[rows], loss_rows[rows], compute_grad=need_grad)
        if need_hidden:
            torch.mm(logits, weight, out=d_hidden[rows])
        if need_weight:
            d_weight.add_(logits, h)
        if need_bias:
            d_bias += logits.sum(0, dtype=acc)
    del buffer, logits
    return (loss_rows.sum(), d_hidden, None if d_weight is None else d_weight.result(),
            None if d_bias is None else d_bias.to(bias.dtype))


class _LinearCrossEntropySum(torch.autograd.Function):
    """sum over valid rows of logsumexp(h W^T + b) - (h W^T + b)[target], with its gradients computed in the
    FORWARD (`_linear_ce_chunks`); backward only scales them by grad_output (no logits recompute).

    The gradients are held on ctx until the one backward, which hands them over (in place scaled) and drops
    them: a second backward through the same graph (retain_graph=True) raises, and so does a backward with
    create_graph=True (double backward: the gradients are constants of the forward).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, impl, grad_accum_dtype):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        total, d_hidden, d_weight, d_bias = _linear_ce_chunks(
            hidden, weight, bias, targets, chunk_size, need_hidden=need_h, need_weight=need_w, need_bias=need_b,
            ce_rows=_ce_kernel(hidden.device, hidden.dtype, impl), grad_accum_dtype=grad_accum_dtype)
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
        # d (g * sum) = g * d sum, in place (no second [vocab, hidden] buffer); g = 1 / global count under CP
        for g in grads:
            if g is not None:
                g.mul_(grad_total)
        return (*grads, None, None, None, None)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, chunk_size: int | None = None, *, impl: str | None = None,
                             grad_accum_dtype: torch.dtype | None = None) -> torch.Tensor:
    """sum over valid rows of cross_entropy(hidden @ weight.T + bias, targets), one rank, no checks (callers check).

    hidden [tokens, hidden], targets [tokens] (IGNORE_INDEX rows count 0). With gradients wanted (grad mode on and
    an input requiring grad) they are computed in this call; otherwise only the loss. `impl`: the per-chunk
    kernel ("torch" / "triton"; None: Triton for CUDA tensors).
    """
    if chunk_size is None:
        chunk_size = budget_chunk_size(weight.shape[0], hidden.dtype)
    wants_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    if not wants_grad:
        with torch.no_grad():
            total, *_ = _linear_ce_chunks(hidden, weight, bias, targets, chunk_size, need_hidden=False,
                                          need_weight=False, need_bias=False,
                                          ce_rows=_ce_kernel(hidden.device, hidden.dtype, impl))
        return total
    return _LinearCrossEntropySum.apply(hidden, weight, bias, targets, chunk_size, impl, grad_accum_dtype)


def cp_linear_cross_entropy(hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, target_ids: torch.Tensor,
                            cp_mesh: DeviceMesh, *, chunk_size: int | None = None,
                            lm_head_bias: torch.Tensor | None = None,
                            grad_accum_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Mean cross entropy of `hidden_states @ lm_head_weight.T (+ lm_head_bias)` over every valid target of the
    global batch, without ever holding [tokens, vocab] logits.

    hidden_states: this rank's last hidden states [..., hidden] (after the final norm), e.g. [B, s, hidden];
    target_ids: this rank's targets [...] (`shard_batch_for_cp(...)["target_ids"]`; IGNORE_INDEX = -100 is
    ignored); lm_head_weight [vocab, hidden], lm_head_bias [vocab] or None, in the dtype of hidden_states.

    Same value and gradients as `cp_cross_entropy(model(...).logits, target_ids, cp_mesh)`: the value is the
    global mean on every rank (0 when every target is ignored), the gradient this rank's share, so gradients
    summed over the CP ranks (FSDP2 via `fully_shard_qwen3_5`, or `all_reduce_cp_grads`) are the
    single-device gradients.

    The gradients are computed in the FORWARD (the loss is the last op of a training step), `chunk_size` tokens
    at a time (None: as many as fit a 256 MiB logits buffer, a multiple of 256; vocab 248,320 in bf16: 512):
    the chunk's logits in the input dtype (as nn.Linear), one kernel (Triton on CUDA) forming the loss terms
    (logsumexp in float32; float64 stays float64) and, over the logits, softmax - onehot; then the chunk's
    d hidden_states rows, and d weight / d bias accumulated in place in float32 (float64 for float64), rounded
    to their dtype once. Backward only scales them by its grad_output (1 / global count): no recompute. Once:
    a second backward through the same loss (retain_graph) raises, double backward too. Without gradients
    (torch.no_grad, no input requiring grad) only the loss is computed.

    Memory (bf16 weight [V, H]): the logits chunk, d hidden_states [tokens, H], and a float32 [V, H] accumulator
    (4 V H bytes, twice the weight) during the forward, rounded at its end into its own storage (the bf16
    gradient, 2 V H bytes, is then held until backward). `grad_accum_dtype=torch.bfloat16` (the weight's dtype)
    accumulates in bf16 instead: 2 V H bytes, each chunk's product rounded into the running sum (as liger-kernel
    does by default), less exact.
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
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"cp_linear_cross_entropy: chunk_size must be a positive integer, got {chunk_size!r}")
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
    acc = torch.promote_types(hidden.dtype, torch.float32)
    if grad_accum_dtype not in (None, acc, hidden.dtype):
        raise ValueError(f"cp_linear_cross_entropy: grad_accum_dtype must be None ({acc}) or the weight's dtype "
                         f"({hidden.dtype}), got {grad_accum_dtype}")
    local_sum = linear_cross_entropy_sum(hidden, lm_head_weight, lm_head_bias, targets, chunk_size,
                                         grad_accum_dtype=grad_accum_dtype)
    return cp_global_mean(local_sum, valid.sum(), cp_mesh)


def cp_causal_lm_loss(model: nn.Module, target_ids: torch.Tensor, cp_mesh: DeviceMesh, *,
                      chunk_size: int | None = None, grad_accum_dtype: torch.dtype | None = None,
                      **model_kwargs) -> torch.Tensor:
    """`cp_linear_cross_entropy` of a causal LM (Qwen3_5ForCausalLM, CP'd, with or without FSDP2): no logits.

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
                                       lm_head_bias=head.bias, grad_accum_dtype=grad_accum_dtype)

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
