"""2-D linear attention CP (`ulysses_degree` = u < cp): Ulysses inside a group of u consecutive CP ranks,
p2p (or all_gather) across the cp / u groups on the head-sharded state.

Group g holds the contiguous tokens [g L, (g + 1) L), L = u * s, because its ranks are consecutive CP ranks
(sequence_layout='balanced': group pieces g and 2G - 1 - g of the row cut into 2G, `placement.py`, put in row
order after the all-to-all). One all-to-all inside the group gives rank j of it those L tokens for value heads [j Hv/u, (j + 1) Hv/u) (and
the q/k heads they read; repeated to the value heads when the key heads do not divide by u, with their conv
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
from deltacp.parallel.gdn_layer import GDNLayerCP
from deltacp.parallel.placement import from_row_order
from deltacp.parallel.ulysses import seq_to_head_shard


@dataclass
class TwoDGroups:
    """The process groups of one rank in the 2-D layout (besides the CP group)."""

    ulysses: object  # u consecutive CP ranks: the all-to-alls
    across: object  # rank j of every group, in group order: conv halo, all_gather's summary all-gather
    across_p2p: object | None = None  # the same ranks, a communicator for the p2p state hops only


def two_d_mixer(layer: GDNLayerCP, qkv_BsC: torch.Tensor, b_BsH: torch.Tensor, a_BsH: torch.Tensor,
                ctx: CPForwardContext) -> torch.Tensor:
    """Ulysses inside the group, the mode's across-group scan (its registry entry's `across`) on the head shard."""
    m = layer.view
    groups = layer.two_d
    B, s, _ = qkv_BsC.shape
    V, Hv = m.head_v_dim, m.num_v_heads
    sh = seq_to_head_shard(layer, qkv_BsC, b_BsH, a_BsH, groups.ulysses)
    L = sh.qkv_BSC.shape[1]
    o_BLHV = layer.mode.across(layer, sh.scan_shard(layer, groups.across), sh.qkv_BSC, sh.b_BSH, sh.a_BSH, ctx)
    o_BLX = from_row_order(o_BLHV.reshape(B, L, sh.v_local * V), 1, groups.ulysses.size(), layer.balanced)
    o_BsPX = all_to_all_head_to_seq(o_BLX, groups.ulysses)
    return o_BsPX.reshape(B, s, Hv, V)
