"""Context parallelism for transformers' GDN hybrid models: the Qwen3.5 family (dense, MoE, multimodal) and
Qwen3-Next, through their model adapters (`models/adapters.py`; the supported classes are listed there).

    model = parallelize_cp(model, cp_mesh, linear_attention_cp_mode="p2p")   # parallelize_qwen3_5_cp: same
    batch = shard_batch_for_cp(input_ids, cp_mesh, attention_mask=mask)    # or cu_seqlens= for packed rows
    logits = model(**{k: v for k, v in batch.items() if k != "target_ids"}, use_cache=False).logits
    loss = cp_cross_entropy(logits, batch["target_ids"], cp_mesh)   # global mean over all tokens

Order of application (one log line each), after validating every rank's configuration together: the GDN
style on every `linear_attn`, the full attention method (Ulysses, KV all-gather or ring; in the 2-D layout
Ulysses inside groups and all-gather or ring across them) on every `self_attn`, on the Triton backend the fused
decoder glue (RMSNorm, residual add + RMSNorm, SwiGLU: `models/fused_decoder.py`), then a pre-hook on the text
model that builds each forward's `CPForwardContext` (documents, padding, checkpoint replay) for every layer, on a
multimodal model a pre-hook that runs the vision tower and forms the mRoPE positions over the whole row
(`models/multimodal.py`), on a causal-LM / conditional-generation wrapper a pre-hook refusing `labels` and
`logits_to_keep` (both would act on one rank's slice) and, for routed experts, a hook making `aux_loss` global
(`models/moe.py`). Experts are per-token work and stay as they are. Parameters are not sharded: compose FSDP2 on
top with `fully_shard_qwen3_5`, or sum gradients over the CP group with
`all_reduce_cp_grads` when parameters are replicated.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deltacp.models.adapters import ModelAdapter, adapter_for
from deltacp.models.moe import make_aux_loss_hook
from deltacp.models.multimodal import make_multimodal_hook
from deltacp.ops.gdn.varlen import check_cu_seqlens
from deltacp.parallel.attention import (
    attention_cp_plan,
    check_attention_module,
    install_kv_cp_attention,
    install_ulysses_attention,
)
from deltacp.parallel.layout import attention_two_d_degree, validate_cp_layout
from deltacp.parallel.documents import (
    PACKING_KEYWORDS,
    AttentionDocuments,
    CPForwardContext,
    PackedDocuments,
    agree_on_inputs,
    all_gather_tokens,
    cu_seqlens_from_padding,
    cu_seqlens_from_position_ids,
    documents_from_keywords,
    position_ids_from_cu_seqlens,
)
from deltacp.parallel.fingerprint import check_same_config_across_ranks
from deltacp.parallel.style import LinearAttentionContextParallel, batch_group_of, batch_mesh_of, cp_group_of

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100


def _text_model(model: nn.Module) -> nn.Module:
    """The text model (decoder layers) of any supported model; NotImplementedError naming an unsupported class."""
    return adapter_for(model).text


def parallelize_cp(model: nn.Module, cp_mesh: DeviceMesh, ulysses_degree: int | None = None,
                   linear_attention_cp_mode: str = "ulysses", linear_attention_gdn_backend: str = "eager",
                   full_attention_cp: str = "ulysses", linear_attention_state_passing: str = "chain") -> nn.Module:
    """Apply CP in place to every layer of a GDN hybrid (any class `models/adapters.py` supports); return the model.

    On each rank, `model(**shard_batch_for_cp(...) without target_ids, use_cache=False).logits` is that rank's
    slice of the single-device logits (per document, for packed rows). `parallelize_qwen3_5_cp` is this function.

    full_attention_cp: 'ulysses' (heads split cp ways: the heads must divide by cp), 'allgather' (KV all-gather,
    no head limit) or 'ring' (KV ring). ulysses_degree: None / cp (1-D layout) or u < cp dividing cp: the 2-D
    layout, Ulysses inside groups of u consecutive ranks, linear_attention_cp_mode (p2p | all_gather) and
    full_attention_cp (allgather | ring) across groups (deltacp.parallel.layout). linear_attention_state_passing: p2p
    state hops as a chain of P - 1 hops ('chain') or a log-depth scan ('scan', deltacp.parallel.scan).
    """
    group = cp_group_of(cp_mesh)
    cp = group.size()
    config = dict(linear_attention_cp_mode=linear_attention_cp_mode,
                  linear_attention_gdn_backend=linear_attention_gdn_backend, cp=cp, ulysses_degree=ulysses_degree,
                  full_attention_cp=full_attention_cp, model=type(model).__name__)
    error = None
    try:  # validate, then exchange: a check failing on some ranks only must not leave the others waiting
        validate_cp_layout(cp, ulysses_degree, linear_attention_cp_mode, full_attention_cp)
        style = LinearAttentionContextParallel(mode=linear_attention_cp_mode, backend=linear_attention_gdn_backend,
                                               ulysses_degree=ulysses_degree,
                                               state_passing=linear_attention_state_passing)
        attention_degree = attention_two_d_degree(cp, ulysses_degree, full_attention_cp)
        adapter = adapter_for(model)
        text = adapter.text
        if getattr(text, "_deltacp_parallelized", False):
            raise ValueError("parallelize_cp: this model is already parallelized; apply CP once, to the "
                             "single-device model")
        layers = adapter.layers()
        config.update(family=adapter.family.name, layer_types=tuple(text.config.layer_types[: len(layers)]),
                      hidden_size=text.config.hidden_size, moe=adapter.moe is not None)
        for i, layer in enumerate(layers):
            linear, full = adapter.linear_attention(layer), adapter.full_attention(layer)
            if linear is not None:
                layer_config = style.check_module(linear, cp)
            elif full is not None:
                layer_config = check_attention_module(full, cp, full_attention_cp, attention_degree)
            else:
                raise NotImplementedError(f"decoder layer {i} of {type(model).__name__} has neither linear_attn nor "
                                          f"self_attn (layer type {text.config.layer_types[i]!r})")
            config.update({f"layer{i}.{key}": value for key, value in layer_config.items()})
    except (ValueError, NotImplementedError, RuntimeError, TypeError) as e:
        error = e
    check_same_config_across_ranks(config, group, "parallelize_cp", error)

    p2p_group = style.p2p_group(cp_mesh)
    n_linear = n_full = 0
    for layer in layers:
        if adapter.linear_attention(layer) is not None:
            style.install(adapter.linear_attention(layer), group, p2p_group)
            n_linear += 1
    logger.info("Applied %s linear attention CP (%s backend) to %d GDN layers", linear_attention_cp_mode,
                linear_attention_gdn_backend, n_linear)
    plan = None
    if full_attention_cp != "ulysses":
        shared = p2p_group if getattr(p2p_group, "ulysses", None) is not None else None
        plan = attention_cp_plan(cp_mesh, full_attention_cp, attention_degree,
                                 shared if attention_degree > 1 else None)
    for layer in layers:
        full = adapter.full_attention(layer)
        if full is not None:
            if plan is None:
                install_ulysses_attention(full, group)
            else:
                install_kv_cp_attention(full, plan)
            n_full += 1
    logger.info("Applied %s CP (Ulysses degree %d) to %d full attention layers", full_attention_cp,
                attention_degree, n_full)
    if linear_attention_gdn_backend == "triton":  # the eager backend keeps transformers' forwards (the reference)
        from deltacp.models.fused_decoder import install_fused_decoder

        install_fused_decoder(model)  # logs its line
    text.register_forward_pre_hook(_make_cp_inputs_hook(group, adapter), with_kwargs=True)
    logger.info("Applied the CP input hook (documents, padding, positions) to %s", type(text).__name__)
    if adapter.multimodal is not None:
        adapter.multimodal.register_forward_pre_hook(make_multimodal_hook(group), with_kwargs=True)
        logger.info("Applied the multimodal CP hook (vision on the whole batch, global mRoPE positions) to %s",
                    type(adapter.multimodal).__name__)
    if adapter.head is not None:
        adapter.head.register_forward_pre_hook(_refuse_local_loss, with_kwargs=True)
        if adapter.moe is not None:
            adapter.head.register_forward_hook(make_aux_loss_hook(adapter.moe.num_experts, adapter.moe.top_k,
                                                                  batch_group_of(cp_mesh)), with_kwargs=True)
            logger.info("Applied the global MoE auxiliary loss hook (%d experts, top %d) to %s",
                        adapter.moe.num_experts, adapter.moe.top_k, type(adapter.head).__name__)
    text._deltacp_parallelized = True
    return model


parallelize_qwen3_5_cp = parallelize_cp


def _refuse_local_loss(module, args, kwargs):
    """The causal-LM head's own loss and logit slicing would act on one rank's slice as if it were the row."""
    if kwargs.get("labels") is not None:
        raise ValueError("labels under CP: the model's own loss would shift targets within each rank's slice; use "
                         "shard_batch_for_cp(...)['target_ids'] with cp_cross_entropy instead")
    keep = kwargs.get("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        raise ValueError(f"logits_to_keep={keep!r} under CP: each rank holds a slice of the row; keep all logits "
                         f"(logits_to_keep=0)")
    return args, kwargs


def _make_cp_inputs_hook(group, adapter: ModelAdapter):
    """Builds the forward's `CPForwardContext` (documents, padding, activation-checkpoint replay) and hands it to
    every layer as its attention mask; fills missing position ids.

    Documents come from transformers' packing keywords (`cu_seq_lens_q/k`, `max_length_q/k`: GLOBAL offsets
    under CP), or from position ids that restart inside the row; padding masks are local [B, s]. One small
    all-gather of what every rank received comes first, so ranks that disagree all raise together; then, only
    where needed, one all-gather of the position ids or the padding mask (a few bytes per token).
    """

    def hook(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        local = input_ids if input_ids is not None else embeds
        B, s = local.shape[:2]
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        S = s * cp
        packing = {key: kwargs.pop(key, None) for key in PACKING_KEYWORDS}
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        docs, error, text_positions = None, None, None
        try:  # local checks first; their outcome travels in the header, so all ranks raise together
            if positions is not None:
                text_positions = adapter.text_positions(positions)
            if isinstance(mask, dict):
                raise ValueError("under CP, attention_mask must be None or the local 2-D padding mask [B, s]; a "
                                 "per-layer-type dict is built by deltacp itself")
            if mask is not None and (mask.ndim != 2 or tuple(mask.shape) != (B, s)):
                raise ValueError(f"under CP, attention_mask must be the local 2-D padding mask [B, s] = {(B, s)}, "
                                 f"got {tuple(mask.shape)}")
            docs = documents_from_keywords(S, **packing)
            if docs is not None and mask is not None:
                raise NotImplementedError("packed documents with a padding mask: pad a packed row with a padding "
                                          "document instead (shard_batch_for_cp's pad_to_multiple_of)")
        except (ValueError, NotImplementedError, TypeError) as e:
            error = e
        agree_on_inputs(group, local.device, [B, s, mask is not None, positions is not None,
                                              text_positions is not None, bool(kwargs.get("output_router_logits"))],
                        packing, error)
        # transformers' convention: restarting position ids describe documents only when no padding mask is given
        # (and only text positions do: the mRoPE rows of an image do not follow on by one)
        if docs is None and text_positions is not None and mask is None:
            cu_pos = cu_seqlens_from_position_ids(all_gather_tokens(text_positions.to(torch.int64), group, cp))
            docs = None if cu_pos is None else PackedDocuments.build(cu_pos, S, "position_ids")
        if positions is None:
            positions = (position_ids_from_cu_seqlens(docs.cu_seqlens)[:, rank * s:(rank + 1) * s].to(local.device)
                         if docs is not None else torch.arange(rank * s, (rank + 1) * s, device=local.device)[None])
            kwargs["position_ids"] = positions.expand(B, s)
        attention = None
        if docs is not None:
            attention = AttentionDocuments.build(docs.cu_seqlens)
        elif mask is not None:
            cu_pad = cu_seqlens_from_padding(all_gather_tokens(mask.to(torch.int64), group, cp))
            attention = None if cu_pad is None else AttentionDocuments.build(cu_pad)
        context = CPForwardContext(padding=mask, documents=docs, attention=attention)
        kwargs["attention_mask"] = {"linear_attention": context, "full_attention": context}
        return args, kwargs

    return hook


def pad_packed_row(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, multiple: int, pad_token_id: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad a packed row [1, S] to a multiple of `multiple` (the CP degree) with one padding document.

    The padding tokens form a document of their own, so no real document reads them or is read by them;
    `shard_batch_for_cp(pad_to_multiple_of=)` calls this and ignores their targets.
    """
    S = input_ids.shape[1]
    extra = (-S) % multiple
    if extra == 0:
        return input_ids, cu_seqlens
    pad = input_ids.new_full((input_ids.shape[0], extra), pad_token_id)
    cu = torch.cat([cu_seqlens.to(torch.int64).cpu(), torch.tensor([S + extra])]).to(cu_seqlens.dtype)
    return torch.cat([input_ids, pad], dim=1), cu


def shard_batch_for_cp(input_ids: torch.Tensor, cp_mesh: DeviceMesh, *, attention_mask: torch.Tensor | None = None,
                       labels: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None, pad_to_multiple_of: int | None = None,
                       pad_token_id: int = 0, mm_token_type_ids: torch.Tensor | None = None
                       ) -> dict[str, torch.Tensor | int | None]:
    """Cut a global batch [B, S] into this rank's contiguous slice: keyword arguments of the CP'd model, plus
    `target_ids` for `cp_cross_entropy`.

    Packed documents (one row, B = 1): give `cu_seqlens` (global offsets [0, ..., S]) or `position_ids` that
    restart at each document (transformers' convention). The result then carries the rank's per-document
    position ids and transformers' packing keywords `cu_seq_lens_q/k`, `max_length_q/k` (global), and no
    target crosses a document boundary. Padded rows (B >= 1): `attention_mask`, left or right padding.

    S must be divisible by the CP degree: `pad_to_multiple_of=cp` appends a padding document of
    `pad_token_id` tokens to a packed row (targets ignored) so that it is.
    Targets are shifted over the whole row before cutting (no rank needs its neighbour's tokens):
    IGNORE_INDEX at each document's last token, and wherever the target token is padding.

    Multimodal batches (images): give the processor's `mm_token_type_ids` [B, S]; the result carries its slice
    and no position_ids (the model's multimodal hook forms the mRoPE positions over the whole row). Pass the
    batch's `pixel_values` and `image_grid_thw` whole to every rank's model call. Not with packed documents.
    """
    group = cp_group_of(cp_mesh)
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    B, S = input_ids.shape
    labels = input_ids if labels is None else labels
    if cu_seqlens is None and position_ids is not None:
        cu_seqlens = cu_seqlens_from_position_ids(position_ids)
        if cu_seqlens is None:  # one document
            cu_seqlens = torch.tensor([0, S])
    if cu_seqlens is not None and pad_to_multiple_of is None and check_cu_seqlens(cu_seqlens, S).numel() == 2:
        cu_seqlens = None  # one document: an unpacked row
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError("shard_batch_for_cp: a packed row (cu_seqlens / position_ids) takes no attention_mask; "
                             "use pad_to_multiple_of to pad it")
        cu = check_cu_seqlens(cu_seqlens, S)
        if B != 1:
            raise ValueError(f"shard_batch_for_cp: packed documents need one row (B = 1), got B = {B}")
        if pad_to_multiple_of:
            real = S
            input_ids, cu = pad_packed_row(input_ids, cu, pad_to_multiple_of, pad_token_id)
            labels = torch.cat([labels, labels.new_full((1, input_ids.shape[1] - real), IGNORE_INDEX)], dim=1)
            S = input_ids.shape[1]
    elif pad_to_multiple_of:
        raise ValueError("shard_batch_for_cp: pad_to_multiple_of pads packed rows (give cu_seqlens or position_ids);"
                         " pad unpacked rows yourself with an attention_mask")
    if mm_token_type_ids is not None and (cu_seqlens is not None or tuple(mm_token_type_ids.shape) != (B, S)):
        raise ValueError(f"shard_batch_for_cp: mm_token_type_ids must be [B, S] = {(B, S)} of an unpacked batch, got "
                         f"{tuple(mm_token_type_ids.shape)}" + (" with packed documents" if cu_seqlens is not None
                                                               else ""))
    if S % cp:
        raise ValueError(f"the global sequence length ({S}) must be divisible by cp ({cp})"
                         + ("; pass pad_to_multiple_of=cp to append a padding document" if cu_seqlens is not None
                            else ""))
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    if attention_mask is not None:
        targets[:, :-1][attention_mask[:, 1:] == 0] = IGNORE_INDEX
    cut = slice(rank * (S // cp), (rank + 1) * (S // cp))
    if mm_token_type_ids is not None:  # positions: the model's multimodal hook forms mRoPE over the whole row
        return dict(input_ids=input_ids[:, cut], mm_token_type_ids=mm_token_type_ids[:, cut],
                    target_ids=targets[:, cut],
                    attention_mask=None if attention_mask is None else attention_mask[:, cut])
    if cu_seqlens is None:
        positions = torch.arange(S, device=input_ids.device).expand(B, S)
        return dict(input_ids=input_ids[:, cut], position_ids=positions[:, cut], target_ids=targets[:, cut],
                    attention_mask=None if attention_mask is None else attention_mask[:, cut])
    targets[:, (cu[1:] - 1).to(targets.device)] = IGNORE_INDEX  # a document's last token predicts nothing
    positions = position_ids_from_cu_seqlens(cu).to(input_ids.device)
    longest = int((cu[1:] - cu[:-1]).max())
    cu_dev = cu.to(device=input_ids.device, dtype=torch.int32)
    return dict(input_ids=input_ids[:, cut], position_ids=positions[:, cut], target_ids=targets[:, cut],
                cu_seq_lens_q=cu_dev, cu_seq_lens_k=cu_dev, max_length_q=longest, max_length_k=longest)


def cp_cross_entropy(logits: torch.Tensor, target_ids: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Mean cross entropy over every valid token of the global batch.

    The value is the global mean on every rank; the gradient is this rank's share only, so gradients
    summed over CP ranks are the single-device gradients (see `fully_shard_qwen3_5` for FSDP).
    It needs the full [tokens, vocab] logits, upcast: at a large vocabulary use `cp_linear_cross_entropy`
    (deltacp.models.loss; the same value and gradients from the hidden states, chunk by chunk).
    """
    from deltacp.models.loss import cp_global_mean  # loss.py imports this module

    # float32 for bf16/fp16/fp32 logits, float64 stays float64 (the precision policy of every deltacp op)
    logits = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))
    local_sum = F.cross_entropy(logits, target_ids.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum")
    return cp_global_mean(local_sum, (target_ids != IGNORE_INDEX).sum(), cp_mesh)


def all_reduce_cp_grads(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Sum replicated parameters' gradients over every rank of the mesh (without FSDP): the CP group, or dp x cp
    for a ("dp", "cp") mesh, whose ranks together hold the global batch the loss averages over."""
    group = batch_group_of(cp_mesh)
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)


def fully_shard_qwen3_5(model: nn.Module, mesh: DeviceMesh, mp_policy=None, reshard_after_forward: bool = True
                        ) -> nn.Module:
    """FSDP2 on each decoder layer, then the root, over every rank of `mesh`: a CP mesh, or a ("dp", "cp") mesh
    flattened to one dimension (parameters sharded over dp x cp, not HSDP).

    FSDP2 would average over its mesh, but each rank's loss (`cp_cross_entropy`) already carries only its share
    of the mean over the global batch (its all-reduce spans the whole mesh, dp x cp: the one place the loss is
    scaled), so the reduction here must be a plain sum. With the divide factor set to 1 the reduced gradient
    is the single-device gradient of the global batch.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = dict(mesh=batch_mesh_of(mesh), reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy if isinstance(mp_policy, MixedPrecisionPolicy) else MixedPrecisionPolicy(
            **mp_policy)
    for layer in _text_model(model).layers:  # any supported class (the vision tower goes with the root)
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            # With factor 1, FSDP2 would reduce float32/bf16 with PREMUL_SUM(1), which gloo lacks; a plain
            # SUM is the same result on every backend.
            module.set_force_sum_reduction_for_comms(True)
    return model
