"""Activation checkpointing of a CP'd model: decoder layers recomputed in backward (non-reentrant), under a policy.

    apply_activation_checkpointing(model)                         # every layer, policy "full" (the default)
    apply_activation_checkpointing(model, policy="selective")     # every layer; attention outputs kept too
    apply_activation_checkpointing(model, num_layers=20)          # the first 20 layers only

Policies (`POLICIES`):
- full: a checkpointed layer keeps only its inputs; backward recomputes its whole forward.
- selective (never recomputes more than full, and skips the quadratic part): as full, but each
  full attention's output and log-sum-exp are kept (`ops/recompute.py`: torch's
  selective checkpoint for SDPA's kernels, a kept-output store for the tiled / ring attention), so the recompute
  never runs the quadratic part again; it costs one attention output [tokens, heads x head_dim] (+ fp32 lse) per
  attention layer. linear-recurrent layers recompute as under full.
Which is faster depends on the length (one H200, Qwen3.5-2B, cp = 1: selective 0.92x of full at 16K tokens, 1.07x
at 64K, where attention dominates; NOTES.md): "full" stays the default, "selective" is the choice for long rows,
and the trainer's `auto` weighs memory. `num_layers` checkpoints only the first n decoder layers (of those
`every_n_layers` picks); the rest keep their activations (the last layers: their activations are freed first in
backward, so the peak stays lowest; `train/memory.py` plans n for a budget).

The recompute of a checkpointed layer stops at the last tensor its forward saved (torch's early stop): the MLP's down
projection, whose input is saved before it runs, is never recomputed (`ops/recompute.py`).

Applied after CP and before FSDP2 (inside the FSDP unit's forward, so FSDP's unshard hooks run once). The
recompute of a p2p linear-recurrent layer replays the entering state its forward received, found in that forward's
`CPForwardContext` (the attention_mask argument the checkpoint keeps), instead of posting another receive; the
collectives of a recomputed layer run again in the same order on every rank under either policy.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from torch import nn
from torch.utils.checkpoint import checkpoint

from deltacp.models.adapters import adapter_for
from deltacp.ops.recompute import selective_contexts

logger = logging.getLogger(__name__)

POLICIES = ("full", "selective")
DEFAULT_POLICY = "full"


def check_policy(policy: str, what: str = "policy") -> str:
    if policy not in POLICIES:
        raise ValueError(f"{what}={policy!r} is not an activation checkpointing policy; expected one of "
                         f"{list(POLICIES)}")
    return policy


def check_plan(policy, every_n_layers, num_layers) -> None:
    """The settings of a checkpointing plan: a policy, every_n_layers >= 1, num_layers None or >= 0."""
    check_policy(policy)
    if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 1:
        raise ValueError(f"every_n_layers={every_n_layers!r} must be an integer >= 1")
    if num_layers is not None and (not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 0):
        raise ValueError(f"num_layers={num_layers!r} must be None or an integer >= 0")


_APPLIED = "_deltacp_checkpointing"  # set on the text model: (policy, every_n_layers, num_layers, layers checkpointed)


def checkpointing_signature(text: nn.Module) -> tuple[int, int, int, int]:
    """What `apply_activation_checkpointing` did to a text model, as four ints (all 0: nothing): the policy's index
    in POLICIES + 1, every_n_layers, num_layers (-1: None), the number of layers checkpointed. The CP input hook
    has every rank agree on it before the first layer runs (`models/inputs.py`): a rank that checkpoints where
    another does not would recompute (and run its collectives again) alone."""
    return getattr(text, _APPLIED, (0, 0, 0, 0))


def apply_activation_checkpointing(model: nn.Module, every_n_layers: int = 1, *, policy: str = DEFAULT_POLICY,
                                   num_layers: int | None = None) -> int:
    """Activation checkpointing of every `every_n_layers`-th decoder layer (1: all) of any supported model, the first
    `num_layers` of them (None: all), under `policy` ("selective" | "full"); returns the number of layers
    checkpointed.

    Once per model: asking again for the plan already applied changes nothing (checkpointing nested in
    checkpointing would recompute every layer twice); another plan raises, naming the one applied. Every rank must
    apply the same plan; a CP'd model checks that at its first forward, on every rank together."""
    check_plan(policy, every_n_layers, num_layers)
    adapter = adapter_for(model)
    applied = checkpointing_signature(adapter.text)
    asked = (POLICIES.index(policy) + 1, every_n_layers, -1 if num_layers is None else num_layers)
    if applied[0]:
        return _already_applied(model, applied, asked)
    layers = adapter.layers()
    chosen = layers[::every_n_layers][:num_layers]
    setattr(adapter.text, _APPLIED, (*asked, len(chosen)))
    kwargs = dict(use_reentrant=False, **({"context_fn": selective_contexts} if policy == "selective" else {}))
    for layer in chosen:
        layer.forward = functools.partial(checkpoint, layer.forward, **kwargs)
    logger.info("Applied activation checkpointing (%s) to %d of %d decoder layers", policy, len(chosen), len(layers))
    return len(chosen)


def _already_applied(model: nn.Module, applied: tuple, asked: tuple) -> int:
    """A second `apply_activation_checkpointing`: the layers already checkpointed when `asked` (policy index + 1,
    every_n_layers, num_layers or -1) is the plan `applied`, else ValueError naming both."""
    def describe(plan):
        return (f"policy={POLICIES[plan[0] - 1]!r}, every_n_layers={plan[1]}, "
                f"num_layers={None if plan[2] < 0 else plan[2]}")

    if tuple(applied[:3]) == asked:
        logger.info("Activation checkpointing (%s) is already applied to %s; left as it is", describe(applied),
                    type(model).__name__)
        return applied[3]
    raise ValueError(f"apply_activation_checkpointing: already applied to this {type(model).__name__} "
                     f"({describe(applied)}: {applied[3]} layers), asked again with {describe(asked)}: apply one "
                     f"plan, once (load_pretrained, parallelize_and_shard and the CP trainers' activation_checkpointing "
                     f"argument apply theirs)")


@dataclass(frozen=True)
class CheckpointingPlan:
    """Which decoder layers `parallelize_and_shard` / `load_pretrained` checkpoint, under which policy (the
    arguments of `apply_activation_checkpointing`)."""

    policy: str = DEFAULT_POLICY
    every_n_layers: int = 1
    num_layers: int | None = None

    def __post_init__(self):
        check_plan(self.policy, self.every_n_layers, self.num_layers)

    def apply(self, model: nn.Module) -> int:
        return apply_activation_checkpointing(model, self.every_n_layers, policy=self.policy,
                                              num_layers=self.num_layers)


def checkpointing_plan(value) -> CheckpointingPlan | None:
    """The plan of an `activation_checkpointing=` argument: False / 0 / None (none), True (every decoder layer,
    the default policy), n >= 1 (every n-th layer), a policy name ("full" | "selective": every layer), or a
    CheckpointingPlan."""
    if isinstance(value, CheckpointingPlan):
        return value
    if value is None or value is False or (isinstance(value, int) and not isinstance(value, bool) and value == 0):
        return None
    if value is True:
        return CheckpointingPlan()
    if isinstance(value, int) and value >= 1:
        return CheckpointingPlan(every_n_layers=value)
    if isinstance(value, str):
        return CheckpointingPlan(check_policy(value, "activation_checkpointing"))
    raise ValueError(f"activation_checkpointing={value!r}: expected False, True (every decoder layer), an integer n "
                     f">= 1 (every n-th layer), a policy {list(POLICIES)} or a CheckpointingPlan")
