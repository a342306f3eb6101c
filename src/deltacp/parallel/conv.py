"""Causal depthwise conv of the GDN layer, locally (Ulysses: whole sequence) or with a halo (P2P, all_gather).

With packed documents no token of another document may enter a conv window. Only the first
(kernel-1)*dilation tokens of each document have windows that reach back that far, so the conv runs as usual
and those few outputs are recomputed from their own document's taps (`doc_fix`, from
`documents.DocumentSegment.conv_fix`): exact, and the unpacked path is unchanged.

Shape legend: x_BsC pre-conv channels of the local tokens; weight_CK depthwise kernels [C, kernel];
n tokens to fix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltacp.distributed.collectives import conv_halo_exchange


def causal_conv_silu(x_BsC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None, dilation: int,
                     left_context_BhC: torch.Tensor | None = None,
                     doc_fix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """SiLU(causal depthwise conv) of x; `left_context` supplies the tokens before x (zeros when None).

    `doc_fix` = (index [n], valid [n, kernel]): the outputs of tokens `index` use only the taps marked valid
    (the others would read another document). Casts to the weight dtype for the conv and back, as
    transformers' Qwen3.5 does.
    """
    s, channels = x_BsC.shape[1], x_BsC.shape[2]
    kernel = weight_CK.shape[-1]
    halo = (kernel - 1) * dilation
    x = x_BsC if left_context_BhC is None else torch.cat([left_context_BhC, x_BsC], dim=1)
    x = x.transpose(1, 2).to(weight_CK.dtype)
    if left_context_BhC is None:
        x = F.pad(x, (halo, 0))
    out = F.conv1d(x, weight_CK.unsqueeze(1), bias_C, dilation=dilation, groups=channels)[:, :, -s:]
    if doc_fix is not None and doc_fix[0].numel():
        index, valid = doc_fix
        # x holds halo + s tokens: token t's tap j reads x[..., t + halo - (kernel-1-j)*dilation]
        taps_nK = index[:, None] + halo - (kernel - 1 - torch.arange(kernel, device=x.device)) * dilation
        x_BCnK = x[:, :, taps_nK] * valid.to(x.dtype)
        fixed_BCn = torch.einsum("bcnk,ck->bcn", x_BCnK, weight_CK)
        if bias_C is not None:
            fixed_BCn = fixed_BCn + bias_C[:, None]
        out = out.index_copy(2, index, fixed_BCn)
    return F.silu(out).to(x_BsC.dtype).transpose(1, 2)


def halo_conv_silu(x_BsC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None, dilation: int,
                   group, doc_fix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Conv of the local slice of a sequence sharded over `group`: the previous rank's last
    (kernel-1)*dilation pre-conv tokens arrive by `conv_halo_exchange` (rank 0 gets zeros)."""
    halo = (weight_CK.shape[-1] - 1) * dilation
    left = conv_halo_exchange(x_BsC, halo, group)
    return causal_conv_silu(x_BsC, weight_CK, bias_C, dilation, left_context_BhC=left, doc_fix=doc_fix)
