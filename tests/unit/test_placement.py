"""The sequence layouts (`parallel/placement.py`) against positions written out here: which row positions each rank
holds, who holds a piece, and the block permutation that puts a member-major concatenation of u consecutive
members' tokens (a Ulysses group's all-to-all, an all-gather) in row order, at every divisor u of P."""

import pytest
import torch

from deltacp.parallel.placement import Pieces, check_sequence_layout, from_row_order, rank_pieces, to_row_order

pytestmark = pytest.mark.fast


def _expected_positions(layout: str, rank: int, P: int, S: int) -> list[int]:
    if layout == "contiguous":
        s = S // P
        return list(range(rank * s, (rank + 1) * s))
    h = S // (2 * P)
    return list(range(rank * h, (rank + 1) * h)) + list(range((2 * P - 1 - rank) * h, (2 * P - rank) * h))


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 6, 8, 16])
def test_rank_positions_holders_and_row_order(layout, P):
    S = 2 * P * 3
    ranks = [rank_pieces(layout, r, P, S // P) for r in range(P)]
    for r, pieces in enumerate(ranks):
        assert pieces.row_index().tolist() == _expected_positions(layout, r, P, S)
        for slot, piece in enumerate(pieces.positions):
            assert pieces.holder(piece) == (r, slot)
    # every row position held exactly once
    assert sorted(torch.cat([p.row_index() for p in ranks]).tolist()) == list(range(S))
    balanced = layout == "balanced"
    for u in [d for d in range(1, P + 1) if P % d == 0]:
        G = P // u
        for g in range(G):
            members = torch.cat([ranks[r].row_index() for r in range(g * u, (g + 1) * u)])
            in_order = to_row_order(members, 0, u, balanced)
            # the group's tokens in row order: one run (contiguous) or two runs, group pieces g and 2G - 1 - g
            assert in_order.tolist() == sorted(members.tolist())
            assert torch.equal(in_order, Pieces(g, G, balanced, in_order.numel()).row_index())
            assert torch.equal(from_row_order(in_order, 0, u, balanced), members)


def test_layout_names_and_piece_lengths_are_checked():
    with pytest.raises(ValueError, match=r"sequence_layout='zigzag' is not supported; expected one of "
                                         r"\('contiguous', 'balanced'\)"):
        check_sequence_layout("zigzag")
    with pytest.raises(ValueError, match=r"^sequence_layout='balanced' needs an even number of local tokens on every "
                                         r"rank \(its two equal pieces of the row\), got 5: the row length must be "
                                         r"divisible by 2 x cp \(6\)"):
        rank_pieces("balanced", 0, 3, 5)
    assert rank_pieces("contiguous", 0, 3, 5).length == 5
