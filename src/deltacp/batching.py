"""Cutting a global batch into this rank's slice: `shard_batch_for_cp`, and padding a packed row to a multiple of
the CP degree.

One description of a packed row travels from here to the kernels: the global offsets `cu_seqlens` (validated once
here), carried in transformers' packing keywords `cu_seq_lens_q/k` to the model, whose input hook builds the
row's `PackedDocuments` from them (validating the model's input once), from which every layer derives its views
(`DocumentSegment` and its `VarlenLayout` for GDN, `AttentionDocuments` for full attention).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deltacp.distributed.agree import LocalChecks, raise_together
from deltacp.distributed.collectives import all_gather_seq_replicated
from deltacp.distributed.mesh import cp_group_of
from deltacp.losses import IGNORE_INDEX
from deltacp.ops.gdn.varlen import check_cu_seqlens
from deltacp.parallel.documents import cu_seqlens_from_position_ids, fingerprints, position_ids_from_cu_seqlens
from deltacp.models.inputs import BATCH_LAYOUT_KEY
from deltacp.models.parallelize import row_cut_of
from deltacp.parallel.placement import RowCut, check_sequence_layout, rank_pieces, to_row_order


def pad_packed_row(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, multiple: int, pad_token_id: int = 0, *,
                   min_length: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad a packed row [1, S] with one padding document to the shortest length that is a multiple of `multiple`
    (the CP degree; 2 x cp under sequence_layout='balanced') and at least max(S, `min_length`) (the shortest row
    a model's `RowCut` admits).

    The padding tokens form a document of their own, so no real document reads them or is read by them;
    `shard_batch_for_cp(pad_to_multiple_of=)` calls this and ignores their targets.
    """
    S = input_ids.shape[1]
    length = -(-max(S, min_length) // multiple) * multiple
    extra = length - S
    if extra == 0:
        return input_ids, cu_seqlens
    pad = input_ids.new_full((input_ids.shape[0], extra), pad_token_id)
    cu = torch.cat([cu_seqlens.to(torch.int64).cpu(), torch.tensor([length])]).to(cu_seqlens.dtype)
    return torch.cat([input_ids, pad], dim=1), cu


def batch_row_cut(sequence_layout: str | None, model: nn.Module | None, what: str = "shard_batch_for_cp") -> RowCut:
    """The RowCut a batch is cut by: the model's (`row_cut_of`; `sequence_layout`, if given too, must equal its
    layout), else `sequence_layout`'s (default 'contiguous') with no minimum piece length."""
    if model is None:
        return RowCut(check_sequence_layout("contiguous" if sequence_layout is None else sequence_layout,
                                            f"{what}: "))
    cut = row_cut_of(model)
    if cut is None:
        raise ValueError(f"{what}: model= must be a model parallelize_cp was applied to ({type(model).__name__} is "
                         f"not): apply parallelize_cp(model, mesh, ...) first, or load it with deltacp.load_pretrained")
    if sequence_layout is not None and sequence_layout != cut.sequence_layout:
        raise ValueError(f"{what}: sequence_layout={sequence_layout!r}, but the model was parallelized with "
                         f"sequence_layout={cut.sequence_layout!r}; leave sequence_layout out (model= gives it)")
    return cut


def _packed_offsets(S: int, cu_seqlens, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, position_ids
                    ) -> torch.Tensor | None:
    """The row's global document offsets (int64, CPU, validated once) from whichever description was given; None
    for an unpacked row (no description, or one document)."""
    if cu_seqlens is not None and cu_seq_lens_q is not None:
        raise ValueError("shard_batch_for_cp: give the document offsets once, as cu_seqlens or as cu_seq_lens_q "
                         "(transformers' packing keyword), not both")
    name = "cu_seq_lens_q" if cu_seq_lens_q is not None else "cu_seqlens"
    given = cu_seqlens if cu_seqlens is not None else cu_seq_lens_q
    if given is None and any(v is not None for v in (cu_seq_lens_k, max_length_q, max_length_k)):
        raise ValueError("shard_batch_for_cp: cu_seq_lens_k / max_length_q / max_length_k given without "
                         "cu_seq_lens_q (the document offsets)")
    if given is None and position_ids is not None:
        given, name = cu_seqlens_from_position_ids(position_ids), "position_ids"
        if given is None:  # one document
            given = torch.tensor([0, S])
    if given is None:
        return None
    cu = check_cu_seqlens(given, S, f"shard_batch_for_cp: {name} (global offsets of the whole row)")
    if position_ids is not None and name != "position_ids" and not torch.equal(
            position_ids.detach().to("cpu", torch.int64).reshape(1, -1), position_ids_from_cu_seqlens(cu)):
        raise ValueError(f"shard_batch_for_cp: position_ids disagree with {name} (with documents they must count 0, 1, "
                         f"2, ... within each document)")
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k.detach().to("cpu", torch.int64), cu):
        raise ValueError("shard_batch_for_cp: cu_seq_lens_k must equal cu_seq_lens_q (causal self-attention)")
    longest = int((cu[1:] - cu[:-1]).max())
    for key, value in (("max_length_q", max_length_q), ("max_length_k", max_length_k)):
        if value is not None and int(value) != longest:
            raise ValueError(f"shard_batch_for_cp: {key}={int(value)} is not the longest document ({longest})")
    return cu


def shard_batch_for_cp(input_ids: torch.Tensor, cp_mesh: DeviceMesh, *, attention_mask: torch.Tensor | None = None,
                       labels: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None, pad_to_multiple_of: int | None = None,
                       pad_token_id: int = 0, mm_token_type_ids: torch.Tensor | None = None,
                       cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                       max_length_q: int | None = None, max_length_k: int | None = None,
                       sequence_layout: str | None = None, model: nn.Module | None = None
                       ) -> dict[str, torch.Tensor | int | str | None]:
    """Cut a global batch [B, S] into this rank's slice: keyword arguments of the CP'd model, plus `target_ids` for
    the CP losses (`cp_causal_lm_loss`, `cp_cross_entropy`).

    model: the CP'd model the batch is for (recommended): the batch is cut by its `RowCut` (`row_cut_of(model)`):
    its sequence layout, and its shortest piece (the conv halo of p2p / all_gather GDN layers), up to which
    `pad_to_multiple_of` also pads. Or `sequence_layout` alone (default 'contiguous'; with model= it must equal
    the model's): 'contiguous': rank r gets row positions [r s, (r + 1) s); 'balanced': pieces r and 2 cp - 1 - r
    of the row cut into 2 cp equal pieces, concatenated in that order (`parallel/placement.py`). Every per-token
    field is cut the same way; the packing keywords stay GLOBAL offsets of the whole row. The result carries
    `cp_sequence_layout`, which the model's input hook checks against its own layout (a batch cut for the other
    layout raises on every rank, with or without position ids).

    Packed documents (one row, B = 1): give `cu_seqlens` (global offsets [0, ..., S]), or transformers' packing
    keywords `cu_seq_lens_q/k`, `max_length_q/k` (as `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`
    returns them, so `shard_batch_for_cp(**collator_batch, cp_mesh=mesh)` works), or `position_ids` that restart at
    each document (transformers' convention). The result then carries the rank's per-document position ids and the
    packing keywords `cu_seq_lens_q/k`, `max_length_q/k` (global), and no target crosses a document boundary.
    Padded rows (B >= 1): `attention_mask`, left or right padding.

    S must be divisible by the CP degree (by 2 x cp under 'balanced'): `pad_to_multiple_of=cp` (`2 * cp` under
    'balanced', which takes only multiples of 2 x cp) appends a padding document of `pad_token_id` tokens to a
    packed row (targets ignored) so that it is, and so that every piece holds at least the model's shortest
    piece (model=). Targets are shifted over the whole row before cutting (no rank
    needs its neighbour's tokens, even where a piece's last token targets the first token of a piece held by
    another rank): IGNORE_INDEX at each document's last token, and wherever the target token is padding.

    Multimodal batches (images): give the processor's `mm_token_type_ids` [B, S]; the result carries its slice
    and no position_ids (the model's multimodal hook forms the mRoPE positions over the whole row). Pass the
    batch's `pixel_values` and `image_grid_thw` whole to every rank's model call. Not with packed documents.

    Every rank of the CP group must pass the same batch (ids, labels, masks, positions, offsets): one small
    exchange checks it (and the outcome of every check here), so that all ranks raise together, naming what
    differs.
    """
    group = cp_group_of(cp_mesh)
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    B, S = input_ids.shape
    layout_given = sequence_layout
    given = dict(input_ids=input_ids, labels=labels, attention_mask=attention_mask, position_ids=position_ids,
                 mm_token_type_ids=mm_token_type_ids, cu_seqlens=cu_seqlens, cu_seq_lens_q=cu_seq_lens_q,
                 cu_seq_lens_k=cu_seq_lens_k)
    labels = input_ids if labels is None else labels
    cu, sequence_layout, padded = None, "contiguous", S
    with LocalChecks() as checks:
        for name, value in given.items():
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                raise ValueError(f"shard_batch_for_cp: {name} is on the meta device (a tensor without data); give "
                                 f"every rank the batch's values")
        row_cut = batch_row_cut(layout_given, model)
        sequence_layout = row_cut.sequence_layout
        pieces = row_cut.pieces(cp)  # the row is cut into this many equal pieces
        cu = _packed_offsets(S, cu_seqlens, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, position_ids)
        if cu is not None and cu.numel() == 2 and not pad_to_multiple_of:
            cu = None  # one document: an unpacked row
        if cu is not None:
            if attention_mask is not None:
                raise ValueError("shard_batch_for_cp: a packed row (cu_seqlens / cu_seq_lens_q / position_ids) takes "
                                 "no attention_mask; use pad_to_multiple_of to pad it")
            if B != 1:
                raise ValueError(f"shard_batch_for_cp: packed documents need one row (B = 1), got B = {B}")
        elif pad_to_multiple_of:
            raise ValueError("shard_batch_for_cp: pad_to_multiple_of pads packed rows (give cu_seqlens, cu_seq_lens_q "
                             "or position_ids); pad unpacked rows yourself with an attention_mask")
        if pad_to_multiple_of and pieces != cp and pad_to_multiple_of % pieces:  # balanced
            raise ValueError(f"shard_batch_for_cp: sequence_layout={sequence_layout!r} cuts the row into 2 x cp = "
                             f"{pieces} equal pieces; pad_to_multiple_of={pad_to_multiple_of} is not a multiple of "
                             f"{pieces}: pass pad_to_multiple_of=2*cp ({pieces})")
        if mm_token_type_ids is not None and (cu is not None or tuple(mm_token_type_ids.shape) != (B, S)):
            raise ValueError(f"shard_batch_for_cp: mm_token_type_ids must be [B, S] = {(B, S)} of an unpacked batch, "
                             f"got {tuple(mm_token_type_ids.shape)}" + (" with packed documents" if cu is not None
                                                                       else ""))
        if cu is not None and pad_to_multiple_of:
            padded = row_cut.padded_length(S, cp, pad_to_multiple_of)
        if padded % pieces and pieces == cp:
            raise ValueError(f"shard_batch_for_cp: the global sequence length ({S}) must be divisible by cp ({cp})"
                             + ("; pass pad_to_multiple_of=cp to append a padding document" if cu is not None
                                else "; pad the rows (with an attention_mask) to a multiple of cp"))
        if padded % pieces:
            raise ValueError(f"shard_batch_for_cp: sequence_layout={sequence_layout!r} cuts the row into 2 x cp = "
                             f"{pieces} equal pieces: the global sequence length ({S}) must be divisible by {pieces}"
                             + (f"; pass pad_to_multiple_of=2*cp ({pieces}) to append a padding document"
                                if cu is not None else f"; pad the rows (with an attention_mask) to a multiple of "
                                                       f"2 x cp ({pieces})"))
        if padded < row_cut.min_row_length(cp):
            raise ValueError(f"shard_batch_for_cp: the model's layers read the previous piece's last "
                             f"{row_cut.min_piece_length} tokens (a conv halo), so every one of the {pieces} pieces of "
                             f"the row needs at least {row_cut.min_piece_length}: a row of {S} tokens is shorter than "
                             f"{row_cut.min_row_length(cp)}; "
                             + ("pass pad_to_multiple_of to append a padding document" if cu is not None else
                                "pad the rows (with an attention_mask) to at least that length, or pack them "
                                "(cu_seqlens / position_ids) with pad_to_multiple_of"))
    ok = checks.error is None
    raise_together(group, "shard_batch_for_cp", checks.error, device=input_ids.device,
                   agree=dict(rows=B, length=S, pad_to_multiple_of=pad_to_multiple_of or 0,
                              sequence_layout_balanced=int(sequence_layout == "balanced"),
                              min_piece_length=row_cut.min_piece_length if ok else 0,
                              **fingerprints(dict(input_ids=input_ids, labels=given["labels"],
                                                   attention_mask=attention_mask, position_ids=position_ids,
                                                   mm_token_type_ids=mm_token_type_ids, document_offsets=cu), ok)))
    if cu is not None and padded != S:
        input_ids, cu = pad_packed_row(input_ids, cu, pad_to_multiple_of, pad_token_id,
                                       min_length=row_cut.min_row_length(cp))
        labels = torch.cat([labels, labels.new_full((1, input_ids.shape[1] - S), IGNORE_INDEX)], dim=1)
        S = input_ids.shape[1]
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    if attention_mask is not None:
        targets[:, :-1][attention_mask[:, 1:] == 0] = IGNORE_INDEX
    spans = rank_pieces(sequence_layout, rank, cp, S // cp).spans()

    def cut(x: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's tokens of a per-token field [B, S], in local order (contiguous: a view)."""
        if x is None:
            return None
        parts = [x[:, lo:hi] for lo, hi in spans]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    if mm_token_type_ids is not None:  # positions: the model's multimodal hook forms mRoPE over the whole row
        return dict(input_ids=cut(input_ids), mm_token_type_ids=cut(mm_token_type_ids), target_ids=cut(targets),
                    attention_mask=cut(attention_mask), **{BATCH_LAYOUT_KEY: sequence_layout})
    if cu is None:
        positions = torch.arange(S, device=input_ids.device).expand(B, S)
        return dict(input_ids=cut(input_ids), position_ids=cut(positions), target_ids=cut(targets),
                    attention_mask=cut(attention_mask), **{BATCH_LAYOUT_KEY: sequence_layout})
    targets[:, (cu[1:] - 1).to(targets.device)] = IGNORE_INDEX  # a document's last token predicts nothing
    positions = position_ids_from_cu_seqlens(cu).to(input_ids.device)
    longest = int((cu[1:] - cu[:-1]).max())
    cu_dev = cu.to(device=input_ids.device, dtype=torch.int32)
    return dict(input_ids=cut(input_ids), position_ids=cut(positions), target_ids=cut(targets),
                cu_seq_lens_q=cu_dev, cu_seq_lens_k=cu_dev, max_length_q=longest, max_length_k=longest,
                **{BATCH_LAYOUT_KEY: sequence_layout})



def gather_cp_rows(x_Bs: torch.Tensor, cp_mesh: DeviceMesh, sequence_layout: str = "contiguous") -> torch.Tensor:
    """The inverse of the cut, for per-token values: this rank's [B, s] (in its local order, as `shard_batch_for_cp`
    cut the rows with `sequence_layout`) -> the whole rows [B, S] in row order, on every rank of the CP group.

    For a loss that every rank then computes identically on the whole rows (e.g. TRL's RL losses on per-token
    log-probabilities): the backward hands each rank the gradient of its own slice only (no communication), so the
    parameter gradients summed over the CP ranks are the loss's gradient, as with a loss of each rank's own tokens.
    """
    group = cp_group_of(cp_mesh)
    cp = dist.get_world_size(group)
    rows = all_gather_seq_replicated(x_Bs, 1, group)  # member-major: every rank's local tokens in rank order
    return to_row_order(rows, 1, cp, check_sequence_layout(sequence_layout) == "balanced")
