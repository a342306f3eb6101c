"""Full attention CP for any family's full attention (through its `AttentionView`): Ulysses, KV all-gather, ring,
and the 2-D layout.

Every method: the view's local projections, q/k norms and rotary (position embeddings of the rank's global
positions; None for a NoPE layer), then its exchange and causal attention, then the view's output path (any output
gate, the output projection). Values of another head dim than queries and keys (MLA) travel and attend zero-padded
to one head dim (`one_head_dim`), the padding cut off the output.
- ulysses: all-to-all to head shards over the whole sequence (each rank gets its query heads and the KV heads
  they read, `ulysses_kv_heads`), causal attention, all-to-all back;
- all_gather / ring (`kv_cp_attention_forward`): optionally Ulysses inside a group of u consecutive ranks (the
  2-D layout), then the queries of the group's slice against every earlier key, K and V coming from the other
  groups by all-gather or around a ring; attention tile by tile (`attention_tiles.py`).

Sequence layout (`placement.py`): contiguous, rank r holds row positions [r s, (r + 1) s); balanced, pieces r and
2P - 1 - r of the row cut into 2P, which makes every rank's causal work equal. Under balanced each all-to-all's
member-major tokens are permuted to row order (`to_row_order`) before attention and back after it; a group of u
ranks then holds group pieces g and 2G - 1 - g, whose queries are planned as two runs, and the K/V gathered
across groups are put in row order the same way (the ring instead routes each key piece's tiles to its holder).

The `attention_mask` this forward takes is None (causal over the whole row) or the model pre-hook's
`CPForwardContext`, whose `attention` describes per-document causal attention over the flattened [B * S]
stream (packed documents, or padded rows as valid + padding documents). No [S, S] (or [s, S]) mask is ever
built: all of them run fused attention tile by tile (`attention_tiles.py`; Ulysses over its whole row), the
diagonals of a query block's documents packed into one varlen call.

Shape legend: x_BsD local hidden states; q_BsHD local tokens, all heads; q_BHSD all tokens, local heads;
q_BHLD the L = u*s tokens of a Ulysses group, local heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from deltacp.distributed.collectives import (
    RingPassing,
    all_gather_seq_autograd,
    all_to_all_head_to_seq,
    all_to_all_seq_to_head,
)
from deltacp.parallel.attention_tiles import plan_span_tiles, ring_attention, tile_kernel, tiled_attention
from deltacp.distributed.mesh import across_subgroup, cp_group_of, dedicated_cp_groups, ulysses_subgroup
from deltacp.parallel.documents import AttentionDocuments, CPForwardContext, refuse_unsupported
from deltacp.parallel.modes import attention_method
from deltacp.parallel.placement import Pieces, check_local_length, from_row_order, to_row_order
from deltacp.parallel.views import AttentionView, attention_view_of, bind_call

# Tile bound per kernel family (tokens on each side of a tile, `attention_tiles.tile_kernel`): the fused kernels
# keep no [queries, keys] scores, so a tile only bounds the head-expanded K/V copy (GQA) of one flash call (cuDNN
# reads the KV heads unexpanded) and the tokens of one packed call; the math kernel (CUDA fp32/fp64) holds
# block x block scores.
DEFAULT_BLOCK = {"fused": 65536, "flash_cpu": 65536, "math": 2048}


def attention_head_layout(num_heads: int, num_kv_heads: int, cp: int) -> tuple[int, int]:
    """(query heads, KV heads) per rank under Ulysses over `cp` ranks, or ValueError naming the setting."""
    if num_heads % cp:
        raise ValueError(f"Ulysses full attention needs num_attention_heads ({num_heads}) divisible by the CP "
                         f"degree ({cp}); full_attention_cp='all_gather' or 'ring' has no head limit")
    return num_heads // cp, ulysses_kv_heads(num_heads, num_kv_heads, cp).shape[1]


def causal_document_attention(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                              docs: AttentionDocuments | None, *, scale: float, dropout_p: float) -> torch.Tensor:
    """Causal attention within each document of the flattened [B * S] stream (all of it when docs is None)."""
    if docs is None:
        return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, is_causal=True, scale=scale,
                                              dropout_p=dropout_p, enable_gqa=k_BHSD.shape[1] != q_BHSD.shape[1])
    if dropout_p:
        raise NotImplementedError(f"attention_dropout={dropout_p} with packed documents or padding under CP is not "
                                  f"supported (set attention_dropout=0.0)")
    # The whole row's queries as one span of tiles (`attention_tiles`): per query block, the diagonals of all its
    # documents in one packed call (varlen flash on the GPU, diagonal by diagonal on the CPU), plus a visible tile
    # for a document that began in an earlier block; rows of a batch are documents of the flattened stream.
    B, _, S, _ = q_BHSD.shape
    tiles = docs.tiles(B, S, [(0, S)], DEFAULT_BLOCK[tile_kernel(q_BHSD)])
    return tiled_attention(q_BHSD, k_BHSD, v_BHSD, tiles, scale)


def ulysses_kv_heads(num_heads: int, num_kv_heads: int, degree: int) -> torch.Tensor:
    """[degree, n] the KV heads that Ulysses sends to each rank of a group of `degree`: the heads its query heads
    read (query head i reads KV head i // (Hq / Hkv)). Whole KV heads when the mapping stays grouped (each rank
    then runs GQA with its own KV heads); otherwise one KV head per query head (a repeat, exact)."""
    hq, groups = num_heads // degree, num_heads // num_kv_heads
    rows = []
    for j in range(degree):
        reads = [(j * hq + i) // groups for i in range(hq)]
        unique = sorted(set(reads))
        grouped = hq % len(unique) == 0 and reads == [h for h in unique for _ in range(hq // len(unique))]
        rows.append(unique if grouped else reads)
    if len({len(r) for r in rows}) != 1:
        rows = [[(j * hq + i) // groups for i in range(hq)] for j in range(degree)]
    return torch.tensor(rows)


def seq_to_heads(q_BsHD, k_BsHD, v_BsHD, group, balanced: bool = False):
    """Ulysses over `group` (degree P): local tokens, all heads -> the group's P*s tokens in row order, this rank's
    query heads and the KV heads they read (`ulysses_kv_heads`); one all-to-all (balanced: then one block
    permutation of the tokens, `placement.to_row_order`; the group's tokens are then its two pieces of the row,
    each in row order). Returns q, k, v as [B, H, P*s, D]."""
    P = 1 if group is None else dist.get_world_size(group)
    B, s, heads, D = q_BsHD.shape
    if P == 1:
        return tuple(x.transpose(1, 2) for x in (q_BsHD, k_BsHD, v_BsHD))
    index = ulysses_kv_heads(heads, k_BsHD.shape[2], P)
    n_kv = index.shape[1]
    k_sel, v_sel = (x[:, :, index.flatten().to(x.device)] for x in (k_BsHD, v_BsHD))
    # [B, s, P, (Hq/P + 2 n_kv) D] -> [B, P*s, (Hq/P + 2 n_kv) D]
    packed_BsPX = torch.cat([x.reshape(B, s, P, -1) for x in (q_BsHD, k_sel, v_sel)], dim=-1)
    full_BSX = to_row_order(all_to_all_seq_to_head(packed_BsPX, group), 1, P, balanced)
    q_BSX, k_BSX, v_BSX = torch.split(full_BSX, [heads // P * D, n_kv * D, n_kv * D], dim=-1)
    return tuple(x.reshape(B, s * P, -1, D).transpose(1, 2) for x in (q_BSX, k_BSX, v_BSX))


def heads_to_seq(o_BHSD: torch.Tensor, group, balanced: bool = False) -> torch.Tensor:
    """The inverse of `seq_to_heads` for the output: [B, H/P, P*s, D] (row order) -> [B, s, H * D]."""
    P = 1 if group is None else dist.get_world_size(group)
    B, h, S, D = o_BHSD.shape
    o_BSX = o_BHSD.transpose(1, 2).reshape(B, S, h * D)
    if P == 1:
        return o_BSX
    o_BSX = from_row_order(o_BSX, 1, P, balanced)
    return all_to_all_head_to_seq(o_BSX, group).reshape(B, S // P, P * h * D)


def one_head_dim(q_BsHD: torch.Tensor, k_BsHD: torch.Tensor, v_BsHD: torch.Tensor):
    """(q, k, v, value head dim) with one head dim for all three: a layer whose values are narrower than its queries
    and keys (MLA) gets them zero-padded, one whose values are wider gets q and k zero-padded. Exact: zero value
    columns give zero output columns (cut off after the attention: `o[..., :dv]`), zero q / k columns add nothing to
    the scores, and the softmax scale is the view's own, not one of the padded dim. The kernels and the exchanges
    all take one head dim."""
    d, dv = q_BsHD.shape[-1], v_BsHD.shape[-1]
    if dv < d:
        v_BsHD = F.pad(v_BsHD, (0, d - dv))
    elif dv > d:
        q_BsHD, k_BsHD = F.pad(q_BsHD, (0, dv - d)), F.pad(k_BsHD, (0, dv - d))
    return q_BsHD, k_BsHD, v_BsHD, dv


def attention_inputs(view: AttentionView, hidden_states, attention_mask, unsupported, cache, past_key_values,
                      use_cache, what):
    refuse_unsupported(type(view.module).__name__, dict(unsupported, cache=cache, past_key_values=past_key_values,
                                                        use_cache=use_cache))
    if hasattr(hidden_states, "to_local"):
        hidden_states = hidden_states.to_local()
    if attention_mask is not None and not isinstance(attention_mask, CPForwardContext):
        raise ValueError(f"{what} full attention takes None or the model hook's CPForwardContext as attention_mask, "
                         f"got {type(attention_mask).__name__}; call the model through parallelize_cp, "
                         f"which builds it from the padding mask or the packed documents")
    docs = None if attention_mask is None else attention_mask.attention
    return hidden_states, docs


def ulysses_attention_forward(view: AttentionView, group, balanced: bool, hidden_states: torch.Tensor,
                              position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                              attention_mask: CPForwardContext | None = None, cache=None, past_key_values=None,
                              use_cache: bool | None = None, position_ids: torch.Tensor | None = None,
                              output_router_logits: bool | None = None, **unsupported):
    """position_ids: read upstream (the rotary embedding, and the model hook for document starts), not here.
    output_router_logits: passed down every decoder layer of an MoE model, honoured by transformers' recording of
    the routers' outputs; nothing to do here. balanced: the rank holds pieces r and 2P - 1 - r of the row
    (`placement.py`); the all-to-all's tokens are put in row order for the attention and back after it."""
    view = bind_call(view, unsupported)
    hidden_states, docs = attention_inputs(view, hidden_states, attention_mask, unsupported, cache,
                                            past_key_values, use_cache, "Ulysses")
    cp = dist.get_world_size(group)
    attention_head_layout(view.num_heads, view.num_kv_heads, cp)
    check_local_length(balanced, hidden_states.shape[1], cp)
    q_BsHD, k_BsHD, v_BsHD, out = view.project(hidden_states, view.positions(position_embeddings, position_ids))
    q_BsHD, k_BsHD, v_BsHD, dv = one_head_dim(q_BsHD, k_BsHD, v_BsHD)
    q_BHSD, k_BHSD, v_BHSD = seq_to_heads(q_BsHD, k_BsHD, v_BsHD, group, balanced)  # the whole row, row order
    o_BHSD = causal_document_attention(q_BHSD, k_BHSD, v_BHSD, docs, scale=view.scaling, dropout_p=view.dropout)
    return view.output(heads_to_seq(o_BHSD[..., :dv], group, balanced), out), None


@dataclass
class AttentionCP:
    """How one full attention layer runs under CP on this rank (see `kv_cp_attention_forward`)."""

    method: str  # "all_gather" | "ring" (parallel/modes.py)
    ulysses_group: object  # the rank's Ulysses group (size u), or None: no Ulysses
    across_group: object  # rank j of every Ulysses group, in group order (size cp / u)
    ring: RingPassing | None = None  # ring: on its own group over the same ranks as across_group
    block: int | None = None  # tile size bound in tokens (None: per kernel default, see attention_tiles)
    balanced: bool = False  # sequence_layout='balanced' (placement.py)


def kv_cp_attention_forward(view: AttentionView, plan: AttentionCP, hidden_states: torch.Tensor,
                            position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                            attention_mask: CPForwardContext | None = None, cache=None, past_key_values=None,
                            use_cache: bool | None = None, position_ids: torch.Tensor | None = None,
                            output_router_logits: bool | None = None, **unsupported):
    """Full attention without a head limit: Ulysses inside a group of u ranks (u = 1: none), then the group's
    queries against every earlier key, the keys and values coming from the other groups by all-gather or ring.

    Group g of G (u consecutive CP ranks) holds L = u * s tokens of the row (`placement.Pieces` of member g of G):
    contiguous, row positions [g L, (g + 1) L); balanced, group pieces g and 2G - 1 - g of L / 2 each. After the
    Ulysses all-to-all (and, balanced, the block permutation to row order) each rank of the group holds those L
    tokens in local order for Hq / u query heads and the KV heads they read, and rank j of group g exchanges KV
    with rank j of every other group (the same heads). Causal per document, tile by tile (`attention_tiles`: the
    tiles of each query piece), no mask built."""
    view = bind_call(view, unsupported)
    hidden_states, docs = attention_inputs(view, hidden_states, attention_mask, unsupported, cache,
                                            past_key_values, use_cache, f"{plan.method}")
    if view.dropout:
        raise NotImplementedError(f"attention_dropout={view.dropout} with full_attention_cp={plan.method!r} is not "
                                  f"supported (set attention_dropout=0.0)")
    G, g = dist.get_world_size(plan.across_group), dist.get_rank(plan.across_group)
    u = 1 if plan.ulysses_group is None else dist.get_world_size(plan.ulysses_group)
    check_local_length(plan.balanced, hidden_states.shape[1], u * G)
    q_BsHD, k_BsHD, v_BsHD, out = view.project(hidden_states, view.positions(position_embeddings, position_ids))
    q_BsHD, k_BsHD, v_BsHD, dv = one_head_dim(q_BsHD, k_BsHD, v_BsHD)
    q_BHLD, k_BHLD, v_BHLD = seq_to_heads(q_BsHD, k_BsHD, v_BsHD, plan.ulysses_group, plan.balanced)
    B, _, L, D = q_BHLD.shape
    S = G * L
    spans = Pieces(g, G, plan.balanced, L).spans()  # the group's query runs of the row, in local order
    block = plan.block if plan.block is not None else DEFAULT_BLOCK[tile_kernel(q_BHLD)]
    tiles = plan_span_tiles(B, S, spans, None, block) if docs is None else docs.tiles(B, S, spans, block)
    match plan.method:
        case "all_gather":
            # K and V in one collective: [B, L, h, 2D] -> [B, S, h, 2D] (member-major, then row order)
            kv_BLHX = torch.cat([k_BHLD, v_BHLD], dim=-1).transpose(1, 2)
            kv_BSHX = to_row_order(all_gather_seq_autograd(kv_BLHX, 1, plan.across_group), 1, G, plan.balanced)
            k_BHSD, v_BHSD = kv_BSHX.transpose(1, 2).split(D, dim=-1)
            o_BHLD = tiled_attention(q_BHLD, k_BHSD, v_BHSD, tiles, view.scaling)
        case "ring":
            o_BHLD = ring_attention(q_BHLD, k_BHLD.contiguous(), v_BHLD.contiguous(), tiles, view.scaling,
                                    plan.ring, plan.balanced, block=block)
    return view.output(heads_to_seq(o_BHLD[..., :dv], plan.ulysses_group, plan.balanced), out), None


def check_attention_module(module: nn.Module, cp: int, method: str, ulysses_degree: int) -> dict:
    """Validate a full attention module for `method` (a registered name, `parallel/modes.py`) over `cp` ranks
    (Ulysses degree `ulysses_degree` inside groups for the methods that run across groups), through its family's
    view; return the configuration every rank must share."""
    view = attention_view_of(module)
    method = attention_method(method)
    if method.splits_heads:
        attention_head_layout(view.num_heads, view.num_kv_heads, cp)
    elif view.num_heads % ulysses_degree:
        raise ValueError(f"ulysses_degree={ulysses_degree} must divide num_attention_heads "
                         f"({view.num_heads}): full attention splits its heads over each Ulysses group")
    return dict(family=view.family, num_attention_heads=view.num_heads, num_key_value_heads=view.num_kv_heads,
                head_dim=view.head_dim, full_attention_cp=method.name)


def install_ulysses_attention(module: nn.Module, group, balanced: bool = False) -> nn.Module:
    """Install the Ulysses forward on the module instance (class, parameters and state_dict keys unchanged)."""
    module.forward = partial(ulysses_attention_forward, attention_view_of(module), group, balanced)
    return module


def install_kv_cp_attention(module: nn.Module, plan: AttentionCP) -> nn.Module:
    """Install the KV all-gather / ring forward on the module instance (class, parameters, state_dict unchanged)."""
    module.forward = partial(kv_cp_attention_forward, attention_view_of(module), plan)
    return module


_CP_FORWARDS: list = []  # every attention CP forward (`register_attention_forward`), for `has_attention_cp`


def register_attention_forward(forward) -> None:
    """An attention CP method of another module (the indexed attention's) declares its forward here."""
    _CP_FORWARDS.append(forward)


def has_attention_cp(module: nn.Module) -> bool:
    """Whether an attention CP forward (Ulysses, KV all-gather, ring, or a registered one) is installed here."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, partial) and forward.func in (ulysses_attention_forward, kv_cp_attention_forward,
                                                             *_CP_FORWARDS)


def attention_cp_plan(cp_mesh, method: str, degree: int, shared=None, block: int | None = None,
                      balanced: bool = False) -> AttentionCP:
    """The groups of KV all-gather / ring full attention with Ulysses degree `degree` inside groups (1: none).
    `shared`: the linear-recurrent layers' `TwoDGroups` of the same degree, whose Ulysses and across groups (collectives only)
    attention reuses. The ring always gets its own communicator. Collective: every rank calls it at one point."""
    cp_group = cp_group_of(cp_mesh)
    if degree == 1:
        ulysses, across = None, cp_group
    elif shared is not None:
        ulysses, across = shared.ulysses, shared.across
    else:
        ulysses, across = ulysses_subgroup(cp_mesh, degree), across_subgroup(cp_mesh, degree)
    ring = None
    if method == "ring":
        if across.size() == 1:
            ring = RingPassing(across)
        else:
            ring = RingPassing(dedicated_cp_groups(cp_mesh) if degree == 1 else across_subgroup(cp_mesh, degree))
    return AttentionCP(method=method, ulysses_group=ulysses, across_group=across, ring=ring, block=block,
                       balanced=balanced)
