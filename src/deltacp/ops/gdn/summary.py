"""The (M, S) algebra of a GDN segment's summary, H_out = M @ H_in + S with a full M [B, Hv, K, K] (a backend's
`state_summary`): the full `Transition` of the recurrence contract (`ops/recurrence.py`, where every structure of
M has its algebra), under the names of earlier versions. Knows no backend and no rank.
"""

from __future__ import annotations

import torch

from deltacp.ops.recurrence import FULL


def compose_summaries(later: tuple[torch.Tensor, torch.Tensor],
                      earlier: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(M1, S1) ∘ (M0, S0) = (M1 M0, M1 S0 + S1): segment 0 then segment 1. Associative, not commutative."""
    return FULL.compose(later, earlier)


def apply_summary(m: torch.Tensor, s: torch.Tensor, state_in: torch.Tensor) -> torch.Tensor:
    """H_out = M @ H_in + S."""
    return FULL.apply(m, s, state_in)


def summary_grad(m: torch.Tensor, grad_state_out: torch.Tensor, grad_state_local: torch.Tensor) -> torch.Tensor:
    """dH_in = Mᵀ dH_out + dS_local, where dS_local reaches H_in from the local outputs alone."""
    return FULL.grad_in(m, grad_state_out, grad_state_local)
