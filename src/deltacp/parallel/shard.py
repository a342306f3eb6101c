"""What one rank's GDN scan covers: its heads (with their conv channels and gate parameters) and where its
tokens' conv halo comes from. The 1-D modes scan every head of the rank's own slice; the 2-D layout
(`two_d.py`) scans Hv / u heads of its Ulysses group's slice, the halo coming from the same heads of the
previous group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltacp.parallel.gdn_layer import GDNLayerCP


@dataclass
class GDNShard:
    qk_heads: int  # q/k heads scanned here (after any repeat to the value heads)
    v_heads: int
    conv_weight_CK: torch.Tensor  # this shard's [q | k | v] conv channels
    conv_bias_C: torch.Tensor | None
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    halo_group: object  # the group whose previous rank sends the conv halo (collective)

    @classmethod
    def whole(cls, layer: GDNLayerCP) -> "GDNShard":
        m = layer.view
        return cls(m.num_k_heads, m.num_v_heads, layer.conv_weight_CK, m.conv1d.bias, m.A_log, m.dt_bias, layer.group)
