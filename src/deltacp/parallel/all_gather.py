"""Summary-AllGather linear attention CP (eager only; for comparing algorithms).

Every rank summarises each of its pieces (`placement.Pieces`: one under the contiguous layout, two under the
balanced one), the packed [M | S] of all pieces are all-gathered (differentiably) and put in row order, and each
local piece composes the pieces before it to get its entering state, then scans its own tokens.
"""

from __future__ import annotations

import torch

from deltacp.distributed.collectives import all_gather_autograd
from deltacp.ops.recurrence import Transition
from deltacp.parallel.documents import CPForwardContext
from deltacp.parallel.linear_layer import LinearLayerCP, document_segments
from deltacp.parallel.placement import Pieces
from deltacp.parallel.shard import LinearShard, scan_inputs


def _compose_prefixes(packed_NBHKX: torch.Tensor, positions: tuple[int, ...], transition: Transition,
                      w: int) -> torch.Tensor:
    """[slots, B, H, K, V]: the state entering each of `positions`, from the row-ordered packed summaries [M | S]
    of all pieces (M's packed width w, `ops/recurrence.Transition`)."""
    state = torch.zeros_like(packed_NBHKX[0, ..., w:])
    states, done = [], 0
    for p in positions:  # increasing
        for r in range(done, p):
            state = transition.apply(packed_NBHKX[r, ..., :w], packed_NBHKX[r, ..., w:], state)
        done = p
        states.append(state)
    return torch.stack(states)


class _EnteringStates(torch.autograd.Function):
    """The states entering the local pieces from the gathered summaries of the pieces before them.

    A Function rather than plain autograd so that its backward (and with it the all-gather's
    backward collective) runs on every rank, the one holding the row's first piece included, whose
    first entering state depends on no summary.
    """

    @staticmethod
    def forward(ctx, packed_NBHKX, positions, transition, w):
        ctx.save_for_backward(packed_NBHKX)
        ctx.positions, ctx.transition, ctx.w = positions, transition, w
        return _compose_prefixes(packed_NBHKX, positions, transition, w)

    @staticmethod
    def backward(ctx, grad_states):
        (packed,) = ctx.saved_tensors
        with torch.enable_grad():
            packed = packed.detach().requires_grad_()
            states = _compose_prefixes(packed, ctx.positions, ctx.transition, ctx.w)
            if not states.requires_grad:  # only the row's first piece here: no summary reaches it
                return torch.zeros_like(packed), None, None, None
            (grad,) = torch.autograd.grad(states, packed, grad_states)
        return grad, None, None, None


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


def all_gather_mixer(layer: LinearLayerCP, pre_BsC: torch.Tensor, extras_BsHX: torch.Tensor,
                     ctx: CPForwardContext) -> torch.Tensor:
    return all_gather_scan(layer, LinearShard.whole(layer), pre_BsC, extras_BsHX, ctx)


def all_gather_scan(layer: LinearLayerCP, shard: LinearShard, pre_BsC: torch.Tensor, extras_BsHX: torch.Tensor,
                    ctx: CPForwardContext) -> torch.Tensor:
    """The all_gather scan of `shard`'s heads over this rank's pieces of the row held by its group."""
    rec = layer.recurrence
    group = shard.seq_group
    pieces = Pieces(torch.distributed.get_rank(group), torch.distributed.get_world_size(group), layer.balanced,
                    pre_BsC.shape[1])
    docs = document_segments(ctx, pieces)
    inputs = scan_inputs(layer, shard, pre_BsC, extras_BsHX, pieces, docs, padded=ctx.padding is not None)

    # with documents, M = 0 wherever the entering state cannot reach the end of the piece (varlen.py)
    summaries = [torch.cat(rec.summary(x, cu_seqlens=lay), dim=-1) for x, lay in zip(inputs.calls, inputs.layouts)]
    K = rec.state_shape(inputs.calls[0])[2]
    w = rec.transition.width(K)
    packed = torch.stack(inputs.per_slot(summaries))  # [slots, B, H, K, w + V]
    gathered = all_gather_autograd(packed, group)  # [members, slots, ...], member-major
    order = [member * pieces.per_member + slot for member, slot in map(pieces.holder, range(pieces.total))]
    by_piece = gathered.flatten(0, 1).index_select(0, torch.tensor(order, device=gathered.device))
    states = _EnteringStates.apply(by_piece, pieces.positions, rec.transition, w)
    reads = [d is None or d.layout.first_continues for d in docs]
    entering = inputs.to_calls([states[slot] if r else None for slot, r in enumerate(reads)], states,
                               states.shape[1:], states.dtype)
    outs = [rec.forward(x, initial_state=entering[c], cu_seqlens=inputs.layouts[c])[0]
            for c, x in enumerate(inputs.calls)]
    o = inputs.join(outs, pre_BsC.shape[0])
    # a piece whose first document starts in it reads no entering state, but the states' backward (and with it
    # the all-gather's collective) must still run here as on every other rank
    return o if all(reads) else _AnchorBackward.apply(o, states)
