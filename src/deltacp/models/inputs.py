"""The forward pre-hooks `parallelize_cp` installs: what every CP'd layer needs of one model forward.

- on the text model: `CPForwardContext` (documents, padding, activation-checkpoint replay) handed to every layer
  as its attention mask, position ids filled in where missing;
- on a causal-LM / conditional-generation wrapper: `labels` and `logits_to_keep` refused (both would act on one
  rank's slice as if it were the row).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deltacp.distributed.agree import LocalChecks, raise_together
from deltacp.distributed.collectives import all_gather_tokens
from deltacp.models.adapters import ModelAdapter
from deltacp.parallel.documents import (
    PACKING_KEYWORDS,
    AttentionDocuments,
    CPForwardContext,
    PackedDocuments,
    cu_seqlens_from_padding,
    cu_seqlens_from_position_ids,
    documents_from_keywords,
    fingerprints,
    position_ids_from_cu_seqlens,
)


def refuse_local_loss(module, args, kwargs):
    """The causal-LM head's own loss and logit slicing would act on one rank's slice as if it were the row."""
    if kwargs.get("labels") is not None:
        raise ValueError("labels under CP: the model's own loss would shift targets within each rank's slice; use "
                         "shard_batch_for_cp(...)['target_ids'] with cp_cross_entropy or cp_causal_lm_loss instead")
    keep = kwargs.get("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        raise ValueError(f"logits_to_keep={keep!r} under CP: each rank holds a slice of the row; keep all logits "
                         f"(logits_to_keep=0)")
    return args, kwargs


def _check_row_length(packing: dict, s: int, cp: int) -> None:
    """Offsets that end anywhere but at the row length s x cp: say that the model takes this rank's slice."""
    cu = packing.get("cu_seq_lens_q")
    if cu is None or not isinstance(cu, torch.Tensor) or cu.numel() == 0:
        return
    last = int(cu.reshape(-1)[-1])
    if last != s * cp and last == s and cp > 1:
        raise ValueError(f"cu_seq_lens_q ends at {last}, the number of tokens this rank was given: under CP the model "
                         f"takes this rank's slice of the row ({s} tokens here, so a row of {s} x cp {cp} = {s * cp} "
                         f"tokens) with GLOBAL offsets [0, ..., {s * cp}]; give each rank its slice of the row, as "
                         f"shard_batch_for_cp returns it")


def make_cp_inputs_hook(group, adapter: ModelAdapter, sequence_layout: str = "contiguous"):
    """Builds the forward's `CPForwardContext` and hands it to every layer as its attention mask; fills missing
    position ids.

    Documents come from transformers' packing keywords (`cu_seq_lens_q/k`, `max_length_q/k`: GLOBAL offsets
    under CP), or from position ids that restart inside the row; padding masks are local [B, s]. One small
    exchange of what every rank received comes first, so ranks that disagree all raise together; then, only
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
        docs, text_positions = None, None
        with LocalChecks() as checks:  # their outcome travels in the exchange below: all ranks raise together
            if positions is not None:
                text_positions = adapter.text_positions(positions)
            if isinstance(mask, dict):
                raise ValueError("under CP, attention_mask must be None or the local 2-D padding mask [B, s]; a "
                                 "per-layer-type dict is built by deltacp itself")
            if mask is not None and (mask.ndim != 2 or tuple(mask.shape) != (B, s)):
                raise ValueError(f"under CP, attention_mask must be the local 2-D padding mask [B, s] = {(B, s)}, "
                                 f"got {tuple(mask.shape)}")
            _check_row_length(packing, s, cp)
            docs = documents_from_keywords(S, **packing)
            if docs is not None and mask is not None:
                raise NotImplementedError("packed documents with a padding mask: pad a packed row with a padding "
                                          "document instead (shard_batch_for_cp's pad_to_multiple_of)")
        raise_together(group, f"{type(module).__name__} under CP", checks.error, device=local.device,
                       agree=dict(batch=B, local_length=s, padding_mask=mask is not None,
                                  position_ids=positions is not None, text_position_ids=text_positions is not None,
                                  output_router_logits=bool(kwargs.get("output_router_logits")),
                                  **fingerprints(packing)))
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
