"""CP -> activation checkpointing -> FSDP2: the one composition every trainer and `load_pretrained` apply.

    parallelize_and_shard(model, cp_mesh, fsdp=True, activation_checkpointing="full", linear_attention_cp_mode="p2p")

The order is torchtitan's: the CP forwards go on the layers first (`parallelize_cp`), then the per-decoder-layer
checkpointing (inside the FSDP unit's forward, so FSDP's unshard hooks run once per layer), FSDP2 last
(`fully_shard_cp`: every decoder layer, then the root, over every rank of the mesh, summed gradients). Works on a
model on the meta device as well (nothing here reads a parameter's values): that is how `load_pretrained` builds
a model whose ranks never hold more than their shard.
"""

from __future__ import annotations

import inspect

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deltacp.distributed.agree import LocalChecks, raise_together
from deltacp.distributed.mesh import batch_group_of
from deltacp.models.checkpointing import CheckpointingPlan, checkpointing_plan
from deltacp.models.fsdp import fully_shard_cp
from deltacp.models.parallelize import parallelize_cp

CP_SETTINGS: tuple[str, ...] = tuple(name for name in inspect.signature(parallelize_cp).parameters
                                     if name not in ("model", "cp_mesh"))


def check_cp_settings(cp_settings: dict, what: str) -> None:
    """TypeError naming an unknown keyword (the keywords of `parallelize_cp`)."""
    unknown = sorted(set(cp_settings) - set(CP_SETTINGS))
    if unknown:
        raise TypeError(f"{what}: unknown keyword {unknown[0]!r}; the CP settings are parallelize_cp's keywords "
                        f"{list(CP_SETTINGS)}")


def parallelize_and_shard(model: nn.Module, cp_mesh: DeviceMesh, *, fsdp: bool = True,
                          activation_checkpointing: bool | int | str | CheckpointingPlan = False, mp_policy=None,
                          **cp_settings) -> nn.Module:
    """`parallelize_cp(model, cp_mesh, **cp_settings)`, then activation checkpointing (`checkpointing_plan`: False,
    True: every decoder layer, n: every n-th, "full" / "selective", or a CheckpointingPlan), then with `fsdp` FSDP2
    over every rank of the mesh (`fully_shard_cp`, `mp_policy` a `MixedPrecisionPolicy` or its keywords); returns
    the model. Without `fsdp` the parameters stay replicated: sum their gradients with `all_reduce_cp_grads`."""
    plan = None
    with LocalChecks() as checks:  # every rank raises together (parallelize_cp checks the CP settings the same way)
        check_cp_settings(cp_settings, "parallelize_and_shard")
        plan = checkpointing_plan(activation_checkpointing)
        if not isinstance(fsdp, bool):
            raise ValueError(f"fsdp={fsdp!r}: expected True (FSDP2 over the mesh) or False (replicated parameters)")
        if mp_policy is not None and not fsdp:
            raise ValueError("mp_policy is FSDP2 mixed precision: it needs fsdp=True")
    raise_together(batch_group_of(cp_mesh), "parallelize_and_shard", checks.error,
                   agree=dict(fsdp=fsdp, activation_checkpointing=repr(plan)))
    parallelize_cp(model, cp_mesh, **cp_settings)
    if plan is not None:
        plan.apply(model)
    if fsdp:
        fully_shard_cp(model, cp_mesh, mp_policy=mp_policy)
    return model
