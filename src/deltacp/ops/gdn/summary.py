"""The algebra of state summaries, shared by every backend and CP mode (docs/design.md, "The math").

A segment's effect on the recurrent state is affine: H_out = M @ H_in + S, with M [B, Hv, K, K] and S [B, Hv, K, V]
(a backend's `state_summary`). These are the tiny K x K matmuls that combine summaries; they know no backend and
no rank. Imports torch only.
"""

from __future__ import annotations

import torch


def compose_summaries(later: tuple[torch.Tensor, torch.Tensor],
                      earlier: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(M1, S1) ∘ (M0, S0) = (M1 M0, M1 S0 + S1): segment 0 then segment 1. Associative, not commutative."""
    (m1, s1), (m0, s0) = later, earlier
    return m1 @ m0, m1 @ s0 + s1


def apply_summary(m: torch.Tensor, s: torch.Tensor, state_in: torch.Tensor) -> torch.Tensor:
    """H_out = M @ H_in + S."""
    return m @ state_in + s


def summary_grad(m: torch.Tensor, grad_state_out: torch.Tensor, grad_state_local: torch.Tensor) -> torch.Tensor:
    """dH_in = Mᵀ dH_out + dS_local, where dS_local reaches H_in from the local outputs alone."""
    return m.transpose(-1, -2) @ grad_state_out + grad_state_local
