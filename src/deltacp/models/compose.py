"""CP -> activation checkpointing -> FSDP2: the one composition every trainer and `load_pretrained` apply.

    parallelize_and_shard(model, cp_mesh, fsdp=True, activation_checkpointing=True, linear_attention_cp_mode="p2p")

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
from deltacp.models.checkpointing import apply_activation_checkpointing
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


def checkpointing_every(activation_checkpointing) -> int:
    """0 (none) for False, 1 (every decoder layer) for True, n for an integer n >= 0 (every n-th layer; 0: none)."""
    value = activation_checkpointing
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value >= 0:
        return value
    raise ValueError(f"activation_checkpointing={value!r}: expected False, True (every decoder layer) or an integer "
                     f"n >= 1 (every n-th decoder layer)")


def parallelize_and_shard(model: nn.Module, cp_mesh: DeviceMesh, *, fsdp: bool = True,
                          activation_checkpointing: bool | int = False, mp_policy=None, **cp_settings) -> nn.Module:
    """`parallelize_cp(model, cp_mesh, **cp_settings)`, then activation checkpointing (False, True: every decoder
    layer, n: every n-th), then with `fsdp` FSDP2 over every rank of the mesh (`fully_shard_cp`, `mp_policy` a
    `MixedPrecisionPolicy` or its keywords); returns the model. Without `fsdp` the parameters stay replicated: sum
    their gradients with `all_reduce_cp_grads`."""
    every = 0
    with LocalChecks() as checks:  # every rank raises together (parallelize_cp checks the CP settings the same way)
        check_cp_settings(cp_settings, "parallelize_and_shard")
        every = checkpointing_every(activation_checkpointing)
        if not isinstance(fsdp, bool):
            raise ValueError(f"fsdp={fsdp!r}: expected True (FSDP2 over the mesh) or False (replicated parameters)")
        if mp_policy is not None and not fsdp:
            raise ValueError("mp_policy is FSDP2 mixed precision: it needs fsdp=True")
    raise_together(batch_group_of(cp_mesh), "parallelize_and_shard", checks.error,
                   agree=dict(fsdp=fsdp, activation_checkpointing=every))
    parallelize_cp(model, cp_mesh, **cp_settings)
    if every:
        apply_activation_checkpointing(model, every)
    if fsdp:
        fully_shard_cp(model, cp_mesh, mp_policy=mp_policy)
    return model
