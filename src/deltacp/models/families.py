"""The supported model families, by transformers class NAME: one `Family` per family, the only place that names
a family's classes.

This module imports nothing but the standard library (the deltacp package around it loads torch; nothing here loads
transformers): the trainer's config checks read it before transformers' models load (`python -m deltacp.train`
reports a bad config first). `models/adapters.py` resolves the names, registers each family's views and finds a
model's adapter; the trainer builds configs from
`text_config` / `multimodal_config`; the fused decoder glue replaces the family's `norm`. Adding a family is adding
one `Family` here (and a GDN view in `models/adapters.py` if its projections read differently) plus its parity
test.

    family_of("Qwen3_5MoeForCausalLM").text_config     # 'Qwen3_5MoeTextConfig'
    trainable_classes()                                # the classes the trainer builds (train.model.model_class)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One model family: its transformers modeling module and the class names of each role."""

    name: str
    module: str  # transformers.models.<...>.modeling_<...>
    causal_lm: str
    text_model: str
    gdn: str
    attention: str
    norm: str  # the decoder's RMSNorm: (x * rsqrt(mean(x^2) + eps) * (1 + w)).type_as(x), the fused glue's form
    mlp: str  # the dense MLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)) (activation checkpointing's SwiGLU form)
    gdn_view: str  # the GDNView subclass of models/adapters.py that reads its GDN projections
    text_config: str  # the config class of the text model (the trainer's train.model.config fields)
    conditional: str | None = None  # the multimodal ...ForConditionalGeneration
    multimodal_model: str | None = None  # its inner model: vision tower + language model
    multimodal_config: str | None = None  # the conditional class's config: text_config + vision_config
    vision_config: str | None = None  # the vision tower's config class (train.model.vision_config fields)
    mrope: bool = False  # 3-D (text + mRoPE) position ids
    presets: bool = False  # models/presets.py's released sizes are text_config fields of this family

    def trainable_classes(self) -> tuple[str, ...]:
        """The classes with a language-model head: what the trainer builds."""
        return tuple(n for n in (self.causal_lm, self.conditional) if n is not None)

    def model_classes(self) -> tuple[str, ...]:
        """Every class parallelize_cp takes: the trainable ones and the bare text model."""
        return (self.causal_lm, self.text_model) + ((self.conditional,) if self.conditional else ())

    def classes(self) -> dict[str, type] | None:
        """The role -> class map from the installed transformers (imports the modeling module), or None when
        transformers lacks the family."""
        try:
            mod = importlib.import_module(self.module)
        except ImportError:
            return None
        names = dict(causal_lm=self.causal_lm, text_model=self.text_model, gdn=self.gdn, attention=self.attention,
                     conditional=self.conditional, multimodal_model=self.multimodal_model)
        found = {role: getattr(mod, name, None) for role, name in names.items() if name is not None}
        return found if all(found.values()) else None


FAMILIES = (
    Family("qwen3_5", "transformers.models.qwen3_5.modeling_qwen3_5", causal_lm="Qwen3_5ForCausalLM",
           text_model="Qwen3_5TextModel", gdn="Qwen3_5GatedDeltaNet", attention="Qwen3_5Attention",
           norm="Qwen3_5RMSNorm", mlp="Qwen3_5MLP", gdn_view="Qwen3_5GDNView", text_config="Qwen3_5TextConfig",
           conditional="Qwen3_5ForConditionalGeneration", multimodal_model="Qwen3_5Model",
           multimodal_config="Qwen3_5Config", vision_config="Qwen3_5VisionConfig", mrope=True, presets=True),
    Family("qwen3_5_moe", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", causal_lm="Qwen3_5MoeForCausalLM",
           text_model="Qwen3_5MoeTextModel", gdn="Qwen3_5MoeGatedDeltaNet", attention="Qwen3_5MoeAttention",
           norm="Qwen3_5MoeRMSNorm", mlp="Qwen3_5MoeMLP", gdn_view="Qwen3_5GDNView", text_config="Qwen3_5MoeTextConfig",
           conditional="Qwen3_5MoeForConditionalGeneration", multimodal_model="Qwen3_5MoeModel",
           multimodal_config="Qwen3_5MoeConfig", vision_config="Qwen3_5MoeVisionConfig", mrope=True),
    Family("qwen3_next", "transformers.models.qwen3_next.modeling_qwen3_next", causal_lm="Qwen3NextForCausalLM",
           text_model="Qwen3NextModel", gdn="Qwen3NextGatedDeltaNet", attention="Qwen3NextAttention",
           norm="Qwen3NextRMSNorm", mlp="Qwen3NextMLP", gdn_view="Qwen3NextGDNView", text_config="Qwen3NextConfig"),
)


def supported_classes() -> list[str]:
    """Every class name parallelize_cp takes, family by family."""
    return [name for family in FAMILIES for name in family.model_classes()]


def trainable_classes() -> tuple[str, ...]:
    """The class names the trainer builds (train.model.model_class), family by family."""
    return tuple(name for family in FAMILIES for name in family.trainable_classes())


def family_of(class_name: str) -> Family:
    """The family of a supported class name, or NotImplementedError naming it and the supported ones."""
    for family in FAMILIES:
        if class_name in family.model_classes():
            return family
    raise NotImplementedError(f"{class_name} is not a supported class; expected one of {supported_classes()}")
