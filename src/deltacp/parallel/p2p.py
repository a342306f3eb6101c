"""State-P2P linear attention CP: every rank keeps all heads and its contiguous tokens; only the fp32
state [B, H, K, V] travels, rank to rank.

Forward on rank r: the conv halo (a collective over the CP group) and every check that can raise, then
prepare the chunks (the backend's WY form, shared by the stages below), post the receive from r-1 (on the
dedicated point-to-point group), compute the local summary (M, S) (S alone on rank 0, none on the last rank,
whose H_out nobody reads), on receipt send H_out = M @ H_in + S on at once, then compute the local outputs
from H_in, and the local final state.

Packed documents: the entering state reaches the outputs only if the slice's first document began on an
earlier rank, and reaches H_out only if no document starts inside the slice; otherwise M = 0 and H_out = S
(the last document's state from zero). Every rank still receives and sends one state each way, so the
message pattern never depends on the data.

Backward on rank r, in the node `_StateGradHop` that sits on the outputs (so it runs before the local recurrence
backward): dH_in_local, the entering state's gradient from the local outputs alone (one state-backward pass
from dO, not needing dH_out), then receive dH_out from r+1, send dH_in = Mᵀ dH_out + dH_in_local to r-1,
and hand dH_out to the local recurrence backward as the gradient of its final state. Since the final state equals
M @ H_in + S, that one backward gives every input gradient that dM and dS would; the summary itself needs
no backward (its forward runs without autograd). The serial chain per hop stays recv -> one K x K matmul
-> send.

Pieces (`placement.Pieces`): everything above is per piece of the row, and the state flows through the pieces in
row order. Under the contiguous layout a rank holds one piece (its slice) and the above is the whole story. Under
the balanced layout rank r holds pieces r and 2P - 1 - r: it summarises both before waiting on anything, and the
chain runs r -> r + 1 over the first pieces, through rank P - 1 (whose two pieces are adjacent: a local hand-over),
and back P - 1 -> 0 over the second pieces (2P - 1 hops, so the balanced layout wants the scan). A rank handles its
pieces in row order forward (reverse order backward) and posts each receive only after the sends of its earlier
pieces, so the messages between two ranks are issued in the same order on both sides (docs/design.md, section 8).

`StatePassing.schedule == "scan"` (`parallel/scan.py`) replaces the hops each way by a log-depth scan over the same
group: forward, H_in from every piece's (M, S) in ceil(log2 N) rounds (N pieces); backward, dH_out from every
piece's (Mᵀ, dH_in_local) over the pieces in reverse order. Everything else (summaries, replay, the local recurrence) is
shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltacp.distributed.collectives import StatePassing, in_backward_pass
from deltacp.ops.precision import compute_dtype
from deltacp.ops.recurrence import Recurrence, RecurrenceInputs, Transition
from deltacp.parallel.documents import CPForwardContext
from deltacp.parallel.linear_layer import LinearLayerCP, document_segments
from deltacp.parallel.placement import Pieces
from deltacp.parallel.scan import exclusive_state_scan
from deltacp.parallel.shard import LinearShard, PieceInputs, scan_inputs


@dataclass
class _Hops:
    """What the backward hop of one p2p call needs besides its saved tensors."""

    passing: StatePassing
    recurrence: Recurrence
    n_inputs: int  # tensors of one call's RecurrenceInputs
    pieces: Pieces
    inputs: PieceInputs  # the backend calls (their tensors dropped: they travel through save_for_backward)
    reads_state_in: list[bool]  # per slot: its outputs read the entering state
    staged: list[bool]  # per call: prepared chunk tensors saved for the dH_in pass
    saved: list[int]  # per call: how many tensors it saved
    n_m: int  # summaries M saved (per slot, None where absent)
    state_shape: tuple[int, ...]
    state_dtype: torch.dtype


class _StateGradHop(torch.autograd.Function):
    """Identity on o (and a sink for the final states ht of the backend calls); its backward is this rank's
    backward hops."""

    @staticmethod
    def forward(ctx, o, hops: _Hops, n_ht: int, *tensors):
        # tensors: the n_ht final states (None where no piece of a call sends one), then the per-slot M, then per
        # call what its dH_in pass needs, through save_for_backward (the prepared tensors too), so that activation
        # checkpointing frees it
        ctx.hops, ctx.n_ht = hops, n_ht
        ctx.save_for_backward(*tensors[n_ht:])
        return o.view_as(o)

    @staticmethod
    def backward(ctx, grad_o):
        hops: _Hops = ctx.hops
        passing, pieces, inputs = hops.passing, hops.pieces, hops.inputs
        saved = ctx.saved_tensors
        ms, at = list(saved[:hops.n_m]), hops.n_m
        grads_o = inputs.split(grad_o, pieces)
        local_calls = []
        for c in range(len(inputs.calls)):
            x = RecurrenceInputs(*saved[at:at + hops.n_inputs])
            staged = saved[at + hops.n_inputs:at + hops.saved[c]]
            at += hops.saved[c]
            if not any(hops.reads_state_in[j] for j in inputs.slots_of(c)):
                local_calls.append(None)
                continue
            prepared = hops.recurrence.prepared_from_saved(tuple(staged)) if hops.staged[c] else None
            local_calls.append(hops.recurrence.initial_state_grad(x, grads_o[c], prepared=prepared,
                                                                  cu_seqlens=inputs.layouts[c]))
        # a piece that does not read the entering state has none of its gradient
        local = [grad if reads else None for grad, reads in zip(inputs.per_slot(local_calls), hops.reads_state_in)]
        local = [grad_o.new_zeros(hops.state_shape, dtype=hops.state_dtype) if grad is None else grad.contiguous()
                 for grad in local]
        if passing.schedule == "scan":  # dH_out from every later piece's (Mᵀ, dH_in_local) in log-depth rounds
            tr = hops.recurrence.transition
            grad_out = exclusive_state_scan([None if m is None else tr.transpose(m) for m in ms], local, passing,
                                            pieces, state_shape=hops.state_shape, dtype=hops.state_dtype,
                                            device=grad_o.device, reverse=True, what="dH", transition=tr)
        else:
            grad_out = _chain_backward(passing, pieces, ms, local, grad_o, hops.recurrence.transition)
        grad_ht = inputs.to_calls(grad_out, grad_o, hops.state_shape, hops.state_dtype)
        return (grad_o, None, None, *grad_ht[:ctx.n_ht], *([None] * len(saved)))


def _chain_backward(passing: StatePassing, pieces: Pieces, ms: list, local: list, like: torch.Tensor,
                    transition: Transition) -> list:
    """dH_out of every local piece by the chain, pieces in reverse row order: receive dH_out from the holder of the
    next piece, send dH_in = Mᵀ dH_out + dH_in_local to the holder of the previous one."""
    grad_out = [None] * pieces.per_member
    grad_in_by_piece = {}  # handed over between this rank's own adjacent pieces
    for slot in reversed(range(pieces.per_member)):
        piece = pieces.positions[slot]
        grad_in = local[slot]
        if piece + 1 < pieces.total:
            member, _ = pieces.holder(piece + 1)
            if member == pieces.member:
                grad_out[slot] = grad_in_by_piece[piece + 1]
            else:
                grad_out[slot] = passing.post_recv(like.new_empty(grad_in.shape, dtype=grad_in.dtype), member,
                                                   "dH_out").wait()
            if ms[slot] is not None:
                grad_in = transition.grad_in(ms[slot], grad_out[slot], grad_in)
        if piece > 0:
            member, _ = pieces.holder(piece - 1)
            if member == pieces.member:
                grad_in_by_piece[piece] = grad_in
            else:
                passing.send(grad_in, member, "dH_in")
    # Wait for the sends when this backward pass ends, past the rest of the local backward compute.
    torch.autograd.Variable._execution_engine.queue_callback(passing.wait_sends)
    return grad_out


def _chain_forward(passing: StatePassing, pieces: Pieces, summaries: list, first_recv, like: torch.Tensor,
                   transition: Transition) -> list:
    """H_in of every local piece by the chain, pieces in row order: receive H_in from the holder of the previous
    piece (the first one's receive already posted), send H_out = M H_in + S on to the holder of the next one."""
    states_in = [None] * pieces.per_member
    state_out_by_piece = {}
    for slot, piece in enumerate(pieces.positions):
        if piece > 0:
            member, _ = pieces.holder(piece - 1)
            if member == pieces.member:
                states_in[slot] = state_out_by_piece[piece - 1]
            else:
                pending = first_recv if slot == 0 else passing.post_recv(like, member, "H_in")
                states_in[slot] = pending.wait()
        if piece + 1 < pieces.total:
            m, s = summaries[slot]
            state_out = s if m is None else transition.apply(m, s, states_in[slot])
            member, _ = pieces.holder(piece + 1)
            if member == pieces.member:
                state_out_by_piece[piece] = state_out
            else:
                passing.send(state_out, member, "H_out")
    return states_in


def p2p_mixer(layer: LinearLayerCP, pre_BsC: torch.Tensor, extras_BsHX: torch.Tensor,
              ctx: CPForwardContext) -> torch.Tensor:
    return p2p_scan(layer, LinearShard.whole(layer), pre_BsC, extras_BsHX, ctx)


def p2p_scan(layer: LinearLayerCP, shard: LinearShard, pre_BsC: torch.Tensor, extras_BsHX: torch.Tensor,
             ctx: CPForwardContext) -> torch.Tensor:
    """The p2p scan of `shard`'s heads over this rank's pieces of the row, the state passing on layer.passing
    (its rank and size, with the layer's sequence layout, say which pieces of the row these tokens are)."""
    rec = layer.recurrence
    passing: StatePassing = layer.passing
    passing.wait_sends()  # buffers of the previous step's sends
    B, s = pre_BsC.shape[:2]
    pieces = Pieces(passing.rank, passing.size, layer.balanced, s)
    state_dtype = compute_dtype(pre_BsC)
    grad_enabled = torch.is_grad_enabled()
    recompute = in_backward_pass() and grad_enabled  # a checkpoint recompute replays H_in: no receive
    docs = document_segments(ctx, pieces)
    layouts = [None if d is None else d.layout for d in docs]
    last = [piece == pieces.total - 1 for piece in pieces.positions]
    # the entering state reaches a piece's outputs unless a document starts at its first token (the row's first
    # piece: none) ...
    reads_state_in = [piece > 0 and (lay is None or lay.first_continues) for piece, lay in zip(pieces.positions,
                                                                                                  layouts)]
    # ... and its final state unless a document starts anywhere in the piece (then M = 0: H_out = S)
    need_transition = [piece > 0 and (lay is None or not lay.any_reset) for piece, lay in zip(pieces.positions,
                                                                                                  layouts)]

    # Schedule: the conv-halo collective and every check that can raise come before any point-to-point
    # message is posted (the state hops run on their own process group besides; see docs/design.md).
    inputs = scan_inputs(layer, shard, pre_BsC, extras_BsHX, pieces, docs, padded=ctx.padding is not None)
    state_shape = (B, *rec.state_shape(inputs.calls[0])[1:])  # a piece's state: [B, H, K, V] of these heads
    calls = range(len(inputs.calls))
    replay_key = id(layer)
    if recompute and replay_key not in ctx.replay:
        raise RuntimeError(
            "p2p linear attention CP was recomputed in backward (activation checkpointing) but its forward left "
            "no record in this forward's context: checkpoint the decoder layers of a model parallelized with "
            "parallelize_cp (its forward context carries the received states), or pass the same "
            "deltacp CPForwardContext as attention_mask to the forward and its recompute")
    # what the summary, the output pass and the dH_in pass would each build from the inputs (GDN: T, W, U), once
    with torch.no_grad():
        prepared = [rec.prepare(x, cu_seqlens=lay) for x, lay in zip(inputs.calls, inputs.layouts)]

    if recompute:
        states_in, summary_ms = ctx.replay[replay_key]
    else:
        scan = passing.schedule == "scan"
        first_recv = None
        if not scan and pieces.positions[0] > 0:  # posted before the summaries, which overlap its arrival
            first_recv = passing.post_recv(torch.empty(state_shape, dtype=state_dtype, device=pre_BsC.device),
                                           pieces.holder(pieces.positions[0] - 1)[0], "H_in")
        # no autograd: the gradient that would flow through (M, S) reaches the inputs through the local recurrence's
        # final state instead (see _StateGradHop); the row's last piece has no H_out that anyone reads. One call
        # summarises every piece it holds (M where any of them needs it; a piece that does not gets None).
        ms_calls, ss_calls = [], []
        with torch.no_grad(), torch.profiler.record_function("deltacp::p2p summary"):
            for c in calls:
                slots = inputs.slots_of(c)
                if all(last[j] for j in slots):
                    ms_calls.append(None)
                    ss_calls.append(None)
                    continue
                sm, ss = rec.summary(inputs.calls[c].detach(), prepared=prepared[c],
                                     need_transition=any(need_transition[j] for j in slots),
                                     cu_seqlens=inputs.layouts[c])
                ms_calls.append(sm)
                ss_calls.append(ss)
        summary_ms = [m if need else None for m, need in zip(inputs.per_slot(ms_calls), need_transition)]
        summary_ss = [s_ if not end else None for s_, end in zip(inputs.per_slot(ss_calls), last)]
        if scan:  # H_in of every piece from every earlier piece's (M, S) in log-depth rounds
            states_in = exclusive_state_scan(summary_ms, summary_ss, passing, pieces, state_shape=state_shape,
                                             dtype=state_dtype, device=pre_BsC.device, what="H",
                                             transition=rec.transition)
        else:
            states_in = _chain_forward(passing, pieces, list(zip(summary_ms, summary_ss)), first_recv,
                                       torch.empty(state_shape, dtype=state_dtype, device=pre_BsC.device),
                                       rec.transition)
        if grad_enabled:
            ctx.replay[replay_key] = (states_in, summary_ms)

    entering = inputs.to_calls([st if reads else None for st, reads in zip(states_in, reads_state_in)],
                               pre_BsC, state_shape, state_dtype)
    outs, finals = [], []
    with torch.profiler.record_function("deltacp::p2p output"):
        for c in calls:
            o, ht = rec.forward(
                inputs.calls[c], initial_state=entering[c],
                output_final_state=grad_enabled and not all(last[j] for j in inputs.slots_of(c)),
                prepared=prepared[c], cu_seqlens=inputs.layouts[c])
            outs.append(o)
            finals.append(ht)
    o = inputs.join(outs, B)
    if not grad_enabled:
        return o
    saved, counts, staged = [], [], []
    n_inputs = len(inputs.calls[0])
    for c in calls:
        reads = any(reads_state_in[j] for j in inputs.slots_of(c))
        stage = prepared[c] is not None and reads
        part = ([*inputs.calls[c], *(prepared[c].tensors_for_backward() if stage else ())] if reads
                else [None] * n_inputs)
        saved += part
        counts.append(len(part))
        staged.append(stage)
    hops = _Hops(passing, rec, n_inputs, pieces, PieceInputs([()] * len(inputs.calls), inputs.layouts, inputs.slots,
                                                             inputs.batched),
                 reads_state_in, staged, counts, len(summary_ms), state_shape, state_dtype)
    return _StateGradHop.apply(o, hops, len(finals), *finals, *summary_ms, *saved)
