"""What a CP algorithm sees of a model's layer: a view, never the model class.

The CP algorithms (GDN modes, Ulysses attention) read a layer only through these two views. A model family's
adapter (`deltacp.models.adapters`) subclasses them for its module classes and registers a factory per class
here (deltacp's package registers a loader that imports `deltacp.models.adapters`, which registers every family,
before the first lookup); `parallel/` itself knows no model class. Views read the module's parameters at call time
(FSDP2 swaps a module's parameters between sharded and unsharded tensors around each forward).

GDNView hands over, per call, the pre-conv channels in the order [q | k | v] (key heads, then value heads),
the output gate z, and the per-value-head beta and gate inputs b, a; plus the conv, A_log, dt_bias, the gated
norm's weight and epsilon, and the out projection. AttentionView hands over the projections of a gated full
attention (q_proj emits query and output gate per head), its q/k norms, head counts and the family's rotary
embedding.

Shape legend: x_BsD local hidden states; qkv_BsC pre-conv channels [q | k | v]; z_BsHV per value head;
b_BsH, a_BsH per value head.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def _reads(path: str) -> property:
    """A read-only property: `self.module.<path>`, read at every call (FSDP2 swaps parameters between calls)."""
    names = path.split(".")

    def get(self):
        x = self.module
        for name in names:
            x = getattr(x, name)
        return x

    return property(get, doc=f"module.{path}, read at call time")


class GDNView:
    """One GDN module as the CP algorithms need it (subclassed per model family)."""

    family = "generic"

    def __init__(self, module: nn.Module):
        self.module = module

    # head layout
    num_k_heads = _reads("num_k_heads")
    num_v_heads = _reads("num_v_heads")
    head_k_dim = _reads("head_k_dim")
    head_v_dim = _reads("head_v_dim")

    # parameters and submodules, read at call time
    conv1d = _reads("conv1d")
    A_log = _reads("A_log")
    dt_bias = _reads("dt_bias")
    norm_weight = _reads("norm.weight")
    norm_eps = _reads("norm.variance_epsilon")
    out_proj = _reads("out_proj")  # view.out_proj(x) calls the module's projection

    def project(self, x_BsD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, s, hidden] -> qkv_BsC [B, s, q|k|v channels], z_BsHV [B, s, Hv, V], b_BsH, a_BsH [B, s, Hv]."""
        raise NotImplementedError

    def parameter(self) -> torch.Tensor:
        """Any parameter (dtype and device of the module)."""
        return next(self.module.parameters())


class AttentionView:
    """One gated full-attention module (q_proj emits query and output gate per head) as Ulysses CP needs it."""

    family = "generic"

    def __init__(self, module: nn.Module, apply_rotary: Callable):
        self.module = module
        self._apply_rotary = apply_rotary

    num_heads = _reads("config.num_attention_heads")
    num_kv_heads = _reads("config.num_key_value_heads")
    head_dim = _reads("head_dim")
    scaling = _reads("scaling")

    @property
    def dropout(self) -> float:
        return self.module.attention_dropout if self.module.training else 0.0

    q_proj = _reads("q_proj")  # the module's projections, called as view.q_proj(x)
    k_proj = _reads("k_proj")
    v_proj = _reads("v_proj")
    o_proj = _reads("o_proj")

    @property
    def q_norm(self) -> tuple[torch.Tensor, float]:
        return self.module.q_norm.weight, self.module.q_norm.eps

    @property
    def k_norm(self) -> tuple[torch.Tensor, float]:
        return self.module.k_norm.weight, self.module.k_norm.eps

    def apply_rotary(self, q_BsHD: torch.Tensor, k_BsHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The family's rotary embedding of the local tokens (partial rotary and mRoPE are in cos/sin)."""
        return self._apply_rotary(q_BsHD, k_BsHD, cos, sin, unsqueeze_dim=2)


_GDN_VIEWS: dict[type, Callable[[nn.Module], GDNView]] = {}
_ATTENTION_VIEWS: dict[type, Callable[[nn.Module], AttentionView]] = {}
_FAMILY_LOADERS: list[Callable[[], object]] = []  # run once, before the first lookup: they register the families


def register_family_loader(load: Callable[[], object]) -> None:
    """`load()` registers views (importing the model adapters); run before the first lookup. deltacp's package
    registers the adapters' import here, so that `import deltacp` stays light and `parallel/` imports no model."""
    _FAMILY_LOADERS.append(load)


def _load_families() -> None:
    while _FAMILY_LOADERS:
        _FAMILY_LOADERS.pop(0)()


def register_gdn_view(module_class: type, factory: Callable[[nn.Module], GDNView]) -> None:
    _GDN_VIEWS[module_class] = factory


def register_attention_view(module_class: type, factory: Callable[[nn.Module], AttentionView]) -> None:
    _ATTENTION_VIEWS[module_class] = factory


def _lookup(registry: dict, module: nn.Module, what: str):
    _load_families()
    for cls in type(module).__mro__:
        if cls in registry:
            return registry[cls](module)
    known = ", ".join(sorted(cls.__name__ for cls in registry))
    raise NotImplementedError(f"{what} applies to transformers' {known}; got {type(module).__name__}")


def gdn_view_of(module: nn.Module) -> GDNView:
    """The registered view of a GDN module, or NotImplementedError naming its class and the supported ones."""
    if isinstance(module, GDNView):
        return module
    return _lookup(_GDN_VIEWS, module, "LinearAttentionContextParallel")


def attention_view_of(module: nn.Module) -> AttentionView:
    if isinstance(module, AttentionView):
        return module
    return _lookup(_ATTENTION_VIEWS, module, "Ulysses full attention CP")

