"""Summary-AllGather linear attention CP (eager only; for comparing algorithms).

Every rank summarises its tokens, the packed [M | S] of all ranks are all-gathered (differentiably),
and rank r composes ranks 0..r-1 in order to get its entering state, then scans its own tokens.
"""

from __future__ import annotations

import torch

from deltacp.distributed.collectives import all_gather_autograd
from deltacp.ops.gdn.summary import apply_summary
from deltacp.parallel.documents import CPForwardContext
from deltacp.parallel.gdn_layer import GDNLayerCP, document_segment
from deltacp.parallel.shard import GDNShard, scan_inputs


def _compose_prefix(packed_PBHKX: torch.Tensor, rank: int, K: int) -> torch.Tensor:
    state = torch.zeros_like(packed_PBHKX[0, ..., K:])
    for r in range(rank):
        state = apply_summary(packed_PBHKX[r, ..., :K], packed_PBHKX[r, ..., K:], state)
    return state


class _EnteringState(torch.autograd.Function):
    """H_in of rank r from the gathered summaries of ranks 0..r-1.

    A Function rather than plain autograd so that its backward (and with it the all-gather's
    backward collective) runs on every rank, rank 0 included, whose H_in depends on no summary.
    """

    @staticmethod
    def forward(ctx, packed_PBHKX, rank, K):
        ctx.save_for_backward(packed_PBHKX)
        ctx.rank, ctx.K = rank, K
        return _compose_prefix(packed_PBHKX, rank, K)

    @staticmethod
    def backward(ctx, grad_state):
        (packed,) = ctx.saved_tensors
        if ctx.rank == 0:
            return torch.zeros_like(packed), None, None
        with torch.enable_grad():
            packed = packed.detach().requires_grad_()
            (grad,) = torch.autograd.grad(_compose_prefix(packed, ctx.rank, ctx.K), packed, grad_state)
        return grad, None, None


class _AnchorBackward(torch.autograd.Function):
    """Identity on o whose backward also reaches `unused` (with a zero gradient)."""

    @staticmethod
    def forward(ctx, o, unused):
        ctx.unused = (unused.shape, unused.dtype)
        return o.view_as(o)

    @staticmethod
    def backward(ctx, grad_o):
        shape, dtype = ctx.unused
        return grad_o, grad_o.new_zeros(shape, dtype=dtype)


def all_gather_mixer(layer: GDNLayerCP, qkv_BsC: torch.Tensor, b_BsH: torch.Tensor, a_BsH: torch.Tensor,
                     ctx: CPForwardContext) -> torch.Tensor:
    return all_gather_scan(layer, GDNShard.whole(layer), qkv_BsC, b_BsH, a_BsH, ctx)


def all_gather_scan(layer: GDNLayerCP, shard: GDNShard, qkv_BsC: torch.Tensor, b_BsH: torch.Tensor,
                    a_BsH: torch.Tensor, ctx: CPForwardContext) -> torch.Tensor:
    """The all_gather scan of `shard`'s heads over this rank's contiguous tokens, slice `rank` of its group."""
    m = layer.view
    group = shard.seq_group
    rank = torch.distributed.get_rank(group)
    s = qkv_BsC.shape[1]
    docs = document_segment(layer, ctx, rank, torch.distributed.get_world_size(group), s)
    layout = None if docs is None else docs.layout
    q, k, v, g, beta = scan_inputs(layer, shard, qkv_BsC, b_BsH, a_BsH, docs)

    # with documents, M = 0 wherever the entering state cannot reach the end of the slice (varlen.py)
    summary_m, summary_s = layer.backend.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                       cu_seqlens=layout)
    packed_PBHKX = all_gather_autograd(torch.cat([summary_m, summary_s], dim=-1), group)
    state = _EnteringState.apply(packed_PBHKX, rank, m.head_k_dim)
    if layout is not None and not layout.first_continues:
        # the first document starts on this rank: the entering state reaches no output, but its backward (and
        # with it the all-gather's collective) must still run here as on every other rank
        o, _ = layer.backend.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=layout)
        return _AnchorBackward.apply(o, state)
    o, _ = layer.backend.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, use_qk_l2norm_in_kernel=True,
                                                cu_seqlens=layout)
    return o
