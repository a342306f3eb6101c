"""Tile-by-tile attention (parallel/attention_tiles.py) against one causal SDPA per document, float64, every
kernel (the CPU flash op and the explicit math kernel that CUDA fp32/fp64 uses), output and gradients; the KV
heads Ulysses sends each rank; packed tiles (one call for the diagonals of a query block's documents)."""

import pytest
import torch

import deltacp.parallel.attention_tiles as tiles_mod
from deltacp.parallel.attention import ulysses_kv_heads
from deltacp.parallel.attention_tiles import plan_span_tiles, plan_tiles, split_tiles_by_block, tiled_attention
from deltacp.parallel.placement import Pieces
from helpers import per_document_attention

pytestmark = pytest.mark.fast

_reference = per_document_attention  # causal attention per document of the flattened [B * S] stream, one SDPA each


@pytest.mark.parametrize("kernel", ["flash_cpu", "math"])
@pytest.mark.parametrize("B, cu", [(2, None), (1, [0, 1, 4, 30, 31, 57, 64]), (2, [0, 50, 64, 70, 128])])
@pytest.mark.parametrize("q0, L, block", [(0, 64, None), (16, 16, None), (24, 40, 5), (40, 24, 8)])
def test_tiles_match_per_document_sdpa(monkeypatch, kernel, B, cu, q0, L, block):
    monkeypatch.setattr(tiles_mod, "tile_kernel", lambda q: kernel)
    torch.manual_seed(0)
    S, H, Hk, D, scale = 64, 4, 2, 8, 0.37
    plan_cu = None if cu is None else torch.tensor(cu)
    cu = plan_cu if cu is not None else torch.arange(B + 1) * S  # no documents: one per row
    q, k, v = (torch.randn(B, h, S, D, dtype=torch.float64, requires_grad=True) for h in (H, Hk, Hk))
    ref = _reference(q, k, v, cu, scale)[:, :, q0:q0 + L]
    d_out = torch.randn_like(ref)
    grads_ref = torch.autograd.grad((ref * d_out).sum(), (q, k, v))
    tiles = plan_tiles(B, S, q0, L, plan_cu, block)
    if block is not None:
        assert all(t.q[1] - t.q[0] <= block and t.k[1] - t.k[0] <= block for t in tiles)
    out = tiled_attention(q[:, :, q0:q0 + L], k, v, tiles, scale)
    grads = torch.autograd.grad((out * d_out).sum(), (q, k, v))
    assert (out - ref).abs().max() < 1e-12
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert (g - g_ref).abs().max() < 1e-12, name


def test_ring_blocks_cover_each_pair_once():
    tiles = plan_tiles(1, 64, 32, 16, torch.tensor([0, 5, 40, 64]), 7)
    covered = torch.zeros(16, 64, dtype=torch.int64)
    for block, part in split_tiles_by_block(tiles, 16).items():
        for t in part:
            assert 0 <= t.k[0] < t.k[1] <= 16
            ks = slice(block * 16 + t.k[0], block * 16 + t.k[1])
            if t.causal:
                covered[t.q[0]:t.q[1], ks] += torch.ones(t.q[1] - t.q[0], t.k[1] - t.k[0], dtype=torch.int64).tril()
            else:
                covered[t.q[0]:t.q[1], ks] += 1
    pos = torch.arange(64)
    qpos = torch.arange(32, 48)[:, None]
    doc = torch.searchsorted(torch.tensor([0, 5, 40, 64]), pos, right=True)
    expected = (pos[None] <= qpos) & (doc[None] == doc[qpos])
    assert torch.equal(covered, expected.long())


def test_plan_refuses_documents_of_another_batch_shape():
    with pytest.raises(ValueError, match="cover 64 tokens, expected the flattened batch B \\* S = 2 \\* 64"):
        plan_tiles(2, 64, 0, 64, torch.tensor([0, 64]), None)


@pytest.mark.parametrize("heads, kv, degree, expected", [
    (8, 2, 8, [[0], [0], [0], [0], [1], [1], [1], [1]]),  # one KV head per rank (was: repeated, the same here)
    (8, 2, 4, [[0], [0], [1], [1]]),  # 2 query heads read one KV head: sent once, not repeated
    (8, 2, 2, [[0], [1]]),
    (24, 4, 4, [[0], [1], [2], [3]]),
    (16, 4, 2, [[0, 1], [2, 3]]),
    (12, 4, 6, [[0, 0], [0, 1], [1, 1], [2, 2], [2, 3], [3, 3]]),  # not grouped: one KV head per query head
])
def test_ulysses_kv_heads(heads, kv, degree, expected):
    assert ulysses_kv_heads(heads, kv, degree).tolist() == expected


# ---------------------------------------------------------------------------------------------------------------
# Query spans (sequence_layout='balanced': a rank's queries are two runs of the row) and the ring's holders
# ---------------------------------------------------------------------------------------------------------------

SPAN_DOCS = [None, [0, 5, 17, 18, 40, 47, 64], [0, 64]]  # documents crossing piece boundaries (pieces of 8 at G=4)
# many short documents; a document boundary on every piece boundary (a packed tile across a balanced member's pieces)
PACKED_DOCS = [[0, 1, 2, 3, 5, 8, 9, 10, 30, 31, 33, 64], list(range(0, 65, 4))]


def _expected_pairs(row_q, S, cu):
    """[L, S] 1 where local query i (row position row_q[i]) may see key position k: same document, k <= it."""
    pos = torch.arange(S)
    bounds = torch.tensor(cu if cu is not None else [0, S])
    doc = torch.searchsorted(bounds, pos, right=True)
    return ((pos[None] <= row_q[:, None]) & (doc[None] == doc[row_q][:, None])).long()


def _add_tile(covered, t, key_positions):
    """Count tile t's (query, key) pairs; key_positions: the row positions of its keys. A packed tile is causal
    within each of its diagonals."""
    for u in tiles_mod.unpack(t):
        a, b = u.k[0] - t.k[0], u.k[1] - t.k[0]
        ones = torch.ones(u.q[1] - u.q[0], b - a, dtype=torch.int64)
        covered[u.q[0]:u.q[1], key_positions[a:b]] += ones.tril() if u.causal else ones


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("block", [None, 3, 7])
@pytest.mark.parametrize("cu", SPAN_DOCS + PACKED_DOCS)
@pytest.mark.parametrize("pack", [False, True])
def test_span_tiles_and_ring_holders_cover_each_pair_once(balanced, block, cu, pack):
    """Every (query, key) pair a query may see lies in exactly one tile, for every member of groups of 1-4; and
    once more after the ring's split by holder, whose re-based keys name the holder's own local keys. pack: the
    diagonals merged by `pack_diagonals` (at most `block` tokens each), which the ring cuts at piece boundaries."""
    S = 64
    for G in (1, 2, 4):
        L = S // G
        for g in range(G):
            pieces = Pieces(g, G, balanced, L)
            expected = _expected_pairs(pieces.row_index(), S, cu)
            tiles = plan_span_tiles(1, S, pieces.spans(), None if cu is None else torch.tensor(cu), block)
            if pack:
                tiles = tiles_mod.pack_diagonals(tiles, block)
                for t in tiles:
                    assert t.ragged == (cu is not None)
                    if t.packed:
                        assert t.causal and t.packed[0] == 0 and t.packed[-1] == t.q[1] - t.q[0] == t.k[1] - t.k[0]
                        assert block is None or t.packed[-1] <= block
            covered = torch.zeros(L, S, dtype=torch.int64)
            for t in tiles:
                _add_tile(covered, t, torch.arange(*t.k))
            assert torch.equal(covered, expected), (G, g)
            covered.zero_()
            buckets = split_tiles_by_block(tiles, pieces.piece_length, pieces.holder, block)
            assert set(buckets) <= set(range(G))
            for member, part in buckets.items():
                held = Pieces(member, G, balanced, L).row_index()  # the holder's local keys, row positions
                for t in part:
                    assert 0 <= t.k[0] < t.k[1] <= L
                    assert block is None or t.k[1] - t.k[0] <= block  # rejoined parts stay within the bound
                    _add_tile(covered, t, held[t.k[0]:t.k[1]])
            assert torch.equal(covered, expected), (G, g, "ring")


def test_span_tiles_match_per_document_sdpa():
    """Two query runs (a balanced rank's pieces), documents across them, against one SDPA per document."""
    torch.manual_seed(0)
    S, H, Hk, D, scale, cu = 64, 4, 2, 8, 0.37, torch.tensor([0, 5, 17, 18, 40, 47, 64])
    q, k, v = (torch.randn(1, h, S, D, dtype=torch.float64, requires_grad=True) for h in (H, Hk, Hk))
    pieces = Pieces(1, 4, True, 16)  # row positions [8, 16) and [48, 56)
    rows = pieces.row_index()
    ref = _reference(q, k, v, cu, scale)[:, :, rows]
    d_out = torch.randn_like(ref)
    grads_ref = torch.autograd.grad((ref * d_out).sum(), (q, k, v))
    out = tiled_attention(q[:, :, rows], k, v, plan_span_tiles(1, S, pieces.spans(), cu, 5), scale)
    grads = torch.autograd.grad((out * d_out).sum(), (q, k, v))
    assert (out - ref).abs().max() < 1e-12
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert (g - g_ref).abs().max() < 1e-12, name


def _work(tiles):
    """Causal attention work: query count x key count per tile, the diagonal counted half."""
    return sum((t.q[1] - t.q[0]) * (t.k[1] - t.k[0]) * (t.rows[1] - t.rows[0]) * (0.5 if t.causal else 1.0)
               for t in tiles)


@pytest.mark.parametrize("G", [2, 4, 8])
def test_ring_work_is_balanced_under_the_balanced_layout(G):
    """Per rank (and per ring step: the tiles on the block held at that step) the causal work of the ring is equal
    across ranks within 5% under sequence_layout='balanced'; contiguous grows with the rank."""
    S, block = 1024, 32
    spread = {}
    for balanced in (False, True):
        totals, steps = [], []
        for g in range(G):
            pieces = Pieces(g, G, balanced, S // G)
            tiles = plan_span_tiles(2, S, pieces.spans(), None, block)
            buckets = split_tiles_by_block(tiles, pieces.piece_length, pieces.holder)
            totals.append(_work(tiles))
            steps += [_work(buckets.get(m, ())) for m in range(G)]
        spread[balanced] = (max(totals) / min(totals), max(steps) / max(min(steps), 1e-300))
    assert spread[True][0] < 1.05 and spread[True][1] < 1.05, spread
    assert spread[False][0] > 1.5, spread


# ---------------------------------------------------------------------------------------------------------------
# Packed tiles: the diagonals of a query block's documents in one call
# ---------------------------------------------------------------------------------------------------------------


def test_packed_calls_follow_tokens_not_documents():
    """A row of 1,000 documents needs no more tile calls than the same row holding 10 (per query block: one packed
    call and at most one visible tile per document that began in an earlier block)."""
    S, block = 4096, 1024
    counts = {}
    for n in (10, 1000):
        cu = torch.linspace(0, S, n + 1).round().long()
        tiles = tiles_mod.pack_diagonals(plan_span_tiles(1, S, [(0, S)], cu, block), block)
        counts[n] = len(tiles)
        assert len(tiles) <= 3 * S // block, (n, len(tiles))
    assert counts[1000] <= counts[10] + S // block, counts


@pytest.mark.parametrize("kernel", ["flash_cpu", "math"])
@pytest.mark.parametrize("spans, block", [([(0, 64)], None), ([(0, 64)], 9), ([(8, 16), (48, 56)], 8),
                                          ([(24, 64)], 16)])
def test_packed_tiles_match_per_document_sdpa(monkeypatch, kernel, spans, block):
    """Packed plans on the CPU kernels (run diagonal by diagonal) against one SDPA per document, float64."""
    monkeypatch.setattr(tiles_mod, "tile_kernel", lambda q: kernel)
    torch.manual_seed(0)
    S, H, Hk, D, scale = 64, 4, 2, 8, 0.37
    cu = torch.tensor([0, 1, 2, 3, 5, 17, 18, 30, 31, 40, 47, 50, 64])
    q, k, v = (torch.randn(1, h, S, D, dtype=torch.float64, requires_grad=True) for h in (H, Hk, Hk))
    rows = torch.cat([torch.arange(a, b) for a, b in spans])
    ref = _reference(q, k, v, cu, scale)[:, :, rows]
    d_out = torch.randn_like(ref)
    grads_ref = torch.autograd.grad((ref * d_out).sum(), (q, k, v))
    tiles = tiles_mod.pack_diagonals(plan_span_tiles(1, S, spans, cu, block), block)
    assert any(t.packed for t in tiles)
    out = tiled_attention(q[:, :, rows], k, v, tiles, scale)
    grads = torch.autograd.grad((out * d_out).sum(), (q, k, v))
    assert (out - ref).abs().max() < 1e-12
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert (g - g_ref).abs().max() < 1e-12, name


def test_operand_copies_keep_within_their_budget():
    from deltacp.parallel.attention_tiles import NO_COPIES, OperandCopies

    x = torch.randn(1, 4, 16, 8)  # 2 KiB per [1, 4, 16, 8] float32 copy
    made = []

    def make(a, b):
        return lambda: made.append((a, b)) or x[:, :, a:b].contiguous()

    copies = OperandCopies(budget=x[:, :, :8].numel() * 4 + x[:, :, :4].numel() * 4)  # rows 0-8 and 0-4 fit
    first = copies(x, (0, 1), (0, 8), "plain", make(0, 8))
    assert copies(x, (0, 1), (0, 8), "plain", make(0, 8)) is first and made == [(0, 8)]
    copies(x, (0, 1), (8, 16), "plain", make(8, 16))  # over the budget: made, not kept
    copies(x, (0, 1), (8, 16), "plain", make(8, 16))
    assert made == [(0, 8), (8, 16), (8, 16)]
    small = copies(x, (0, 1), (0, 4), "plain", make(0, 4))  # still fits
    assert copies(x, (0, 1), (0, 4), "plain", make(0, 4)) is small and copies.held == x[:, :, :12].numel() * 4
    other = x.clone()  # another tensor with the same key parts is not confused with x
    assert not torch.equal(copies(other, (0, 1), (0, 8), "plain", lambda: other[:, :, :8].contiguous() + 1), first)
    assert NO_COPIES(x, (0, 1), (0, 8), "plain", make(0, 8)) is not first and NO_COPIES.held == 0


@pytest.mark.parametrize("G", [2, 4, 8])
def test_ring_rejoins_a_visible_tile_over_both_pieces_of_a_balanced_holder(G):
    """A balanced rank's late query piece sees both pieces of every later member h > g's block: the two parts of its
    visible tile are one tile of the whole block on that member (one kernel call, not two); a bound below the block
    keeps them apart."""
    L = 16
    for g in range(G):
        pieces = Pieces(g, G, True, L)
        tiles = plan_span_tiles(1, G * L, pieces.spans(), None, None)
        late = pieces.spans()[1]
        buckets = split_tiles_by_block(tiles, pieces.piece_length, pieces.holder)
        for h in range(g + 1, G):
            whole = [t for t in buckets[h] if not t.causal and t.q == (L // 2, L)]
            assert [t.k for t in whole] == [(0, L)], (g, h, buckets[h])
        apart = split_tiles_by_block(tiles, pieces.piece_length, pieces.holder, L // 2)
        for h in range(g + 1, G):
            assert sorted(t.k for t in apart[h] if not t.causal and t.q == (L // 2, L)) == [(0, L // 2), (L // 2, L)]
        assert late[1] - late[0] == L // 2
