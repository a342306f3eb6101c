"""What one rank's GDN scan covers: its heads (with their conv channels and gate parameters) and the group over
which its tokens are one slice of the row. The 1-D p2p / all_gather modes scan every head of the rank's own
slice; Ulysses scans Hv / P heads of the whole row (no group: the sequence is whole here); the 2-D layout
(`two_d.py`) scans Hv / u heads of its Ulysses group's slice, across the same heads of the other groups.

`scan_inputs` is the start every mode's scan shares: the causal conv + SiLU + q/k/v split (with the halo from the
previous piece), the gates, and the backend's contract check, per local piece (`placement.Pieces`: one piece under
the contiguous layout, two under the balanced one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltacp.parallel.conv import conv_silu_qkv
from deltacp.parallel.documents import DocumentSegment
from deltacp.parallel.gdn_layer import GDNLayerCP
from deltacp.parallel.placement import Pieces


@dataclass
class GDNShard:
    qk_heads: int  # q/k heads scanned here (after any repeat to the value heads)
    v_heads: int
    conv_weight_CK: torch.Tensor  # this shard's [q | k | v] conv channels
    conv_bias_C: torch.Tensor | None
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    seq_group: object | None  # the ranks whose slices make the row (halo from the previous one); None: whole here

    @classmethod
    def whole(cls, layer: GDNLayerCP) -> "GDNShard":
        m = layer.view
        return cls(m.num_k_heads, m.num_v_heads, layer.conv_weight_CK, m.conv1d.bias, m.A_log, m.dt_bias, layer.group)


def scan_inputs(layer: GDNLayerCP, shard: GDNShard, qkv_BsC: torch.Tensor, b_BsH: torch.Tensor, a_BsH: torch.Tensor,
                pieces: Pieces, docs: list[DocumentSegment | None]):
    """Per local piece: q, k [B, n, qk_heads, K], v [B, n, Hv, V], g, beta [B, n, Hv] of this shard, checked against
    the backend's contract. Contiguous once here (the Triton backend writes them so; eager's are views of the conv
    output): the backend's saves and the modes' own autograd nodes then share these tensors instead of views
    keeping the whole conv output alive through the backward."""
    qkvs = conv_silu_qkv(layer, qkv_BsC, shard.conv_weight_CK, shard.conv_bias_C, shard.qk_heads, pieces, docs,
                         shard.seq_group)
    g, beta = layer.backend.gates(a_BsH, b_BsH, shard.A_log, shard.dt_bias)
    out = []
    for slot, qkv in enumerate(qkvs):
        q, k, v = (t.contiguous() for t in qkv)
        g_s, beta_s = (g, beta) if len(qkvs) == 1 else (t[:, pieces.local(slot)].contiguous() for t in (g, beta))
        layer.backend.check(q, k, v, g_s, beta_s)
        out.append((q, k, v, g_s, beta_s))
    return out
