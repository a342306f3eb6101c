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
from deltacp.models.checkpointing import checkpointing_signature
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
from deltacp.parallel.placement import (
    SEQUENCE_LAYOUTS,
    check_sequence_layout,
    pieces_per_rank,
    rank_pieces,
    to_row_order,
)


BATCH_LAYOUT_KEY = "cp_sequence_layout"
"""The key under which `shard_batch_for_cp` records the sequence layout it cut a batch with; the input hook pops it
and checks it against the model's layout (so a batch cut for the other layout is caught without position ids)."""


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


def _not_in_row_order(sequence_layout: str, detail: str) -> ValueError:
    return ValueError(f"position_ids are not in row order for sequence_layout={sequence_layout!r}: {detail}; the model "
                      f"holds each rank's tokens as sequence_layout={sequence_layout!r}: cut the batch with "
                      f"shard_batch_for_cp(..., model=model) (or sequence_layout={sequence_layout!r})")


def check_row_order(row_positions: torch.Tensor, valid: torch.Tensor | None, sequence_layout: str) -> None:
    """Position ids [B, S] put in row order (as the model's layout places the ranks' tokens) must follow on by one,
    or restart at 0 (a document start): a jump to anything else means the batch was cut with another layout than
    the model's (its tokens would be run in the wrong order, a silent wrong answer). `valid`: the padding mask
    [B, S] in row order (padded tokens may hold any position), or None."""
    pos = row_positions.detach().to("cpu", torch.int64)
    bad = (pos[:, 1:] != pos[:, :-1] + 1) & (pos[:, 1:] != 0)
    if valid is not None:
        ok = valid.detach().to("cpu").bool()
        bad &= ok[:, 1:] & ok[:, :-1]
    if bool(bad.any()):
        b, j = (int(i) for i in bad.nonzero()[0])
        raise _not_in_row_order(sequence_layout, f"row {b} jumps from position {int(pos[b, j])} to "
                                                 f"{int(pos[b, j + 1])} at token {j + 1} of {pos.shape[1]} "
                                                 f"without restarting at 0")


def _check_packed_positions(text_positions: torch.Tensor, docs: PackedDocuments, rank: int, cp: int, s: int,
                            sequence_layout: str) -> None:
    """Per-document position ids given with the packing keywords: they must not be the ones of another layout's
    cut (a batch cut for another layout; positions of any other kind are the caller's own)."""
    row = position_ids_from_cu_seqlens(docs.cu_seqlens)[0]
    given = text_positions.detach().to("cpu", torch.int64)
    if torch.equal(given, row[rank_pieces(sequence_layout, rank, cp, s).row_index()].expand_as(given)):
        return
    for other in SEQUENCE_LAYOUTS:
        if other != sequence_layout and s % pieces_per_rank(other) == 0 and torch.equal(
                given, row[rank_pieces(other, rank, cp, s).row_index()].expand_as(given)):
            raise _not_in_row_order(sequence_layout, f"they are this rank's positions of a batch cut with "
                                                     f"sequence_layout={other!r}")


def make_layer_context_hooks():
    """(deliver, layer hook) for a text model that reads its attention_mask as a 2-D tensor (`Family.
    mask_through_layers`): `deliver(context)` keeps the forward's context (the text model then gets attention_mask
    None), and the layer hook, a forward pre-hook (with kwargs) on each decoder layer, hands it to the layer as its
    attention_mask. The layer's kwargs hold it from there (an activation-checkpoint recompute reuses them)."""
    current = [None]

    def deliver(context: CPForwardContext) -> None:
        current[0] = context

    def layer_hook(module, args, kwargs):
        if current[0] is not None:
            kwargs["attention_mask"] = current[0]
        return args, kwargs

    return deliver, layer_hook


RELAYED_KEYWORDS = PACKING_KEYWORDS + (BATCH_LAYOUT_KEY, "position_ids")


def make_keyword_relay():
    """(head hook, take) for a causal LM whose forward does not hand its extra keywords to the text model
    (`Family.lm_passes_kwargs` False: MambaForCausalLM's forward takes **kwargs and drops them, so the packing
    keywords, the batch's layout and position_ids would never reach the text model, and a packed row would run as
    one document). The head hook, a forward pre-hook (with kwargs) on the causal LM, takes them out of its call
    (`RELAYED_KEYWORDS`); `take()`, called by the text model's CP input hook, hands them back once (those the text
    model was given itself win)."""
    held = [{}]

    def head_hook(module, args, kwargs):
        held[0] = {key: kwargs.pop(key) for key in RELAYED_KEYWORDS if key in kwargs}
        return args, kwargs

    def take() -> dict:
        out, held[0] = held[0], {}
        return out

    return head_hook, take


def make_cp_inputs_hook(group, adapter: ModelAdapter, sequence_layout: str = "contiguous", deliver=None,
                        relay=None):
    """Builds the forward's `CPForwardContext` and hands it to every layer as its attention mask; fills missing
    position ids.

    Documents come from transformers' packing keywords (`cu_seq_lens_q/k`, `max_length_q/k`: GLOBAL offsets
    under CP), or from position ids that restart inside the row; padding masks are local [B, s]. One small
    exchange of what every rank received comes first, so ranks that disagree all raise together; then, only
    where needed, one all-gather of the position ids and / or the padding mask (a few bytes per token), put in
    row order (`sequence_layout`: where each rank's tokens sit in the row, `parallel/placement.py`).

    Position ids given are checked against the layout: gathered in row order they must follow on by one or
    restart at 0 (`check_row_order`), else the batch was cut with another layout (ValueError naming it). That
    check reads only the all-gathered row, the same on every rank, so every rank raises it together without a
    second exchange.

    deliver: None (the context goes in as every layer kind's attention_mask), or `make_layer_context_hooks`'s
    (the text model gets attention_mask None; its layers' pre-hooks hand them the context).
    relay: None, or `make_keyword_relay`'s `take` (the keywords the causal LM's forward would drop).
    """
    check_sequence_layout(sequence_layout)
    balanced = sequence_layout == "balanced"

    def hook(module, args, kwargs):
        if relay is not None:
            for key, value in relay().items():
                kwargs.setdefault(key, value)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        local = input_ids if input_ids is not None else embeds
        B, s = local.shape[:2]
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        S = s * cp
        packing = {key: kwargs.pop(key, None) for key in PACKING_KEYWORDS}
        batch_layout = kwargs.pop(BATCH_LAYOUT_KEY, None)  # the layout shard_batch_for_cp cut the batch with
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        docs, text_positions, pieces = None, None, None
        with LocalChecks() as checks:  # their outcome travels in the exchange below: all ranks raise together
            if local.device.type == "meta":
                raise ValueError("under CP, the model's input is on the meta device (a tensor without data); give "
                                 "every rank its slice of the batch")
            if batch_layout is not None and batch_layout != sequence_layout:
                raise ValueError(f"the batch was cut with sequence_layout={batch_layout!r} (shard_batch_for_cp), but "
                                 f"the model holds each rank's tokens as sequence_layout={sequence_layout!r}: cut it "
                                 f"with shard_batch_for_cp(..., model=model) (or sequence_layout={sequence_layout!r})")
            if B != 1 and any(v is not None for v in packing.values()):
                raise ValueError(f"packed documents (cu_seq_lens_q / cu_seq_lens_k / max_length_q / max_length_k) "
                                 f"need one row (B = 1) under CP, got a batch of {B} rows of {s} tokens on this rank: "
                                 f"pack the rows into one (shard_batch_for_cp does it for one packed row)")
            pieces = rank_pieces(sequence_layout, rank, cp, s)  # balanced: an even s (placement.check_local_length)
            if positions is not None:
                text_positions = adapter.text_positions(positions)
            if text_positions is not None and (text_positions.shape[-1] != s or text_positions.shape[0] not in (1, B)):
                raise ValueError(f"under CP, position_ids must be this rank's [B, s] = {(B, s)} (or [1, s]), got "
                                 f"{tuple(positions.shape)}")
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
            if docs is not None and text_positions is not None:
                _check_packed_positions(text_positions, docs, rank, cp, s, sequence_layout)
        raise_together(group, f"{type(module).__name__} under CP", checks.error, device=local.device,
                       agree=dict(batch=B, local_length=s, padding_mask=mask is not None,
                                  position_ids=positions is not None, text_position_ids=text_positions is not None,
                                  output_router_logits=bool(kwargs.get("output_router_logits")),
                                  sequence_layout_balanced=int(balanced),
                                  activation_checkpointing=checkpointing_signature(adapter.text),
                                  batch_layout=SEQUENCE_LAYOUTS.index(batch_layout)
                                  if batch_layout in SEQUENCE_LAYOUTS else -1,
                                  **fingerprints(packing, ok=checks.error is None)))
        # one all-gather of what needs the whole row (the mask and / or the text positions, stacked), in row order
        row_mask = row_positions = None
        gather_positions = docs is None and text_positions is not None
        if mask is not None or gather_positions:
            parts = ([mask.to(torch.int64)] if mask is not None else []) + (
                [text_positions.to(torch.int64).expand(B, s)] if gather_positions else [])
            row = to_row_order(all_gather_tokens(torch.cat(parts, dim=0), group, cp), 1, cp, balanced)
            row_mask = row[:B] if mask is not None else None
            row_positions = row[-B:] if gather_positions else None
        if row_positions is not None:  # the same row on every rank: every rank raises together
            check_row_order(row_positions, row_mask, sequence_layout)
        # transformers' convention: restarting position ids describe documents only when no padding mask is given
        # (and only text positions do: the mRoPE rows of an image do not follow on by one)
        if row_positions is not None and mask is None:
            cu_pos = cu_seqlens_from_position_ids(row_positions)
            docs = None if cu_pos is None else PackedDocuments.build(cu_pos, S, "position_ids")
        if positions is None:  # the row positions of this rank's tokens (per document, for packed rows)
            index = pieces.row_index()
            positions = (position_ids_from_cu_seqlens(docs.cu_seqlens)[:, index] if docs is not None
                         else index[None]).to(local.device)
            kwargs["position_ids"] = positions.expand(B, s)
        attention = None
        if docs is not None:
            attention = AttentionDocuments.build(docs.cu_seqlens)
        elif row_mask is not None:
            cu_pad = cu_seqlens_from_padding(row_mask)
            attention = None if cu_pad is None else AttentionDocuments.build(cu_pad)
        context = CPForwardContext(padding=mask, documents=docs, attention=attention)
        # every layer kind of the config reads the context (e.g. Qwen4-Exp's "indexed_attention"); RecurrentGemma's
        # text model reads "sliding_attention" whatever its layers
        if deliver is not None:
            deliver(context)
            kwargs["attention_mask"] = None
            return args, kwargs
        kwargs["attention_mask"] = {kind: context for kind in ("linear_attention", "full_attention",
                                                               "sliding_attention",
                                                               *(adapter.text_config.layer_types or ()))}
        return args, kwargs

    return hook
