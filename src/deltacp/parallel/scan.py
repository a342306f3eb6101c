"""Log-depth state scan for p2p linear attention CP (`state_passing="scan"`): the state entering every rank in
ceil(log2 P) rounds of point-to-point exchanges instead of the chain's P - 1 sequential hops.

Rank r's slice maps the state entering it to the state leaving it, f_r(H) = M_r H + S_r (docs/design.md,
section 2; M_r absent = zero: rank 0, or a document starts inside the slice). The state entering rank r is

    H_in_r = (f_{r-1} ∘ ... ∘ f_0)(0),        (M1, S1) ∘ (M0, S0) = (M1 M0, M1 S0 + S1),

the S of an exclusive prefix scan of the maps (rank 0's M never matters: it acts on the zero state). Backward:
dH_out_r = (g_{r+1} ∘ ... ∘ g_{P-1})(0) with g_j(X) = M_jᵀ X + dH_in_local_j, the same scan over the ranks in
reverse order (position p = P - 1 - r) with transposed maps.

Algorithm (Hillis-Steele, exclusive) at position p of n, rounds d = 0 .. ceil(log2 n) - 1, offset o = 2^d. The
position keeps two running summaries, each [M | S] ([..., K, w + V], M packed as the recurrence's
`ops/recurrence.Transition` declares: w = K for a full M, 1 for a diagonal or scalar one) or S alone ([..., K, V]):

    inc = f_p ∘ ... ∘ f_{p-2^d+1}        (only while p still sends)
    exc = f_{p-1} ∘ ... ∘ f_{p-2^d+1}    (starts as the identity)

In round d, p sends inc to p + o (if p + o < n) and receives inc_{p-o} (if p - o >= 0), which covers positions
p - 2o + 1 .. p - o; then exc <- exc ∘ recv and inc <- inc ∘ recv. After the last round exc covers 0 .. p - 1,
and its S is the entering state. A summary keeps M only while its window does not reach position 0 (a window
that does is only ever the earlier operand of a composition and is finally applied to the zero state, so its M is
never read): a message carries M iff its sender's position is >= o. That depends on (p, n, d) alone:
`scan_schedule` is the whole message pattern, the same for any data. A rank whose M is zero sends zeros where the
schedule says M, and skips its own products (its inc is kept as S alone).

Per position and round: at most two compositions (full M: K x K by K x (K + V) products, or K x K by K x V where
the result reaches position 0; a diagonal M: elementwise). Memory: three summaries (exc, inc, the received one) whatever n, never a gather of n
summaries. Products run in
promote(dtype, float32): float32 for float32/bf16 states, float64 stays float64.

Positions are the pieces of the row (`placement.Pieces`): one per rank under the contiguous layout, two under the
balanced one (rank r runs positions r and 2P - 1 - r, n = 2P, ceil(log2 2P) rounds).

`ScanState` holds one position's side of the algorithm with the transport left out: `exclusive_state_scan` runs a
member's positions over a `StatePassing` (batch_isend_irecv on the p2p group), `simulate_exclusive_scan` runs n
positions in lockstep in one process (tests, `bench/state_scan.py`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import torch

from deltacp.distributed.collectives import StatePassing
from deltacp.ops.recurrence import FULL, Transition
from deltacp.parallel.placement import Pieces


def scan_rounds(n: int) -> int:
    """ceil(log2 n): rounds of the scan over n positions (0 for one position)."""
    return (n - 1).bit_length()


@dataclass(frozen=True)
class ScanRound:
    """What one position does in one round; a function of (position, n, round) only."""

    offset: int
    send_to: int | None  # position it sends inc to
    send_m: bool  # that message carries M (else S alone)
    recv_from: int | None  # position it receives from
    recv_m: bool  # the message it receives carries M; exc and inc keep their M after this round
    inc_kept: bool  # inc is sent in a later round


def scan_schedule(position: int, n: int) -> list[ScanRound]:
    """A summary carries M only while its window of positions does not reach position 0: a window that does is
    only ever composed as the earlier operand and finally applied to the zero state, so its M is never read.
    inc before round d covers position - o + 1 .. position (reaches 0 iff position < o); the received window
    position - 2o + 1 .. position - o (iff position < 2o)."""
    if not 0 <= position < n:
        raise ValueError(f"position {position} is outside a scan over {n} positions")
    rounds = []
    for d in range(scan_rounds(n)):
        o = 1 << d
        to = position + o if position + o < n else None
        src = position - o if position - o >= 0 else None
        rounds.append(ScanRound(offset=o, send_to=to, send_m=to is not None and position >= o, recv_from=src,
                                recv_m=src is not None and position >= 2 * o, inc_kept=position + 2 * o < n))
    return rounds


def _mul_add(m: torch.Tensor, x: torch.Tensor, s: torch.Tensor, transition: Transition) -> torch.Tensor:
    """M x + s over the leading dims (a full M: one baddbmm)."""
    if transition.kind != "full":
        return transition.apply(m, s, x)
    lead = m.shape[:-2]
    out = torch.baddbmm(s.reshape(-1, *s.shape[-2:]), m.reshape(-1, *m.shape[-2:]), x.reshape(-1, *x.shape[-2:]))
    return out.reshape(*lead, *out.shape[-2:])


class ScanState:
    """One position's side of the exclusive scan. Drive it round by round: `outgoing(rnd)` is the message to send
    (None if it sends nothing), `incoming(rnd)` an empty buffer for the one it receives, `absorb(rnd, x)` takes what
    arrived; `result()` is the S of exc: the state entering this position (None at position 0).

    m: packed [..., K, w] (`transition`) or None (the zero map on the state); s: [..., K, V], or None where the
    position never sends (position n - 1: its own map is never read)."""

    def __init__(self, m: torch.Tensor | None, s: torch.Tensor | None, position: int, n: int, *,
                 state_shape: Sequence[int], dtype: torch.dtype, device: torch.device | str,
                 transition: Transition = FULL):
        self.position = position
        self.schedule = scan_schedule(position, n)
        self.state_shape = tuple(state_shape)
        self.transition = transition
        self.k = transition.width(self.state_shape[-2])  # M's packed columns
        self.dtype = torch.promote_types(dtype, torch.float32)
        self.device = torch.device(device)
        sends = any(r.send_to is not None for r in self.schedule)
        if sends and s is None:
            raise ValueError(f"scan position {position} of {n} sends its summary: S is required")
        self.inc: torch.Tensor | None = None  # [M | S], or S alone (M zero, or never read)
        if sends:
            s = s.to(self.dtype)
            self.inc = s if m is None or position == 0 else torch.cat([m.to(self.dtype), s], dim=-1)
        self.exc: torch.Tensor | None = None  # None: the identity (nothing received yet)

    def _with_m(self, x: torch.Tensor) -> bool:
        return x.shape[-1] == self.k + self.state_shape[-1]

    def outgoing(self, rnd: ScanRound) -> torch.Tensor | None:
        if rnd.send_to is None:
            return None
        inc, k = self.inc, self.k
        if rnd.send_m:
            if self._with_m(inc):
                return inc
            return torch.cat([inc.new_zeros(*inc.shape[:-1], k), inc], dim=-1)  # M zero, but the shape is fixed
        return (inc[..., k:] if self._with_m(inc) else inc).contiguous()

    def incoming_shape(self, rnd: ScanRound) -> tuple[int, ...] | None:
        if rnd.recv_from is None:
            return None
        return (*self.state_shape[:-1], self.state_shape[-1] + (self.k if rnd.recv_m else 0))

    def incoming(self, rnd: ScanRound) -> torch.Tensor | None:
        shape = self.incoming_shape(rnd)
        return None if shape is None else torch.empty(shape, dtype=self.dtype, device=self.device)

    def _then(self, later: torch.Tensor, earlier: torch.Tensor, keep_m: bool) -> torch.Tensor:
        """later ∘ earlier; `later` carries M, `earlier` is [M | S] or S alone. keep_m False: S alone."""
        k = self.k
        m_l, s_l = later[..., :k], later[..., k:]
        if keep_m:
            out = self.transition.mul(m_l, earlier)
            out[..., k:] += s_l
            return out
        return _mul_add(m_l, earlier[..., k:] if self._with_m(earlier) else earlier, s_l, self.transition)

    def absorb(self, rnd: ScanRound, x: torch.Tensor | None) -> None:
        if rnd.recv_from is None:
            if not rnd.inc_kept:
                self.inc = None
            return
        if x is None or tuple(x.shape) != self.incoming_shape(rnd):
            raise ValueError(f"scan round of offset {rnd.offset}: expected a message of shape "
                             f"{self.incoming_shape(rnd)}, got {None if x is None else tuple(x.shape)}")
        x = x.to(self.dtype)
        if not rnd.inc_kept:
            self.inc = None
        elif self._with_m(self.inc):  # an inc whose M is zero ignores what precedes it: it stays as it is
            self.inc = self._then(self.inc, x, keep_m=rnd.recv_m)
        self.exc = x if self.exc is None else self._then(self.exc, x, keep_m=rnd.recv_m)

    def result(self) -> torch.Tensor | None:
        if self.exc is None:
            return None
        return (self.exc[..., self.k:] if self._with_m(self.exc) else self.exc).contiguous()


def exclusive_state_scan(ms: Sequence[torch.Tensor | None], ss: Sequence[torch.Tensor | None],
                         passing: StatePassing, pieces: Pieces, *, state_shape: Sequence[int], dtype: torch.dtype,
                         device: torch.device | str, reverse: bool = False, what: str = "scan",
                         transition: Transition = FULL) -> list[torch.Tensor | None]:
    """The state entering each local piece: the S of the composition of the earlier pieces' maps (M, S) applied to a
    zero state, in ceil(log2 N) rounds over `passing`'s group (N = pieces.total, the positions of the scan; each
    member runs the positions of its pieces). reverse: the pieces in reverse order (the backward: pass Mᵀ and
    dH_in_local, get dH_out). Per local piece (slot order) m (None: the zero map) and s (None where the piece is the
    last of the order); the result is None for the first piece of the order. Every member of the group calls it at
    the same point. A message between two pieces of one member is handed over locally; the others of a round go out
    as one batch of point-to-point operations (at most one each way per peer: a balanced member's two pieces
    exchange with different peers in every round)."""
    n, me = pieces.total, pieces.member

    def position_of(piece: int) -> int:
        return n - 1 - piece if reverse else piece

    def holder(position: int) -> tuple[int, int]:
        return pieces.holder(position_of(position))

    states = [ScanState(m, s, position_of(piece), n, state_shape=state_shape, dtype=dtype, device=device,
                        transition=transition) for m, s, piece in zip(ms, ss, pieces.positions)]
    for d in range(scan_rounds(n)):
        rounds = [st.schedule[d] for st in states]
        local, sends, recvs = {}, [], []
        for st, rnd in zip(states, rounds):
            out = st.outgoing(rnd)
            if out is None:
                continue
            member, slot = holder(rnd.send_to)
            if member == me:
                local[slot] = out
            else:
                sends.append((out, member))
        for slot, (st, rnd) in enumerate(zip(states, rounds)):
            if rnd.recv_from is not None and holder(rnd.recv_from)[0] != me:
                recvs.append((st.incoming(rnd), holder(rnd.recv_from)[0]))
        received = iter(passing.exchange(sends, recvs, f"{what} d{1 << d}"))
        for slot, (st, rnd) in enumerate(zip(states, rounds)):
            if rnd.recv_from is None:
                st.absorb(rnd, None)
            elif holder(rnd.recv_from)[0] == me:
                st.absorb(rnd, local[slot])
            else:
                st.absorb(rnd, next(received))
    return [st.result() for st in states]


def simulate_exclusive_scan(ms: Sequence[torch.Tensor | None], ss: Sequence[torch.Tensor | None], *,
                            on_step: Callable[[ScanState, int, str], ContextManager] | None = None,
                            transition: Transition = FULL) -> list[torch.Tensor | None]:
    """The scan over n = len(ss) positions in one process, in lockstep: each round, every position's message, then
    every position absorbs its own. Returns each position's entering state (None at position 0). `on_step(state,
    round, "out" | "in")` wraps each position's own work of a round (building its message; absorbing the received
    one) in a context manager, e.g. to time what one rank would spend on its own device (`bench/state_scan.py`)."""
    n = len(ss)
    like = next(s for s in ss if s is not None)
    states = [ScanState(m, s, p, n, state_shape=like.shape, dtype=like.dtype, device=like.device,
                        transition=transition) for p, (m, s) in enumerate(zip(ms, ss))]
    step = on_step or (lambda state, d, phase: contextlib.nullcontext())
    for d in range(scan_rounds(n)):
        sent = []
        for p, st in enumerate(states):
            with step(st, d, "out"):
                sent.append(st.outgoing(st.schedule[d]))
        for p, st in enumerate(states):
            rnd = st.schedule[d]
            with step(st, d, "in"):
                st.absorb(rnd, None if rnd.recv_from is None else sent[rnd.recv_from])  # absorb checks the shape
    return [st.result() for st in states]
