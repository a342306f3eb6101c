"""Indexed sparse attention under CP, for any family's indexed attention (through its `IndexedAttentionView`):
each query attends to the top-k blocks an indexer scores over the pooled keys of its whole visible prefix, plus the
tail of its own incomplete block.

A document's blocks are runs of `block_size` tokens from its first token (a packed document's first token; the
first valid token of a left-padded row), so they start anywhere relative to the rank boundaries. A query at row
position p of a document starting at d0 sees n = (p - d0 + 1) // block_size complete blocks; it reads the
`top_blocks` of them with the highest scores and the tail tokens d0 + n * block_size .. p (fewer than block_size).
All of a query's visible blocks complete, the layer is causal attention within the document.

Exact under CP, every rank running the same collectives in the same order (no rank-dependent branch):
1. the pooled keys of the whole row: each rank sums its tokens' terms into the blocks they belong to (a block
   straddling two ranks gets a part from each) and writes the rotary cos / sin of the block starts it holds; ONE
   all-reduce (sum) over the CP group gives every rank every block's full sum and start angles (a sum of parts
   plus zeros: exact but for the order of the float additions). Without gradient: the indexer's choice is discrete.
   A softmax-pooling view (GLM-5.3-Flash: each block's key a softmax-weighted mean of its tokens' keys) first takes
   each block's largest logit over the ranks (one all-reduce, max, of [B, N, Y]) and sums exp(logit - that) times
   the values and exp(logit - that): the softmax of one process, whichever ranks hold the block's tokens;
   a layer that reuses the previous decoder layer's selection (GLM's "shared" indexer layers) skips 1 and 2: the
   selection of this rank's queries comes with that layer's outputs, as the token indices do in one process;
2. each local query (in chunks of QUERY_CHUNK) scores every block of its row; blocks it cannot see are -inf; the
   selection is a stable descending sort (ties: the earlier block first), the same on every rank and in one process
   (torch.topk leaves the order of equal scores unspecified: it varies with the vector's length, so transformers'
   choice among exactly equal scores is its own; unequal scores select the same blocks);
3. K and V of the whole row by one all-gather (in row order for either sequence layout), then each local query
   attends to its selection (`ops/selected_attention.py`): Triton kernels reading each query's runs of keys in
   place on CUDA, the selected tokens gathered per chunk of queries elsewhere. No [S, S] or [s, S] tensor: the largest are the
   block scores and the visibility test of a chunk of c = QUERY_CHUNK queries, [B, c, N] (N = the row's blocks,
   S / block_size).

Shape legend: x_BsD local hidden states; N blocks of a row (the most of any row of the batch); T keys a query reads;
rows: row positions of the local tokens (`placement.Pieces`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from deltacp.distributed.collectives import all_gather_seq_autograd
from deltacp.ops.selected_attention import Selection, selected_attention
from deltacp.parallel.attention import AttentionCP, attention_inputs, register_attention_forward
from deltacp.parallel.placement import Pieces, check_local_length, to_row_order
from deltacp.parallel.views import IndexedAttentionView

QUERY_CHUNK = 1024  # local queries whose block scores ([B, c, N]) are held at once


@dataclass(frozen=True)
class RowBlocks:
    """The blocks of every row of a [B, S] batch whose documents are `cu` (offsets over the flattened [B * S]
    stream; rows are documents when nothing else is given). Per token of the stream: its document's first row
    position and its block (-1: in its document's incomplete last run). Per row: its blocks' first row positions."""

    doc_start: torch.Tensor  # [B, S] row position of each token's document start
    block: torch.Tensor  # [B, S] the token's block within its row, -1 if none
    first_block: torch.Tensor  # [B, S] the row block index of the token's document's first block
    block_start: torch.Tensor  # [B, N] row position of each block's first token (0 past the row's blocks)
    blocks: int  # N

    @classmethod
    def build(cls, cu: torch.Tensor, B: int, S: int, size: int, device) -> "RowBlocks":
        cu = cu.to("cpu", torch.int64)
        flat = torch.arange(B * S)
        doc = torch.searchsorted(cu, flat, right=True) - 1
        start, length = cu[doc], (cu[1:] - cu[:-1])[doc]
        offset = flat - start
        per_doc = (cu[1:] - cu[:-1]) // size
        before = torch.cat([torch.zeros(1, dtype=torch.int64), per_doc.cumsum(0)])  # blocks of earlier documents
        row_first = before[doc].view(B, S)[:, :1]  # blocks of the stream before each row
        first = before[doc].view(B, S) - row_first
        inside = offset < (length // size) * size
        block = torch.where(inside.view(B, S), first + (offset // size).view(B, S), -1)
        row_end = torch.searchsorted(cu, torch.arange(1, B + 1) * S, right=True) - 1
        row_blocks = before[row_end].view(B) - row_first[:, 0]
        N = int(row_blocks.max()) if B else 0
        block_start = torch.zeros(B, max(N, 1), dtype=torch.int64)
        heads = inside.view(B, S) & (offset.view(B, S) % size == 0)
        b_idx, p_idx = heads.nonzero(as_tuple=True)
        block_start[b_idx, block[b_idx, p_idx]] = p_idx
        rowpos = (start - torch.arange(B).repeat_interleave(S) * S).view(B, S)
        return cls(*(t.to(device) for t in (rowpos, block, first, block_start[:, :N])), N)


def _row_blocks(docs, B: int, S: int, size: int, device) -> RowBlocks:
    """The forward's `RowBlocks`, built once per forward and block size (cached on the documents, which live one
    forward) or, without documents, per call (the rows' blocks then need only S)."""
    if docs is None:
        return RowBlocks.build(torch.arange(B + 1) * S, B, S, size, device)
    key = ("indexed_blocks", B, S, size, str(device))
    if key not in docs._cache:
        docs._cache[key] = RowBlocks.build(docs.cu_seqlens, B, S, size, device)
    return docs._cache[key]


def _reduce_over_group(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Every rank's x reduced by `op` (not differentiable: the indexer's pooled keys); through host memory over
    gloo."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    staged = x.is_cuda and dist.get_backend(group) == "gloo"
    y = x.cpu() if staged else x.clone()
    dist.all_reduce(y, op=op, group=group)
    return y.to(x.device)


def softmax_pooling_terms(terms_BsX: torch.Tensor, slot_Bs: torch.Tensor, N: int, group) -> torch.Tensor:
    """A softmax-pooling view's terms [logits | values] (Y channels each) -> [exp(logit - m) value | exp(logit - m)],
    m the largest logit of the token's block per channel over every rank (one MAX all-reduce of [B, N, Y]: a block
    straddling ranks is weighted as in one process); zeros for tokens in no complete block (slot N)."""
    B, s, X = terms_BsX.shape
    logits, values = terms_BsX.split(X // 2, dim=-1)
    index = slot_Bs[..., None].expand_as(logits)
    peak = logits.new_full((B, N + 1, X // 2), float("-inf")).scatter_reduce_(1, index, logits, "amax")
    peak = torch.cat([_reduce_over_group(peak[:, :N], group, dist.ReduceOp.MAX), peak.new_zeros(B, 1, X // 2)], 1)
    weight = torch.where(index < N, torch.exp(logits - peak.gather(1, index)), 0.0)
    return torch.cat([weight * values, weight], dim=-1)


def select_tokens(view: IndexedAttentionView, blocks: RowBlocks, x_BsD: torch.Tensor, position_embeddings,
                  rows: torch.Tensor, group) -> Selection:
    """What each local query reads (`Selection`): its chosen blocks, then its tail. One all-reduce over `group`, two
    for a softmax-pooling view (every rank, whatever its tokens)."""
    B, s, _ = x_BsD.shape
    N, size = blocks.blocks, view.block_size
    local_block = blocks.block[:, rows]  # [B, s]
    offsets = torch.where(local_block >= 0, (rows[None] - blocks.doc_start[:, rows]) % size, -1)
    iq, terms_BsX = view.index(x_BsD, position_embeddings, offsets)
    slot = torch.where(local_block >= 0, local_block, N)
    if view.pooling == "softmax":
        terms_BsX = softmax_pooling_terms(terms_BsX, slot, N, group)
    # 1. the blocks' sums (a straddling block: a part from each rank holding some of it) and start angles
    X = terms_BsX.shape[-1]
    cos_sin = None if position_embeddings is None else torch.cat(position_embeddings, dim=-1)
    width = X + (0 if cos_sin is None else cos_sin.shape[-1])
    parts = terms_BsX.new_zeros(B, N + 1, width)  # block N: the tokens of no complete block
    parts[..., :X].scatter_add_(1, slot[..., None].expand(B, s, X), terms_BsX)
    if cos_sin is not None:
        head = (local_block >= 0) & (blocks.block_start.gather(1, local_block.clamp_min(0))
                                     == rows[None]) if N else torch.zeros_like(local_block, dtype=torch.bool)
        b_idx, t_idx = head.nonzero(as_tuple=True)
        parts[b_idx, local_block[b_idx, t_idx], X:] = cos_sin[b_idx if cos_sin.shape[0] == B else 0 * b_idx,
                                                              t_idx].to(parts.dtype)
    sums = _reduce_over_group(parts[:, :N], group)
    if N:
        angles = (None, None) if cos_sin is None else sums[..., X:].to(cos_sin.dtype).split(
            position_embeddings[0].shape[-1], dim=-1)
        keys = view.block_keys(sums[..., :X], *angles)
    chosen = []  # 2. per chunk of local queries: [c, N] scores at most (never [s, N] at once)
    for lo in range(0, s, QUERY_CHUNK):
        hi = min(s, lo + QUERY_CHUNK)
        chosen.append(_chosen_blocks(view, blocks, iq[:, lo:hi], keys if N else None, rows[lo:hi]))
    return selection_of(blocks, rows, *(torch.cat(parts, dim=1) for parts in zip(*chosen)), view.block_size)


def selection_of(blocks: RowBlocks, rows: torch.Tensor, chosen: torch.Tensor, ok: torch.Tensor,
                 size: int) -> Selection:
    """The `Selection` of the queries at row positions `rows` that chose `chosen` (where `ok`): their tails run
    from the end of their last complete block to themselves."""
    start = blocks.doc_start[:, rows]
    pos = rows[None].expand_as(start)
    tail_lo = start + (pos - start + 1) // size * size
    return Selection(chosen, ok, tail_lo, pos, blocks.block_start, size)


def _chosen_blocks(view: IndexedAttentionView, blocks: RowBlocks, iq, keys, rows: torch.Tensor):
    """(chosen row blocks, ok) [B, c, kk] of the queries at row positions `rows`: every block of the row scored,
    those the query cannot see -inf (it sees its document's blocks from the first, as many as are complete), a
    stable descending sort (ties: the earlier block), the first top_blocks; ok where the query sees that many."""
    size, N = view.block_size, blocks.blocks
    B, c = blocks.doc_start.shape[0], rows.shape[0]
    dev = rows.device
    if not N:
        return torch.zeros(B, c, 0, dtype=torch.int64, device=dev), torch.zeros(B, c, 0, dtype=torch.bool, device=dev)
    n_visible = (rows[None] - blocks.doc_start[:, rows] + 1) // size  # [B, c] complete blocks each query sees
    scores = view.block_scores(iq, keys)  # [B, c, N]
    j = torch.arange(N, device=dev)
    first = blocks.first_block[:, rows]
    visible = (j >= first[..., None]) & (j < (first + n_visible)[..., None])
    scores = scores.masked_fill(~visible, float("-inf"))
    kk = min(view.top_blocks, N)
    chosen = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :kk]  # [B, c, kk]
    return chosen, torch.arange(kk, device=dev) < n_visible[..., None]


def passed_selection(view: IndexedAttentionView, selection, B: int, s: int) -> Selection:
    """The selection a layer that indexes nothing (`reuses_selection`) reads: the previous decoder layer's, handed on
    with its outputs (for this rank's queries); ValueError otherwise, as transformers raises without one."""
    if not isinstance(selection, Selection) or tuple(selection.pos.shape) != (B, s):
        got = type(selection).__name__ if not isinstance(selection, Selection) else \
            f"a selection of {tuple(selection.pos.shape)} queries"
        raise ValueError(f"{type(view.module).__name__} reuses the previous decoder layer's selection (a 'shared' "
                         f"indexer layer) and needs it as prev_topk_indices, a deltacp Selection of this rank's "
                         f"{(B, s)} queries; got {got} (the previous layer must be an indexed attention layer that "
                         f"runs its indexer)")
    return selection


def indexed_attention_forward(view: IndexedAttentionView, plan: AttentionCP, hidden_states: torch.Tensor,
                              position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                              attention_mask=None, cache=None, past_key_values=None, use_cache: bool | None = None,
                              position_ids: torch.Tensor | None = None, output_router_logits: bool | None = None,
                              prev_topk_indices: Selection | None = None, input_ids: torch.Tensor | None = None,
                              **unsupported):
    """The CP forward of an indexed attention layer on this rank's tokens (see the module docstring).
    position_ids: read upstream (the rotary embedding, the model hook's documents). output_router_logits: honoured
    by transformers' recording of the routers. attention_mask: None or the model hook's CPForwardContext.
    prev_topk_indices: the previous decoder layer's selection, read by a layer that reuses it
    (`view.reuses_selection`; a layer that indexes ignores it, as transformers does); what the layer returns is
    `view.outputs` (GLM-5.3-Flash hands its selection on to a "shared" next layer). input_ids: read upstream (the
    embedding; GLM-5.3-Flash's decoder layers pass them to their attention, which ignores them)."""
    hidden_states, docs = attention_inputs(view, hidden_states, attention_mask, unsupported, cache, past_key_values,
                                           use_cache, "indexed")
    if view.dropout:
        raise NotImplementedError(f"attention_dropout={view.dropout} in an indexed attention layer under CP is not "
                                  f"supported (set attention_dropout=0.0)")
    group = plan.across_group
    P, r = dist.get_world_size(group), dist.get_rank(group)
    B, s, _ = hidden_states.shape
    check_local_length(plan.balanced, s, P)
    S = P * s
    dev = hidden_states.device
    rows = Pieces(r, P, plan.balanced, s).row_index(dev)
    if view.reuses_selection:
        selection = passed_selection(view, prev_topk_indices, B, s)
    else:
        blocks = _row_blocks(docs, B, S, view.block_size, dev)
        with torch.no_grad():
            selection = select_tokens(view, blocks, hidden_states, position_embeddings, rows, group)
    q_BsHD, k_BsKD, v_BsKD, out = view.project(hidden_states, position_embeddings)
    shared_kv = v_BsKD is k_BsKD  # one tensor as keys and values (MLA's latent in its absorbed form): gathered once
    D = k_BsKD.shape[-1]
    kv_BsKX = k_BsKD if shared_kv else torch.cat([k_BsKD, v_BsKD], dim=-1)
    if P > 1:  # one all-gather of K and V, then row order
        kv_BsKX = to_row_order(all_gather_seq_autograd(kv_BsKX, 1, group), 1, P, plan.balanced)
    k_BSKD, v_BSKD = (kv_BsKX, kv_BsKX) if shared_kv else kv_BsKX.split([D, v_BsKD.shape[-1]], dim=-1)
    o = selected_attention(q_BsHD, k_BSKD, v_BSKD, selection, view.scaling)
    return view.outputs(view.output(o, out), selection)


def check_indexed_attention(view: IndexedAttentionView, method: str, ulysses_degree: int) -> dict:
    """An indexed attention layer runs with full_attention_cp='all_gather' in the 1-D layout (K/V all-gathered);
    anything else raises naming the setting and the allowed values. Returns the configuration every rank shares."""
    if method != "all_gather":
        raise ValueError(f"full_attention_cp={method!r}: the indexed attention layers ({type(view.module).__name__}) "
                         f"run under CP with full_attention_cp='all_gather' only (K/V all-gathered; allowed: "
                         f"('all_gather',))")
    if ulysses_degree != 1:
        raise ValueError(f"ulysses_degree={ulysses_degree}: the indexed attention layers "
                         f"({type(view.module).__name__}) run in the 1-D layout only (ulysses_degree None or cp)")
    return dict(family=view.family, num_attention_heads=view.num_heads, num_key_value_heads=view.num_kv_heads,
                head_dim=view.head_dim, full_attention_cp=method, block_size=view.block_size,
                top_blocks=view.top_blocks, pooling=view.pooling, reuses_selection=view.reuses_selection)


def install_indexed_attention(module, view: IndexedAttentionView, plan: AttentionCP):
    """Install the indexed forward on the module instance (class, parameters, state_dict unchanged)."""
    module.forward = partial(indexed_attention_forward, view, plan)
    return module


register_attention_forward(indexed_attention_forward)
