"""Sliding-window attention under CP: a K/V halo of window - 1 tokens, then local banded attention.

A query at row position i of a layer with window W (transformers' convention, `masking_utils.sliding_window_overlay`:
key j is visible iff i - W < j <= i) reads itself and the W - 1 tokens before it, within its document. So a rank needs
only the W - 1 keys and values before each of its pieces (`placement.Pieces`): the layer projects its own tokens
(norms, rotary at their row positions), fetches that halo of the post-rotary K and V from whichever ranks hold it
(`collectives.halo_exchange` through `token_halo.left_context`: one all-to-all-v on the CP group; a window longer
than a piece reaches back over several pieces, each part from its holder; zeros before the row's start), and attends
each piece's queries to [halo | piece] with a band mask:

    visible(i, j) = max(i - W + 1, start(i)) <= j <= i       start(i): the row position of i's document start

Documents (packed rows) and padding (a padded row's valid run and its padding are documents, `documents.py`) stop a
window at the document start; positions before the row never pass `start`. The same in every full-attention method
and both sequence layouts: a sliding layer holds no head shard and no gathered row, so the 1-D and 2-D layouts, the
Ulysses degree and `full_attention_cp` do not change it (`FullAttentionContextParallel` installs this forward on
every attention module whose view has a window).

Kernel: queries in blocks of `block` (at least W), each block one `F.scaled_dot_product_attention` call against the
block + W - 1 keys it may see, with its [B, 1, block, block + W - 1] boolean band mask; no [S, S] or [s, S] tensor at
any length. The same call on every device (CPU: the math or flash-for-CPU kernel; CUDA: the memory-efficient kernel,
which takes a mask): one code path, the one the CPU tests verify. A flash kernel with a native window (FA2's
window_size_left) would drop the mask; it waits for a GPU to measure and verify it on.

Collectives per sliding layer: one all-to-all-v forward (its dual backward) on the CP group, on every rank, in the
same order, whatever its tokens, documents or padding: it cannot deadlock (docs/design.md, section 8).

Shape legend: x_BsD local hidden states; q_BsHD local tokens, all heads; q_BHnD one piece's queries; kv_BmX a
piece's halo + tokens (m = W - 1 + n), K and V flattened side by side.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from deltacp.parallel.attention import attention_inputs, one_head_dim, register_attention_forward
from deltacp.parallel.documents import CPForwardContext
from deltacp.parallel.placement import Pieces
from deltacp.parallel.token_halo import left_context
from deltacp.parallel.views import AttentionView, IndexedAttentionView, attention_view_of, bind_call

MIN_BLOCK = 256  # queries per SDPA call (at least the window): the band mask of a call is block x (block + W - 1)


def check_sliding_attention(view: AttentionView) -> dict:
    """A sliding-window attention's configuration every rank must share, or an error naming the setting."""
    window = view.sliding_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window={window!r}: expected an integer >= 1 (the tokens a query sees, itself "
                         f"included)")
    if isinstance(view, IndexedAttentionView):
        raise NotImplementedError(f"an indexed attention with sliding_window={window} has no CP method")
    return dict(family=view.family, num_attention_heads=view.num_heads, num_key_value_heads=view.num_kv_heads,
                head_dim=view.head_dim, sliding_window=window, full_attention_cp="sliding_window_halo")


def band_attention(q_BHnD: torch.Tensor, k_BHmD: torch.Tensor, v_BHmD: torch.Tensor, first: int, window: int,
                   starts_Bn: torch.Tensor, scale: float, block: int | None = None) -> torch.Tensor:
    """Sliding-window attention of n queries at row positions first .. first + n - 1 over keys at row positions
    first - (window - 1) .. first + n - 1 (m = window - 1 + n; the halo first), causal, each query seeing the keys
    at or after max(its position - window + 1, its document start) (`starts_Bn`, row positions). Query blocks of
    `block` (default max(window, MIN_BLOCK)), each one SDPA call with its band mask. -> [B, H, n, D]."""
    B, H, n, _ = q_BHnD.shape
    halo = window - 1
    if k_BHmD.shape[2] != halo + n:
        raise ValueError(f"{k_BHmD.shape[2]} keys for {n} queries and a window of {window}: expected {halo + n}")
    if k_BHmD.shape[1] != H:  # grouped KV heads: each read by H / Hk query heads, in order
        k_BHmD, v_BHmD = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (k_BHmD, v_BHmD))
    block = max(window, MIN_BLOCK) if block is None else block
    starts_Bn = starts_Bn.to(q_BHnD.device)
    out = []
    for a in range(0, n, block):
        b = min(n, a + block)
        q_pos = torch.arange(first + a, first + b, device=q_BHnD.device)  # row positions of the block's queries
        k_pos = torch.arange(first + a - halo, first + b, device=q_BHnD.device)  # ... of the keys they may see
        lower = torch.maximum(q_pos - halo, starts_Bn[:, a:b])  # [B, nb]
        mask = (k_pos[None, None] <= q_pos[None, :, None]) & (k_pos[None, None] >= lower[..., None])
        out.append(F.scaled_dot_product_attention(q_BHnD[:, :, a:b], k_BHmD[:, :, a:b + halo],
                                                  v_BHmD[:, :, a:b + halo], attn_mask=mask[:, None], scale=scale))
    return torch.cat(out, dim=2)


def sliding_attention_forward(view: AttentionView, group, balanced: bool, hidden_states: torch.Tensor,
                              position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                              attention_mask: CPForwardContext | None = None, cache=None, past_key_values=None,
                              use_cache: bool | None = None, position_ids: torch.Tensor | None = None,
                              output_router_logits: bool | None = None, **unsupported):
    """A sliding-window attention layer on this rank's pieces of the row (module docstring). position_ids: read
    upstream (the rotary embedding, the model hook's documents); output_router_logits: passed down every decoder
    layer of an MoE model, nothing to do here; every other keyword raises (`attention_inputs`)."""
    view = bind_call(view, unsupported)
    hidden_states, docs = attention_inputs(view, hidden_states, attention_mask, unsupported, cache,
                                            past_key_values, use_cache, "sliding-window")
    if view.dropout:
        raise NotImplementedError(f"attention_dropout={view.dropout} with a sliding window under CP is not "
                                  f"supported (set attention_dropout=0.0)")
    window = view.sliding_window
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    B, s, _ = hidden_states.shape
    pieces = Pieces(rank, P, balanced, s)  # raises for an odd length under 'balanced'
    q_BsHD, k_BsHD, v_BsHD, out = view.project(hidden_states, view.positions(position_embeddings, position_ids))
    q_BsHD, k_BsHD, v_BsHD, dv = one_head_dim(q_BsHD, k_BsHD, v_BsHD)
    Hk, D = k_BsHD.shape[2:]
    kv_BsX = torch.cat([k_BsHD, v_BsHD], dim=2).flatten(2)  # one exchange for K and V
    S = pieces.row_length
    starts = None if docs is None else docs.starts(B, S, pieces.spans())
    o = []
    for slot, (kv_BmX, (lo, hi)) in enumerate(zip(left_context(kv_BsX, window - 1, group, pieces), pieces.spans())):
        k_BHmD, v_BHmD = kv_BmX.unflatten(2, (2 * Hk, D)).transpose(1, 2).split(Hk, dim=1)
        q_BHnD = q_BsHD[:, pieces.local(slot)].transpose(1, 2)
        starts_Bn = torch.zeros(B, hi - lo, dtype=torch.int64) if starts is None else starts[:, pieces.local(slot)]
        o.append(band_attention(q_BHnD, k_BHmD, v_BHmD, lo, window, starts_Bn, view.scaling))
    o_BsX = torch.cat(o, dim=2)[..., :dv].transpose(1, 2).flatten(2)
    return view.output(o_BsX, out), None


register_attention_forward(sliding_attention_forward)


def install_sliding_attention(module: nn.Module, group, balanced: bool = False) -> nn.Module:
    """Install the sliding-window forward on the module instance (class, parameters and state_dict unchanged)."""
    module.forward = partial(sliding_attention_forward, attention_view_of(module), group, balanced)
    return module
