"""2-D linear attention CP (`ulysses_degree` = u < cp): Ulysses inside a group of u consecutive CP ranks,
p2p (or all_gather) across the cp / u groups on the head-sharded state.

Group g holds the contiguous tokens [g L, (g + 1) L), L = u * s, because its ranks are consecutive CP ranks
(sequence_layout='balanced': group pieces g and 2G - 1 - g of the row cut into 2G, `placement.py`, put in row
order after the all-to-all). One all-to-all inside the group gives rank j of it those L tokens for value heads [j Hv/u, (j + 1) Hv/u) (and
the key heads they read; repeated to the value heads when the key heads do not divide by u, with their conv
kernels, as in `ulysses.py`). Across groups it is the 1-D algorithm on that head shard: rank j of group g takes
its conv halo from, and its entering state from, rank j of group g - 1 (same heads), over the `across` group
(CP ranks j, j + u, ...). The inverse all-to-all brings the outputs back to the rank's own tokens.

Shape legend: s local tokens, L = u*s the group's tokens, u the Ulysses degree; *_BsPX packed per destination.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltacp.distributed.collectives import all_to_all_head_to_seq
from deltacp.parallel.documents import CPForwardContext
from deltacp.parallel.linear_layer import LinearLayerCP
from deltacp.parallel.placement import from_row_order
from deltacp.parallel.ulysses import seq_to_head_shard


@dataclass
class TwoDGroups:
    """The process groups of one rank in the 2-D layout (besides the CP group)."""

    ulysses: object  # u consecutive CP ranks: the all-to-alls
    across: object  # rank j of every group, in group order: conv halo, all_gather's summary all-gather
    across_p2p: object | None = None  # the same ranks, a communicator for the p2p state hops only


def two_d_mixer(layer: LinearLayerCP, pre_BsC: torch.Tensor, extras_BsHX: torch.Tensor,
                ctx: CPForwardContext) -> torch.Tensor:
    """Ulysses inside the group, the mode's across-group scan (its registry entry's `across`) on the head shard."""
    groups = layer.two_d
    B, s, _ = pre_BsC.shape
    sh = seq_to_head_shard(layer, pre_BsC, extras_BsHX, groups.ulysses)
    L = sh.pre_BSC.shape[1]
    o_BLHV = layer.mode.across(layer, sh.scan_shard(layer, groups.across), sh.pre_BSC, sh.extras_BSHX, ctx)
    o_BLX = from_row_order(o_BLHV.reshape(B, L, -1), 1, groups.ulysses.size(), layer.balanced)
    o_BsPX = all_to_all_head_to_seq(o_BLX, groups.ulysses)
    return o_BsPX.reshape(B, s, layer.view.layout.value_heads, -1)
