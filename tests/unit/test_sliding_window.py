"""Sliding-window attention's two parts on their own (the model runs are the LaRA-mini conformance table and
tests/distributed/test_family_parity.py):

- the halo routes (`collectives.halo_routes`): for every member of a sequence group, both layouts, halos shorter and
  longer than a piece, each piece's left context comes exactly from the row positions before it (zeros before the
  row), every message is sent by the holder of its source piece and received by the holder of its destination, and
  a pair of members lists the messages between them in the same order;
- the banded attention (`sliding_attention.band_attention`) in query blocks smaller than the piece (the model runs
  use one block per piece) against a dense masked reference written out here: transformers' window (a query sees
  itself and window - 1 tokens before it), documents stopping it, grouped KV heads; outputs and every gradient.
"""

import pytest
import torch

from deltacp.distributed.collectives import halo_routes
from deltacp.parallel.placement import rank_pieces
from deltacp.parallel.sliding_attention import band_attention

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
def test_halo_routes_cover_the_window(layout, P):
    n = 3  # tokens per piece
    per = 2 if layout == "balanced" else 1
    members = [rank_pieces(layout, r, P, n * per) for r in range(P)]
    for halo in (0, 1, 2, 3, 4, 7, 3 * n * per * P):
        routes = [halo_routes(m, halo) for m in members]
        for r, (sends, recvs) in enumerate(routes):
            for part in recvs:  # the sender lists the same message, in the same order among the pair's messages
                theirs = [(p.source, p.dest, p.length) for p in routes[part.peer][0] if p.peer == r]
                mine = [(p.source, p.dest, p.length) for p in recvs if p.peer == part.peer]
                assert theirs == mine
                assert members[part.peer].holder(part.source)[0] == part.peer
            for part in sends:
                assert members[part.peer].holder(part.dest)[0] == part.peer
            for slot, piece in enumerate(members[r].positions):
                got = {}  # halo buffer index -> row position
                for part in (p for p in recvs if p.slot == slot):
                    sender = next(p for p in routes[part.peer][0]
                                  if (p.peer, p.source, p.dest) == (r, part.source, part.dest))
                    for i in range(part.length):
                        got[part.offset + i] = part.source * n + sender.offset + i
                first = piece * n - halo  # the halo's row positions: first .. piece * n - 1, zeros below 0
                assert got == {i: first + i for i in range(halo) if first + i >= 0}, (r, slot, halo)


def _dense_reference(q, k, v, first, window, starts, scale):
    """Every (query, key) score, masked as transformers' sliding window with documents."""
    n, m = q.shape[2], k.shape[2]
    q_pos = torch.arange(first, first + n)
    k_pos = torch.arange(first + n - m, first + n)
    lower = torch.maximum(q_pos - window + 1, starts)
    mask = (k_pos[None, None] <= q_pos[None, :, None]) & (k_pos[None, None] >= lower[..., None])
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("window,block", [(1, 4), (4, 3), (6, 4), (12, 5)])
def test_band_attention_in_blocks_matches_dense(window, block):
    gen = torch.Generator().manual_seed(window)
    B, H, Hk, n, D, first = 2, 4, 2, 10, 8, 7  # queries at row positions 7 .. 16; keys from 7 - (window - 1)
    m = window - 1 + n
    q = torch.randn(B, H, n, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, Hk, m, D, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    # row 0: a document starting at 0 then one at 12; row 1: its valid run starts at 9 (left padding), one at 15
    starts = torch.tensor([[0] * 5 + [12] * 5, [0, 0] + [9] * 6 + [15] * 2])
    starts[1, :2] = 0  # the padding queries (positions 7, 8) belong to the padding document [0, 9)
    out = band_attention(q, k, v, first, window, starts, 0.3, block=block)
    ref = _dense_reference(q, k, v, first, window, starts, 0.3)
    assert torch.allclose(out, ref, atol=1e-13, rtol=0)
    d_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    grads_ref = torch.autograd.grad(ref, (q, k, v), d_out)
    for g, g_ref in zip(grads, grads_ref):
        assert torch.allclose(g, g_ref, atol=1e-12, rtol=0)
