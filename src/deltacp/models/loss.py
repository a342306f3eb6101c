"""Cross entropy under CP from the last hidden states: the LM head and the loss in token chunks.

    hidden = model.model(**inputs, use_cache=False).last_hidden_state      # this rank's slice, no logits
    loss = cp_linear_cross_entropy(hidden, model.lm_head.weight, target_ids, cp_mesh)
    loss = cp_causal_lm_loss(model, target_ids, cp_mesh, **inputs, use_cache=False)   # the same; FSDP2 too

Same contract as `cp_cross_entropy` (the mean over every valid target of the GLOBAL batch on every rank, each
rank's gradient its share), same value and gradients, but [tokens, vocab] logits never exist: at 32K tokens and
Qwen3.5's vocabulary (248,320) full logits are 16 GB in bf16 (32 GB in fp32) and their gradient as much again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deltacp.models.qwen3_5 import IGNORE_INDEX
from deltacp.parallel.style import batch_group_of

DEFAULT_CHUNK_SIZE = 1024
"""Tokens per chunk: the transient logits are chunk x vocab (1024 x 248,320: 0.5 GB bf16, 1 GB fp32)."""


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


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, acc: torch.dtype
                  ) -> torch.Tensor:
    """One chunk's logits, the matmul in the input dtype (as nn.Linear), then in the accumulation dtype."""
    logits = hidden @ weight.T if bias is None else torch.addmm(bias, hidden, weight.T)
    return logits.to(acc)


class _LinearCrossEntropySum(torch.autograd.Function):
    """sum over valid rows of logsumexp(h W^T + b) - (h W^T + b)[target], chunk by chunk of rows.

    Saves h, W, b, the targets and the per-row logsumexp; backward recomputes each chunk's logits and forms
    softmax - onehot there. Accumulation dtype: float32 for bf16/fp16/fp32, float64 for float64.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        valid = targets != IGNORE_INDEX
        lse = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = _chunk_logits(hidden[rows], weight, bias, acc)
            lse[rows] = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, targets[rows].clamp(min=0)[:, None]).squeeze(1)
            total += torch.where(valid[rows], lse[rows] - target_logit, 0).sum()
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_size = chunk_size
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = lse.dtype
        d_hidden = torch.empty_like(hidden) if need_h else None
        # weight and bias gradients sum over chunks: accumulate in the accumulation dtype, round once at the end
        d_weight = torch.zeros_like(weight, dtype=acc) if need_w else None
        d_bias = torch.zeros_like(bias, dtype=acc) if need_b else None
        # d total / d logits = (softmax - onehot(target)) on valid rows, 0 on ignored rows; times grad_total
        row_scale = (targets != IGNORE_INDEX).to(acc) * grad_total.to(acc)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows]
            d_logits = _chunk_logits(h, weight, bias, acc).sub_(lse[rows, None]).exp_()  # softmax (fresh tensor)
            d_logits.scatter_add_(1, targets[rows].clamp(min=0)[:, None],
                                  torch.full_like(lse[rows, None], -1.0))
            d_logits.mul_(row_scale[rows, None])
            if need_b:
                d_bias += d_logits.sum(0)
            d_logits = d_logits.to(hidden.dtype)  # as the logits' gradient reaches nn.Linear in today's loss
            if need_h:
                torch.mm(d_logits, weight, out=d_hidden[rows])
            if need_w:
                if d_weight.dtype == d_logits.dtype:
                    d_weight.addmm_(d_logits.T, h)
                else:  # bf16/fp16: the chunk's product in the input dtype (fp32 accumulation inside the matmul)
                    d_weight += d_logits.T @ h
            del d_logits
        return (d_hidden, None if d_weight is None else d_weight.to(weight.dtype),
                None if d_bias is None else d_bias.to(bias.dtype), None, None)


def cp_linear_cross_entropy(hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, target_ids: torch.Tensor,
                            cp_mesh: DeviceMesh, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                            lm_head_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross entropy of `hidden_states @ lm_head_weight.T (+ lm_head_bias)` over every valid target of the
    global batch, without ever holding [tokens, vocab] logits.

    hidden_states: this rank's last hidden states [..., hidden] (after the final norm), e.g. [B, s, hidden];
    target_ids: this rank's targets [...] (`shard_batch_for_cp(...)["target_ids"]`; IGNORE_INDEX = -100 is
    ignored); lm_head_weight [vocab, hidden], lm_head_bias [vocab] or None, in the dtype of hidden_states.

    Same value and gradients as `cp_cross_entropy(model(...).logits, target_ids, cp_mesh)`: the value is the
    global mean on every rank (0 when every target is ignored), the gradient this rank's share, so gradients
    summed over the CP ranks (FSDP2 via `fully_shard_qwen3_5`, or `all_reduce_cp_grads`) are the
    single-device gradients. Tokens go `chunk_size` at a time: the logits of one chunk are computed in the
    input dtype (as nn.Linear does), their logsumexp and target logit in float32 (float64 stays float64); only
    the per-token logsumexp is kept. Backward recomputes each chunk's logits and accumulates the gradients of
    hidden_states, the weight and the bias chunk by chunk (weight and bias in float32 / float64, rounded to
    their dtype once). Transient memory is O(chunk_size x vocab), plus one float32 [vocab, hidden] gradient
    accumulator when the weight is bf16/fp16.

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
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
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
    local_sum = _LinearCrossEntropySum.apply(hidden, lm_head_weight, lm_head_bias, targets, chunk_size)
    return cp_global_mean(local_sum, valid.sum(), cp_mesh)


def cp_causal_lm_loss(model: nn.Module, target_ids: torch.Tensor, cp_mesh: DeviceMesh, *,
                      chunk_size: int = DEFAULT_CHUNK_SIZE, **model_kwargs) -> torch.Tensor:
    """`cp_linear_cross_entropy` of a causal LM (Qwen3_5ForCausalLM, CP'd, with or without FSDP2): no logits.

    Runs the model's own forward with `model_kwargs` (the CP input hook, FSDP2's hooks and activation
    checkpointing act as usual) with its output head replaced, for this call only, by the loss of the last
    hidden state against `target_ids` with the head's weight and bias. Inside the forward the head's weight is
    the unsharded one under FSDP2 (the root module holds it): FSDP2 frees it after the forward and gathers it
    again before the loss's backward, exactly as for nn.Linear. Tied embeddings work the same.

    With routed experts whose forward returns `aux_loss` (output_router_logits), the result is the loss plus
    `router_aux_loss_coef * aux_loss` (the global auxiliary loss, `models/moe.py`), as transformers adds it.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"cp_causal_lm_loss: the model's output head must be an nn.Linear, got "
                        f"{type(head).__name__}")

    def loss_head(hidden: torch.Tensor) -> torch.Tensor:
        return cp_linear_cross_entropy(hidden, head.weight, target_ids, cp_mesh, chunk_size=chunk_size,
                                       lm_head_bias=head.bias)

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
