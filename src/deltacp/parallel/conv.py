"""The causal depthwise conv of a GDN layer under CP: where its left context comes from. The conv math (+ SiLU and
the q/k/v split) is the backend's `conv_silu_split` (`ops/gdn/contract.py`; eager: `ops/gdn/eager.py`, Triton:
the fused kernel of `ops/fused/conv.py`).

Locally (Ulysses: the whole sequence) the conv's left padding is zeros. With a halo (p2p, all_gather, the 2-D
layout across groups) the previous rank's last (kernel-1)*dilation pre-conv tokens arrive by `conv_halo_exchange`
(rank 0 gets zeros). With packed documents no token of another document enters a conv window: the backend gets
each token's document start (`documents.DocumentSegment.doc_start`).

Shape legend: x_BsC pre-conv [q | k | v] channels of the local tokens; weight_CK depthwise kernels [C, kernel].
"""

from __future__ import annotations

import torch

from deltacp.distributed.collectives import conv_halo_exchange
from deltacp.parallel.documents import DocumentSegment
from deltacp.parallel.gdn_layer import GDNLayerCP


def conv_silu_qkv(layer: GDNLayerCP, x_BsC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None,
                  qk_heads: int, docs: DocumentSegment | None, halo_group=None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [B, s, qk_heads, K], v [B, s, Hv, V] = split of SiLU(causal conv of x) by the layer's backend.

    halo_group: None (the sequence is whole here), or the group whose previous rank sends the conv halo (a
    collective: every rank of the group calls this)."""
    left = None if halo_group is None else conv_halo_exchange(x_BsC, layer.halo, halo_group)
    m = layer.view
    return layer.backend.conv_silu_split(
        x_BsC, weight_CK, bias_C, layer.conv_dilation, left_BhC=left,
        doc_start_s=None if docs is None else docs.doc_starts(x_BsC.device),
        heads=(qk_heads, m.head_k_dim, m.head_v_dim))
