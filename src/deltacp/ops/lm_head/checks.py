"""Argument checks shared by the output-head ops and their model-facing callers: each error names the function and
the argument."""

from __future__ import annotations

import math

import torch

from deltacp.ops.lm_head.chunks import WEIGHT_GRAD_MODES
from deltacp.ops.lm_head.kernels import IGNORE_INDEX


def check_chunk(fn: str, name: str, value) -> None:
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{fn}: {name} must be a positive integer, got {value!r}")


def check_weight_grad(fn: str, weight_grad) -> None:
    if weight_grad not in WEIGHT_GRAD_MODES:
        raise ValueError(f"{fn}: weight_grad={weight_grad!r}; expected one of {WEIGHT_GRAD_MODES}")


def check_temperature(fn: str, temperature) -> None:
    """A Python number, finite and > 0 (a host value: no device sync)."""
    ok = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    if not (ok and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"{fn}: temperature must be a finite number > 0, got {temperature!r}")


def check_targets(fn: str, targets: torch.Tensor, vocab: int, name: str = "target_ids") -> None:
    """Integer targets, each in [0, vocab) or IGNORE_INDEX (one device reduction and a host sync)."""
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"{fn}: {name} must be an integer tensor, got {targets.dtype}")
    bad = ((targets < 0) & (targets != IGNORE_INDEX)) | (targets >= vocab)
    if bool(bad.any()):
        raise ValueError(f"{fn}: target {targets[bad][0].item()} is out of bounds for vocab {vocab} (ignored: "
                         f"{IGNORE_INDEX})")


def check_head(fn: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               targets: torch.Tensor, names: tuple[str, str, str, str], alternative: str) -> None:
    """hidden [..., H] with as many tokens as targets, weight [V, H] (a plain tensor: `alternative` names the call
    for a DTensor, a sharded parameter), bias [V] or None, one floating dtype, targets in bounds. `names`: the
    caller's names of (hidden, weight, bias, targets)."""
    from torch.distributed.tensor import DTensor

    h_name, w_name, b_name, t_name = names
    if isinstance(weight, DTensor) or isinstance(bias, DTensor):
        raise ValueError(f"{fn}: {w_name if isinstance(weight, DTensor) else b_name} is a DTensor (a sharded "
                         f"parameter); pass the unsharded weight: under FSDP2 use {alternative}, which runs inside "
                         f"the root module's forward")
    if hidden.ndim < 1 or targets.numel() * hidden.shape[-1] != hidden.numel():
        raise ValueError(f"{fn}: {hidden.numel() // max(hidden.shape[-1], 1) if hidden.ndim else 0} hidden states "
                         f"but {targets.numel()} targets ({h_name} {tuple(hidden.shape)}, {t_name} "
                         f"{tuple(targets.shape)})")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{fn}: {w_name} must be [vocab, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{fn}: {b_name} must be [{weight.shape[0]}] (the vocabulary), got {tuple(bias.shape)}")
    dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) != 1 or not hidden.dtype.is_floating_point:
        raise ValueError(f"{fn}: {h_name}, {w_name} and {b_name} must share one dtype, a floating one, got "
                         f"{hidden.dtype}, {weight.dtype}{'' if bias is None else f', {bias.dtype}'}")
    check_targets(fn, targets, weight.shape[0], t_name)
