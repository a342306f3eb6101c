"""Causal per-document attention of a rank's queries (one contiguous run of the row, or two under the balanced
sequence layout) against keys held elsewhere (all-gathered, or passing by on a ring), tile by tile, merged by
log-sum-exp: flash attention's online softmax across calls.

A *tile* is one attention call on one block of queries and one block of keys of the same document, either fully
visible (the keys precede every query of the block) or the causal diagonal (keys = the queries' own positions,
a square block). Every (query, key) pair a query may see lies in exactly one tile, so no mask is ever built: a
tile runs a fused kernel with `is_causal` False or True (square), and the tiles of one query block merge as

    lse = logaddexp(lse_a, lse_b)        o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse)

Backward recomputes each tile with the merged output and log-sum-exp (the flash backward of a tile given the
global O and lse yields exactly that tile's share of dq, dk, dv), so nothing of size [queries, keys] is saved.
`block` bounds both sides of a tile (None: one tile per document part); the memory of a tile's call is the
kernel's (flash: O(tokens); the explicit math kernel for fp32/fp64 on CUDA: block x block scores).

Kernels, chosen by device and dtype (documented, not a fall-back): CUDA bf16/fp16 -> `aten._scaled_dot_product_
flash_attention`; CPU (any float dtype) -> `aten._scaled_dot_product_flash_attention_for_cpu`; CUDA fp32/fp64 ->
explicit math on the tile. Dropout is not supported (callers refuse it).

Shape legend: q_BHLD the rank's queries (L tokens of each row, in the row-position runs the plan names), k_BHSD / v_BHSD keys and values of
row positions [0, S) (Hk heads; Hq / Hk query heads read each, as in GQA); lse_BHL log-sum-exp per query.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch

from deltacp.ops.precision import compute_dtype
from deltacp.ops.recompute import keep_outputs
from deltacp.parallel.placement import Pieces


@dataclass(frozen=True)
class Tile:
    rows: tuple[int, int]  # batch rows [lo, hi)
    q: tuple[int, int]  # local query positions [lo, hi) (the rank's queries in their local order)
    k: tuple[int, int]  # key row positions [lo, hi)
    causal: bool  # the square diagonal block (keys = the queries' own row positions)


def plan_span_tiles(B: int, S: int, spans, cu_seqlens: torch.Tensor | None, block: int | None) -> list[Tile]:
    """The tiles of the queries of every row of S tokens that lie in `spans`, a sequence of row-position runs
    [lo, hi) held one after the other locally (span i starts at local position sum of the earlier spans'
    lengths: one span for a contiguous slice, two for a balanced one, `placement.Pieces.spans`). `cu_seqlens`:
    documents over the flattened [B * S] stream, in row order (None: one causal sequence per row). Tiles of one
    query block are consecutive."""
    segments = []  # (rows, first query, end query, document start, local offset of row position 0)
    cu = None if cu_seqlens is None else cu_seqlens.tolist()
    if cu is not None and cu[-1] != B * S:
        raise ValueError(f"attention documents cover {cu[-1]} tokens, expected the flattened batch B * S = "
                         f"{B} * {S}")
    local = 0
    for q0, q1 in spans:
        if not 0 <= q0 < q1 <= S:
            raise ValueError(f"query span [{q0}, {q1}) is not a non-empty run of a row of {S} tokens")
        shift = local - q0
        if cu is None:
            segments.append(((0, B), q0, q1, 0, shift))
        else:
            for b in range(B):
                base, lo, hi = b * S, b * S + q0, b * S + q1
                i = bisect_right(cu, lo) - 1
                while i < len(cu) - 1 and cu[i] < hi:
                    start = max(cu[i], base)  # documents never cross rows (padding documents end at row ends)
                    segments.append(((b, b + 1), max(cu[i], lo) - base, min(cu[i + 1], hi) - base, start - base,
                                     shift))
                    i += 1
        local += q1 - q0
    tiles = []
    for rows, a, e, start, shift in segments:
        step = block or (e - a)
        for qa in range(a, e, step):
            qb = min(e, qa + step)
            kstep = block or max(qa - start, 1)
            for ka in range(start, qa, kstep):
                tiles.append(Tile(rows, (qa + shift, qb + shift), (ka, min(qa, ka + kstep)), False))
            tiles.append(Tile(rows, (qa + shift, qb + shift), (qa, qb), True))
    return tiles


def plan_tiles(B: int, S: int, q0: int, L: int, cu_seqlens: torch.Tensor | None, block: int | None) -> list[Tile]:
    """`plan_span_tiles` of one contiguous run of queries [q0, q0 + L) (local position 0 at row position q0)."""
    return plan_span_tiles(B, S, [(q0, q0 + L)], cu_seqlens, block)


def split_tiles_by_block(tiles: list[Tile], block_len: int, holder=None) -> dict[int, list[Tile]]:
    """Tiles cut at key positions that are multiples of `block_len` (the row's pieces: piece p holds key positions
    [p * block_len, (p + 1) * block_len)) and grouped by the ring member holding the key piece; keys re-based to
    that member's local keys. `holder(p)` -> (member, slot): the member holds p as its slot-th piece of
    block_len keys (`placement.Pieces.holder`); None: member p holds piece p alone (a contiguous layout)."""
    out: dict[int, list[Tile]] = {}
    for t in tiles:
        ka, kb = t.k
        while ka < kb:
            p = ka // block_len
            end = min(kb, (p + 1) * block_len)
            if t.causal and end != kb:
                raise ValueError("a causal diagonal tile crosses a ring block (queries outside the rank's block)")
            member, slot = (p, 0) if holder is None else holder(p)
            shift = slot * block_len - p * block_len
            out.setdefault(member, []).append(Tile(t.rows, t.q, (ka + shift, end + shift), t.causal))
            ka = end
    return out


# ---------------------------------------------------------------------------------------------------------------
# One tile: (o, lse) forward, (dq, dk, dv) backward given the merged o and lse
# ---------------------------------------------------------------------------------------------------------------


def tile_kernel(q) -> str:
    """flash_cuda (CUDA bf16/fp16), flash_cpu (CPU), or math (CUDA fp32/fp64: no fused kernel with a log-sum-exp)."""
    if q.is_cuda:
        return "flash_cuda" if q.dtype in (torch.float16, torch.bfloat16) else "math"
    return "flash_cpu"


def tile_forward(q, k, v, causal: bool, scale: float):
    """q [b, H, lq, D], k/v [b, H, lk, D] (heads already matched) -> o [b, H, lq, D], lse [b, H, lq], and what the
    kernel's backward needs of its forward besides (CUDA flash: sequence metadata and RNG state, passed back
    as the forward returned them, as torch's own ring attention does; None otherwise)."""
    kernel = tile_kernel(q)
    if kernel == "flash_cuda":
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out[0], out[1], tuple(out[2:8])
    if kernel == "flash_cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return o, lse, None
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return (s - lse[..., None]).exp() @ v, lse, None


def tile_backward(do, q, k, v, o, lse, causal: bool, scale: float, meta=None):
    kernel = tile_kernel(q)
    if kernel == "flash_cuda":
        cum_q, cum_k, max_q, max_k, seed, offset = meta
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    if kernel == "flash_cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, o, lse, 0.0, causal,
                                                                                   scale=scale)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    p = (s - lse[..., None]).exp()
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, dv


def _expand(x, groups):
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce(dx, groups):
    return dx if groups == 1 else dx.unflatten(1, (-1, groups)).sum(2)


def _folds(t: Tile, groups: int) -> bool:
    """Whether a tile runs with its query heads folded into the query length (see `_tile_views`)."""
    return groups > 1 and not t.causal


def _fold(x_bHlX: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, H, l, ...] (H = Hk * groups, query head i reads KV head i // groups) -> [b, Hk, groups * l, ...]."""
    b, H, l = x_bHlX.shape[:3]
    return x_bHlX.reshape(b, H // groups, groups * l, *x_bHlX.shape[3:])


def _unfold(x_bKmX: torch.Tensor, groups: int) -> torch.Tensor:
    b, Hk, m = x_bKmX.shape[:3]
    return x_bKmX.reshape(b, Hk * groups, m // groups, *x_bKmX.shape[3:])


def _tile_views(t: Tile, q, k, v, groups):
    """The tile's q, k, v for one kernel call, heads matched. A fully visible tile (no causal mask) folds the query
    heads that read one KV head into its query length ([b, Hk, groups * lq, D] against [b, Hk, lk, D]): exact,
    since every query sees every key of the tile, and K, V are neither repeated nor their gradients summed. The
    causal diagonal keeps one query row per position (the kernel's mask is positional) and repeats K, V."""
    r = slice(*t.rows)
    q_t, k_t, v_t = q[r, :, t.q[0]:t.q[1]], k[r, :, t.k[0]:t.k[1]], v[r, :, t.k[0]:t.k[1]]
    if _folds(t, groups):
        return _fold(q_t, groups), k_t.contiguous(), v_t.contiguous()
    return q_t.contiguous(), _expand(k_t, groups).contiguous(), _expand(v_t, groups).contiguous()


class TileAccumulator:
    """Merges tiles' (o, lse) into the output of every query (in the compute dtype)."""

    def __init__(self, q):
        B, H, L, D = q.shape
        self.o = q.new_zeros((B, H, L, D), dtype=compute_dtype(q))
        self.lse = q.new_full((B, H, L), float("-inf"), dtype=compute_dtype(q))

    def add(self, t: Tile, o_t, lse_t):
        r, qs = slice(*t.rows), slice(*t.q)
        old = self.lse[r, :, qs]
        new = torch.logaddexp(old, lse_t.to(old.dtype))
        self.o[r, :, qs] = (self.o[r, :, qs] * (old - new).exp()[..., None]
                            + o_t.to(self.o.dtype) * (lse_t.to(old.dtype) - new).exp()[..., None])
        self.lse[r, :, qs] = new


def forward_tiles(acc: TileAccumulator, tiles, q, k, v, scale) -> list:
    """Merge every tile into `acc`; returns each tile's kernel metadata for `backward_tiles`."""
    groups = q.shape[1] // k.shape[1]
    metas = []
    for t in tiles:
        o_t, lse_t, meta = tile_forward(*_tile_views(t, q, k, v, groups), t.causal, scale)
        if _folds(t, groups):
            o_t, lse_t = _unfold(o_t, groups), _unfold(lse_t, groups)
        acc.add(t, o_t, lse_t)
        metas.append(meta)
    return metas


def backward_tiles(tiles, metas, do, q, k, v, o, lse, scale, dq, dk, dv):
    """Accumulate every tile's dq, dk, dv (in place; dk/dv have k's heads)."""
    groups = q.shape[1] // k.shape[1]
    for t, meta in zip(tiles, metas, strict=True):
        r, qs, ks = slice(*t.rows), slice(*t.q), slice(*t.k)
        qt, kt, vt = _tile_views(t, q, k, v, groups)
        lse_t = lse[r, :, qs]
        if tile_kernel(q) == "flash_cuda":
            lse_t = lse_t.float()
        do_t, o_t, lse_t = do[r, :, qs], o[r, :, qs], lse_t
        if folded := _folds(t, groups):
            do_t, o_t, lse_t = _fold(do_t, groups), _fold(o_t, groups), _fold(lse_t, groups)
        dq_t, dk_t, dv_t = tile_backward(do_t.contiguous(), qt, kt, vt, o_t.contiguous(), lse_t.contiguous(),
                                         t.causal, scale, meta)
        dq[r, :, qs] += (_unfold(dq_t, groups) if folded else dq_t).to(dq.dtype)
        dk[r, :, ks] += (dk_t if folded else _reduce(dk_t, groups)).to(dk.dtype)
        dv[r, :, ks] += (dv_t if folded else _reduce(dv_t, groups)).to(dv.dtype)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tiles, scale):
        def compute():
            acc = TileAccumulator(q)
            metas = forward_tiles(acc, tiles, q, k, v, scale)
            return acc.o.to(q.dtype), acc.lse, metas

        # a selective checkpoint's recompute takes the forward's merged o and lse (ops/recompute.py)
        o, lse, ctx.metas = keep_outputs("tiled attention", compute)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.tiles, ctx.scale = tiles, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dt = compute_dtype(q)
        dq, dk, dv = (torch.zeros_like(x, dtype=dt) for x in (q, k, v))
        backward_tiles(ctx.tiles, ctx.metas, do.contiguous(), q, k, v, o, lse, ctx.scale, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def tiled_attention(q_BHLD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, tiles: list[Tile],
                    scale: float) -> torch.Tensor:
    """Attention of q over the keys the tiles name (see `plan_tiles`), differentiable in q, k and v."""
    return _TiledAttention.apply(q_BHLD, k_BHSD, v_BHSD, tiles, scale)


# ---------------------------------------------------------------------------------------------------------------
# Ring: key/value blocks travel around the group instead of being gathered
# ---------------------------------------------------------------------------------------------------------------


class _RingAttention(torch.autograd.Function):
    """Ring attention over `ring` (a RingPassing): rank g holds the keys/values of its pieces of the row (its block:
    contiguous, row positions [g * L, (g + 1) * L); balanced, pieces g and 2G - 1 - g of L / 2 each) and its
    queries are those same positions; `buckets` are the tiles grouped by the rank holding their keys, keys
    re-based to that rank's block (`split_tiles_by_block`). Forward: G steps; at step t the rank holds block
    (g - t) mod G, posts the exchange that brings the next block, computes its tiles on the held block
    (contiguous: only blocks <= g have any; balanced: every block has the same causal work), waits. Backward: the same walk recomputing each tile from the merged o and lse, with the
    block's dk/dv accumulator travelling behind the block (its hop overlapping the next step's tiles); after G
    exchanges of the accumulator every block's gradient is back on its owner. Exchanges are issued in the same
    order on every rank (K|V of step t, then dK|dV of step t), so each neighbour pair matches them in order. Memory: two blocks of k/v (and of their gradient), never the gathered row."""

    @staticmethod
    def forward(ctx, q, k, v, buckets, scale, ring):
        def compute():
            G, g = ring.size, ring.rank
            acc = TileAccumulator(q)
            kv = torch.stack([k, v])
            metas = {}
            for t in range(G):
                src = (g - t) % G
                pending = ring.exchange(kv, "kv") if t < G - 1 else None
                metas[src] = forward_tiles(acc, buckets.get(src, ()), q, kv[0], kv[1], scale)
                if pending is not None:
                    kv = pending.wait()
            return acc.o.to(q.dtype), acc.lse, metas

        # a selective checkpoint's recompute takes the forward's merged o and lse, and issues no exchange (every
        # rank alike: ops/recompute.py)
        o, lse, ctx.metas = keep_outputs("ring attention", compute)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.buckets, ctx.scale, ctx.ring = buckets, scale, ring
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        ring = ctx.ring
        G, g = ring.size, ring.rank
        dt = compute_dtype(q)
        dq = torch.zeros_like(q, dtype=dt)
        kv = torch.stack([k, v])
        do = do.contiguous()
        incoming = None  # the accumulator of the block held now, from the ranks that held it before
        for t in range(G):
            src = (g - t) % G
            pending = ring.exchange(kv, "kv bwd") if t < G - 1 else None
            dkv = torch.zeros_like(kv, dtype=dt)
            backward_tiles(ctx.buckets.get(src, ()), ctx.metas[src], do, q, kv[0], kv[1], o, lse, ctx.scale, dq,
                           dkv[0], dkv[1])
            if incoming is not None:
                dkv += incoming.wait()
            # the accumulator of block src follows it to rank g + 1 (after the last step: its owner); the hop
            # overlaps the next step's tiles
            incoming = ring.exchange(dkv, "dkv") if G > 1 else None
            if pending is not None:
                kv = pending.wait()
        if incoming is not None:
            dkv = incoming.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q_BHLD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor, tiles: list[Tile],
                   scale: float, ring, balanced: bool = False) -> torch.Tensor:
    """Attention of this rank's queries over the keys the tiles name, with keys and values held one block per rank
    and passed around the ring. The rank's queries, keys and values are its pieces of the row in local order
    (`placement.Pieces` of member g = ring.rank of G = ring.size: row positions [g L, (g + 1) L); balanced,
    pieces g and 2G - 1 - g of L / 2 each). Differentiable."""
    pieces = Pieces(ring.rank, ring.size, balanced, q_BHLD.shape[2])
    buckets = split_tiles_by_block(tiles, pieces.piece_length, pieces.holder)
    return _RingAttention.apply(q_BHLD, k_BHLD, v_BHLD, buckets, scale, ring)
