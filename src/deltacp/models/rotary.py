"""Rotary embeddings whose frequencies depend on the positions of the call, made exact under CP.

transformers' `dynamic_rope_update` (`modeling_rope_utils.py`) wraps the forward of every rotary embedding module:
before computing cos / sin it updates the module's frequencies from `max(position_ids) + 1` of that call -
'dynamic' types (dynamic NTK) rescale once the call reaches past the cached length and reset below the original
one, 'longrope' picks its long factors past `original_max_position_embeddings`. The other types (default, linear,
yarn, llama3, proportional, mRoPE sections) read no positions beyond the ones they rotate.

Under CP each rank's call holds its slice of the row only, so every rank but the one holding the largest position
would rotate with other frequencies. `install_global_rotary` gives such a module an instance forward that first
agrees on the largest position of the whole batch (one all-reduce MAX over the CP group, before the first decoder
layer: the text model calls its rotary module once, before its layers), runs transformers' own update with it (the
decorated forward on one probe position per row), then transformers' undecorated forward on the rank's positions:
the frequencies are the single-device call's, by transformers' own code. A module that declares such a type but is
not wrapped by transformers' decorator (a frequency update deltacp cannot reproduce) is refused by `check_rotary`,
naming it, before any collective. Inside `suspend_cp` the forward is transformers' own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deltacp.distributed.collectives import max_over_group

_INSTALLED = "_deltacp_global_rotary"


def position_dependent_types(module: nn.Module) -> list[str]:
    """The rope types of `module` (its `rope_type`: a string, or a dict per layer type) whose frequencies transformers
    updates from the positions of each call: the 'dynamic' types and 'longrope'."""
    rope = getattr(module, "rope_type", None)
    types = list(rope.values()) if isinstance(rope, dict) else [rope]
    return [t for t in types if isinstance(t, str) and ("dynamic" in t or t == "longrope")]


def _decorated(module: nn.Module) -> bool:
    """Whether the class forward is transformers' `dynamic_rope_update` wrapper (its code's own qualified name: the
    wrapper takes the forward's `__qualname__`, and keeps it as `__wrapped__`)."""
    forward = type(module).forward
    code = getattr(forward, "__code__", None)
    return (getattr(forward, "__wrapped__", None) is not None and code is not None
            and code.co_qualname == "dynamic_rope_update.<locals>.wrapper")


def check_rotary(text: nn.Module) -> None:
    """ValueError naming each rotary module with a position-dependent rope type that deltacp cannot make exact (its
    frequency update is not transformers' decorator)."""
    bad = [f"{name or type(text).__name__} ({type(m).__name__}, rope_type {position_dependent_types(m)})"
           for name, m in text.named_modules() if position_dependent_types(m) and not _decorated(m)]
    if bad:
        raise ValueError(f"rotary embedding(s) {bad} update their frequencies from the positions of each call, but "
                         f"not through transformers' dynamic_rope_update: under CP each rank sees its slice only, and "
                         f"deltacp cannot make them equal to the single-device call; use a rope type whose frequencies "
                         f"do not depend on the call ('default', 'linear', 'yarn', 'llama3', 'proportional')")


def install_global_rotary(text: nn.Module, group, suspended: Callable[[], bool]) -> list[str]:
    """The global-position forward on every position-dependent rotary module of `text` (see the module docstring);
    the names of the modules it went on. `suspended()`: whether `suspend_cp` holds the model (then transformers'
    forward runs as it is)."""
    names = []
    for name, module in text.named_modules():
        if position_dependent_types(module) and not getattr(module, _INSTALLED, False):
            module.forward = _global_forward(module, group, suspended)
            setattr(module, _INSTALLED, True)
            names.append(name or type(text).__name__)
    return names


def _global_forward(module: nn.Module, group, suspended: Callable[[], bool]):
    decorated = type(module).forward  # transformers' wrapper: the frequency update, then the forward
    undecorated = decorated.__wrapped__

    def forward(x: torch.Tensor, position_ids: torch.Tensor, layer_type=None):
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        if suspended():
            return decorated(module, x, position_ids, **kwargs)
        top = max_over_group(position_ids.detach().max(), group)
        probe = top.to(position_ids.dtype).expand(*position_ids.shape[:-1], 1)  # one position per row
        decorated(module, x, probe, **kwargs)  # transformers' update from the batch's largest position
        return undecorated(module, x, position_ids, **kwargs)

    return forward
