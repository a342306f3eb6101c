"""Model adapters: where things are in one model instance of a supported family, for applying CP to it.

The families and their views live in their homes (`deltacp.families`, registered in `families/registry.py`); here
every family's views are registered with `parallel/views.py` for its module classes, and `adapter_for(model)` finds
a model's text model, decoder layers, linear-attention and full-attention modules, how its positions are formed
(2-D text positions, Qwen3.5's [4, B, S] text + mRoPE rows, or the 3 mRoPE rows alone of a multimodal forward),
whether its MLPs are routed experts (their auxiliary loss is made global, `models/moe.py`) and whether a vision
tower precedes the language model (`models/multimodal.py`). The CP algorithms see only the views.

    adapter = adapter_for(model)      # NotImplementedError naming the class and the supported ones
    adapter.text, adapter.layers(), adapter.multimodal, adapter.moe

Supported: `supported_classes()` (a family missing from the installed transformers is skipped).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from deltacp.families.registry import Family, families, refuse_class, supported_classes
from deltacp.parallel.views import register_attention_view, register_mixer_view


def _register_views() -> None:
    for family in families():
        classes = family.classes()
        if classes is None:
            continue
        if family.linear_mixer is not None:  # LFM2: no linear-recurrent mixer
            register_mixer_view(classes["linear_mixer"], family.mixer_view)
        if family.attention is None:  # a pure linear-recurrent model
            continue
        rotary = getattr(importlib.import_module(family.module), "apply_rotary_pos_emb", None)
        register_attention_view(classes["attention"], partial(family.attention_view, apply_rotary=rotary))


_register_views()


def __getattr__(name: str):
    """The view classes by the names of earlier versions (`Qwen3_5GDNView`, `GDN_VIEWS`), from the homes."""
    views = {family.mixer_view.__name__: family.mixer_view for family in families() if family.mixer_view is not None}
    if name == "GDN_VIEWS":
        return views
    if name in views:
        return views[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _module_at(layer: nn.Module, paths: str | tuple[str, ...]) -> nn.Module | None:
    """The module at the first of `paths` (dotted attribute paths) the layer has, or None."""
    for path in (paths,) if isinstance(paths, str) else paths:
        module = layer
        for name in path.split("."):
            module = getattr(module, name, None)
        if module is not None:
            return module
    return None


@dataclass(frozen=True)
class MoEInfo:
    """Routed experts of a family's text config: what the auxiliary load-balancing loss needs."""

    num_experts: int
    top_k: int
    aux_loss_coef: float


@dataclass
class ModelAdapter:
    """Where things are in one model instance (the one given to `parallelize_cp`)."""

    family: Family
    model: nn.Module  # what the user passed
    text: nn.Module  # the text model: embed_tokens, layers, norm, rotary_emb
    multimodal: nn.Module | None  # vision tower + language model (...ForConditionalGeneration's .model)
    head: nn.Module | None  # the causal-LM / conditional-generation wrapper (its labels, logits, aux loss)

    def layers(self) -> list[nn.Module]:
        return list(self.text.layers)

    def linear_attention(self, layer: nn.Module) -> nn.Module | None:
        """The layer's linear mixer (the family's class at its attribute), or None (also for a family without one)."""
        if self.family.linear_mixer is None:
            return None
        module = _module_at(layer, self.family.linear_attribute)
        return module if type(module).__name__ == self.family.linear_mixer else None

    def full_attention(self, layer: nn.Module) -> nn.Module | None:
        """The layer's full attention (the family's class at its attribute), or None (always, for a family without
        one)."""
        if self.family.attention is None:
            return None
        module = _module_at(layer, self.family.attention_attribute)
        return module if type(module).__name__ == self.family.attention else None

    @property
    def text_config(self):
        return self.text.config

    @property
    def moe(self) -> MoEInfo | None:
        """The routed experts whose auxiliary loss CP makes global (the family's `moe_fields`), or None."""
        fields = self.family.moe_fields
        if fields is None:
            return None
        cfg = self.text_config
        layer_attribute, router = self.family.moe_router
        if getattr(cfg, fields[0], 0) and any(hasattr(getattr(layer, layer_attribute, None), router)
                                              for layer in self.layers()):
            return MoEInfo(*(getattr(cfg, name) for name in fields))
        return None

    @property
    def logit_factor(self) -> float:
        """What the causal LM's forward multiplies the head's output by (the family's `logit_scale`; 1.0: none)."""
        if self.family.logit_scale is None or self.head is None:
            return 1.0
        field, op = self.family.logit_scale
        value = float(getattr(self.text_config, field))
        return 1.0 / value if op == "div" else value

    @property
    def logit_softcap(self) -> float | None:
        """The cap of the causal LM's soft-capped logits (the family's `logit_softcap`), or None: none."""
        if self.family.logit_softcap is None or self.head is None:
            return None
        cap = getattr(self.text_config, self.family.logit_softcap, None)
        return None if cap is None else float(cap)

    def text_positions(self, position_ids: torch.Tensor) -> torch.Tensor | None:
        """The [B, s] text positions that describe documents (restarting per document), or None when the
        position ids carry none (the 3 mRoPE rows of a multimodal forward, as transformers' text model reads them).
        Raises ValueError for a layout the family does not take."""
        if position_ids.ndim == 2:
            return position_ids
        if self.family.mrope and position_ids.ndim == 3 and position_ids.shape[0] in (3, 4):
            return position_ids[0] if position_ids.shape[0] == 4 else None
        allowed = "[B, s], [4, B, s] (text + mRoPE rows) or [3, B, s] (mRoPE rows)" if self.family.mrope else "[B, s]"
        raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} for {type(self.model).__name__}: "
                         f"expected {allowed}")


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter of a supported model, or NotImplementedError naming its class and the supported classes (a refused
    class: why, `registry.REFUSED`)."""
    refuse_class(type(model).__name__, "context parallelism")
    for family in families():
        classes = family.classes()
        if classes is None:
            continue
        if isinstance(model, classes["text_model"]):
            return ModelAdapter(family, model, model, None, None)
        if "causal_lm" in classes and isinstance(model, classes["causal_lm"]):
            return ModelAdapter(family, model, getattr(model, family.text_attribute), None, model)
        if "conditional" in classes and isinstance(model, classes["conditional"]):
            return ModelAdapter(family, model, model.model.language_model, model.model, model)
    raise NotImplementedError(f"context parallelism supports {', '.join(supported_classes())}; got "
                              f"{type(model).__name__}")
