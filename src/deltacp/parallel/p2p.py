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

Backward on rank r, in the node `_StateGradHop` that sits on the outputs (so it runs before the local GDN
backward): dH_in_local, the entering state's gradient from the local outputs alone (one state-backward pass
from dO, not needing dH_out), then receive dH_out from r+1, send dH_in = Mᵀ dH_out + dH_in_local to r-1,
and hand dH_out to the local GDN backward as the gradient of its final state. Since the final state equals
M @ H_in + S, that one backward gives every input gradient that dM and dS would; the summary itself needs
no backward (its forward runs without autograd). The serial chain per hop stays recv -> one K x K matmul
-> send.

`StatePassing.schedule == "scan"` (`parallel/scan.py`) replaces the P - 1 hops each way by a log-depth scan over
the same group: forward, H_in from every rank's (M, S) in ceil(log2 P) rounds; backward, dH_out from every rank's
(Mᵀ, dH_in_local) over the ranks in reverse order. Everything else (summaries, replay, the local GDN) is shared.
"""

from __future__ import annotations

import torch

from deltacp.distributed.collectives import StatePassing, in_backward_pass
from deltacp.ops.gdn.contract import GDNBackend
from deltacp.ops.gdn.summary import apply_summary, summary_grad
from deltacp.ops.precision import compute_dtype
from deltacp.parallel.documents import CPForwardContext
from deltacp.parallel.gdn_layer import GDNLayerCP, document_segment
from deltacp.parallel.scan import exclusive_state_scan
from deltacp.parallel.shard import GDNShard, scan_inputs


class _StateGradHop(torch.autograd.Function):
    """Identity on o (and a sink for the final state ht); its backward is this rank's backward hop."""

    @staticmethod
    def forward(ctx, o, ht, q, k, v, g, beta, m, prepared, passing: StatePassing, backend: GDNBackend, layout,
                reads_state_in: bool):
        ctx.passing, ctx.backend, ctx.layout = passing, backend, layout
        ctx.state_shape = (v.shape[0], v.shape[2], k.shape[3], v.shape[3])
        ctx.state_dtype = compute_dtype(v)
        # only ranks whose outputs read the entering state run the dH_in pass; what it needs goes through
        # save_for_backward (the prepared tensors too), so that activation checkpointing frees it
        ctx.reads_state_in = reads_state_in
        ctx.staged = prepared is not None and reads_state_in
        if not reads_state_in:
            ctx.save_for_backward(None, None, None, None, None, m)
        else:
            ctx.save_for_backward(q, k, v, g, beta, m, *(prepared.tensors_for_backward() if ctx.staged else ()))
        return o.view_as(o)

    @staticmethod
    def backward(ctx, grad_o):
        passing: StatePassing = ctx.passing
        q, k, v, g, beta, m, *staged = ctx.saved_tensors
        grad_state_out = None
        grad_state_in = grad_o.new_zeros(ctx.state_shape, dtype=ctx.state_dtype)
        if ctx.reads_state_in:
            prepared = ctx.backend.prepared_from_saved(tuple(staged)) if ctx.staged else None
            grad_state_in = ctx.backend.initial_state_grad(q, k, v, g, beta, grad_o, use_qk_l2norm_in_kernel=True,
                                                           prepared=prepared, cu_seqlens=ctx.layout)
        if passing.schedule == "scan":  # dH_out from every later rank's (Mᵀ, dH_in_local) in log-depth rounds
            grad_state_out = exclusive_state_scan(None if m is None else m.mT, grad_state_in, passing,
                                                  state_shape=ctx.state_shape, dtype=ctx.state_dtype,
                                                  device=grad_o.device, reverse=True, what="dH")
        elif not passing.is_last:
            like = grad_o.new_empty(ctx.state_shape, dtype=ctx.state_dtype)
            grad_state_out = passing.post_recv(like, passing.rank + 1, "dH_out").wait()
            if m is not None:
                grad_state_in = summary_grad(m, grad_state_out, grad_state_in)
        if not passing.is_first and passing.schedule == "chain":
            passing.send(grad_state_in, passing.rank - 1, "dH_in")
            # Wait for the send when this backward pass ends, past the rest of the local backward compute.
            torch.autograd.Variable._execution_engine.queue_callback(passing.wait_sends)
        return grad_o, grad_state_out, None, None, None, None, None, None, None, None, None, None, None


def p2p_mixer(layer: GDNLayerCP, qkv_BsC: torch.Tensor, b_BsH: torch.Tensor, a_BsH: torch.Tensor,
              ctx: CPForwardContext) -> torch.Tensor:
    return p2p_scan(layer, GDNShard.whole(layer), qkv_BsC, b_BsH, a_BsH, ctx)


def p2p_scan(layer: GDNLayerCP, shard: GDNShard, qkv_BsC: torch.Tensor, b_BsH: torch.Tensor, a_BsH: torch.Tensor,
             ctx: CPForwardContext) -> torch.Tensor:
    """The p2p scan of `shard`'s heads over this rank's contiguous tokens, the state passing on
    layer.passing (its rank and size say which slice of the row these tokens are)."""
    m = layer.view
    passing: StatePassing = layer.passing
    passing.wait_sends()  # buffers of the previous step's sends
    B, s = qkv_BsC.shape[:2]
    state_shape = (B, shard.v_heads, m.head_k_dim, m.head_v_dim)
    state_dtype = compute_dtype(qkv_BsC)
    grad_enabled = torch.is_grad_enabled()
    recompute = in_backward_pass() and grad_enabled  # a checkpoint recompute replays H_in: no receive
    docs = document_segment(layer, ctx, passing.rank, passing.size, s)
    layout = None if docs is None else docs.layout
    # the entering state reaches this rank's outputs unless a document starts at its first token (rank 0: none)
    reads_state_in = not passing.is_first and (layout is None or layout.first_continues)
    # ... and its final state unless a document starts anywhere in the slice (then M = 0: H_out = S)
    need_transition = not passing.is_first and (layout is None or not layout.any_reset)

    # Schedule: the conv-halo collective and every check that can raise come before any point-to-point
    # message is posted (the state hops run on their own process group besides; see docs/design.md).
    q, k, v, g, beta = scan_inputs(layer, shard, qkv_BsC, b_BsH, a_BsH, docs)
    replay_key = id(layer)
    if recompute and replay_key not in ctx.replay:
        raise RuntimeError(
            "p2p linear attention CP was recomputed in backward (activation checkpointing) but its forward left "
            "no record in this forward's context: checkpoint the decoder layers of a model parallelized with "
            "parallelize_cp (its forward context carries the received states), or pass the same "
            "deltacp CPForwardContext as attention_mask to the forward and its recompute")
    # what the summary, the output pass and the dH_in pass would each build from k, v, g, beta (T, W, U), once
    with torch.no_grad():
        prepared = layer.backend.prepare_chunks(k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=layout)

    if recompute:
        state_in, summary_m = ctx.replay[replay_key]
    else:
        scan = passing.schedule == "scan"
        recv = None
        if not passing.is_first and not scan:
            recv = passing.post_recv(torch.empty(state_shape, dtype=state_dtype, device=qkv_BsC.device),
                                     passing.rank - 1, "H_in")
        summary_m = summary_s = None
        if not passing.is_last:
            # no autograd: the gradient that would flow through (M, S) reaches k, v, g, beta through the local
            # GDN's final state instead (see _StateGradHop)
            with torch.no_grad(), torch.profiler.record_function("deltacp::p2p summary"):
                summary_m, summary_s = layer.backend.state_summary(
                    k.detach(), v.detach(), g.detach(), beta.detach(), use_qk_l2norm_in_kernel=True,
                    prepared=prepared, need_transition=need_transition, cu_seqlens=layout)
        if scan:  # H_in from every earlier rank's (M, S) in log-depth rounds
            state_in = exclusive_state_scan(summary_m, summary_s, passing, state_shape=state_shape,
                                            dtype=state_dtype, device=qkv_BsC.device, what="H")
        else:
            state_in = None if recv is None else recv.wait()
        if not passing.is_last and not scan:
            h_out = summary_s if summary_m is None else apply_summary(summary_m, summary_s, state_in)
            passing.send(h_out, passing.rank + 1, "H_out")
        if grad_enabled:
            ctx.replay[replay_key] = (state_in, summary_m)

    with torch.profiler.record_function("deltacp::p2p output"):
        o, ht = layer.backend.chunk_gated_delta_rule(q, k, v, g, beta,
                                                     initial_state=state_in if reads_state_in else None,
                                                     output_final_state=grad_enabled and not passing.is_last,
                                                     use_qk_l2norm_in_kernel=True, prepared=prepared,
                                                     cu_seqlens=layout)
    if not grad_enabled:
        return o
    return _StateGradHop.apply(o, ht, q, k, v, g, beta, summary_m, prepared, passing, layer.backend, layout,
                               reads_state_in)
