"""The `train.accelerator` section of the trainer YAML (docs/design.md and README), typed and validated early.

    train:
      accelerator:
        dp: null          # data-parallel degree: null derives world // (cp * tp); given, world = dp x cp x tp
        tp: 1
        cp: 4             # the CP plan's fields from here on (deltacp.parallel.plan.CPPlan: every CP setting)
        ulysses_degree: null          # null / cp: 1-D; u < cp dividing cp: the 2-D layout (parallel/layout.py)
        linear_attention_cp_mode: p2p
        linear_attention_backend: triton
        full_attention_cp: ulysses    # ulysses | all_gather | ring  ('allgather': an alias of all_gather)
        linear_attention_state_passing: chain   # p2p's state hops: chain | scan (log-depth)
        sequence_layout: contiguous   # which tokens each rank holds: contiguous | balanced (parallel/placement.py)

The CP settings are the fields of `CPPlan` (their meaning and rules are there, written once); this section adds the
data- and tensor-parallel degrees. Validated on every rank before the first collective, so a bad value is an error
everywhere, never a hang.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from deltacp.parallel.plan import RENAMED, CPPlan, renamed_settings

PREFIX = "train.accelerator."
OWN_KEYS = ("dp", "tp")


def _degree(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{PREFIX}{name} must be {'null or ' if allow_none else ''}an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class AcceleratorConfig:
    """train.accelerator: the CP plan (its fields flat in the YAML, read as attributes here: `acc.cp`,
    `acc.linear_attention_cp_mode`, ...) and the other parallel degrees."""

    dp: int | None = None
    """Data-parallel degree: groups of cp ranks that each read their share of the global batch. None: derived as
    world_size // (cp * tp); given: world_size must equal dp x cp x tp."""
    tp: int = 1
    """Tensor-parallel degree; must be 1 while linear attention CP is on (linear attention TP+CP is out of scope)."""
    plan: CPPlan = field(default_factory=lambda: CPPlan(cp=1, prefix=PREFIX))
    """Every CP setting (`deltacp.parallel.plan.CPPlan`); cp defaults to 1 here."""

    def __post_init__(self):
        _degree("dp", self.dp, allow_none=True)
        _degree("tp", self.tp)
        if self.tp != 1:
            raise ValueError(f"{PREFIX}tp={self.tp} is not supported with linear attention CP: tp must be 1")
        if self.plan.cp is None:
            raise ValueError(f"{PREFIX}cp must be an integer >= 1, got None")

    def __getattr__(self, name: str):
        """The plan's settings, as `train.accelerator.<name>` (only called for names that are not fields)."""
        name = RENAMED.get(name, name)
        if not name.startswith("_") and name in CPPlan.setting_names():
            return getattr(self.__dict__["plan"], name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The section's keys: dp, tp and the plan's fields."""
        return OWN_KEYS + CPPlan.setting_names()

    @classmethod
    def from_dict(cls, raw: dict | None) -> "AcceleratorConfig":
        raw = renamed_settings(dict(raw or {}), "train.accelerator", PREFIX)
        unknown = sorted(set(raw) - set(cls.keys()))
        if unknown:
            raise ValueError(f"train.accelerator: unknown key(s) {unknown}; allowed keys are {sorted(cls.keys())}")
        own = {k: raw.pop(k) for k in OWN_KEYS if k in raw}
        raw.setdefault("cp", 1)
        return cls(**own, plan=CPPlan(**raw, prefix=PREFIX))

    def to_dict(self) -> dict:
        """The section as the YAML holds it (flat)."""
        return {"dp": self.dp, "tp": self.tp, **self.plan.settings()}

    def replace(self, **changes) -> "AcceleratorConfig":
        """A copy with `changes` to any key of the section (validated again)."""
        own = {k: changes.pop(k) for k in OWN_KEYS if k in changes}
        plan = self.plan.replace(**changes) if changes else self.plan
        return dataclasses.replace(self, **own, plan=plan)

    def validate(self, world_size: int | None = None) -> None:
        """The rules that need the world size (the others ran when the section was built)."""
        if world_size is None:
            return
        cp = self.plan.cp
        if self.dp is None and world_size % (cp * self.tp):
            raise ValueError(f"{PREFIX}cp ({cp}) x tp ({self.tp}) must divide the world size ({world_size}) "
                             f"(train.accelerator.dp is null: derived as world // (cp x tp))")
        if self.dp is not None and self.dp * cp * self.tp != world_size:
            raise ValueError(f"{PREFIX}dp ({self.dp}) x cp ({cp}) x tp ({self.tp}) = {self.dp * cp * self.tp} must "
                             f"equal the world size ({world_size}); set train.accelerator.dp to null to derive it")

    def data_parallel(self, world_size: int) -> int:
        """The dp degree at this world size (after `validate(world_size)`)."""
        return self.dp if self.dp is not None else world_size // (self.plan.cp * self.tp)
