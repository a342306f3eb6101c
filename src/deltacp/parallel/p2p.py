"""State-P2P linear attention CP: every rank keeps all heads and its contiguous tokens; only the fp32
state [B, H, K, V] travels, rank to rank.

Forward on rank r: post the receive from r-1, compute the local summary (M, S) (skipped on the last
rank, whose H_out nobody reads), on receipt send H_out = M @ H_in + S on at once, then compute the
local outputs from H_in. Backward (by `relay_state`): receive dH_out from r+1, send
dH_in = Mᵀ dH_out + dS_local to r-1; dM and dS flow back through the summary into k, v, g, beta.
"""

from __future__ import annotations

import torch

from deltacp.distributed.collectives import StatePassing, in_backward_pass, relay_state
from deltacp.ops.gdn.naive import compute_dtype
from deltacp.parallel.conv import halo_conv_silu
from deltacp.parallel.gdn_layer import GDNLayerCP, gdn_gate, split_qkv


def p2p_mixer(layer: GDNLayerCP, qkv_BsC: torch.Tensor, b_BsH: torch.Tensor, a_BsH: torch.Tensor) -> torch.Tensor:
    m = layer.module
    passing: StatePassing = layer.extra["passing"]
    passing.wait_sends()  # buffers of the previous step's sends
    B = qkv_BsC.shape[0]
    like_state = torch.empty(B, m.num_v_heads, m.head_k_dim, m.head_v_dim, dtype=compute_dtype(qkv_BsC),
                             device=qkv_BsC.device)
    recompute = in_backward_pass()  # a checkpoint recompute replays H_in: no receive
    recv = None if passing.is_first or recompute else passing.post_recv(like_state, passing.rank - 1, "H_in")

    x_BsC = halo_conv_silu(qkv_BsC, layer.conv_weight_CK, m.conv1d.bias, layer.conv_dilation, layer.group)
    q, k, v = split_qkv(x_BsC, m.num_k_heads, m.head_k_dim, m.head_v_dim)
    g, beta = gdn_gate(a_BsH, m.A_log, m.dt_bias), b_BsH.sigmoid()
    layer.backend.check(q, k, v, g, beta, mode="p2p")

    summary_m = summary_s = None
    if not passing.is_last:
        with torch.profiler.record_function("deltacp::p2p summary"):
            summary_m, summary_s = layer.backend.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True)
    state_in = relay_state(summary_m, summary_s, passing, recv, like_state, anchor=x_BsC)
    with torch.profiler.record_function("deltacp::p2p output"):
        o, _ = layer.backend.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state_in,
                                                    use_qk_l2norm_in_kernel=True)
    return o
