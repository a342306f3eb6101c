"""The model- and CP-facing head ops: the losses under CP, each the mean over every valid target of the GLOBAL batch
on every rank, each rank's gradient its share (so gradients summed over the mesh are the single-device gradients),
and the per-token log-probabilities of reinforcement learning (no reduction: each rank its own tokens).

    loss = cp_cross_entropy(logits, target_ids, cp_mesh)                            # from this rank's logits
    loss = cp_causal_lm_loss(model, target_ids, cp_mesh, **inputs, use_cache=False)   # no logits; FSDP2 too
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    loss = cp_linear_cross_entropy(hidden, model.lm_head.weight, target_ids, cp_mesh)
    logp, entropy = cp_token_logprobs(model, target_ids, cp_mesh, temperature=0.7, return_entropy=True, **inputs)

The linear cross entropy and the log-probabilities never build [tokens, vocab] logits (at 32K tokens and Qwen3.5's
vocabulary of 248,320 they are 16 GB in bf16, their gradient as much again): the ops (`deltacp.ops.lm_head`:
chunk budgets, the chunk loop, kernels) run over token chunks of logits. The cross entropy computes its gradients
in the forward; the head's weight gradient is summed over the chunks in its dtype (`weight_grad="accumulate"`, the
default) or rounded once from a second pass over vocabulary chunks (`"two_pass"`). The log-probabilities' backward
takes any per-token upstream gradients and recomputes the logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deltacp.distributed.agree import LocalChecks, raise_together
from deltacp.distributed.mesh import batch_group_of
from deltacp.models.parallelize import cp_plan_of, require_parallelized
from deltacp.models.adapters import adapter_for
from deltacp.ops.lm_head.checks import check_chunk, check_head, check_targets, check_temperature, check_weight_grad
from deltacp.ops.lm_head.chunks import (  # noqa: F401  (re-exported: their home was here)
    CHUNK_MULTIPLE,
    LOGITS_CHUNK_BUDGET,
    WEIGHT_GRAD_MODES,
    accumulate_chunk_size,
    budget_chunk_size,
    budget_vocab_chunk_size,
    chunk_sizes,
    vocab_budget_bytes,
)
from deltacp.ops.lm_head.cross_entropy import linear_cross_entropy_sum
from deltacp.ops.lm_head.kernels import IGNORE_INDEX, KERNELS, check_kernels, select_impl
from deltacp.ops.lm_head.logprobs import linear_token_logprobs
from deltacp.ops.lm_head.metrics import head_token_stats

__all__ = ["IGNORE_INDEX", "cp_causal_lm_loss", "cp_cross_entropy", "cp_global_mean", "cp_linear_cross_entropy",
           "cp_token_logprobs", "head_kernels_of", "linear_cross_entropy_sum", "linear_token_logprobs"]


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
                            num_items_in_batch: int | torch.Tensor | None = None,
                            kernels: str = "auto", logit_softcap: float | None = None) -> torch.Tensor:
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
    at a time into one reused buffer; one kernel (`kernels`, below) forms the loss terms and each row's logsumexp
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

    kernels: the kernels over each logits chunk (`ops/lm_head/kernels.py`, one contract): "auto" (default) Triton
    for CUDA bf16 / fp16 / fp32 inputs, PyTorch otherwise; "torch" PyTorch on any device and dtype; "triton" the
    Triton kernels (CUDA, or any device under TRITON_INTERPRET=1; not float64). `cp_causal_lm_loss` passes the
    model's GDN backend's choice (`head_kernels_of`: eager "torch", triton "triton").

    logit_softcap: the logits are cap * tanh(logits / cap) (transformers' RecurrentGemma, `logits_soft_cap`), formed
    in float32 (float64 stays float64) from the logits chunk, the gradient through it; the PyTorch kernels only
    (the Triton ones refuse it, before any collective). `cp_causal_lm_loss` passes the model's.

    From a Qwen3_5ForCausalLM (CP'd): the text model's last hidden state (after the final norm) and the head,
    `hidden = model.model(**kwargs).last_hidden_state` and `model.lm_head.weight` (tied embeddings work the
    same: the weight is the embedding matrix, both uses' gradients add up). Under FSDP2 the head's weight is
    sharded outside the root module's forward: use `cp_causal_lm_loss(model, target_ids, cp_mesh, **kwargs)`,
    which computes this loss inside the model's forward in place of the head (also fine without FSDP).
    """
    fn = "cp_linear_cross_entropy"
    check_soft_cap(fn, logit_softcap, kernels, hidden_states)
    check_chunk(fn, "chunk_size", chunk_size)
    check_chunk(fn, "vocab_chunk_size", vocab_chunk_size)
    check_weight_grad(fn, weight_grad)
    check_kernels(fn, kernels, hidden_states.dtype)
    check_head(fn, hidden_states, lm_head_weight, lm_head_bias, target_ids,
               ("hidden_states", "lm_head_weight", "lm_head_bias", "target_ids"),
               "cp_causal_lm_loss(model, target_ids, cp_mesh, **inputs)")
    hidden = hidden_states.flatten(0, -2)
    targets = target_ids.flatten().to(hidden.device)
    valid = targets != IGNORE_INDEX
    group = batch_group_of(cp_mesh)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    if num_items_in_batch is None:
        count = valid.sum().reshape(1)  # int64: exact at any batch size
        dist.all_reduce(count, group=group)
    else:
        count = _checked_num_items(num_items_in_batch, hidden.device)
    scale = (1.0 / count.clamp(min=1).to(acc)).reshape(())  # on the device
    local = linear_cross_entropy_sum(hidden, lm_head_weight, lm_head_bias, targets, chunk_size,  # this rank's
                                     vocab_chunk_size=vocab_chunk_size, scale=scale,  # sum / count
                                     weight_grad=weight_grad, impl=kernels, softcap=logit_softcap)
    global_mean = local.detach().clone()
    dist.all_reduce(global_mean, group=group)
    # the value: the global mean on every rank; the gradient: this rank's share (local's, already scaled)
    return local + (global_mean - local.detach())


def check_soft_cap(fn: str, cap, kernels: str, hidden_states: torch.Tensor) -> None:
    """A logit soft-cap is a finite number > 0 (or None), computed by the PyTorch kernels only: ValueError /
    NotImplementedError naming it, before any collective."""
    if cap is None:
        return
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"{fn}: logit_softcap={cap!r}: expected a finite number > 0 (or None: no soft-cap)")
    if kernels in KERNELS and select_impl(fn, hidden_states.device, hidden_states.dtype, kernels) == "triton":
        raise NotImplementedError(f"{fn}: the Triton head kernels compute no logit soft-cap (logit_softcap={cap}); "
                                  f"use kernels='torch'")


def refuse_z_loss(model: nn.Module, fn: str) -> None:
    """A z-loss term the model's own loss would add (Bamba's `z_loss_coefficient` > 0: the mean of logsumexp(logits)^2
    over every position, with labels) is not computed by the CP losses: ValueError naming the setting rather than a
    silently different loss."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    coef = getattr(config, "z_loss_coefficient", 0.0) or 0.0
    if coef > 0:
        raise ValueError(f"{fn}: {type(model).__name__} has z_loss_coefficient={coef}: transformers adds "
                         f"z_loss_coefficient * mean(logsumexp(logits)^2) to its own loss, which deltacp's CP losses "
                         f"do not compute; set config.z_loss_coefficient = 0 (or add the z-loss to your loss from "
                         f"the logits)")


def cp_causal_lm_loss(model: nn.Module, target_ids: torch.Tensor, cp_mesh: DeviceMesh, *,
                      chunk_size: int | None = None, vocab_chunk_size: int | None = None,
                      weight_grad: str = "accumulate", num_items_in_batch: int | torch.Tensor | None = None,
                      return_token_stats: bool = False, **model_kwargs):
    """`cp_linear_cross_entropy` of a causal LM (Qwen3_5ForCausalLM, CP'd, with or without FSDP2): no logits.
    `num_items_in_batch`: the normaliser of the summed loss (see `cp_linear_cross_entropy`; None: this call's count).
    return_token_stats: (loss, this rank's [entropy sum, top-1 count, valid count] over its valid targets), for
    logging (`head_token_stats`: one more head-sized matmul per token, no gradient; sum them over the batch group).

    Runs the model's own forward with `model_kwargs` (the CP input hook, FSDP2's hooks and activation
    checkpointing act as usual) with its output head replaced, for this call only, by the loss of the last
    hidden state against `target_ids` with the head's weight and bias. Inside the forward the head's weight is
    the unsharded one under FSDP2 (the root module holds it): FSDP2 frees it after the forward and gathers it
    again before the loss's backward, exactly as for nn.Linear. Tied embeddings work the same. The loss's
    gradients are computed in this forward: activation checkpointing of the decoder layers (the trainer's) leaves
    the head outside every checkpointed region, so nothing recomputes them; do not checkpoint the whole model
    forward around this call (a recompute would run the loss, gradients included, a second time).

    A causal LM that soft-caps its logits (RecurrentGemma's `logits_soft_cap`) gets the cap inside the loss's kernels
    (`logit_softcap`), and the model's own cap is kept off the loss (`forward_with_head`).

    With routed experts whose forward returns `aux_loss` (output_router_logits), the result is the loss plus
    `router_aux_loss_coef * aux_loss` (the global auxiliary loss, `models/moe.py`), as transformers adds it.

    The loss's kernels follow the model's GDN backend (`head_kernels_of`): PyTorch with eager, Triton with triton.
    A model CP is not applied to (or one inside `suspend_cp`) is refused on every rank together before the forward
    (one small all-gather over the batch group).
    """
    fn = "cp_causal_lm_loss"
    with LocalChecks() as checks:
        require_parallelized(model, fn)
        head = output_head(model, fn)
        kernels = head_kernels_of(model)
        refuse_z_loss(model, fn)
        softcap = adapter_for(model).logit_softcap
    raise_together(batch_group_of(cp_mesh), fn, checks.error, device=target_ids.device)
    stats = []

    def loss_head(hidden: torch.Tensor) -> torch.Tensor:
        if return_token_stats:
            stats.append(head_token_stats(hidden.flatten(0, -2), head.weight, head.bias,
                                          target_ids.reshape(-1).to(hidden.device), softcap=softcap))
        return cp_linear_cross_entropy(hidden, head.weight, target_ids, cp_mesh, chunk_size=chunk_size,
                                       vocab_chunk_size=vocab_chunk_size, lm_head_bias=head.bias,
                                       weight_grad=weight_grad, num_items_in_batch=num_items_in_batch,
                                       kernels=kernels, logit_softcap=softcap)

    output = forward_with_head(model, head, loss_head, model_kwargs)
    loss = output.logits
    aux = getattr(output, "aux_loss", None)
    if aux is not None:
        cfg = model.config
        coef = getattr(cfg, "router_aux_loss_coef", None)
        if coef is None:  # a multimodal config keeps it in its text config
            coef = cfg.get_text_config().router_aux_loss_coef
        loss = loss + coef * aux.to(loss.dtype)
    return (loss, stats[0]) if return_token_stats else loss


def cp_token_logprobs(model: nn.Module, target_ids: torch.Tensor, cp_mesh: DeviceMesh, *, temperature: float = 1.0,
                      return_entropy: bool = False, chunk_size: int | None = None,
                      vocab_chunk_size: int | None = None, weight_grad: str = "two_pass", **model_inputs):
    """This rank's per-token log-probabilities of `target_ids` under softmax(logits / temperature) of a causal LM
    (CP'd, with or without FSDP2), without [tokens, vocab] logits: [B, s] (s this rank's local length, in its
    sequence layout, as `shard_batch_for_cp` cut the targets) in float32 (float64 for a float64 model), 0 where
    the target is IGNORE_INDEX; with return_entropy, (logprobs, entropy) of the same tempered distribution.

    What reinforcement learning needs of the policy, the old policy and the reference model (TRL's
    `selective_log_softmax(logits / temperature, ids)` and `entropy_from_logits`) for rows far too long for full
    logits. Each rank returns its own tokens: no reduction, no collective of its own (log-probabilities are per
    token); combine them with the advantages, ratios or KL terms of your loss, then reduce that loss over the
    batch group (e.g. `cp_global_mean`). The entropy is computed at every token, ignored targets included (a
    well-defined value, as TRL computes it before masking): mask it yourself (TRL's `entropy` metric and
    `top_entropy_quantile` mask with the completion mask); its gradient there is whatever you send back.

    Runs the model's own forward with `model_inputs` (the CP input hook, FSDP2's hooks and activation
    checkpointing act as usual) with its output head replaced, for this call only, by `linear_token_logprobs`
    with the head's weight and bias (tied embeddings work the same; under FSDP2 the weight is the unsharded one
    inside the root module's forward, gathered again before the backward as for nn.Linear). Backward takes any
    upstream gradients of the log-probabilities and entropy and recomputes the logits chunk by chunk (see
    `linear_token_logprobs`: `chunk_size`, `vocab_chunk_size`, `weight_grad`). Without gradients
    (torch.no_grad: the old policy, the reference model) only the forward pass over the logits runs.

    Checked on every rank before the forward (one small all-gather over the batch group; every rank raises
    together): that CP is applied to the model (and it is not inside `suspend_cp`), the temperature (a finite
    number > 0, the same on every rank), the chunk sizes, weight_grad, the targets (integers in [0, vocab) or
    IGNORE_INDEX). The MoE auxiliary loss is not added (no loss here). The kernels follow the
    model's GDN backend (`head_kernels_of`): PyTorch with eager, Triton with triton.
    """
    fn = "cp_token_logprobs"
    with LocalChecks() as checks:
        require_parallelized(model, fn)
        head = output_head(model, fn)
        check_temperature(fn, temperature)
        check_chunk(fn, "chunk_size", chunk_size)
        check_chunk(fn, "vocab_chunk_size", vocab_chunk_size)
        check_weight_grad(fn, weight_grad)
        check_targets(fn, target_ids, head.out_features)
        kernels = head_kernels_of(model)
        softcap = adapter_for(model).logit_softcap
    same = float(temperature) if isinstance(temperature, (int, float)) else math.nan  # (a bad one raised above)
    raise_together(batch_group_of(cp_mesh), fn, checks.error, device=target_ids.device,
                   agree=dict(temperature=same))

    def logprob_head(hidden: torch.Tensor) -> torch.Tensor:
        out = linear_token_logprobs(hidden, head.weight, target_ids.to(hidden.device), bias=head.bias,
                                    temperature=temperature, return_entropy=return_entropy, chunk_size=chunk_size,
                                    vocab_chunk_size=vocab_chunk_size, weight_grad=weight_grad, kernels=kernels,
                                    softcap=softcap)
        # one tensor through the model's output (its `logits` field; FSDP2's pre-backward hook sees it)
        return torch.stack(out, dim=-1) if return_entropy else out

    out = forward_with_head(model, head, logprob_head, model_inputs).logits
    return tuple(out.unbind(-1)) if return_entropy else out


def head_kernels_of(model: nn.Module) -> str:
    """The output-head kernels (`ops/lm_head/kernels.py`'s KERNELS) of a model: its GDN backend's, "torch" with
    the eager backend (PyTorch throughout: the readable reference), "triton" with the Triton one (CUDA, or
    TRITON_INTERPRET=1); "auto" (the device rule) for a model `parallelize_cp` has not touched (any class with an
    nn.Linear head). The one place the model-facing losses read the backend."""
    try:
        plan = cp_plan_of(model)
    except NotImplementedError:  # a class no adapter knows: parallelize_cp was not applied to it
        plan = None
    backend = None if plan is None else plan.linear_attention_backend
    match backend:
        case None:
            return "auto"
        case "eager":
            return "torch"
        case "triton":
            return "triton"
        case _:
            raise ValueError(f"no output-head kernels for linear_attention_backend={backend!r}")


def output_head(model: nn.Module, fn: str) -> nn.Linear:
    """The model's output head, an nn.Linear (else a TypeError naming `fn`)."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"{fn}: the model's output head must be an nn.Linear, got {type(head).__name__}")
    return head


def forward_with_head(model: nn.Module, head: nn.Linear, head_fn: Callable[[torch.Tensor], torch.Tensor],
                      model_kwargs: dict):
    """(see `_forward_with_head`) A family whose causal LM scales the head's output by a factor f (Granite-4.0-H's
    1 / logits_scaling, Falcon-H1's lm_head_multiplier): head_fn sees the hidden states times f (the logits it
    computes are the model's: (f h) Wᵀ = f (h Wᵀ); a head bias is refused) and its result is divided by f, which
    the model's forward multiplies back. A family that soft-caps the head's output (RecurrentGemma): head_fn caps
    the logits itself, and its result is the model's output as it is (`_forward_past_soft_cap`)."""
    adapter = adapter_for(model)
    if adapter.logit_softcap is not None:
        return _forward_past_soft_cap(model, head, head_fn, model_kwargs)
    factor = adapter.logit_factor
    if factor == 1.0:
        return _forward_with_head(model, head, head_fn, model_kwargs)
    if head.bias is not None:
        raise NotImplementedError(f"{type(model).__name__} scales its logits by {factor}: an output head with a bias "
                                  f"is not supported by the CP losses")
    return _forward_with_head(model, head, lambda hidden: head_fn(hidden * factor) / factor, model_kwargs)


def _forward_past_soft_cap(model: nn.Module, head: nn.Linear, head_fn: Callable[[torch.Tensor], torch.Tensor],
                           model_kwargs: dict):
    """`_forward_with_head` for a causal LM that soft-caps the head's output (RecurrentGemma: cap * tanh(x / cap)
    after the head): head_fn computes the soft-cap itself (its kernels' `softcap`), and its result replaces the
    capped one in the model's output (a forward hook run before FSDP2's, so FSDP2's pre-backward hook is on the
    result as on any output)."""
    held = []

    def keep(hidden: torch.Tensor) -> torch.Tensor:
        held.append(head_fn(hidden))
        return held[-1]

    def swap(module, args, output):
        output.logits = held[-1]
        return output

    handle = model.register_forward_hook(swap, prepend=True)
    try:
        return _forward_with_head(model, head, keep, model_kwargs)
    finally:
        handle.remove()


def _forward_with_head(model: nn.Module, head: nn.Linear, head_fn: Callable[[torch.Tensor], torch.Tensor],
                       model_kwargs: dict):
    """model(**model_kwargs) with `head`'s forward replaced, for this call only, by head_fn(last hidden state): the
    model's own forward (the CP input hook, FSDP2's hooks, activation checkpointing act as usual), inside which
    the head's weight is the unsharded one under FSDP2 (the root module holds it). Returns the model's output,
    head_fn's result in its `logits` field. The head's own forward (a per-instance override included) is put
    back however the call ends."""
    own_forward = head.__dict__.get("forward")
    head.forward = head_fn
    try:
        return model(**model_kwargs)
    finally:
        if own_forward is None:
            del head.forward
        else:
            head.forward = own_forward
