"""The CP plan: every context-parallel setting of a model in one validated object.

    plan = CPPlan(linear_attention_cp_mode="p2p", full_attention_cp="ring", sequence_layout="balanced")
    model = parallelize_cp(model, cp_mesh, plan)                  # cp: the mesh's (or plan.cp, checked against it)
    model = load_pretrained(path, cp_mesh, plan=plan)             # trainer YAML: train.accelerator.<field>
    trainer = CPSFTTrainer(..., cp_size=4, plan=plan)             # or the fields as keywords, as before

Every consumer (`parallelize_cp`, `parallelize_and_shard`, `load_pretrained`, the trainer's `train.accelerator`,
preflight, the transformers / TRL integrations) takes a CPPlan, or builds one from the same keywords, so the
settings are validated here, once, with one message per rule; adding a setting is a field here and the code that
uses it. The rules that need no model: each name is registered (`modes.py`, `placement.py`, the state-passing
schedules), the linear-attention mode runs on the backend, state passing needs a mode with state hops, and with `cp` known the
layout rules (`layout.py`: heads split or not, 2-D degree). What needs the model (head counts, the conv) is checked
by the styles when `parallelize_cp` applies them.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import InitVar, dataclass, field, fields

from deltacp.ops.gdn.backends import GDN_BACKENDS
from deltacp.parallel.layout import check_ulysses_degree, check_ulysses_degree_value, validate_cp_layout
from deltacp.parallel.modes import attention_method, canonical_name, check_state_passing, linear_mode
from deltacp.parallel.placement import RowCut, check_sequence_layout

# settings renamed, old name -> new name: still accepted (keyword, YAML key, CPPlan argument), with a FutureWarning
# naming the new one
RENAMED: dict[str, str] = {"linear_attention_gdn_backend": "linear_attention_backend"}


def renamed_settings(settings: dict, what: str, prefix: str = "") -> dict:
    """`settings` with the RENAMED names under their new names, each old one warned about (FutureWarning) once per
    call; ValueError when an old and its new name are both given with different values."""
    out = dict(settings)
    for old, new in RENAMED.items():
        if old in out:
            value = out.pop(old)
            warnings.warn(f"{what}: {prefix}{old} is deprecated; it is {prefix}{new} now (the same values)",
                          FutureWarning, stacklevel=3)
            if new in out and out[new] != value:
                raise ValueError(f"{what}: {prefix}{old}={value!r} (deprecated) and {prefix}{new}={out[new]!r} "
                                 f"disagree; give {prefix}{new} only")
            out[new] = value
    return out


@dataclass(frozen=True)
class CPPlan:
    """Every CP setting of a model; validated when built (errors name the setting, with `prefix` before it)."""

    cp: int | None = None
    """Ranks that share one sequence (the CP degree). None: the CP mesh's, where the plan is applied; given, it must
    equal the mesh's."""
    ulysses_degree: int | None = None
    """None (or cp): the 1-D layout, every layer over the whole CP group. u < cp dividing cp: the 2-D layout, cp / u
    groups of u consecutive ranks; every layer runs Ulysses inside a group (its heads must divide by u) and across
    groups linear_attention_cp_mode (p2p | all_gather) and full_attention_cp (all_gather | ring)."""
    linear_attention_cp_mode: str = "ulysses"
    """The linear-recurrent layers' CP mode: ulysses | p2p | all_gather (`parallel/modes.py`; with ulysses_degree < cp the
    across-group mode: p2p | all_gather)."""
    linear_attention_backend: str = "eager"
    """The local computation of the linear-recurrent layers (GDN, Mamba2's SSD, KDA): eager (PyTorch, the reference)
    | triton (fused kernels, CUDA). The output head's ops (the losses, the log-probabilities) follow it: torch
    kernels under eager, Triton on CUDA under triton. Its earlier name linear_attention_gdn_backend is accepted with
    a FutureWarning (`RENAMED`)."""
    linear_attention_state_passing: str = "chain"
    """How p2p's state travels between ranks: chain (P - 1 sequential hops) or scan (ceil(log2 P) rounds; when it
    pays: README "p2p" and NOTES.md). Only with a mode that has state hops (p2p)."""
    full_attention_cp: str = "ulysses"
    """Full attention CP: ulysses (heads split cp ways: num_attention_heads must divide by cp), all_gather (KV
    all-gather, no head limit; 'allgather' is accepted) or ring (KV blocks passed around a ring). With
    ulysses_degree < cp: all_gather | ring, the across-group method."""
    sequence_layout: str = "contiguous"
    """Which tokens of a row each CP rank holds, in every layer: contiguous (rank r: positions [r s, (r + 1) s)) or
    balanced (rank r: pieces r and 2 cp - 1 - r of the row cut into 2 cp, equal causal attention work per rank;
    rows must then divide by 2 x cp; `parallel/placement.py`)."""
    prefix: str = field(default="", repr=False, compare=False)
    """Put before each setting's name in error messages ("train.accelerator." for the trainer's YAML)."""
    linear_attention_gdn_backend: InitVar[str | None] = None
    """The earlier name of linear_attention_backend (FutureWarning)."""

    def __post_init__(self, linear_attention_gdn_backend: str | None = None):
        if linear_attention_gdn_backend is not None:
            given = {"linear_attention_gdn_backend": linear_attention_gdn_backend}
            if self.linear_attention_backend != "eager":
                given["linear_attention_backend"] = self.linear_attention_backend
            object.__setattr__(self, "linear_attention_backend",
                               renamed_settings(given, "CPPlan", self.prefix)["linear_attention_backend"])
        # one spelling from here on ('allgather' -> 'all_gather')
        object.__setattr__(self, "linear_attention_cp_mode", canonical_name(self.linear_attention_cp_mode))
        object.__setattr__(self, "full_attention_cp", canonical_name(self.full_attention_cp))
        p = self.prefix
        if self.cp is not None and (not isinstance(self.cp, int) or isinstance(self.cp, bool) or self.cp < 1):
            raise ValueError(f"{p}cp must be an integer >= 1, got {self.cp!r}")
        if self.linear_attention_backend not in GDN_BACKENDS:  # (linear_mode skips a backend of None)
            raise ValueError(f"{p}linear_attention_backend={self.linear_attention_backend!r} is not supported; "
                             f"expected one of {GDN_BACKENDS}")
        mode = linear_mode(self.linear_attention_cp_mode, self.linear_attention_backend, prefix=p)
        check_state_passing(self.linear_attention_state_passing, mode, p)
        method = attention_method(self.full_attention_cp, prefix=p)
        object.__setattr__(self, "_resolved", (mode, method))  # what the styles receive: nothing to check again
        check_sequence_layout(self.sequence_layout, prefix=p)
        check_ulysses_degree_value(self.ulysses_degree, p)
        if self.cp is not None:
            check_ulysses_degree(self.cp, self.ulysses_degree, p)
            validate_cp_layout(self.cp, self.ulysses_degree, self.linear_attention_cp_mode, self.full_attention_cp, p)

    # -- construction --------------------------------------------------------------------------------------------
    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """The settings' names (the keywords parallelize_cp and the trainers take), cp first."""
        return tuple(f.name for f in fields(cls) if f.name != "prefix")

    @classmethod
    def resolve(cls, plan: "CPPlan | None", settings: dict, cp: int | None = None, what: str = "parallelize_cp",
                prefix: str = "", cp_name: str = "the CP mesh's degree") -> "CPPlan":
        """The plan of a call that takes `plan` or the settings as keywords (not both), with the CP degree `cp`
        (the mesh's, when known, or the setting `cp_name` names: a plan's own cp must equal it). Raises naming an
        unknown keyword."""
        settings = renamed_settings(settings, what, prefix)
        unknown = sorted(set(settings) - set(cls.setting_names()))
        if unknown:
            raise TypeError(f"{what}: unknown keyword {unknown[0]!r}; the CP settings are {list(cls.setting_names())} "
                            f"(or plan=CPPlan(...))")
        if plan is not None and not isinstance(plan, CPPlan):
            raise TypeError(f"{what}: plan must be a CPPlan, got {type(plan).__name__}")
        if plan is not None and settings:
            raise ValueError(f"{what}: give the CP settings as plan=CPPlan(...) or as keywords, not both (got plan and "
                             f"{sorted(settings)})")
        if plan is None:
            plan = cls(**settings, prefix=prefix)
        if cp is not None and plan.cp not in (None, cp):
            raise ValueError(f"{what}: the plan's cp={plan.cp} is not {cp_name} ({cp})")
        return plan if cp is None or plan.cp == cp else plan.replace(cp=cp)

    def replace(self, **changes) -> "CPPlan":
        """A copy with `changes` (validated again)."""
        return dataclasses.replace(self, **changes)

    def settings(self) -> dict:
        """The settings as parallelize_cp's keywords (cp included)."""
        return {name: getattr(self, name) for name in self.setting_names()}

    # -- what the settings imply ---------------------------------------------------------------------------------
    def row_cut(self, conv_halo: int) -> RowCut:
        """How rows are cut under this plan for linear-recurrent layers whose causal conv reads `conv_halo` ((kernel - 1) x
        dilation) tokens back: its sequence layout, and the fewest tokens each piece holds: the halo where the mode
        reads the previous piece's tail (p2p, all_gather), else 1."""
        needs = self._resolved[0].needs_halo
        return RowCut(self.sequence_layout, max(conv_halo, 1) if needs else 1)

    def styles(self):
        """(LinearAttentionContextParallel, FullAttentionContextParallel) of this plan (cp must be known)."""
        from deltacp.parallel.style import FullAttentionContextParallel, LinearAttentionContextParallel

        if self.cp is None:
            raise ValueError("CPPlan.styles: the plan's cp is unknown (apply it to a CP mesh)")
        mode, method = self._resolved
        return (LinearAttentionContextParallel(mode, self.linear_attention_backend, self.ulysses_degree,
                                               self.linear_attention_state_passing, self.sequence_layout),
                FullAttentionContextParallel(method, self.ulysses_degree, sequence_layout=self.sequence_layout))

    def describe(self, defaults: bool = False) -> str:
        """One line for logs and banners, cp first: the settings that differ from the defaults (`defaults`: the
        modes, backend and layout always, the others where they differ)."""
        always = ("linear_attention_cp_mode", "linear_attention_backend", "full_attention_cp", "sequence_layout")
        default = CPPlan()
        parts = [f"cp={self.cp}"] + [f"{name}={getattr(self, name)}" for name in self.setting_names()[1:]
                                     if getattr(self, name) != getattr(default, name) or (defaults and name in always)]
        return " ".join(parts)
