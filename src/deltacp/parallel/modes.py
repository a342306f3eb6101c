"""The CP modes of linear-recurrent layers and the CP methods of full attention: one typed registry each.

Every check of a mode name (the styles, the layout rules, the trainer's YAML, `parallelize_cp`) resolves it here,
so adding a mode is one entry: its mixer, what it needs, where it may run.

    mode         mixer (1-D)          across groups (2-D)   backends        conv halo   own p2p group
    ulysses      heads split cp ways  -                     eager, triton   no          no
    p2p          state chain          yes                   eager, triton   yes         yes
    all_gather   summary all-gather   yes                   eager           yes         no

    attention    what travels            head limit       across groups (2-D)
    ulysses      heads (all-to-all)      heads % cp == 0  -
    all_gather   K/V (all-gather)        none             yes
    ring         K/V blocks (ring)       none             yes

One spelling everywhere: `all_gather` for both layer kinds ('allgather', the full-attention spelling of earlier
versions, is accepted as an alias and resolved here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from deltacp.distributed.collectives import StatePassing
from deltacp.ops.gdn.backends import GDN_BACKENDS
from deltacp.parallel.all_gather import all_gather_mixer, all_gather_scan
from deltacp.parallel.p2p import p2p_mixer, p2p_scan
from deltacp.parallel.ulysses import ulysses_mixer


@dataclass(frozen=True)
class LinearMode:
    """One linear-attention CP mode."""

    name: str
    mixer: Callable  # (layer, pre_BsC, extras_BsHX, ctx) -> o_BsHV: the 1-D token mixer
    across: Callable | None  # (layer, shard, pre, extras, ctx) -> o: the scan across Ulysses groups (2-D); None: 1-D only
    backends: tuple[str, ...]  # backends it runs on
    needs_halo: bool  # reads the previous rank's conv tail: local tokens >= (kernel - 1) * dilation
    state_hops: bool  # point-to-point state traffic, on a communicator of its own (docs/design.md, schedule)


@dataclass(frozen=True)
class AttentionMethod:
    """One full-attention CP method."""

    name: str
    splits_heads: bool  # heads split over the CP group: num_attention_heads (and KV heads, repeated) by cp
    across_groups: bool  # may run across Ulysses groups in the 2-D layout


LINEAR_MODES: dict[str, LinearMode] = {m.name: m for m in (
    LinearMode("ulysses", ulysses_mixer, None, GDN_BACKENDS, needs_halo=False, state_hops=False),
    LinearMode("p2p", p2p_mixer, p2p_scan, GDN_BACKENDS, needs_halo=True, state_hops=True),
    LinearMode("all_gather", all_gather_mixer, all_gather_scan, ("eager",), needs_halo=True, state_hops=False),
)}
ATTENTION_METHODS: dict[str, AttentionMethod] = {m.name: m for m in (
    AttentionMethod("ulysses", splits_heads=True, across_groups=False),
    AttentionMethod("all_gather", splits_heads=False, across_groups=True),
    AttentionMethod("ring", splits_heads=False, across_groups=True),
)}
ALIASES: dict[str, str] = {"allgather": "all_gather"}

LINEAR_ATTENTION_CP_MODES: tuple[str, ...] = tuple(LINEAR_MODES)
FULL_ATTENTION_CP: tuple[str, ...] = tuple(ATTENTION_METHODS)


def canonical_name(name):
    """The registry's spelling of a mode or method name (aliases resolved; anything else returned as given)."""
    return ALIASES.get(name, name) if isinstance(name, str) else name


def _resolve(registry: dict, name, setting: str, prefix: str):
    key = canonical_name(name)
    if key not in registry:
        raise ValueError(f"{prefix}{setting}={name!r} is not supported; expected one of {tuple(registry)}"
                         + (f" (aliases: {', '.join(f'{a} = {b}' for a, b in ALIASES.items())})" if ALIASES else ""))
    return registry[key]


def linear_mode(name, backend: str | None = None, prefix: str = "") -> LinearMode:
    """The registered linear-attention mode `name` (or an alias); with `backend`, also checks that the mode runs on it.
    Raises naming the setting and the allowed values."""
    mode = _resolve(LINEAR_MODES, name, "linear_attention_cp_mode", prefix)
    if backend is not None:
        if backend not in GDN_BACKENDS:
            raise ValueError(f"{prefix}linear_attention_backend={backend!r} is not supported; expected one of "
                             f"{GDN_BACKENDS}")
        if backend not in mode.backends:
            others = [m.name for m in LINEAR_MODES.values() if backend in m.backends]
            raise NotImplementedError(f"{prefix}linear_attention_cp_mode={mode.name!r} has no {backend} backend "
                                      f"(it runs on {mode.backends}); use linear_attention_backend="
                                      f"{mode.backends[0]!r}, or one of the modes {others}")
    return mode


def attention_method(name, prefix: str = "") -> AttentionMethod:
    """The registered full-attention method `name` (or an alias); raises naming the setting and the allowed values."""
    return _resolve(ATTENTION_METHODS, name, "full_attention_cp", prefix)


def check_state_passing(state_passing, mode: LinearMode, prefix: str = "") -> str:
    """`linear_attention_state_passing`: a schedule of `StatePassing` (chain | scan), and other than 'chain' only for a
    mode with state hops. Raises naming the setting and the allowed values."""
    if state_passing not in StatePassing.SCHEDULES:
        raise ValueError(f"{prefix}linear_attention_state_passing={state_passing!r} is not supported; expected one of "
                         f"{StatePassing.SCHEDULES}")
    if state_passing != "chain" and not mode.state_hops:
        raise ValueError(f"{prefix}linear_attention_state_passing={state_passing!r} schedules the state hops of a mode "
                         f"that has them (p2p); linear_attention_cp_mode={mode.name!r} has none: leave it 'chain'")
    return state_passing
