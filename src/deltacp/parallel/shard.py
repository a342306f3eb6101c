"""What one rank's scan covers: its heads (with their conv channels) and the group over which its tokens are one
slice of the row. The 1-D p2p / all_gather modes scan every head of the rank's own
slice; Ulysses scans Hv / P heads of the whole row (no group: the sequence is whole here); the 2-D layout
(`two_d.py`) scans Hv / u heads of its Ulysses group's slice, across the same heads of the other groups. Where the
heads are split, a view whose heads' inputs read every head's channels (Mamba1's x_proj: `LinearMixerView.
reads_every_head`) sums its partial products over the ranks holding the others (`LinearShard.head_sum`).

`scan_inputs` is the start every mode's scan shares: the causal conv (with the halo from the previous piece), the
family's recurrence inputs of these heads (`LinearMixerView.inputs`: its gates) and the recurrence's contract check,
for the local pieces (`placement.Pieces`: one under
the contiguous layout, two under the balanced one) as `PieceInputs`: the backend calls that cover them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltacp.distributed.collectives import all_reduce_autograd
from deltacp.ops.gdn.varlen import VarlenLayout
from deltacp.ops.recurrence import RecurrenceInputs
from deltacp.parallel.conv import conv_parts
from deltacp.parallel.documents import DocumentSegment
from deltacp.parallel.linear_layer import LinearLayerCP
from deltacp.parallel.placement import Pieces


@dataclass
class LinearShard:
    key_heads: int  # key heads scanned here (after any repeat to the value heads)
    v_heads: int
    conv_weight_CK: torch.Tensor | None  # this shard's pre-conv channels' kernels (None: the mixer has no conv)
    conv_bias_C: torch.Tensor | None
    heads: slice  # the module's value heads scanned here
    seq_group: object | None  # the ranks whose slices make the row (halo from the previous one); None: whole here
    head_group: object | None = None  # the ranks holding the row's other heads (Ulysses, 2-D); None: every head here

    @classmethod
    def whole(cls, layer: LinearLayerCP) -> "LinearShard":
        layout = layer.view.layout
        conv = layer.view.conv
        return cls(layout.key_heads, layout.value_heads, layer.conv_weight_CK, None if conv is None else conv.bias,
                   slice(0, layout.value_heads), layer.group)

    def head_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A per-token product over this shard's heads summed over every head of the row (`LinearMixerView.
        reads_every_head`): an all-reduce over the head group (a collective: every rank of it calls this, as
        often), or the product itself where every head is here."""
        if self.head_group is None or dist.get_world_size(self.head_group) == 1:
            return partial
        return all_reduce_autograd(partial, self.head_group)


@dataclass
class PieceInputs:
    """The scan inputs of a rank's pieces as the backend calls see them. Batched (pieces of unpacked rows, and any
    single piece): ONE call over B x slots rows, row b * slots + slot holding slot `slot` of row b (a view of the
    local tokens [B, slots * n], no copy). Not batched (two pieces of a packed row, each with its own documents):
    one call per piece. `calls[c]`: the call's `RecurrenceInputs`, `layouts[c]` its documents (VarlenLayout or None)."""

    calls: list[RecurrenceInputs]
    layouts: list[VarlenLayout | None]
    slots: int
    batched: bool

    def where(self, slot: int) -> tuple[int, slice]:
        """(call, its rows) holding slot `slot`."""
        return (0, slice(slot, None, self.slots)) if self.batched else (slot, slice(None))

    def slots_of(self, call: int) -> list[int]:
        return list(range(self.slots)) if self.batched else [call]

    def per_slot(self, per_call: list) -> list:
        """A per-call tensor ([rows, ...], or None) cut into per-slot views ([B, ...])."""
        out = []
        for slot in range(self.slots):
            c, rows = self.where(slot)
            out.append(None if per_call[c] is None else per_call[c][rows])
        return out

    def to_calls(self, per_slot: list, like: torch.Tensor, shape: tuple[int, ...], dtype) -> list:
        """Per-slot tensors [B, ...] (None: zeros) assembled per call; None for a call whose slots are all None."""
        out = []
        for c in range(len(self.calls)):
            slots = self.slots_of(c)
            if all(per_slot[j] is None for j in slots):
                out.append(None)
            elif len(slots) == 1:
                out.append(per_slot[slots[0]])
            else:
                zero = like.new_zeros(shape, dtype=dtype)
                out.append(torch.stack([zero if per_slot[j] is None else per_slot[j] for j in slots], dim=1)
                           .flatten(0, 1))
        return out

    def join(self, outs: list[torch.Tensor], B: int) -> torch.Tensor:
        """Per-call outputs [rows, n, ...] -> the local tokens [B, slots * n, ...]."""
        if self.batched:
            o = outs[0]
            return o.reshape(B, self.slots * o.shape[1], *o.shape[2:])
        return torch.cat(outs, dim=1)

    def split(self, x: torch.Tensor, pieces: Pieces) -> list[torch.Tensor]:
        """The local tokens [B, slots * n, ...] -> per call [rows, n, ...] (the inverse of `join`)."""
        if self.batched:
            return [x.contiguous().unflatten(1, (self.slots, -1)).flatten(0, 1)]
        return [x[:, pieces.local(slot)].contiguous() for slot in range(self.slots)]


def scan_inputs(layer: LinearLayerCP, shard: LinearShard, pre_BsC: torch.Tensor, extras_BsHX: torch.Tensor,
                pieces: Pieces, docs: list[DocumentSegment | None], padded: bool = False) -> PieceInputs:
    """The recurrence inputs of this shard per backend call (`PieceInputs`), checked against the recurrence's
    contract. Contiguous once here (the Triton backend writes them so; eager's are views of the conv output): the
    backend's saves and the modes' own autograd nodes then share these tensors instead of views keeping the whole
    conv output alive through the backward.

    padded: the last extra is the padding mask (`linear_forward_cp` appends it; 1 valid, 0 padding). The conv output
    of a padded token is zeroed, as transformers' Mamba2 mixers do, so that no padded token writes into a
    recurrent state: every recurrence here writes k vᵀ (scaled) and erases along k, both zero for q = k = v = 0,
    whatever its gates (a zero state decays to zero). The padded tokens' pre-conv values still enter the conv
    windows of the valid tokens after them, as in transformers (they are zero unless an input projection has a
    bias)."""
    batched = pieces.per_member == 1 or all(d is None for d in docs)
    parts = conv_parts(layer, pre_BsC, shard.conv_weight_CK, shard.conv_bias_C, shard.key_heads, pieces, docs,
                       shard.seq_group, batched)
    inputs = PieceInputs([], [d.layout if d is not None else None for d in docs][:1 if batched else None],
                         pieces.per_member, batched)
    for call, part in enumerate(parts):
        if batched:
            extras = extras_BsHX.unflatten(1, (pieces.per_member, -1)).flatten(0, 1)
        else:
            extras = extras_BsHX[:, pieces.local(call)]
        if padded:
            keep = extras[:, :, 0, -1, None, None]  # [rows, n, 1, 1]
            extras = extras[..., :-1]
            part = tuple(p * keep.to(p.dtype) for p in part)
        reads = dict(head_sum=shard.head_sum) if layer.view.reads_every_head else {}
        x = layer.view.inputs(part, extras, shard.heads, layer.backend, **reads).contiguous()
        layer.recurrence.check(x)
        inputs.calls.append(x)
    return inputs
