"""The recurrence contract: what every CP mode may ask of a local linear recurrence, for any family.

A chunked linear recurrence carries a state h [B, H, K, V] through the tokens; over any segment its effect is
affine, h_out = M h_in + S (docs/design.md, "The math"). The CP modes (Ulysses, the p2p chain and scan, all_gather,
2-D, the balanced layout, packed documents) are built from the operations below and know nothing else: not the
family, not the gate formula, not the names of the inputs.

    RecurrenceInputs    the per-token inputs of one local call, one object: `tensors` in the recurrence's own
                        order, each [rows, T, heads, ...] (or [rows, T, heads]), so that it splits by rows (documents,
                        pieces), detaches, and travels through save_for_backward as a tuple
    Transition          the structure of M, declared by the recurrence: "full" (K x K per head: delta rules),
                        "diagonal" (K per head: per-channel decay), "scalar" (one per head: decay only). Every M a
                        recurrence hands out is PACKED as [..., K, w] (w = K for full, 1 otherwise), so that the
                        chain, the scan and the all-gather move w + V columns per state row, not K + V, when M is
                        cheap; `mul`, `transpose` and `compose` act on the packed form
    Recurrence          the local chunked forward (entering state in, final state out; differentiable), the
                        optional staging shared by p2p's three passes (`prepare`), the affine summary (M, S), the
                        entering state's gradient from the outputs alone (`initial_state_grad`), the state shape

The GDN rule of every family that has one is `GatedDeltaRule` over a GDN backend (`ops/gdn/contract.py`: eager or
Triton); its inputs are (q, k, v, g, beta) and its M is full. A family's view builds the inputs from its
projections (its gate formula, `parallel/views.py`), so no CP mode unpacks them.

Packed documents: `cu_seqlens` as in `ops/gdn/contract.py` (None, offsets, or a `varlen.VarlenLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

TRANSITIONS = ("full", "diagonal", "scalar")


@dataclass(frozen=True)
class Transition:
    """The structure of M in h_out = M h_in + S, and its algebra on the packed form [..., K, w]."""

    kind: str

    def __post_init__(self):
        if self.kind not in TRANSITIONS:
            raise ValueError(f"transition kind {self.kind!r} is not one of {TRANSITIONS}")

    def width(self, K: int) -> int:
        """Columns of a packed M with K state rows."""
        return K if self.kind == "full" else 1

    def pack(self, m: torch.Tensor, K: int) -> torch.Tensor:
        """The native M (full [..., K, K]; diagonal [..., K]; scalar [...]) -> packed [..., K, w]."""
        if self.kind == "full":
            return m
        if self.kind == "diagonal":
            return m.unsqueeze(-1)
        return m[..., None, None].expand(*m.shape, K, 1).contiguous()

    def dense(self, m: torch.Tensor) -> torch.Tensor:
        """Packed M -> the [..., K, K] matrix it stands for (tests, references)."""
        return m if self.kind == "full" else torch.diag_embed(m.squeeze(-1))

    def mul(self, m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """M x for a packed M [..., K, w] and any x [..., K, n] (a state, or another packed [M | S])."""
        return m @ x if self.kind == "full" else m * x

    def transpose(self, m: torch.Tensor) -> torch.Tensor:
        """Mᵀ, packed (a diagonal is its own transpose)."""
        return m.mT if self.kind == "full" else m

    def apply(self, m: torch.Tensor, s: torch.Tensor, state_in: torch.Tensor) -> torch.Tensor:
        """h_out = M h_in + S."""
        return self.mul(m, state_in) + s

    def compose(self, later: tuple[torch.Tensor, torch.Tensor], earlier: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(M1, S1) ∘ (M0, S0) = (M1 M0, M1 S0 + S1): segment 0, then segment 1."""
        (m1, s1), (m0, s0) = later, earlier
        return self.mul(m1, m0), self.mul(m1, s0) + s1

    def grad_in(self, m: torch.Tensor, grad_state_out: torch.Tensor, grad_state_local: torch.Tensor) -> torch.Tensor:
        """dh_in = Mᵀ dh_out + dh_local (dh_local: what reaches h_in from the local outputs alone)."""
        return self.mul(self.transpose(m), grad_state_out) + grad_state_local


FULL = Transition("full")


class RecurrenceInputs:
    """The per-token inputs of one local recurrence call: `tensors` in the recurrence's order, each with the rows
    (batch rows, or pieces of rows) first and the tokens second. Immutable; every method returns a new object."""

    __slots__ = ("tensors",)

    def __init__(self, *tensors: torch.Tensor | None):
        self.tensors = tuple(tensors)

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def map(self, fn) -> "RecurrenceInputs":
        return type(self)(*(None if t is None else fn(t) for t in self.tensors))

    def detach(self) -> "RecurrenceInputs":
        return self.map(torch.Tensor.detach)

    def contiguous(self) -> "RecurrenceInputs":
        return self.map(torch.Tensor.contiguous)

    def rows(self, index) -> "RecurrenceInputs":
        """The inputs of some rows (a slice or index over dim 0)."""
        return self.map(lambda t: t[index])

    def tokens(self, index) -> "RecurrenceInputs":
        """The inputs of some tokens (a slice over dim 1)."""
        return self.map(lambda t: t[:, index])

    def pieces_to_rows(self, pieces: int) -> "RecurrenceInputs":
        """[B, pieces * n, ...] -> [B * pieces, n, ...]: row b * pieces + j holds piece j of row b (contiguous)."""
        return self.map(lambda t: t.unflatten(1, (pieces, -1)).flatten(0, 1).contiguous())


class StagesNothing:
    """`prepare`, `prepared_from_saved` and the check of `prepared` for a recurrence that stages nothing: each call
    computes what it needs (the eager SSD, KDA and selective scan). `name` is the implementation's."""

    name: str

    def prepare(self, x, *, cu_seqlens=None):
        return None  # nothing staged

    def prepared_from_saved(self, tensors):
        raise TypeError(f"{type(self).__name__} ({self.name}) stages nothing (prepare returns None)")

    def _no_prepared(self, prepared) -> None:
        if prepared is not None:
            raise TypeError(f"{type(self).__name__} ({self.name}) takes no prepared chunks (got "
                            f"{type(prepared).__name__})")


class Recurrence(Protocol):
    """A local chunked linear recurrence (no ranks, no modes). `transition` declares M's structure."""

    transition: Transition

    def check(self, x: RecurrenceInputs) -> None:
        """Raise a clear error when the inputs are outside the implementation's contract (never fall back)."""

    def state_shape(self, x: RecurrenceInputs) -> tuple[int, ...]:
        """[rows, H, K, V] of the state these inputs carry."""

    def forward(self, x: RecurrenceInputs, *, initial_state: torch.Tensor | None = None,
                output_final_state: bool = False, prepared: Any = None, cu_seqlens: Any = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(outputs [rows, T, H, V], final state or None); differentiable in the inputs and the entering state."""

    def prepare(self, x: RecurrenceInputs, *, cu_seqlens: Any = None) -> Any:
        """What the summary, the output pass and the dh_in pass of one p2p step would each compute from the inputs
        alone, once, without autograd; None: nothing staged."""

    def prepared_from_saved(self, tensors: tuple[torch.Tensor, ...]) -> Any: ...

    def summary(self, x: RecurrenceInputs, *, prepared: Any = None, need_transition: bool = True,
                cu_seqlens: Any = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(M packed [rows, H, K, w] or None when need_transition is False, S [rows, H, K, V]); M is zero when the
        entering state cannot reach the end (a document starts inside)."""

    def initial_state_grad(self, x: RecurrenceInputs, grad_o: torch.Tensor, *, prepared: Any = None,
                           cu_seqlens: Any = None) -> torch.Tensor:
        """d sum(o * grad_o) / d h_in (o is affine in h_in with a coefficient free of h_in)."""


class GatedDeltaRule:
    """The gated delta rule (GDN) over a GDN backend: inputs (q, k, v, g, beta), q/k [rows, T, Hk, K], v [rows, T,
    Hv, V], g, beta [rows, T, Hv]; M full. `qk_l2norm`: q and k l2-normalised inside the op (every GDN family in
    transformers 5.25 does); `scale`: the query scale (None: K ** -0.5)."""

    transition = FULL

    def __init__(self, backend, *, qk_l2norm: bool = True, scale: float | None = None):
        self.backend = backend
        self.qk_l2norm = qk_l2norm
        self.scale = scale

    @property
    def name(self) -> str:
        return self.backend.name

    def check(self, x: RecurrenceInputs) -> None:
        self.backend.check(*x)

    def state_shape(self, x: RecurrenceInputs) -> tuple[int, ...]:
        q, k, v, g, beta = x.tensors
        return (v.shape[0], v.shape[2], k.shape[-1], v.shape[-1])

    def forward(self, x, *, initial_state=None, output_final_state=False, prepared=None, cu_seqlens=None):
        return self.backend.chunk_gated_delta_rule(*x, scale=self.scale, initial_state=initial_state,
                                                   output_final_state=output_final_state,
                                                   use_qk_l2norm_in_kernel=self.qk_l2norm, prepared=prepared,
                                                   cu_seqlens=cu_seqlens)

    def prepare(self, x, *, cu_seqlens=None):
        q, k, v, g, beta = x.tensors
        return self.backend.prepare_chunks(k, v, g, beta, use_qk_l2norm_in_kernel=self.qk_l2norm,
                                           cu_seqlens=cu_seqlens)

    def prepared_from_saved(self, tensors):
        return self.backend.prepared_from_saved(tensors)

    def summary(self, x, *, prepared=None, need_transition=True, cu_seqlens=None):
        q, k, v, g, beta = x.tensors
        return self.backend.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=self.qk_l2norm, prepared=prepared,
                                          need_transition=need_transition, cu_seqlens=cu_seqlens)

    def initial_state_grad(self, x, grad_o, *, prepared=None, cu_seqlens=None):
        return self.backend.initial_state_grad(*x, grad_o, scale=self.scale, use_qk_l2norm_in_kernel=self.qk_l2norm,
                                               prepared=prepared, cu_seqlens=cu_seqlens)
