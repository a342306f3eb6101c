"""Where a row's tokens live under CP: the sequence layout, shared by every layer, the batch cutter and the hooks.

    sequence_layout   rank r of P holds (local order)                            causal attention work per rank
    contiguous        row positions [r s, (r + 1) s)                             grows with r: (2r + 1) / P of the mean
    balanced          pieces r and 2P - 1 - r of the row cut into 2P pieces      equal on every rank

(s = S / P local tokens; a balanced piece has s / 2 tokens.) Both are fixed by the rank alone, so one setting
serves the 1-D and the 2-D CP layouts alike.

A *sequence group* of n members (the CP group in 1-D; the cp / u groups in 2-D, each member being a Ulysses group
after its all-to-all) runs the row as `Pieces`: member i holds piece i (contiguous: of n) or pieces i and
2n - 1 - i (balanced: of 2n), each a contiguous run of the row. The balanced layout at the rank level is the
balanced layout at every coarser level too: the u consecutive ranks g u .. g u + u - 1 hold rank pieces
g u .. g u + u - 1 (one run: group piece g of 2G) and 2P - u (g + 1) .. 2P - 1 - g u (group piece 2G - 1 - g).
So a member-major concatenation of u consecutive members' tokens (what an all-to-all or all-gather over them
returns) becomes that coarser member's tokens in row order by one block permutation, `member_order(u)`: the
members' first pieces in member order, then their second pieces in reverse member order. Contiguous: the
identity.

Shape legend: x_..S.. tokens of a member-major concatenation along `dim`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SEQUENCE_LAYOUTS: tuple[str, ...] = ("contiguous", "balanced")


def check_sequence_layout(name, prefix: str = "") -> str:
    """The layout's name, or ValueError naming the setting and the allowed values."""
    if name not in SEQUENCE_LAYOUTS:
        raise ValueError(f"{prefix}sequence_layout={name!r} is not supported; expected one of {SEQUENCE_LAYOUTS}")
    return name


def pieces_per_rank(sequence_layout: str) -> int:
    return 2 if check_sequence_layout(sequence_layout) == "balanced" else 1


def check_local_length(balanced: bool, local_tokens: int, cp: int) -> None:
    """The layouts' one rule on a rank's length: 'balanced' holds two equal pieces of the row, so an even number
    of local tokens (a row length divisible by 2 x cp, cp being the members holding the row). ValueError naming
    the layout, the local length and the row-length rule; every check of it, from the batch hooks to the layers,
    is this one."""
    if balanced and local_tokens % 2:
        raise ValueError(f"sequence_layout='balanced' needs an even number of local tokens on every rank (its two "
                         f"equal pieces of the row), got {local_tokens}: the row length must be divisible by 2 x cp "
                         f"({2 * cp}); cut the batch with shard_batch_for_cp(sequence_layout='balanced')")


@dataclass(frozen=True)
class Pieces:
    """The pieces of a row that member `member` of a sequence group of `members` holds, in local order (slot 0,
    then slot 1), as row-position spans of `length` local tokens."""

    member: int
    members: int
    balanced: bool
    length: int  # local tokens (all slots)

    def __post_init__(self):
        check_local_length(self.balanced, self.length, self.members)

    @property
    def per_member(self) -> int:
        return 2 if self.balanced else 1

    @property
    def total(self) -> int:
        """Pieces of the row."""
        return self.members * self.per_member

    @property
    def piece_length(self) -> int:
        return self.length // self.per_member

    @property
    def row_length(self) -> int:
        return self.length * self.members

    @property
    def positions(self) -> tuple[int, ...]:
        """Each slot's piece index in the row (increasing)."""
        if self.balanced:
            return (self.member, 2 * self.members - 1 - self.member)
        return (self.member,)

    def holder(self, piece: int) -> tuple[int, int]:
        """(member, slot) holding `piece` of the row."""
        if not 0 <= piece < self.total:
            raise ValueError(f"piece {piece} is outside a row of {self.total} pieces")
        if not self.balanced:
            return piece, 0
        return (piece, 0) if piece < self.members else (2 * self.members - 1 - piece, 1)

    def local(self, slot: int) -> slice:
        """The slot's local tokens."""
        n = self.piece_length
        return slice(slot * n, (slot + 1) * n)

    def spans(self) -> list[tuple[int, int]]:
        """Each slot's row positions [lo, hi)."""
        n = self.piece_length
        return [(p * n, (p + 1) * n) for p in self.positions]

    def row_index(self, device=None) -> torch.Tensor:
        """[length] int64: the row position of every local token."""
        return torch.cat([torch.arange(lo, hi, device=device) for lo, hi in self.spans()])


@dataclass(frozen=True)
class RowCut:
    """How the rows of a CP'd model must be cut: its sequence layout and the fewest tokens each piece may hold
    (the conv halo, (kernel - 1) x dilation, where a linear-attention mode reads the previous piece's tail: p2p, all_gather;
    1 otherwise). `parallelize_cp` records it on the model (`row_cut_of`); `shard_batch_for_cp(model=...)` and
    the trainers cut and pad by it."""

    sequence_layout: str = "contiguous"
    min_piece_length: int = 1

    def __post_init__(self):
        check_sequence_layout(self.sequence_layout)
        if not isinstance(self.min_piece_length, int) or self.min_piece_length < 1:
            raise ValueError(f"min_piece_length={self.min_piece_length!r} must be an integer >= 1")

    def pieces(self, cp: int) -> int:
        """Equal pieces a row is cut into over `cp` ranks (cp, or 2 x cp under 'balanced')."""
        return cp * pieces_per_rank(self.sequence_layout)

    def min_row_length(self, cp: int) -> int:
        """The shortest row every piece of which holds min_piece_length tokens."""
        return self.pieces(cp) * self.min_piece_length

    def padded_length(self, length: int, cp: int, multiple: int) -> int:
        """The shortest row length >= `length` that is a multiple of `multiple` and at least `min_row_length`
        (what padding appends up to: a padding document, or masked columns)."""
        need = max(length, self.min_row_length(cp))
        return -(-need // multiple) * multiple


def rank_pieces(sequence_layout: str, rank: int, cp: int, local_length: int) -> Pieces:
    """What rank `rank` of a CP group of `cp` holds of a row of cp * local_length tokens."""
    return Pieces(rank, cp, check_sequence_layout(sequence_layout) == "balanced", local_length)


def member_order(members: int, balanced: bool) -> list[int] | None:
    """The block permutation taking a member-major concatenation of `members` consecutive members' tokens (2 blocks
    per member: its two pieces) to row order; None when it is the identity (contiguous, or a single member, whose
    two pieces are in row order already)."""
    if not balanced or members == 1:
        return None
    return [2 * j for j in range(members)] + [2 * j + 1 for j in reversed(range(members))]


def _inverse(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return inv


_INDEX: dict = {}  # (order, device) -> index tensor: built once, not copied to the device on every call


def _permute_blocks(x: torch.Tensor, dim: int, order: list[int]) -> torch.Tensor:
    dim = dim % x.dim()
    blocks = x.unflatten(dim, (len(order), -1))
    key = (tuple(order), x.device)
    if key not in _INDEX:
        _INDEX[key] = torch.tensor(order, device=x.device)
    return blocks.index_select(dim, _INDEX[key]).flatten(dim, dim + 1)


def to_row_order(x: torch.Tensor, dim: int, members: int, balanced: bool) -> torch.Tensor:
    """A member-major concatenation along `dim` of `members` consecutive members' tokens -> row order (one copy;
    none for contiguous). Differentiable (the backward is the inverse permutation)."""
    order = member_order(members, balanced)
    return x if order is None else _permute_blocks(x, dim, order)


def from_row_order(x: torch.Tensor, dim: int, members: int, balanced: bool) -> torch.Tensor:
    """The inverse of `to_row_order`."""
    order = member_order(members, balanced)
    return x if order is None else _permute_blocks(x, dim, _inverse(order))
