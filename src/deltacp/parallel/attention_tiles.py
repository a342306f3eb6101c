"""Causal per-document attention of a rank's queries (one contiguous run of the row, or two under the balanced
sequence layout) against keys held elsewhere (all-gathered, or passing by on a ring), tile by tile, merged by
log-sum-exp: flash attention's online softmax across calls.

A *tile* is one attention call on one block of queries and one block of keys of the same document, either fully
visible (the keys precede every query of the block) or the causal diagonal (keys = the queries' own positions,
a square block). Every (query, key) pair a query may see lies in exactly one tile, so no mask is ever built: a
tile runs a fused kernel with `is_causal` False or True (square), and the tiles of one query block merge as

    lse = logaddexp(lse_a, lse_b)        o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse)

into a float32 accumulator (`TileAccumulator`; on CUDA one pass of `ops/fused/attention_merge.py` per tile, the
eager ops elsewhere). A kernel reads its operands contiguous (the query heads folded onto the KV heads for a
visible tile: a view of the same copy); the ring keeps those copies of its query pieces for the whole call, within
twice the queries' bytes, and of each block for its step (`OperandCopies`), where every step would otherwise copy
them again.

Backward recomputes each tile with the merged output and log-sum-exp (the flash backward of a tile given the
global O and lse yields exactly that tile's share of dq, dk, dv), so nothing of size [queries, keys] is saved.
`block` bounds both sides of a tile (None: one tile per document part); the memory of a tile's call is the
kernel's (flash: O(tokens); the explicit math kernel for fp32/fp64 on CUDA: block x block scores).

Packed documents: the diagonals of consecutive documents in one query block form one *packed* tile
(`pack_diagonals`: square causal blocks back to back, `Tile.packed` their offsets), which the GPU runs as ONE
varlen flash call, so the number of kernel calls follows the tokens, not the documents. A kernel without a varlen
form runs a packed tile diagonal by diagonal (exact; the CPU and the fp32/fp64 path).

Kernels, documented choices, never a try/except fall-back. The device and dtype pick the family (`tile_kernel`):
CPU (any float dtype) `aten._scaled_dot_product_flash_attention_for_cpu`; CUDA fp32/fp64 explicit math on the
tile (no fused kernel returns a log-sum-exp in those dtypes); CUDA bf16/fp16 the fused kernels, chosen per tile
(`fused_kernel`) from the measured table `CUDNN_TILES`:
- cudnn: `aten._scaled_dot_product_cudnn_attention` (+ backward) where the table has a row for the device's
  capability, the head dim and the tile's kind, and the tile's shorter side reaches the row's length; its causal
  diagonal reads grouped KV heads as they are (GQA), where flash gets them repeated (a visible tile folds its
  query heads onto the KV heads for every kernel, `_dense_views`);
- flash: `aten._scaled_dot_product_flash_attention` (+ backward) on every other tile; always under
  `torch.use_deterministic_algorithms(True)` (cuDNN's backward is not bitwise reproducible; FA2's is under that
  switch) and on tiles whose shape follows the documents (`Tile.ragged`: cuDNN builds an execution plan for
  every new shape, tens to hundreds of milliseconds, and packed batches bring new shapes every step);
- flash_varlen: `aten._flash_attention_forward` / `_backward` with cu_seqlens on a packed tile (K, V heads
  expanded: the varlen op takes equal head counts). cuDNN's ragged form measured 12x slower (NOTES.md).
Dropout is not supported (callers refuse it).

Shape legend: q_BHLD the rank's queries (L tokens of each row, in the row-position runs the plan names), k_BHSD / v_BHSD keys and values of
row positions [0, S) (Hk heads; Hq / Hk query heads read each, as in GQA); lse_BHL log-sum-exp per query;
x_THD a packed tile's tokens, heads second (the varlen kernels' layout).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, replace
from functools import cache
from itertools import accumulate

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
    ragged: bool = False  # the tile's shape follows the batch's documents (it changes from batch to batch)
    packed: tuple[int, ...] = ()  # packed tile: offsets (0, ..., length) of its square causal diagonals


def plan_span_tiles(B: int, S: int, spans, cu_seqlens: torch.Tensor | None, block: int | None) -> list[Tile]:
    """The tiles of the queries of every row of S tokens that lie in `spans`, a sequence of row-position runs
    [lo, hi) held one after the other locally (span i starts at local position sum of the earlier spans'
    lengths: one span for a contiguous slice, two for a balanced one, `placement.Pieces.spans`). `cu_seqlens`:
    documents over the flattened [B * S] stream, in row order (None: one causal sequence per row). Tiles of one
    query block are consecutive; one tile per document part (`pack_diagonals` then merges diagonals)."""
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
    ragged = cu is not None
    tiles = []
    for rows, a, e, start, shift in segments:
        step = block or (e - a)
        for qa in range(a, e, step):
            qb = min(e, qa + step)
            kstep = block or max(qa - start, 1)
            for ka in range(start, qa, kstep):
                tiles.append(Tile(rows, (qa + shift, qb + shift), (ka, min(qa, ka + kstep)), False, ragged))
            tiles.append(Tile(rows, (qa + shift, qb + shift), (qa, qb), True, ragged))
    return tiles


def plan_tiles(B: int, S: int, q0: int, L: int, cu_seqlens: torch.Tensor | None, block: int | None) -> list[Tile]:
    """`plan_span_tiles` of one contiguous run of queries [q0, q0 + L) (local position 0 at row position q0)."""
    return plan_span_tiles(B, S, [(q0, q0 + L)], cu_seqlens, block)


def pack_diagonals(tiles: list[Tile], block: int | None) -> list[Tile]:
    """Runs of consecutive causal diagonals of one row that follow each other in queries and in keys (the
    diagonals of consecutive documents, as `plan_span_tiles` lists them) merged into packed tiles of at most
    `block` tokens (None: no bound), each one kernel call; every other tile kept as it is, in order. A packed tile
    is exact whatever its diagonals are: each is causal on its own, and what a query sees before its diagonal
    lies in the visible tiles."""
    out, run = [], []

    def flush():
        if len(run) == 1:
            out.append(run[0])
        elif run:
            offsets = (0, *accumulate(t.q[1] - t.q[0] for t in run))
            out.append(Tile(run[0].rows, (run[0].q[0], run[-1].q[1]), (run[0].k[0], run[-1].k[1]), True,
                            run[0].ragged, offsets))
        run.clear()

    for t in tiles:
        diagonal = t.causal and not t.packed
        if diagonal and run and t.rows == run[-1].rows and t.q[0] == run[-1].q[1] and t.k[0] == run[-1].k[1] \
                and (block is None or t.q[1] - run[0].q[0] <= block):
            run.append(t)
            continue
        flush()
        (run if diagonal else out).append(t)
    flush()
    return out


def unpack(t: Tile) -> list[Tile]:
    """A packed tile's diagonals as tiles of their own (a tile that is not packed: itself)."""
    if not t.packed:
        return [t]
    return [Tile(t.rows, (t.q[0] + a, t.q[0] + b), (t.k[0] + a, t.k[0] + b), True, t.ragged)
            for a, b in zip(t.packed[:-1], t.packed[1:])]


def split_tiles_by_block(tiles: list[Tile], block_len: int, holder=None, block: int | None = None
                         ) -> dict[int, list[Tile]]:
    """Tiles cut at key positions that are multiples of `block_len` (the row's pieces: piece p holds key positions
    [p * block_len, (p + 1) * block_len)) and grouped by the ring member holding the key piece; keys re-based to
    that member's local keys. `holder(p)` -> (member, slot): the member holds p as its slot-th piece of
    block_len keys (`placement.Pieces.holder`); None: member p holds piece p alone (a contiguous layout). Two
    parts of one visible tile that land next to each other in a member's local keys (a balanced member's two
    pieces, both before the queries) are one tile again, of at most `block` keys (None: no bound): one kernel
    call where there were two, exact since every query of a visible tile sees every key."""
    out: dict[int, list[Tile]] = {}
    for t in tiles:
        ka, kb = t.k
        while ka < kb:
            p = ka // block_len
            end = min(kb, (p + 1) * block_len)
            part = _key_part(t, ka, end)
            member, slot = (p, 0) if holder is None else holder(p)
            shift = slot * block_len - p * block_len
            part = replace(part, k=(ka + shift, end + shift))
            bucket = out.setdefault(member, [])
            last = bucket[-1] if bucket else None
            if last is not None and not part.causal and not last.causal and (last.rows, last.q) == (part.rows, part.q) \
                    and last.k[1] == part.k[0] and (block is None or part.k[1] - last.k[0] <= block):
                bucket[-1] = replace(last, k=(last.k[0], part.k[1]), ragged=last.ragged or part.ragged)
            else:
                bucket.append(part)
            ka = end
    return out


def _key_part(t: Tile, ka: int, kb: int) -> Tile:
    """The part of tile t on keys [ka, kb): a visible tile's keys cut; a packed tile's diagonals in that range (its
    queries are its keys); a diagonal, whole."""
    if (ka, kb) == t.k or not t.causal:
        return replace(t, k=(ka, kb))
    a, b = ka - t.k[0], kb - t.k[0]
    if not (a in t.packed and b in t.packed):
        raise ValueError("a causal diagonal tile crosses a ring block (queries outside the rank's block)")
    offsets = tuple(o - a for o in t.packed if a <= o <= b)
    return replace(t, q=(t.q[0] + a, t.q[0] + b), k=(ka, kb), packed=offsets if len(offsets) > 2 else ())


# ---------------------------------------------------------------------------------------------------------------
# The kernel of a tile
# ---------------------------------------------------------------------------------------------------------------

# Where cuDNN's fused attention beats flash (FA2) on a bf16 tile: (capability, head dim, tile kind) -> the shortest
# tile side (tokens) from which it does; every other device, head dim, kind or smaller tile runs flash. The rows are
# `python bench/attention_kernels.py` on an H200 (capability 9.0, torch 2.11 + cuDNN 9.19, 8 query heads, 2 KV
# heads, bf16; `bash scripts/gpu_checks.sh tiles`), 2026-12-04: cuDNN faster fwd + bwd at every measured tile from
# 1K to 64K on each side, head dim 128 and 256, 1.39-2.86x (head dim 256: diagonal 1.60-1.85x, visible 1.39-1.55x;
# its backward gains least, 1.37x at 64K x 64K). Its first call at a new shape builds a plan (~100 ms, measured),
# which is why ragged tiles stay on flash. Add a device by running the bench there.
CUDNN_TILES: dict[tuple[tuple[int, int], int, str], int] = {
    ((9, 0), 128, "diagonal"): 1024,
    ((9, 0), 128, "visible"): 1024,
    ((9, 0), 256, "diagonal"): 1024,
    ((9, 0), 256, "visible"): 1024,
}
FUSED_KERNELS = ("cudnn", "flash")  # what `tiled_attention(kernel=)` may force (benches compare them)


def tile_kernel(q) -> str:
    """The kernel family of q's device and dtype: "fused" (CUDA bf16/fp16: cuDNN or flash, per tile, by
    `fused_kernel`), "flash_cpu" (CPU), or "math" (CUDA fp32/fp64: no fused kernel with a log-sum-exp)."""
    if q.is_cuda:
        return "fused" if q.dtype in (torch.float16, torch.bfloat16) else "math"
    return "flash_cpu"


def tile_kind(t: Tile) -> str:
    """"packed" (several causal diagonals in one call), "diagonal" (one causal square) or "visible"."""
    return "packed" if t.packed else "diagonal" if t.causal else "visible"


def fused_kernel(capability: tuple[int, int], head_dim: int, t: Tile, deterministic: bool) -> str:
    """The fused CUDA kernel of one bf16/fp16 tile: "flash_varlen" (packed), "cudnn" (a `CUDNN_TILES` row whose
    length the tile's shorter side reaches, unless `deterministic` or the tile is ragged) or "flash"."""
    kind = tile_kind(t)
    if kind == "packed":
        return "flash_varlen"
    if deterministic or t.ragged:
        return "flash"
    shortest = CUDNN_TILES.get((tuple(capability), head_dim, kind))
    side = min(t.q[1] - t.q[0], t.k[1] - t.k[0])
    return "cudnn" if shortest is not None and side >= shortest else "flash"


@cache
def device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def choose_kernel(q, t: Tile, forced: str | None = None) -> str:
    """The kernel that runs tile t of queries q: the family's (`tile_kernel`), and for the fused family the table's
    (`fused_kernel`; `forced`: "cudnn" or "flash" on every tile that is not packed, for comparisons)."""
    family = tile_kernel(q)
    if family != "fused":
        return family
    if forced is not None and not t.packed:
        return forced
    return fused_kernel(device_capability(q.device.index), q.shape[-1], t, torch.are_deterministic_algorithms_enabled())


def check_forced_kernel(kernel: str | None) -> None:
    if kernel is not None and kernel not in FUSED_KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected None (the measured table chooses) or one of {FUSED_KERNELS}")


# ---------------------------------------------------------------------------------------------------------------
# One tile: (o, lse) forward, (dq, dk, dv) backward given the merged o and lse
# ---------------------------------------------------------------------------------------------------------------


def _expand(x, groups):
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce(dx, groups):
    return dx if groups == 1 else dx.unflatten(1, (-1, groups)).sum(2)


def _fold(x_bHlX: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, H, l, ...] (H = Hk * groups, query head i reads KV head i // groups) -> [b, Hk, groups * l, ...]."""
    b, H, l = x_bHlX.shape[:3]
    return x_bHlX.reshape(b, H // groups, groups * l, *x_bHlX.shape[3:])


def _unfold(x_bKmX: torch.Tensor, groups: int) -> torch.Tensor:
    b, Hk, m = x_bKmX.shape[:3]
    return x_bKmX.reshape(b, Hk * groups, m // groups, *x_bKmX.shape[3:])


def _thd(x_1HlD: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """[1, H, l, D] -> [l, H * groups, D] (contiguous, each head repeated `groups` times), the varlen kernels'
    layout, in one copy."""
    x_lHD = x_1HlD[0].transpose(0, 1)
    return (x_lHD.repeat_interleave(groups, dim=1) if groups > 1 else x_lHD).contiguous()


def _from_thd(x_lHD: torch.Tensor) -> torch.Tensor:
    return x_lHD.transpose(0, 1)[None]


def _slices(t: Tile, q, k, v):
    r = slice(*t.rows)
    return q[r, :, t.q[0]:t.q[1]], k[r, :, t.k[0]:t.k[1]], v[r, :, t.k[0]:t.k[1]]


class OperandCopies:
    """The laid-out copies of tile operands (contiguous, K/V repeated per query head, token-major) made once per
    (tensor, rows, positions, form) and handed out again while this lives and they fit `budget` bytes (None: no
    bound; past the budget a copy is made anew at each use, as without this). A ring attention call keeps one for its
    query-side operands (q; in backward dO, o and lse), which every ring step's tiles read again, bounded by twice
    the rank's queries' bytes, and one per step for the block's keys and values, which the step's query pieces
    share (unbounded: one block's worth). `NO_COPIES` keeps nothing (the tiled attention: its tiles rarely share an
    operand, and holding copies would raise its peak)."""

    def __init__(self, keep: bool = True, budget: int | None = None):
        self.keep, self.budget, self.held = keep, budget, 0
        self._made: dict = {}

    def __call__(self, x: torch.Tensor, rows: tuple[int, int], span: tuple[int, int], form, make):
        if not self.keep:
            return make()
        key = (id(x), rows, span, form)
        hit = self._made.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        copy = make()
        size = copy.untyped_storage().nbytes()
        if self.budget is None or self.held + size <= self.budget:
            self._made[key] = (x, copy)
            self.held += size
        return copy


NO_COPIES = OperandCopies(keep=False)


def _query_copies(q) -> OperandCopies:
    """A ring call's query-side copies: kept within twice the bytes of the rank's queries."""
    return OperandCopies(budget=2 * q.numel() * q.element_size())


def _dense_views(kernel: str, t: Tile, q, k, v, groups, qc: OperandCopies, kc: OperandCopies):
    """Heads matched for one dense call, from q [B, H, L, D] and k, v [B, Hk, S, D] (copies through qc, kc). A fully
    visible tile folds the query heads that read one KV head into its query length ([b, Hk, groups * lq, D] against
    [b, Hk, lk, D]): exact, since every query sees every key of the tile, and K, V are neither repeated nor their
    gradients summed. The causal diagonal keeps one query row per position (the kernel's mask is positional):
    cuDNN reads the KV heads as they are (GQA), the other kernels get K, V repeated per query head."""
    q_t, k_t, v_t = _slices(t, q, k, v)
    qq = _query_side(t, q, groups, groups > 1 and not t.causal, qc)
    if kernel == "cudnn" or groups == 1 or not t.causal:
        return qq, kc(k, t.rows, t.k, "plain", k_t.contiguous), kc(v, t.rows, t.k, "plain", v_t.contiguous)
    return (qq, kc(k, t.rows, t.k, "expand", lambda: _expand(k_t, groups).contiguous()),
            kc(v, t.rows, t.k, "expand", lambda: _expand(v_t, groups).contiguous()))


def _query_side(t: Tile, x, groups: int, folded: bool, qc: OperandCopies):
    """x's rows of the tile's queries (q, dO, o or lse: [B, H, L, ...]) contiguous (cuDNN also caches a plan per
    layout, built with these), heads folded onto the KV heads for a visible tile: a view of the contiguous copy,
    which the diagonal tiles of the same queries share."""
    x_t = qc(x, t.rows, t.q, "plain", x[slice(*t.rows), :, slice(*t.q)].contiguous)
    return _fold(x_t, groups) if folded else x_t


def _offsets(t: Tile, device):
    """A packed tile's offsets on the device (int32, copied without a host sync) and its longest diagonal."""
    cu = torch.tensor(t.packed, dtype=torch.int32, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    return cu, max(b - a for a, b in zip(t.packed[:-1], t.packed[1:]))


def _thd_views(t: Tile, q, k, v, groups, qc: OperandCopies, kc: OperandCopies):
    q_t, k_t, v_t = _slices(t, q, k, v)
    return (qc(q, t.rows, t.q, "thd", lambda: _thd(q_t)), kc(k, t.rows, t.k, "thd", lambda: _thd(k_t, groups)),
            kc(v, t.rows, t.k, "thd", lambda: _thd(v_t, groups)))


def tile_forward(kernel: str, t: Tile, q, k, v, scale: float, qc: OperandCopies = NO_COPIES,
                 kc: OperandCopies = NO_COPIES):
    """One tile of q [B, H, L, D] against k/v [B, Hk, S, D]: o [b, H, lq, D], lse [b, H, lq], and what the kernel's
    backward needs of its forward (sequence metadata and RNG state, passed back as the forward returned them, as
    torch's own ring attention does; None for the CPU and math kernels). qc, kc: where the query-side and key-side
    operand copies come from (`OperandCopies`)."""
    groups = q.shape[1] // k.shape[1]
    if kernel == "flash_varlen":  # lse comes [H, lq]
        cu, longest = _offsets(t, q.device)
        out = torch.ops.aten._flash_attention_forward(*_thd_views(t, q, k, v, groups, qc, kc), cu, cu, longest,
                                                      longest, 0.0, True, False, scale=scale)
        return _from_thd(out[0]), out[1][None], (cu, longest, out[2], out[3])
    folded = groups > 1 and not t.causal
    qq, kk, vv = _dense_views(kernel, t, q, k, v, groups, qc, kc)
    match kernel:
        case "cudnn":  # lse comes [b, h, l, 1]
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(qq, kk, vv, None, True, 0.0, t.causal, False,
                                                                     scale=scale)
            o_t, lse_t, meta = out[0], out[1].squeeze(-1), tuple(out[2:8])
        case "flash":
            out = torch.ops.aten._scaled_dot_product_flash_attention(qq, kk, vv, 0.0, t.causal, False, scale=scale)
            o_t, lse_t, meta = out[0], out[1], tuple(out[2:8])
        case "flash_cpu":
            o_t, lse_t = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qq, kk, vv, 0.0, t.causal,
                                                                                    scale=scale)
            meta = None
        case "math":
            s = _math_scores(qq, kk, t.causal, scale)
            lse_t = torch.logsumexp(s, dim=-1)
            o_t, meta = (s - lse_t[..., None]).exp() @ vv, None
    return (_unfold(o_t, groups), _unfold(lse_t, groups), meta) if folded else (o_t, lse_t, meta)


def _math_scores(q, k, causal: bool, scale: float):
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def tile_backward(kernel: str, t: Tile, meta, do, q, k, v, o, lse, scale: float, qc: OperandCopies = NO_COPIES,
                  kc: OperandCopies = NO_COPIES):
    """One tile's share of the gradients given the merged o and lse (all [B, H, L, ...] like q): dq_t [b, H, lq, D],
    dk_t / dv_t [b, Hk, lk, D]. qc, kc: as `tile_forward`'s."""
    groups = q.shape[1] // k.shape[1]
    if kernel == "flash_varlen":
        cu, longest, rng_state, unused = meta
        r, qs = slice(*t.rows), slice(*t.q)
        qq, kk, vv = _thd_views(t, q, k, v, groups, qc, kc)
        dq_t, dk_t, dv_t = torch.ops.aten._flash_attention_backward(
            qc(do, t.rows, t.q, "thd", lambda: _thd(do[r, :, qs])), qq, kk, vv,
            qc(o, t.rows, t.q, "thd", lambda: _thd(o[r, :, qs])),
            qc(lse, t.rows, t.q, "thd", lambda: lse[r, :, qs][0].contiguous()), cu, cu, longest, longest, 0.0,
            True, rng_state, unused, scale=scale)
        return _from_thd(dq_t), _reduce(_from_thd(dk_t), groups), _reduce(_from_thd(dv_t), groups)
    folded = groups > 1 and not t.causal
    qq, kk, vv = _dense_views(kernel, t, q, k, v, groups, qc, kc)
    do_t, o_t, lse_t = (_query_side(t, x, groups, folded, qc) for x in (do, o, lse))
    match kernel:
        case "cudnn":
            cum_q, cum_k, max_q, max_k, seed, offset = meta
            dq_t, dk_t, dv_t = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                do_t, qq, kk, vv, o_t, lse_t.unsqueeze(-1), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0,
                t.causal, scale=scale)
        case "flash":
            cum_q, cum_k, max_q, max_k, seed, offset = meta
            dq_t, dk_t, dv_t = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                do_t, qq, kk, vv, o_t, lse_t, cum_q, cum_k, max_q, max_k, 0.0, t.causal, seed, offset, scale=scale)
        case "flash_cpu":
            dq_t, dk_t, dv_t = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do_t, qq, kk, vv, o_t, lse_t, 0.0, t.causal, scale=scale)
        case "math":
            p = (_math_scores(qq, kk, t.causal, scale) - lse_t[..., None]).exp()
            dv_t = p.transpose(-1, -2) @ do_t
            ds = p * (do_t @ vv.transpose(-1, -2) - (do_t * o_t).sum(-1, keepdim=True))
            dq_t, dk_t = (ds @ kk) * scale, (ds.transpose(-1, -2) @ qq) * scale
    if folded:
        return _unfold(dq_t, groups), dk_t, dv_t
    if kk.shape[1] != k.shape[1]:  # K, V were repeated per query head
        return dq_t, _reduce(dk_t, groups), _reduce(dv_t, groups)
    return dq_t, dk_t, dv_t


def merge_eager(o, lse, o_t, lse_t) -> None:
    """(o, lse) <- their log-sum-exp merge with a tile's (o_t, lse_t), in place (module doc), in torch ops."""
    new = torch.logaddexp(lse, lse_t)
    o.mul_((lse - new).exp()[..., None]).add_(o_t * (lse_t - new).exp()[..., None])
    lse.copy_(new)


def tile_merge(q):
    """The merge of q's device: on CUDA the one-pass kernel (`ops/fused/attention_merge.py`: the accumulator read
    and written once, where the eager ops pass over it five times), elsewhere `merge_eager`."""
    if q.is_cuda:
        from deltacp.ops.fused.attention_merge import merge_  # imports triton

        return merge_
    return merge_eager


class TileAccumulator:
    """Merges tiles' (o, lse) into the output of every query (in the compute dtype), with `tile_merge(q)`. The first
    tile that reaches a query range is written as it is (what the merge with nothing gives, bit for bit)."""

    def __init__(self, q):
        B, H, L, D = q.shape
        self.o = q.new_zeros((B, H, L, D), dtype=compute_dtype(q))
        self.lse = q.new_full((B, H, L), float("-inf"), dtype=compute_dtype(q))
        self._reached = [([], []) for _ in range(B)]  # per row: sorted disjoint query ranges merged so far
        self._merge = tile_merge(q)

    def _first(self, t: Tile) -> bool:
        """Whether no query of the tile was merged before (and mark them merged)."""
        first = True
        for b in range(*t.rows):
            starts, ends = self._reached[b]
            lo, hi = t.q
            i, j = bisect_right(ends, lo), bisect_left(starts, hi)  # ranges i..j-1 overlap [lo, hi)
            if i < j:
                first, lo, hi = False, min(lo, starts[i]), max(hi, ends[j - 1])
            starts[i:j], ends[i:j] = [lo], [hi]
        return first

    def add(self, t: Tile, o_t, lse_t):
        r, qs = slice(*t.rows), slice(*t.q)
        o, lse = self.o[r, :, qs], self.lse[r, :, qs]
        lse_t = lse_t.to(lse.dtype)
        if self._first(t):
            o.copy_(o_t)
            lse.copy_(lse_t)
            return
        self._merge(o, lse, o_t, lse_t)


def forward_tiles(acc: TileAccumulator, tiles, q, k, v, scale, kernel: str | None = None,
                  qc: OperandCopies = NO_COPIES) -> list:
    """Merge every tile into `acc`; returns the calls made, (tile, kernel, metadata), for `backward_tiles`. A packed
    tile whose kernel has no varlen form runs diagonal by diagonal. qc: the caller's query-side copies (the key-side
    ones live for this call when qc keeps its copies)."""
    runs = []
    kc = OperandCopies(keep=qc.keep)
    for t in tiles:
        name = choose_kernel(q, t, kernel)
        for u in [t] if name == "flash_varlen" else unpack(t):
            o_t, lse_t, meta = tile_forward(name, u, q, k, v, scale, qc, kc)
            acc.add(u, o_t, lse_t)
            runs.append((u, name, meta))
    return runs


def backward_tiles(runs, do, q, k, v, o, lse, scale, dq, dk, dv, qc: OperandCopies = NO_COPIES):
    """Accumulate every call's dq, dk, dv (in place; dk/dv have k's heads). qc: as `forward_tiles`'s."""
    kc = OperandCopies(keep=qc.keep)
    for t, name, meta in runs:
        dq_t, dk_t, dv_t = tile_backward(name, t, meta, do, q, k, v, o, lse, scale, qc, kc)
        r, qs, ks = slice(*t.rows), slice(*t.q), slice(*t.k)
        dq[r, :, qs].add_(dq_t)
        dk[r, :, ks].add_(dk_t)
        dv[r, :, ks].add_(dv_t)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tiles, scale, kernel):
        def compute():
            acc = TileAccumulator(q)
            runs = forward_tiles(acc, tiles, q, k, v, scale, kernel)
            return acc.o.to(q.dtype), acc.lse, runs

        # a selective checkpoint's recompute takes the forward's merged o and lse (ops/recompute.py)
        o, lse, ctx.runs = keep_outputs("tiled attention", compute)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dt = compute_dtype(q)
        dq, dk, dv = (torch.zeros_like(x, dtype=dt) for x in (q, k, v))
        backward_tiles(ctx.runs, do.contiguous(), q, k, v, o, lse, ctx.scale, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def tiled_attention(q_BHLD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, tiles: list[Tile],
                    scale: float, kernel: str | None = None) -> torch.Tensor:
    """Attention of q over the keys the tiles name (see `plan_tiles`), differentiable in q, k and v. `kernel`: None
    (the measured table chooses per tile), or "cudnn" / "flash" forced on every fused tile that is not packed (for
    comparisons; the CPU and fp32/fp64 kernels are not affected)."""
    check_forced_kernel(kernel)
    return _TiledAttention.apply(q_BHLD, k_BHSD, v_BHSD, tiles, scale, kernel)


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
    def forward(ctx, q, k, v, buckets, scale, ring, kernel):
        def compute():
            G, g = ring.size, ring.rank
            acc = TileAccumulator(q)
            kv = torch.stack([k, v])
            # the query pieces' copies, made at the first step that reads them
            runs, copies = {}, _query_copies(q)
            for t in range(G):
                src = (g - t) % G
                pending = ring.exchange(kv, "kv") if t < G - 1 else None
                runs[src] = forward_tiles(acc, buckets.get(src, ()), q, kv[0], kv[1], scale, kernel, copies)
                if pending is not None:
                    kv = pending.wait()
            return acc.o.to(q.dtype), acc.lse, runs

        # a selective checkpoint's recompute takes the forward's merged o and lse, and issues no exchange (every
        # rank alike: ops/recompute.py)
        o, lse, ctx.runs = keep_outputs("ring attention", compute)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.ring = scale, ring
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
        copies = _query_copies(q)  # q, dO, o and lse of the query pieces, shared by the steps
        incoming = None  # the accumulator of the block held now, from the ranks that held it before
        for t in range(G):
            src = (g - t) % G
            pending = ring.exchange(kv, "kv bwd") if t < G - 1 else None
            dkv = torch.zeros_like(kv, dtype=dt)
            backward_tiles(ctx.runs[src], do, q, kv[0], kv[1], o, lse, ctx.scale, dq, dkv[0], dkv[1], copies)
            if incoming is not None:
                dkv += incoming.wait()
            # the accumulator of block src follows it to rank g + 1 (after the last step: its owner); the hop
            # overlaps the next step's tiles
            incoming = ring.exchange(dkv, "dkv") if G > 1 else None
            if pending is not None:
                kv = pending.wait()
        if incoming is not None:
            dkv = incoming.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q_BHLD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor, tiles: list[Tile],
                   scale: float, ring, balanced: bool = False, kernel: str | None = None,
                   block: int | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the keys the tiles name, with keys and values held one block per rank
    and passed around the ring. The rank's queries, keys and values are its pieces of the row in local order
    (`placement.Pieces` of member g = ring.rank of G = ring.size: row positions [g L, (g + 1) L); balanced,
    pieces g and 2G - 1 - g of L / 2 each). Differentiable. `kernel`: as `tiled_attention`'s; `block`: the bound
    the tiles were planned with (the ring rejoins a visible tile's parts within it: `split_tiles_by_block`)."""
    check_forced_kernel(kernel)
    pieces = Pieces(ring.rank, ring.size, balanced, q_BHLD.shape[2])
    buckets = split_tiles_by_block(tiles, pieces.piece_length, pieces.holder, block)
    return _RingAttention.apply(q_BHLD, k_BHLD, v_BHLD, buckets, scale, ring, kernel)
