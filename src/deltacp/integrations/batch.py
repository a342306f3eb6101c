"""A collator's batch (transformers / TRL conventions) -> this rank's CP slice, through `deltacp.shard_batch_for_cp`.

    batch = collator(examples)                        # every CP rank of a dp group collates the same examples
    cp_batch = shard_collated_batch(batch, mesh)      # this rank's model keyword arguments + target_ids

Two layouts, as the collators make them:

- padded rows [B, S] (`attention_mask`; right padding, or none): columns are appended to a multiple of the CP
  degree (2 x cp under sequence_layout='balanced'; padding: mask 0, label -100), which changes nothing the model
  computes on the valid tokens;
- packed rows [1, S] (`padding_free`): documents given by `cu_seq_lens_q/k` and / or `position_ids` that restart
  at 0 at each document (TRL's padding-free collator, transformers' DataCollatorWithFlattening); a padding
  document is appended to a multiple of the CP degree (2 x cp under sequence_layout='balanced').

Either way the row is padded to at least the model's shortest row (p2p / all_gather GDN layers read the previous
piece's conv halo: at least that many tokens per piece). The batch is cut by the model's `RowCut` (its sequence
layout and shortest piece, `deltacp.row_cut_of(model)`; the CP trainer passes the model).

RL rows (TRL's GRPOTrainer: prompt left-padded, completion right-padded) become either kind by `completion_rows`, and
`completion_values` takes the per-token values of a whole row back to TRL's [B, completion] layout.

The targets are the labels shifted by one over the whole row (deltacp's rule): a label is learned where its token's
predecessor is in the same document (packed) or valid (padded). Every key is checked and used or refused by name;
a batch whose labels would make the single-device model learn something deltacp does not (a target across a
document boundary, a target at a padded position) is refused, never silently changed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.device_mesh import DeviceMesh

from deltacp.distributed.mesh import cp_group_of
from deltacp.batching import batch_row_cut, shard_batch_for_cp
from deltacp.losses import IGNORE_INDEX
from deltacp.parallel.placement import RowCut

PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", *PACKING_KEYS)


class CPBatch(dict):
    """This rank's slice of a collated batch: the CP'd model's keyword arguments plus `target_ids` (a dict; the type
    marks a batch already cut, so that it is not cut twice)."""


def cp_degree(mesh: DeviceMesh) -> int:
    """The size of the mesh's CP dimension (a 1-D ("cp",) mesh or a ("dp", "cp") mesh)."""
    return cp_group_of(mesh).size()


def _scalar(value) -> int:
    return int(value.reshape(-1)[0]) if isinstance(value, torch.Tensor) else int(value)


def _restarts(positions: torch.Tensor) -> bool:
    """Whether position ids [B, S] are anything but 0..S-1 on every row."""
    expected = torch.arange(positions.shape[-1], device=positions.device).expand_as(positions)
    return not torch.equal(positions, expected)


def _check_packed_labels(batch: Mapping, labels: torch.Tensor, cu: torch.Tensor | None) -> None:
    """What a padding-free collator must have done for the single-device loss to equal deltacp's: no label at a
    document start (it would be learned across the boundary) and seq_idx, if given, naming the same documents."""
    S = labels.shape[1]
    cu = torch.tensor([0, S]) if cu is None else cu.detach().to("cpu", torch.int64)
    starts = cu[(cu > 0) & (cu < S)].to(labels.device)
    if bool((labels[0, starts] != IGNORE_INDEX).any()):
        raise ValueError("deltacp: a packed row's label at a document start is not -100: the single-device model "
                         "would learn it from the previous document's last token, and deltacp never trains a target "
                         "across a document boundary; set labels to -100 at each document's first token (TRL's and "
                         "transformers' padding-free collators do)")
    if batch.get("seq_idx") is not None:
        real = cu[cu <= S]
        expected = torch.repeat_interleave(torch.arange(real.numel() - 1), real[1:] - real[:-1])
        if not torch.equal(batch["seq_idx"].reshape(-1).cpu().to(torch.int64), expected):
            raise ValueError("deltacp: seq_idx disagrees with the documents of cu_seq_lens_q / position_ids")


def _padded(batch: Mapping, input_ids: torch.Tensor, labels: torch.Tensor, length: int, multiple: int,
            pad_token_id: int, what: str):
    """(input_ids, attention_mask, labels) of padded rows, columns appended up to `length` (a multiple of
    `multiple`, which `what` names: cp, or 2 x cp under sequence_layout='balanced'; at least the model's shortest
    row)."""
    mask, positions = batch.get("attention_mask"), batch.get("position_ids")
    B, S = input_ids.shape
    if mask is not None and tuple(mask.shape) != (B, S):
        raise ValueError(f"deltacp: attention_mask must be [B, S] = {(B, S)}, got {tuple(mask.shape)}")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    if positions is not None:
        expected = torch.arange(S, device=positions.device).expand(B, S)
        if tuple(positions.shape) != (B, S) or not torch.equal(positions[valid], expected[valid]):
            raise ValueError("deltacp: position_ids of padded rows must be 0, 1, ..., S - 1 on the valid tokens (what "
                             "the model uses without them); packed documents come without an attention_mask")
    if bool((labels[~valid] != IGNORE_INDEX).any()):
        raise ValueError("deltacp: a label at a padded position (attention_mask 0) is not -100: the single-device "
                         "model would learn it, deltacp ignores targets at padding; set those labels to -100")
    extra = length - S
    if extra == 0:
        return input_ids, mask, labels
    if bool((~valid[:, 0] & valid[:, -1]).any()):
        why = (f"a multiple of {what}={multiple}" if length == -(-S // multiple) * multiple else
               f"the shortest row the model's pieces allow, each holding its conv halo, rounded to {what}={multiple}")
        raise ValueError(f"deltacp: left-padded rows of length {S} need {length} columns ({why}): deltacp pads on the "
                         f"right, which would leave holes in the mask; pad them to {length} in the collator or pad on "
                         f"the right")
    mask = valid.to(input_ids.dtype) if mask is None else mask
    return (torch.cat([input_ids, input_ids.new_full((B, extra), pad_token_id)], dim=1),
            torch.cat([mask, mask.new_zeros((B, extra))], dim=1),
            torch.cat([labels, labels.new_full((B, extra), IGNORE_INDEX)], dim=1))


def shard_collated_batch(batch: Mapping, mesh: DeviceMesh, *, pad_token_id: int = 0,
                         sequence_layout: str | None = None, model: torch.nn.Module | None = None) -> CPBatch:
    """Cut a collated batch (the whole batch of this rank's dp group) into this rank's CP slice: the CP'd model's
    keyword arguments plus `target_ids` (see the module docstring). `pad_token_id` fills appended columns (their
    targets are ignored); `model`: the CP'd model (its sequence layout and shortest piece, `row_cut_of`: rows are
    padded up to it), or `sequence_layout` alone (as `shard_batch_for_cp`). Raises ValueError naming any key or
    value it cannot honour."""
    row_cut = batch_row_cut(sequence_layout, model, "deltacp")
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        raise ValueError(f"deltacp: batch keys {unknown} are not supported under CP (supported: {list(BATCH_KEYS)})")
    input_ids, labels = batch.get("input_ids"), batch.get("labels")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ValueError("deltacp: the batch needs input_ids [B, S]")
    if not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape:
        raise ValueError(f"deltacp: the batch needs labels of the shape of input_ids {tuple(input_ids.shape)} (-100 "
                         f"where nothing is learned), got "
                         f"{None if not isinstance(labels, torch.Tensor) else tuple(labels.shape)}")
    cp = cp_degree(mesh)
    multiple = row_cut.pieces(cp)  # the row's pieces: every rank holds equal ones
    what = "cp" if multiple == cp else f"2 x cp (sequence_layout={row_cut.sequence_layout!r})"
    cut = dict(model=model) if model is not None else dict(sequence_layout=row_cut.sequence_layout)
    positions = batch.get("position_ids")
    packed = any(batch.get(k) is not None for k in PACKING_KEYS) or (
        positions is not None and batch.get("attention_mask") is None and _restarts(positions))
    if packed:
        if batch.get("attention_mask") is not None:
            raise ValueError("deltacp: a packed row (cu_seq_lens_* / restarting position_ids) takes no attention_mask; "
                             "padding-free collators leave it out")
        keywords = {k: batch.get(k) for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
        keywords = {k: v if k.startswith("cu") or v is None else _scalar(v) for k, v in keywords.items()}
        out = shard_batch_for_cp(input_ids, mesh, labels=labels, position_ids=positions, pad_to_multiple_of=multiple,
                                 pad_token_id=pad_token_id, **cut, **keywords)
        _check_packed_labels(batch, labels, out.get("cu_seq_lens_q"))
    else:
        length = row_cut.padded_length(input_ids.shape[1], cp, multiple)
        input_ids, mask, labels = _padded(batch, input_ids, labels, length, multiple, pad_token_id, what)
        out = shard_batch_for_cp(input_ids, mesh, attention_mask=mask, labels=labels, **cut)
    return CPBatch({k: v for k, v in out.items() if v is not None})


def completion_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, *,
                    padding_free: bool, row_cut: RowCut | None = None, cp: int = 1,
                    pad_token_id: int = 0) -> tuple[dict, torch.Tensor | None]:
    """RL rows [B, L] (TRL's: a left-padded prompt, then the completion in the last `logits_to_keep` = k columns,
    right-padded; `attention_mask` 1 on the valid tokens, one contiguous run per row) -> (a collated batch for
    `shard_collated_batch`, index for `completion_values`).

    The labels are TRL's: each valid token of the completion columns, -100 elsewhere (so the log-probability of
    completion column c is read at the position before it, c - 1). padding_free=False: the padded rows, columns
    appended (mask 0, label -100) up to the length `row_cut` (the model's, `batch_row_cut`; default contiguous, no
    minimum) admits over `cp` ranks: a multiple of its pieces, at least its shortest row; and index None.
    padding_free=True: one packed row, every row's valid tokens back to back as a document (position
    ids restarting at 0, `cu_seq_lens_q/k`, `max_length_q/k`; no padding computed), and index [B, k]: the packed
    position whose target is completion column i of row b, -1 where there is none (a padded or masked completion
    token, where TRL's value is 0; or a completion token opening its row, which has no predecessor).
    """
    B, L = input_ids.shape
    k = int(logits_to_keep)
    if tuple(attention_mask.shape) != (B, L) or not 0 < k < L:
        raise ValueError(f"completion_rows: rows [B, L] = {(B, L)} with attention_mask of that shape and 0 < "
                         f"logits_to_keep < L, got attention_mask {tuple(attention_mask.shape)}, logits_to_keep {k}")
    valid = attention_mask.bool()
    labels = input_ids.masked_fill(~valid, IGNORE_INDEX)
    labels[:, :-k] = IGNORE_INDEX
    if not padding_free:
        row_cut = row_cut or RowCut()
        extra = row_cut.padded_length(L, cp, row_cut.pieces(cp)) - L
        if extra:
            input_ids = torch.cat([input_ids, input_ids.new_full((B, extra), pad_token_id)], dim=1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_zeros((B, extra))], dim=1)
            labels = torch.cat([labels, labels.new_full((B, extra), IGNORE_INDEX)], dim=1)
        return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels), None
    lengths = valid.sum(1)
    first = valid.to(torch.int64).argmax(1)
    last = L - 1 - valid.flip(1).to(torch.int64).argmax(1)
    if bool(((lengths > 0) & (last - first + 1 != lengths)).any()):
        raise ValueError("completion_rows: an attention_mask row has padding between valid tokens (RL rows are a "
                         "left-padded prompt and a right-padded completion)")
    offsets = torch.cumsum(lengths, 0) - lengths  # each row's first packed position
    cu = torch.cat([offsets[lengths > 0], lengths.sum().reshape(1)]).to(torch.int32)
    packed_labels = labels[valid][None].clone()
    packed_labels[0, cu[:-1].long()] = IGNORE_INDEX  # a document's first token has no predecessor
    positions = (torch.arange(int(lengths.sum()), device=input_ids.device)
                 - torch.repeat_interleave(offsets[lengths > 0], lengths[lengths > 0]))[None]
    before = torch.arange(L - k - 1, L - 1, device=input_ids.device)[None]  # the position predicting each column
    has = (labels[:, -k:] != IGNORE_INDEX) & (before >= first[:, None])
    index = torch.where(has, offsets[:, None] + before - first[:, None], -1)
    longest = int(lengths.max())
    batch = dict(input_ids=input_ids[valid][None], labels=packed_labels, position_ids=positions,
                 cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return batch, index


def completion_values(x_BS: torch.Tensor, index: torch.Tensor | None, length: int, logits_to_keep: int
                      ) -> torch.Tensor:
    """Per-token values of whole rows in row order (x_BS[b, j]: the value for the target at j + 1, e.g. gathered
    from every CP rank) -> TRL's [B, logits_to_keep] completion layout, from `completion_rows`' index and the rows'
    length L (0 where index is -1). Differentiable."""
    k = int(logits_to_keep)
    if index is None:
        return x_BS[:, length - k - 1:length - 1]
    return torch.where(index >= 0, x_BS[0][index.clamp(min=0)], x_BS.new_zeros(()))
