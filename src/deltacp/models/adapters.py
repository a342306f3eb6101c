"""Model adapters: where each transformers model family keeps what context parallelism needs.

One adapter per family says where the text model, its decoder layers, GDN and full-attention modules are, how
to read q/k/v, z, b, a (separate projections in Qwen3.5, fused head-interleaved `in_proj_qkvz` / `in_proj_ba`
in Qwen3-Next), the conv, gates and norms (the views registered with `parallel/views.py`), how positions are
formed (2-D text positions, Qwen3.5's [4, B, S] text + mRoPE rows, or the 3 mRoPE rows alone of a multimodal
forward), whether the MLPs are routed experts (their auxiliary loss is made global, `models/moe.py`) and
whether a vision tower precedes the language model (`models/multimodal.py`). The CP algorithms see only what
the adapter hands them. The families themselves, by class name, are `models/families.py`'s `FAMILIES` (importable
without transformers): adding a family is adding one `Family` there (and a GDN view here if its projections read
differently, named in `Family.gdn_view`) plus its parity test.

    adapter = adapter_for(model)      # NotImplementedError naming the class and the supported ones
    adapter.text, adapter.layers(), adapter.multimodal, adapter.moe

Supported: `supported_classes()` (a family missing from the installed transformers is skipped).

Shape legend: x_BsD local hidden states; *_BsGX per key-head group (Qwen3-Next's interleaved layout).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from deltacp.models.families import FAMILIES, Family, supported_classes
from deltacp.parallel.views import AttentionView, GDNView, register_attention_view, register_gdn_view


class Qwen3_5GDNView(GDNView):
    """Qwen3.5 (dense and MoE): separate projections in_proj_qkv ([q | k | v] channels), in_proj_z, in_proj_b,
    in_proj_a."""

    family = "qwen3_5"

    def project(self, x_BsD):
        m = self.module
        B, s, _ = x_BsD.shape
        return (m.in_proj_qkv(x_BsD), m.in_proj_z(x_BsD).reshape(B, s, -1, m.head_v_dim), m.in_proj_b(x_BsD),
                m.in_proj_a(x_BsD))


class Qwen3NextGDNView(GDNView):
    """Qwen3-Next: fused projections, interleaved per key-head group g (of Hk groups):

        in_proj_qkvz -> per group [q_g (K) | k_g (K) | v_g (r V) | z_g (r V)]      r = Hv / Hk
        in_proj_ba   -> per group [b_g (r) | a_g (r)]

    De-interleaved exactly as transformers' `fix_query_key_value_ordering`: q, k of every group in group order,
    value heads g*r .. g*r + r-1 in order; then [q | k | v] concatenated as the conv channels.
    """

    family = "qwen3_next"

    def project(self, x_BsD):
        m = self.module
        B, s, _ = x_BsD.shape
        Hk, Hv, K, V = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
        r = Hv // Hk
        qkvz_BsGX = m.in_proj_qkvz(x_BsD).view(B, s, Hk, 2 * K + 2 * r * V)
        ba_BsGX = m.in_proj_ba(x_BsD).view(B, s, Hk, 2 * r)
        q, k, v, z = torch.split(qkvz_BsGX, [K, K, r * V, r * V], dim=3)
        b, a = torch.split(ba_BsGX, [r, r], dim=3)
        qkv_BsC = torch.cat([q.reshape(B, s, Hk * K), k.reshape(B, s, Hk * K), v.reshape(B, s, Hv * V)], dim=-1)
        return qkv_BsC, z.reshape(B, s, Hv, V), b.reshape(B, s, Hv), a.reshape(B, s, Hv)


GDN_VIEWS = {view.__name__: view for view in (Qwen3_5GDNView, Qwen3NextGDNView)}  # Family.gdn_view -> class


def _register_views() -> None:
    for family in FAMILIES:
        classes = family.classes()
        if classes is None:
            continue
        view_cls = type(family.gdn_view, (GDN_VIEWS[family.gdn_view],), {"family": family.name})
        register_gdn_view(classes["gdn"], view_cls)
        rotary = importlib.import_module(family.module).apply_rotary_pos_emb
        attention_view = type(f"{family.name}AttentionView", (AttentionView,), {"family": family.name})
        register_attention_view(classes["attention"], partial(attention_view, apply_rotary=rotary))


_register_views()


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

    @staticmethod
    def linear_attention(layer: nn.Module) -> nn.Module | None:
        return getattr(layer, "linear_attn", None)

    @staticmethod
    def full_attention(layer: nn.Module) -> nn.Module | None:
        return getattr(layer, "self_attn", None)

    @property
    def text_config(self):
        return self.text.config

    @property
    def moe(self) -> MoEInfo | None:
        cfg = self.text_config
        if getattr(cfg, "num_experts", 0) and any(hasattr(layer.mlp, "gate") for layer in self.layers()):
            return MoEInfo(cfg.num_experts, cfg.num_experts_per_tok, cfg.router_aux_loss_coef)
        return None

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
    """The adapter of a supported model, or NotImplementedError naming its class and the supported classes."""
    for family in FAMILIES:
        classes = family.classes()
        if classes is None:
            continue
        if isinstance(model, classes["text_model"]):
            return ModelAdapter(family, model, model, None, None)
        if isinstance(model, classes["causal_lm"]):
            return ModelAdapter(family, model, model.model, None, model)
        if "conditional" in classes and isinstance(model, classes["conditional"]):
            return ModelAdapter(family, model, model.model.language_model, model.model, model)
    raise NotImplementedError(f"context parallelism supports {', '.join(supported_classes())}; got "
                              f"{type(model).__name__}")
