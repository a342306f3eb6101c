"""Indexer selections with random block scores, for tests and benchmarks of `ops/selected_attention.py` at sizes
where a model's indexer would dominate: the blocks and visibility of `parallel/indexed_attention.py`, scores drawn."""

from __future__ import annotations

import torch

from deltacp.ops.selected_attention import Selection  # noqa: F401 (the type returned)


class _RandomScores:
    """The part of an IndexedAttentionView that `_chosen_blocks` reads, scoring blocks at random."""

    def __init__(self, block_size: int, top_blocks: int, gen: torch.Generator):
        self.block_size, self.top_blocks, self.gen = block_size, top_blocks, gen

    def block_scores(self, iq, keys):
        B, c = iq.shape[:2]
        return torch.rand(B, c, keys, generator=self.gen, device=iq.device, dtype=torch.float32)


def random_selection(cu: torch.Tensor, B: int, S: int, block_size: int, top_blocks: int, seed: int,
                     device) -> Selection:
    """Every query of a [B, S] batch whose documents are `cu` (offsets over the flattened stream) choosing
    `top_blocks` of its visible complete blocks at random (stable ties: the indexer's own rule), plus its tail."""
    from deltacp.parallel.indexed_attention import QUERY_CHUNK, RowBlocks, _chosen_blocks, selection_of

    blocks = RowBlocks.build(cu, B, S, block_size, device)
    view = _RandomScores(block_size, top_blocks, torch.Generator(device=device).manual_seed(seed))
    rows = torch.arange(S, device=device)
    parts = [_chosen_blocks(view, blocks, torch.empty(B, min(S, lo + QUERY_CHUNK) - lo, device=device),
                            blocks.blocks, rows[lo:lo + QUERY_CHUNK]) for lo in range(0, S, QUERY_CHUNK)]
    return selection_of(blocks, rows, *(torch.cat(p, dim=1) for p in zip(*parts)), block_size)
