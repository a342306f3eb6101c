"""Ulysses linear attention CP: all-to-all from sequence shards to head shards, the whole sequence's
conv and GDN on this rank's heads, and all-to-all back.

Rank p owns value heads [p*Hv/P, (p+1)*Hv/P). When the key heads do not divide by P, q/k are repeated
to the value heads first (each value head j reads key head j // (Hv/Hk)), with the conv kernels of the
repeated channels repeated alike, which is exact for a depthwise conv.

Under sequence_layout='balanced' the all-to-all returns the group's tokens member by member (each member's two
pieces); one block permutation puts them in row order (`placement.to_row_order`) before the conv, and its inverse
puts the outputs back before the return all-to-all.

Shape legend: s local tokens, S = P*s all tokens, P CP degree; *_BsPX packed per destination rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltacp.distributed.collectives import all_to_all_head_to_seq, all_to_all_seq_to_head
from deltacp.parallel.documents import CPForwardContext
from deltacp.ops.gdn.eager import split_qkv
from deltacp.parallel.gdn_layer import GDNLayerCP, document_segments
from deltacp.parallel.placement import Pieces, from_row_order, to_row_order
from deltacp.parallel.shard import GDNShard, scan_inputs


def ulysses_head_layout(num_k_heads: int, num_v_heads: int, cp: int) -> tuple[int, int]:
    """(q/k heads after any repeat, value heads) per rank, or ValueError naming the setting."""
    if num_v_heads % cp:
        raise ValueError(f"linear_attention_cp_mode='ulysses' needs linear_num_value_heads ({num_v_heads}) divisible "
                         f"by the CP degree ({cp}); use linear_attention_cp_mode='p2p' or a CP degree dividing it")
    qk_heads = num_k_heads if num_k_heads % cp == 0 else num_v_heads
    return qk_heads // cp, num_v_heads // cp


def _rank_channels(layer: GDNLayerCP, rank: int, cp: int, device) -> torch.Tensor:
    """Indices of this rank's [q | k | v] conv channels in the module's channel order."""
    m = layer.view
    K, V, Hk, Hv = m.head_k_dim, m.head_v_dim, m.num_k_heads, m.num_v_heads
    qk_local, v_local = ulysses_head_layout(Hk, Hv, cp)
    v_heads = torch.arange(rank * v_local, (rank + 1) * v_local, device=device)
    if Hk % cp == 0:
        qk_heads = torch.arange(rank * qk_local, (rank + 1) * qk_local, device=device)
    else:
        qk_heads = v_heads // (Hv // Hk)
    offs_k, offs_v = torch.arange(K, device=device), torch.arange(V, device=device)
    q_ch = (qk_heads[:, None] * K + offs_k).flatten()
    v_ch = (v_heads[:, None] * V + offs_v).flatten()
    return torch.cat([q_ch, Hk * K + q_ch, 2 * Hk * K + v_ch])


@dataclass
class HeadShard:
    """One rank's heads after the Ulysses all-to-all over a group of P ranks: the group's P*s tokens (in row order)
    of its [q | k | v] channels, beta and gate inputs, and which channels / value heads of the module those are."""

    qkv_BSC: torch.Tensor
    b_BSH: torch.Tensor
    a_BSH: torch.Tensor
    qk_local: int  # q/k heads here (after any repeat to the value heads)
    v_local: int
    channels: torch.Tensor  # this rank's conv channels, in the module's [q | k | v] order
    heads: slice  # this rank's value heads

    def scan_shard(self, layer: GDNLayerCP, seq_group=None) -> GDNShard:
        """What these heads' scan covers: their conv channels and gate parameters; `seq_group`: None (the
        group's whole row is here) or the groups across which it is one slice (2-D)."""
        m = layer.view
        bias = None if m.conv1d.bias is None else m.conv1d.bias[self.channels]
        return GDNShard(self.qk_local, self.v_local, layer.conv_weight_CK[self.channels], bias, m.A_log[self.heads],
                        m.dt_bias[self.heads], seq_group)


def seq_to_head_shard(layer: GDNLayerCP, qkv_BsC: torch.Tensor, b_BsH: torch.Tensor, a_BsH: torch.Tensor,
                      group) -> HeadShard:
    """One all-to-all over `group` (Ulysses degree P): the local tokens, all heads -> the group's tokens, this
    rank's heads, in row order (shared by the 1-D Ulysses mixer and the 2-D layout's groups)."""
    m = layer.view
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    B, s, _ = qkv_BsC.shape
    K, V, Hk, Hv = m.head_k_dim, m.head_v_dim, m.num_k_heads, m.num_v_heads
    qk_local, v_local = ulysses_head_layout(Hk, Hv, P)

    q, k, v = split_qkv(qkv_BsC, Hk, K, V)
    if Hk % P:  # repeat q/k to the value heads so that they split evenly
        q, k = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
    packed_BsPX = torch.cat([
        q.reshape(B, s, P, qk_local * K), k.reshape(B, s, P, qk_local * K), v.reshape(B, s, P, v_local * V),
        b_BsH.reshape(B, s, P, v_local), a_BsH.reshape(B, s, P, v_local),
    ], dim=-1)
    full_BSX = to_row_order(all_to_all_seq_to_head(packed_BsPX, group), 1, P, layer.balanced)
    qkv_BSC, b_BSH, a_BSH = torch.split(full_BSX, [2 * qk_local * K + v_local * V, v_local, v_local], dim=-1)

    key = (rank, P, qkv_BsC.device)
    if key not in layer.channels:  # index tensors built once per device
        layer.channels[key] = _rank_channels(layer, rank, P, qkv_BsC.device)
    return HeadShard(qkv_BSC, b_BSH, a_BSH, qk_local, v_local, layer.channels[key],
                     slice(rank * v_local, (rank + 1) * v_local))


def ulysses_mixer(layer: GDNLayerCP, qkv_BsC: torch.Tensor, b_BsH: torch.Tensor, a_BsH: torch.Tensor,
                  ctx: CPForwardContext) -> torch.Tensor:
    m = layer.view
    B, s, _ = qkv_BsC.shape
    V, Hv = m.head_v_dim, m.num_v_heads
    sh = seq_to_head_shard(layer, qkv_BsC, b_BsH, a_BsH, layer.group)
    S = sh.qkv_BSC.shape[1]
    whole = Pieces(0, 1, False, S)  # the whole row, in row order
    (docs,) = document_segments(ctx, whole)
    ((q, k, v, g, beta),) = scan_inputs(layer, sh.scan_shard(layer), sh.qkv_BSC, sh.b_BSH, sh.a_BSH, whole,
                                        [docs]).calls

    o_BSHV, _ = layer.backend.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                     cu_seqlens=None if docs is None else docs.layout)
    o_BSX = from_row_order(o_BSHV.reshape(B, S, sh.v_local * V), 1, dist.get_world_size(layer.group), layer.balanced)
    o_BsPX = all_to_all_head_to_seq(o_BSX, layer.group)
    return o_BsPX.reshape(B, s, Hv, V)
