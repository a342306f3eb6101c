"""Ulysses linear attention CP: all-to-all from sequence shards to head shards, the whole sequence's
conv and recurrence on this rank's heads, and all-to-all back.

Rank p owns value heads [p*Hv/P, (p+1)*Hv/P) and the pre-conv channels they read (`HeadLayout.slice_channels`: their
value channels, and the key channels of their key heads, repeated to the value heads when the key heads do not
divide by P, with the conv kernels of the repeated channels repeated alike, which is exact for a depthwise conv),
plus the per-value-head extras that skip the conv. One index gather packs them per destination rank.

Under sequence_layout='balanced' the all-to-all returns the group's tokens member by member (each member's two
pieces); one block permutation puts them in row order (`placement.to_row_order`) before the conv, and its inverse
puts the outputs back before the return all-to-all.

Shape legend: s local tokens, S = P*s all tokens, P CP degree; *_BsPX packed per destination rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltacp.distributed.collectives import all_to_all_head_to_seq, all_to_all_seq_to_head
from deltacp.parallel.documents import CPForwardContext
from deltacp.parallel.linear_layer import LinearLayerCP, document_segments
from deltacp.parallel.placement import Pieces, from_row_order, to_row_order
from deltacp.parallel.shard import LinearShard, scan_inputs
from deltacp.parallel.views import HeadLayout


def ulysses_head_layout(layout: HeadLayout, cp: int) -> tuple[int, int]:
    """(key heads after any repeat, value heads) per rank, or ValueError naming the setting."""
    if layout.value_heads % cp:
        raise ValueError(f"linear_attention_cp_mode='ulysses' needs {layout.value_setting} ({layout.value_heads}) "
                         f"divisible by the CP degree ({cp}); use linear_attention_cp_mode='p2p' or a CP degree dividing it")
    return layout.split(cp)


@dataclass
class HeadShard:
    """One rank's heads after the Ulysses all-to-all over a group of P ranks: the group's P*s tokens (in row order)
    of its pre-conv channels and extras, and which channels / value heads of the module those are."""

    pre_BSC: torch.Tensor
    extras_BSHX: torch.Tensor
    key_local: int  # key heads here (after any repeat to the value heads)
    v_local: int
    channels: torch.Tensor  # this rank's conv channels, in the module's order
    heads: slice  # this rank's value heads
    group: object  # the Ulysses group: its members hold the other heads of these tokens

    def scan_shard(self, layer: LinearLayerCP, seq_group=None) -> LinearShard:
        """What these heads' scan covers: their conv channels; `seq_group`: None (the group's whole row is here) or
        the groups across which it is one slice (2-D)."""
        weight, bias = layer.conv_weight_CK, None if layer.view.conv is None else layer.view.conv.bias
        return LinearShard(self.key_local, self.v_local, None if weight is None else weight[self.channels],
                           None if bias is None else bias[self.channels], self.heads, seq_group, self.group)


def seq_to_head_shard(layer: LinearLayerCP, pre_BsC: torch.Tensor, extras_BsHX: torch.Tensor, group) -> HeadShard:
    """One all-to-all over `group` (Ulysses degree P): the local tokens, all heads -> the group's tokens, this
    rank's heads, in row order (shared by the 1-D Ulysses mixer and the 2-D layout's groups)."""
    layout = layer.view.layout
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    B, s, _ = pre_BsC.shape
    key_local, v_local = ulysses_head_layout(layout, P)
    key = (P, pre_BsC.device)
    if key not in layer.channels:  # index tensors built once per device: every rank's channels, [P, channels]
        layer.channels[key] = torch.stack([layout.slice_channels(p, P, pre_BsC.device) for p in range(P)])
    channels_PX = layer.channels[key]
    packed_BsPX = torch.cat([pre_BsC[..., channels_PX],
                             extras_BsHX.reshape(B, s, P, v_local * extras_BsHX.shape[-1])], dim=-1)
    full_BSX = to_row_order(all_to_all_seq_to_head(packed_BsPX, group), 1, P, layer.balanced)
    C = channels_PX.shape[1]
    pre_BSC, extras_BSX = torch.split(full_BSX, [C, full_BSX.shape[-1] - C], dim=-1)
    return HeadShard(pre_BSC, extras_BSX.unflatten(-1, (v_local, -1)), key_local, v_local, channels_PX[rank],
                     slice(rank * v_local, (rank + 1) * v_local), group)


def ulysses_mixer(layer: LinearLayerCP, pre_BsC: torch.Tensor, extras_BsHX: torch.Tensor,
                  ctx: CPForwardContext) -> torch.Tensor:
    B, s, _ = pre_BsC.shape
    sh = seq_to_head_shard(layer, pre_BsC, extras_BsHX, layer.group)
    S = sh.pre_BSC.shape[1]
    whole = Pieces(0, 1, False, S)  # the whole row, in row order
    (docs,) = document_segments(ctx, whole)
    (x,) = scan_inputs(layer, sh.scan_shard(layer), sh.pre_BSC, sh.extras_BSHX, whole, [docs],
                       padded=ctx.padding is not None).calls
    o_BSHV, _ = layer.recurrence.forward(x, cu_seqlens=None if docs is None else docs.layout)
    o_BSX = from_row_order(o_BSHV.reshape(B, S, -1), 1, dist.get_world_size(layer.group), layer.balanced)
    o_BsPX = all_to_all_head_to_seq(o_BSX, layer.group)
    return o_BsPX.reshape(B, s, layer.view.layout.value_heads, -1)
