"""The causal depthwise conv of a linear-recurrent layer under CP: where its left context comes from. The conv math
(+ SiLU and the split into the parts the family's view names, `LinearMixerView.conv_heads`) is the backend's
`conv_silu_split` (`ops/gdn/contract.py`; eager: `ops/gdn/eager.py`, Triton: the fused kernel of
`ops/fused/conv.py`).

Locally (Ulysses: the whole sequence) the conv's left padding is zeros. With a halo (p2p, all_gather, the 2-D
layout across groups) the last (kernel-1)*dilation pre-conv tokens of the piece before each local piece arrive by
`conv_halo_exchange` from whichever rank holds it (contiguous: the previous rank; balanced: the previous rank for
the first piece, the next rank for the second, the rank itself when its two pieces are adjacent; the row's first
piece gets zeros). With packed documents no token of another document enters a conv window: the backend gets
each token's document start (`documents.DocumentSegment.doc_start`).

A mixer without a conv (`LinearMixerView.conv` None: MiniMax's lightning attention) reads no token before its own:
its pre-conv channels are only split into the view's parts (any activation is the view's own, applied in `project`),
with nothing exchanged.

Shape legend: x_BsC pre-conv channels of the local tokens; weight_CK depthwise kernels [C, kernel].
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deltacp.distributed.collectives import conv_halo_exchange
from deltacp.ops.gdn.eager import split_parts
from deltacp.parallel.documents import DocumentSegment
from deltacp.parallel.linear_layer import LinearLayerCP
from deltacp.parallel.placement import Pieces


def whole_row_here(halo_group, pieces: Pieces) -> bool:
    """Whether the halo group is this rank alone, holding the row as one piece (no conv halo to exchange)."""
    return pieces.per_member == 1 and dist.get_world_size(halo_group) == 1


def conv_parts(layer: LinearLayerCP, x_BsC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None,
               key_heads: int, pieces: Pieces, docs: list[DocumentSegment | None], halo_group=None,
               batched: bool = True) -> list[tuple[torch.Tensor, ...]]:
    """The parts [rows, n, heads, dim] of SiLU(causal conv of x) by the layer's backend (split as the view's
    `conv_heads(key_heads)` says), per call: batched (pieces without documents), one call over the B x slots rows of the pieces (row b * slots + slot,
    a view of x); else one call per piece, with its documents.

    halo_group: None (the row is whole here: one piece, zeros on the left), or the group over which `pieces` are
    held, whose holders of the previous pieces send the conv halos (a collective: every rank of it calls this). A
    group of one rank holding the row as one piece needs no halo: it runs as None (no exchange, and no backward that
    writes a zero gradient over the whole input for autograd to add to the conv's); nor does a conv of kernel 1.
    weight_CK None (a mixer without a conv): the parts of x itself, split as `conv_heads` says (no activation)."""
    if weight_CK is None:
        return [split_parts(x, layer.view.conv_heads(key_heads)) for x in _calls(x_BsC, pieces, batched)]
    if halo_group is not None and (layer.halo == 0 or whole_row_here(halo_group, pieces)):
        halo_group = None  # a kernel of one token (halo 0) reads no token before its own: nothing to exchange
    left = None if halo_group is None else conv_halo_exchange(x_BsC, layer.halo, halo_group, pieces)
    heads = layer.view.conv_heads(key_heads)
    slots = pieces.per_member
    if batched:
        if any(d is not None for d in docs) and slots > 1:
            raise ValueError("pieces with documents run one conv call each (their document starts differ)")
        x = x_BsC if slots == 1 else x_BsC.unflatten(1, (slots, -1)).flatten(0, 1)
        return [layer.backend.conv_silu_split(
            x, weight_CK, bias_C, layer.conv_dilation,
            left_BhC=None if left is None else left.transpose(0, 1).flatten(0, 1),
            doc_start_s=None if docs[0] is None else docs[0].doc_starts(x_BsC.device), heads=heads)]
    return [layer.backend.conv_silu_split(
        x_BsC[:, pieces.local(slot)], weight_CK, bias_C, layer.conv_dilation,
        left_BhC=None if left is None else left[slot],
        doc_start_s=None if docs[slot] is None else docs[slot].doc_starts(x_BsC.device),
        heads=heads) for slot in range(slots)]


def _calls(x_BsC: torch.Tensor, pieces: Pieces, batched: bool) -> list[torch.Tensor]:
    """The local tokens per backend call: batched, one [B x slots, n, C] (row b * slots + slot); else one [B, n, C]
    per piece."""
    slots = pieces.per_member
    if batched:
        return [x_BsC if slots == 1 else x_BsC.unflatten(1, (slots, -1)).flatten(0, 1)]
    return [x_BsC[:, pieces.local(slot)] for slot in range(slots)]
