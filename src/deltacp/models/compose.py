"""CP -> activation checkpointing -> FSDP2: the one composition the trainer, the integrations and `load_pretrained`
apply.

    parallelize_and_shard(model, cp_mesh, CPPlan(linear_attention_cp_mode="p2p"), fsdp=True,
                          activation_checkpointing="full")

The order is torchtitan's: the CP forwards go on the layers first (`parallelize_cp`), then the per-decoder-layer
checkpointing (inside the FSDP unit's forward, so FSDP's unshard hooks run once per layer), FSDP2 last
(`fully_shard_cp`: every decoder layer, then the root, over every rank of the mesh, summed gradients). Works on a
model on the meta device as well (nothing here reads a parameter's values): that is how `load_pretrained` builds
a model whose ranks never hold more than their shard.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deltacp.distributed.agree import LocalChecks, raise_together
from deltacp.distributed.mesh import batch_group_of, cp_group_of
from deltacp.models.checkpointing import CheckpointingPlan, checkpointing_plan
from deltacp.models.fsdp import fully_shard_cp
from deltacp.models.parallelize import parallelize_cp
from deltacp.parallel.plan import CPPlan


def parallelize_and_shard(model: nn.Module, cp_mesh: DeviceMesh, plan: CPPlan | None = None, *, fsdp: bool = True,
                          activation_checkpointing: bool | int | str | CheckpointingPlan = False, mp_policy=None,
                          **settings) -> nn.Module:
    """`parallelize_cp(model, cp_mesh, plan)` (a `CPPlan`, or its fields as keywords), then activation checkpointing
    (`checkpointing_plan`: False, True: every decoder layer, n: every n-th, "full" / "selective", or a
    CheckpointingPlan), then with `fsdp` FSDP2 over every rank of the mesh (`fully_shard_cp`, `mp_policy` a
    `MixedPrecisionPolicy` or its keywords); returns the model. Without `fsdp` the parameters stay replicated: sum
    their gradients with `all_reduce_cp_grads`."""
    checkpointing = None
    with LocalChecks() as checks:  # every rank raises together (parallelize_cp checks the CP settings the same way)
        plan = CPPlan.resolve(plan, settings, cp_group_of(cp_mesh).size(), "parallelize_and_shard")
        checkpointing = checkpointing_plan(activation_checkpointing)
        if not isinstance(fsdp, bool):
            raise ValueError(f"fsdp={fsdp!r}: expected True (FSDP2 over the mesh) or False (replicated parameters)")
        if mp_policy is not None and not fsdp:
            raise ValueError("mp_policy is FSDP2 mixed precision: it needs fsdp=True")
    raise_together(batch_group_of(cp_mesh), "parallelize_and_shard", checks.error,
                   agree=dict(fsdp=fsdp, activation_checkpointing=repr(checkpointing)))
    parallelize_cp(model, cp_mesh, plan)
    if checkpointing is not None:
        checkpointing.apply(model)
    if fsdp:
        fully_shard_cp(model, cp_mesh, mp_policy=mp_policy)
    return model
