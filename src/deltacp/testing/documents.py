"""Document mixes for packed-row tests and benchmarks (one implementation, shared)."""

from __future__ import annotations

import math

import torch


def doc_lengths(total: int, median: float, sigma: float, seed: int, big: tuple[int, ...] = (),
                singles: int = 2) -> list[int]:
    """Log-normal document lengths (fixed seed) filling `total` tokens exactly; `big` documents inserted at random
    places, `singles` length-1 documents (one second, one last), the last drawn document cut to fit."""
    gen = torch.Generator().manual_seed(seed)
    fixed = list(big) + [1] * singles
    room = total - sum(fixed)
    lens = []
    while room > 0:
        n = max(1, int(round(math.exp(math.log(median) + sigma * torch.randn(1, generator=gen).item()))))
        n = min(n, room)
        lens.append(n)
        room -= n
    for b in big:
        lens.insert(int(torch.randint(0, len(lens) + 1, (1,), generator=gen)), b)
    if singles:
        lens.insert(1, 1)
        lens += [1] * (singles - 1)
    assert sum(lens) == total
    return lens


def cu_of(lens: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(device)
