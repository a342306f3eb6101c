"""Parameters under CP: FSDP2 over every rank of the mesh, or a plain gradient sum when they stay replicated.

Each rank's loss (`cp_causal_lm_loss`, `cp_cross_entropy`) already carries only its share of the mean over the
global batch (its all-reduce spans the whole mesh, dp x cp: the one place the loss is scaled), so every gradient
reduction here is a plain sum: the reduced gradient is the single-device gradient of the global batch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deltacp.distributed.agree import LocalChecks, raise_together
from deltacp.distributed.mesh import batch_group_of, batch_mesh_of
from deltacp.models.adapters import adapter_for
from deltacp.models.parallelize import require_parallelized
from deltacp.parallel.attention import has_attention_cp
from deltacp.parallel.style import cp_layer_of


BUCKET_BYTES = 64 << 20  # all_reduce_cp_grads: the most gradient bytes summed by one all-reduce


def all_reduce_cp_grads(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Sum replicated parameters' gradients over every rank of the mesh (without FSDP): the CP group, or dp x cp
    for a ("dp", "cp") mesh, whose ranks together hold the global batch the loss averages over. A model CP was not
    applied to is refused on every rank together (one small all-gather first).

    A gradient may be missing on some ranks (a parameter their tokens did not reach): it counts as zero there, and
    every rank where any rank had one gets the sum; a parameter with no gradient on any rank keeps None. Two kinds
    of collectives, whatever the parameter count: one all-reduce of which parameters have a gradient, then the
    gradients flattened in parameter order, one all-reduce per dtype and device and per BUCKET_BYTES (a
    per-parameter all-reduce costs one collective's latency per tensor: 1,272 of them were half of a CP8 test's
    time on gloo)."""
    group = batch_group_of(cp_mesh)
    _require_cp(model, group, "all_reduce_cp_grads")
    params = list(model.parameters())
    if not params:
        return
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(present, group=group)
    summed = [p for p, n in zip(params, present.tolist()) if n > 0]
    bucket, size = [], 0
    for i, p in enumerate(summed):
        bucket.append(p)
        size += p.numel() * p.element_size()
        last = i + 1 == len(summed)
        if last or size >= BUCKET_BYTES or (summed[i + 1].dtype, summed[i + 1].device) != (p.dtype, p.device):
            _sum_bucket(bucket, group)
            bucket, size = [], 0


def _sum_bucket(params: list[nn.Parameter], group) -> None:
    """One all-reduce of these parameters' gradients (one dtype and device; a missing gradient as zeros)."""
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(p.dtype)
                      for p in params])
    dist.all_reduce(flat, group=group)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        if p.grad is None:
            p.grad = g.view_as(p).clone()
        else:
            p.grad.copy_(g.view_as(p.grad))


def fully_shard_cp(model: nn.Module, mesh: DeviceMesh, mp_policy=None, reshard_after_forward: bool = True
                   ) -> nn.Module:
    """FSDP2 on each group of modules that share their parameters (`Family.shared_modules`: one unit each, so a tied
    parameter stays one parameter), each decoder layer, then the root, over every rank of `mesh`: a CP mesh, or a
    ("dp", "cp") mesh flattened to one dimension (parameters sharded over dp x cp, not HSDP). Any class a model
    adapter supports (the vision tower goes with the root).

    FSDP2 would average over its mesh; here the reduction is a plain sum (divide factor 1, see the module
    docstring). A model CP was not applied to is refused on every rank together.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _require_cp(model, batch_group_of(mesh), "fully_shard_cp")
    kwargs = dict(mesh=batch_mesh_of(mesh), reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy if isinstance(mp_policy, MixedPrecisionPolicy) else MixedPrecisionPolicy(
            **mp_policy)
    adapter = adapter_for(model)
    if adapter.family.shared_modules is not None:  # tied across layers (Zamba2's shared blocks): one unit per group
        for modules in adapter.family.shared_modules(adapter.text):
            fully_shard(modules, **kwargs)
    for layer in adapter.layers():
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            # With factor 1, FSDP2 would reduce float32/bf16 with PREMUL_SUM(1), which gloo lacks; a plain
            # SUM is the same result on every backend.
            module.set_force_sum_reduction_for_comms(True)
    model._deltacp_reshard_after_forward = reshard_after_forward  # what unsharded_parameters sets again on exit
    return model


def _require_cp(model: nn.Module, group, fn: str) -> None:
    """Sums over the mesh are right only for a CP'd model (each rank's loss its share of the global batch): a model
    CP was not applied to is refused on every rank together (`require_parallelized`); a module holding layers with
    a CP forward installed (linear-recurrent or full attention layers used on their own) passes. Checked once per model and
    group: `all_reduce_cp_grads` runs every step, and CP once applied stays (no exchange, no device sync after)."""
    checked = model.__dict__.setdefault("_deltacp_cp_checked", set())
    if id(group) in checked:
        return
    with LocalChecks() as checks:
        layers_with_cp = any(cp_layer_of(m) is not None or has_attention_cp(m) for m in model.modules())
        if not layers_with_cp:
            require_parallelized(model, fn)
    raise_together(group, fn, checks.error, device=next(model.parameters()).device)
    checked.add(id(group))


@contextlib.contextmanager
def unsharded_parameters(model: nn.Module):
    """Hold the FSDP2 parameters of a model sharded by `fully_shard_cp` unsharded through every forward inside (e.g.
    the decoding steps of a generation): one all-gather per FSDP unit on entry, none per forward, resharded on exit
    (and the `reshard_after_forward` fully_shard_cp was given set again). A collective over the model's mesh:
    every rank enters together. Costs the full parameters in their compute dtype (the mixed-precision param_dtype)
    on every rank while inside. A model without FSDP2 passes through unchanged.
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    reshard = getattr(model, "_deltacp_reshard_after_forward", True)
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        for unit in units:
            unit.unshard()
        yield model
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(reshard, recurse=False)
