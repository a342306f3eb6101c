"""Per-token layers with a short causal window under CP (no recurrence): the values of the few tokens before each
local piece, wherever they are held, by the conv halo exchange of the linear-recurrent layers
(`collectives.halo_exchange`: one all-to-all-v; contiguous, from the previous rank; balanced, from the holder
of the previous piece; zeros before the row's first piece; backward: the halo's gradient to the tokens it came from).

    left_context(x_BsX, halo, group, pieces)       -> per local piece [B, halo + n, X]: its halo, then its tokens
    dilated_conv_silu(x_BsC, weight_CK, dilation, group, pieces, doc_starts) -> SiLU(causal depthwise conv) [B, s, C]
    windowed_conv(x_BsC, weight_CK, bias_C, dilation, group, pieces, doc_starts) -> causal depthwise conv [B, s, C]

Every rank of the group calls them at the same point (a collective), whatever its tokens. A halo longer than a piece
reaches back over several pieces (the exchange routes each part from its holder); the model's row cut still pads rows
so that every piece holds a PLE layer's halo (`parallelize_cp`'s `token_halo` entries): one message per piece.

Shape legend: x_BsX local tokens (pieces in local order, `placement.Pieces`); weight_CK depthwise kernels.
"""

from __future__ import annotations

import torch

from deltacp.distributed.collectives import halo_exchange
from deltacp.ops.gdn.eager import causal_conv, causal_conv_silu
from deltacp.parallel.conv import whole_row_here
from deltacp.parallel.placement import Pieces


def left_context(x_BsX: torch.Tensor, halo: int, group, pieces: Pieces) -> list[torch.Tensor]:
    """Per local piece (slot order): the `halo` row tokens before it (zeros before the row's start), then the piece's
    own tokens, [B, halo + n, X]. A halo longer than a piece reaches back over several pieces (a sliding window's
    K/V, `sliding_attention.py`). Differentiable (each halo part's gradient returns to the rank it came from)."""
    slots = [x_BsX[:, pieces.local(slot)] for slot in range(pieces.per_member)]
    if halo == 0:
        return slots
    if whole_row_here(group, pieces):
        return [torch.cat([x_BsX.new_zeros(x_BsX.shape[0], halo, x_BsX.shape[2]), slots[0]], dim=1)]
    left = halo_exchange(x_BsX, halo, group, pieces)  # [slots, B, halo, X]
    return [torch.cat([left[slot], x], dim=1) for slot, x in enumerate(slots)]


def dilated_conv_silu(x_BsC: torch.Tensor, weight_CK: torch.Tensor, dilation: int, group, pieces: Pieces,
                      doc_starts: list[torch.Tensor | None]) -> torch.Tensor:
    """SiLU(causal depthwise conv, no bias, `dilation`) of the local tokens as one process computes it over the row:
    the (kernel - 1) * dilation tokens before each piece by `left_context`; `doc_starts[slot]` ([n] local index of
    each token's document start, negative: began before the piece; None: no documents) keeps other documents' tokens
    out of every window (the eager GDN conv's rule, `ops/gdn/eager.causal_conv_silu`)."""
    return _conv_over_pieces(causal_conv_silu, x_BsC, weight_CK, None, dilation, group, pieces, doc_starts)


def windowed_conv(x_BsC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None, dilation: int, group,
                  pieces: Pieces, doc_starts: list[torch.Tensor | None]) -> torch.Tensor:
    """The causal depthwise conv (optional bias, NO activation: a gated short conv, `families/lfm2.py`) of the local
    tokens as one process computes it over the row: `dilated_conv_silu`'s halo and document rules."""
    return _conv_over_pieces(causal_conv, x_BsC, weight_CK, bias_C, dilation, group, pieces, doc_starts)


def _conv_over_pieces(conv, x_BsC, weight_CK, bias_C, dilation, group, pieces, doc_starts) -> torch.Tensor:
    halo = (weight_CK.shape[-1] - 1) * dilation
    out = []
    for slot, x in enumerate(left_context(x_BsC, halo, group, pieces)):
        out.append(conv(x[:, halo:], weight_CK, bias_C, dilation, x[:, :halo] if halo else None, doc_starts[slot]))
    return torch.cat(out, dim=1)
