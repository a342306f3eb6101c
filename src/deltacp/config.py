"""The `train.accelerator` section of the trainer YAML (docs/design.md and README), typed and validated early.

    train:
      accelerator:
        dp: null          # data-parallel degree: null derives world // (cp * tp); given, world = dp x cp x tp
        cp: 4
        tp: 1
        ulysses_degree: null          # null / cp: 1-D; u < cp dividing cp: the 2-D layout (parallel/layout.py)
        linear_attention_cp_mode: p2p
        linear_attention_gdn_backend: triton
        full_attention_cp: ulysses    # ulysses | all_gather | ring  ('allgather': an alias of all_gather)
        linear_attention_state_passing: chain   # p2p's state hops: chain | scan (log-depth)
        sequence_layout: contiguous   # which tokens each rank holds: contiguous | balanced (parallel/placement.py)

`validate()` runs on every rank before the first collective, so a bad value is an error everywhere,
never a hang.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from deltacp.parallel.layout import validate_cp_layout
from deltacp.distributed.collectives import StatePassing
from deltacp.parallel.modes import canonical_name, gdn_mode
from deltacp.parallel.placement import check_sequence_layout

STATE_PASSING = StatePassing.SCHEDULES


@dataclass(frozen=True)
class AcceleratorConfig:
    cp: int = 1
    """Context-parallel degree (>= 1): ranks that share one sequence."""
    tp: int = 1
    """Tensor-parallel degree; must be 1 while linear attention CP is on (linear attention TP+CP is out of scope)."""
    dp: int | None = None
    """Data-parallel degree: groups of cp ranks that each read their share of the global batch. None: derived as
    world_size // (cp * tp); given: world_size must equal dp x cp x tp."""
    ulysses_degree: int | None = None
    """null (or cp): the 1-D layout, every layer over the whole CP group. u < cp dividing cp: the 2-D layout, cp / u
    groups of u consecutive ranks; every layer runs Ulysses inside a group (its heads must divide by u) and across
    groups linear_attention_cp_mode (p2p | all_gather) and full_attention_cp (all_gather | ring)."""
    linear_attention_cp_mode: str = "ulysses"
    """One of ulysses | p2p | all_gather (with ulysses_degree < cp: p2p | all_gather, the across-group method)."""
    linear_attention_gdn_backend: str = "eager"
    """One of eager | triton."""
    full_attention_cp: str = "ulysses"
    """Full attention CP: ulysses (heads split cp ways: num_attention_heads must divide by cp), all_gather (KV
    all-gather, no head limit; 'allgather' is accepted) or ring (KV blocks passed around a ring; memory of two
    blocks). With ulysses_degree < cp: all_gather | ring, the across-group method."""

    linear_attention_state_passing: str = "chain"
    """How p2p's state travels between ranks: chain (P - 1 sequential hops) or scan (ceil(log2 P) rounds of
    point-to-point exchanges; from how many ranks it is faster: README, measured in NOTES.md "The p2p state
    scan"). Only with a mode that has state hops (p2p)."""

    sequence_layout: str = "contiguous"
    """Which tokens of a row each CP rank holds, in every layer: contiguous (rank r: positions [r s, (r + 1) s)) or
    balanced (rank r: pieces r and 2 cp - 1 - r of the row cut into 2 cp, equal causal attention work per rank;
    train.data.seq_len must then divide by 2 x cp). `parallelize_cp(sequence_layout=)`, `parallel/placement.py`."""

    @classmethod
    def from_dict(cls, raw: dict | None) -> "AcceleratorConfig":
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"train.accelerator: unknown key(s) {unknown}; allowed keys are {sorted(known)}")
        for key in ("linear_attention_cp_mode", "full_attention_cp"):  # one spelling from here on
            if key in raw:
                raw[key] = canonical_name(raw[key])
        config = cls(**raw)
        config.validate()
        return config

    def validate(self, world_size: int | None = None) -> None:
        for name in ("cp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"train.accelerator.{name} must be an integer >= 1, got {value!r}")
        if self.dp is not None and (not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1):
            raise ValueError(f"train.accelerator.dp must be null or an integer >= 1, got {self.dp!r}")
        mode = gdn_mode(self.linear_attention_cp_mode, self.linear_attention_gdn_backend, prefix="train.accelerator.")
        if self.linear_attention_state_passing not in STATE_PASSING:
            raise ValueError(f"train.accelerator.linear_attention_state_passing={self.linear_attention_state_passing!r} "
                             f"is not supported; expected one of {STATE_PASSING}")
        if self.linear_attention_state_passing != "chain" and not mode.state_hops:
            raise ValueError(f"train.accelerator.linear_attention_state_passing={self.linear_attention_state_passing!r}"
                             f" needs a mode with state hops (p2p), not linear_attention_cp_mode={mode.name!r}")
        check_sequence_layout(self.sequence_layout, prefix="train.accelerator.")
        if self.tp != 1:
            raise ValueError(f"train.accelerator.tp={self.tp} is not supported with linear attention CP: tp must be 1")
        validate_cp_layout(self.cp, self.ulysses_degree, self.linear_attention_cp_mode, self.full_attention_cp,
                           prefix="train.accelerator.")
        if world_size is None:
            return
        if self.dp is None and world_size % (self.cp * self.tp):
            raise ValueError(f"train.accelerator.cp ({self.cp}) x tp ({self.tp}) must divide the world size "
                             f"({world_size}) (train.accelerator.dp is null: derived as world // (cp x tp))")
        if self.dp is not None and self.dp * self.cp * self.tp != world_size:
            raise ValueError(f"train.accelerator.dp ({self.dp}) x cp ({self.cp}) x tp ({self.tp}) = "
                             f"{self.dp * self.cp * self.tp} must equal the world size ({world_size}); set "
                             f"train.accelerator.dp to null to derive it")

    def data_parallel(self, world_size: int) -> int:
        """The dp degree at this world size (after `validate(world_size)`)."""
        return self.dp if self.dp is not None else world_size // (self.cp * self.tp)
