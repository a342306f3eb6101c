"""Context parallelism for transformers' Qwen3.5 hybrid models (`Qwen3_5ForCausalLM`, `Qwen3_5TextModel`).

    model = parallelize_qwen3_5_cp(model, cp_mesh, linear_attention_cp_mode="p2p")
    batch = shard_batch_for_cp(input_ids, cp_mesh, attention_mask=mask)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   attention_mask=batch["attention_mask"], use_cache=False).logits
    loss = cp_cross_entropy(logits, batch["target_ids"], cp_mesh)   # global mean over all tokens

Order of application (one log line each): the GDN style on every `linear_attn`, Ulysses on every
`self_attn`, then a pre-hook on the text model that hands each layer the mask it needs. Parameters are
not sharded: compose FSDP2 on top with `fully_shard_qwen3_5`, or sum gradients over the CP group with
`all_reduce_cp_grads` when parameters are replicated.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deltacp.parallel.attention import check_attention_module, install_ulysses_attention
from deltacp.parallel.fingerprint import check_same_config_across_ranks
from deltacp.parallel.style import LinearAttentionContextParallel, cp_group_of

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100


def _text_model(model: nn.Module) -> nn.Module:
    if type(model).__name__ == "Qwen3_5TextModel":
        return model
    inner = getattr(model, "model", None)
    if inner is not None and type(inner).__name__ == "Qwen3_5TextModel":
        return inner
    raise NotImplementedError(f"parallelize_qwen3_5_cp takes a Qwen3_5ForCausalLM or Qwen3_5TextModel, got "
                              f"{type(model).__name__}")


def _cp_size(cp_mesh: DeviceMesh) -> int:
    return cp_mesh.size() if cp_mesh.ndim == 1 else cp_mesh["cp"].size()


def parallelize_qwen3_5_cp(model: nn.Module, cp_mesh: DeviceMesh, ulysses_degree: int | None = None,
                           linear_attention_cp_mode: str = "ulysses",
                           linear_attention_gdn_backend: str = "eager") -> nn.Module:
    """Apply CP in place to every layer of a Qwen3.5 hybrid by its type; return the model.

    On each rank, `model(input_ids=<rank's contiguous slice>, position_ids=<its global positions>,
    use_cache=False).logits` is that slice of the single-device logits.
    """
    style = LinearAttentionContextParallel(mode=linear_attention_cp_mode, backend=linear_attention_gdn_backend)
    group = cp_group_of(cp_mesh)
    cp = _cp_size(cp_mesh)
    if ulysses_degree is not None and ulysses_degree != cp:
        raise NotImplementedError(f"ulysses_degree={ulysses_degree} is not supported: it must be None or equal to "
                                  f"cp ({cp}); full attention CP is Ulysses over the whole CP mesh")
    text = _text_model(model)
    if getattr(text, "_deltacp_parallelized", False):
        raise ValueError("parallelize_qwen3_5_cp: this model is already parallelized; apply CP once, to the "
                         "single-device model")
    layers = list(text.layers)
    config = dict(linear_attention_cp_mode=linear_attention_cp_mode,
                  linear_attention_gdn_backend=linear_attention_gdn_backend, cp=cp, ulysses_degree=cp,
                  model=type(model).__name__, layer_types=tuple(text.config.layer_types[: len(layers)]),
                  hidden_size=text.config.hidden_size)
    for i, layer in enumerate(layers):
        if hasattr(layer, "linear_attn"):
            layer_config = style.check_module(layer.linear_attn, cp)
        elif hasattr(layer, "self_attn"):
            layer_config = check_attention_module(layer.self_attn, cp)
        else:
            raise NotImplementedError(f"decoder layer {i} has neither linear_attn nor self_attn")
        config.update({f"layer{i}.{key}": value for key, value in layer_config.items()})
    check_same_config_across_ranks(config, group, "parallelize_qwen3_5_cp")

    n_linear = n_full = 0
    for layer in layers:
        if hasattr(layer, "linear_attn"):
            style.install(layer.linear_attn, group)
            n_linear += 1
    logger.info("Applied %s linear attention CP (%s backend) to %d GDN layers", linear_attention_cp_mode,
                linear_attention_gdn_backend, n_linear)
    for layer in layers:
        if hasattr(layer, "self_attn"):
            install_ulysses_attention(layer.self_attn, group)
            n_full += 1
    logger.info("Applied Ulysses CP (degree %d) to %d full attention layers", cp, n_full)
    text.register_forward_pre_hook(_make_cp_inputs_hook(group), with_kwargs=True)
    text._deltacp_parallelized = True
    logger.info("Applied the CP input hook (global positions, per-layer masks) to %s", type(text).__name__)
    return model


def _make_cp_inputs_hook(group):
    """Hands each layer type the mask it needs under CP, and fills missing positions with global ones.

    GDN layers take the local 2-D padding mask; full attention layers take the global 2-D padding mask
    (all-gathered, a few bytes per token) and build the causal mask over the whole sequence themselves.
    """

    def hook(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        local = input_ids if input_ids is not None else embeds
        B, s = local.shape[:2]
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = (torch.arange(s, device=local.device) + rank * s).expand(B, s)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):
            return args, kwargs
        if mask is not None and (mask.ndim != 2 or tuple(mask.shape) != (B, s)):
            raise ValueError(f"under CP, attention_mask must be the local 2-D padding mask [B, s] = {(B, s)}, got "
                             f"{tuple(mask.shape)}")
        if mask is None:
            kwargs["attention_mask"] = {"linear_attention": None, "full_attention": None}
        else:
            local_mask = mask.to(torch.int64)  # gloo gathers no bool tensors
            parts = [torch.empty_like(local_mask) for _ in range(cp)]
            dist.all_gather(parts, local_mask, group=group)
            kwargs["attention_mask"] = {"linear_attention": mask, "full_attention": torch.cat(parts, dim=1)}
        return args, kwargs

    return hook


def shard_batch_for_cp(input_ids: torch.Tensor, cp_mesh: DeviceMesh, *, attention_mask: torch.Tensor | None = None,
                       labels: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
    """Cut a global batch [B, S] into this rank's contiguous slice.

    Returns input_ids, position_ids (global), attention_mask (local padding mask or None) and target_ids:
    the next-token targets, shifted over the whole sequence before cutting (so no rank needs its
    neighbour's tokens), IGNORE_INDEX at the last position and wherever the target token is padding.
    """
    group = cp_group_of(cp_mesh)
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    B, S = input_ids.shape
    if S % cp:
        raise ValueError(f"the global sequence length ({S}) must be divisible by cp ({cp})")
    labels = input_ids if labels is None else labels
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    if attention_mask is not None:
        targets[:, :-1][attention_mask[:, 1:] == 0] = IGNORE_INDEX
    positions = torch.arange(S, device=input_ids.device).expand(B, S)
    cut = slice(rank * (S // cp), (rank + 1) * (S // cp))
    return dict(input_ids=input_ids[:, cut], position_ids=positions[:, cut], target_ids=targets[:, cut],
                attention_mask=None if attention_mask is None else attention_mask[:, cut])


def cp_cross_entropy(logits: torch.Tensor, target_ids: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Mean cross entropy over every valid token of the global batch.

    The value is the global mean on every rank; the gradient is this rank's share only, so gradients
    summed over CP ranks are the single-device gradients (see `fully_shard_qwen3_5` for FSDP).
    """
    group = cp_group_of(cp_mesh)
    local_sum = F.cross_entropy(logits.flatten(0, -2).float(), target_ids.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum")
    stats = torch.stack([local_sum.detach(), (target_ids != IGNORE_INDEX).sum().to(local_sum.dtype)])
    dist.all_reduce(stats, group=group)
    global_sum, count = stats[0], stats[1].clamp(min=1)
    return (local_sum + (global_sum - local_sum.detach())) / count


def all_reduce_cp_grads(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Sum replicated parameters' gradients over the CP group (without FSDP)."""
    group = cp_group_of(cp_mesh)
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)


def fully_shard_qwen3_5(model: nn.Module, mesh: DeviceMesh, mp_policy=None, reshard_after_forward: bool = True
                        ) -> nn.Module:
    """FSDP2 on each decoder layer, then the root, over `mesh` (the CP ranks, or dp x cp flattened).

    Gradient scaling lives here: FSDP2 averages over its mesh, but under CP each rank's loss
    (`cp_cross_entropy`) already carries only its share of the global mean, so the reduction must be a
    plain sum. Setting the divide factor to 1 makes the reduced gradient the single-device gradient.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy if isinstance(mp_policy, MixedPrecisionPolicy) else MixedPrecisionPolicy(
            **mp_policy)
    for layer in _text_model(model).layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            # With factor 1, FSDP2 would reduce float32/bf16 with PREMUL_SUM(1), which gloo lacks; a plain
            # SUM is the same result on every backend.
            module.set_force_sum_reduction_for_comms(True)
    return model
