"""The registry of supported model families, by transformers class NAME.

Each family's home (`deltacp.families.<family>`, beside this module) describes it with one `Family` and registers it
here; the homes load at the first use of the registry (`FAMILIES`, `family_of`, ...), never at `import deltacp`, and
import no transformers module: the trainer's config checks read the registry before transformers' models load (`python -m deltacp.train`
reports a bad config first). `models/adapters.py` resolves the names, registers each family's views and finds a
model's adapter; the trainer builds configs from `text_config` / `multimodal_config`.

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
    causal_lm: str | None  # None: the family has no causal-LM class (GLM-5.3-Flash: its conditional class takes text)
    text_model: str
    # its linear-recurrent mixer's class (GDN, Mamba2, KDA, ...); None: the family has none (LFM2: its layers are gated
    # short convs, a `token_layers` entry, or attention)
    linear_mixer: str | None
    attention: str | None  # its full attention's class; None: a pure linear-recurrent model (Mamba2)
    norm: str  # the decoder's RMSNorm: (x * rsqrt(mean(x^2) + eps) * (1 + w)).type_as(x), the fused glue's form
    mlp: str | None  # the dense MLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)); None: no MLP (Mamba2)
    text_config: str  # the config class of the text model (the trainer's train.model.config fields)
    conditional: str | None = None  # the multimodal ...ForConditionalGeneration
    multimodal_model: str | None = None  # its inner model: vision tower + language model
    multimodal_config: str | None = None  # the conditional class's config: text_config + vision_config
    vision_config: str | None = None  # the vision tower's config class (train.model.vision_config fields)
    mrope: bool = False  # 3-D (text + mRoPE) position ids
    presets: bool = False  # models/presets.py's released sizes are text_config fields of this family
    mixer_view: object = None  # its linear mixer's view: a `parallel.views.LinearMixerView` subclass
    attention_view: object = None  # its full attention's view: an `AttentionView` subclass (takes apply_rotary=)
    fused_decoder: bool = True  # its decoder norms are the (1 + w) form the fused Triton glue computes
    # the decoder layer's attribute holding its linear mixer: a dotted path, or several (the first a layer has wins:
    # Zamba2's "mamba" in its Mamba layers, "mamba_decoder.mamba" in its hybrid ones)
    linear_attribute: str | tuple[str, ...] = "linear_attn"
    # routed experts with transformers' load-balancing auxiliary loss: the config fields of (experts, top k, loss
    # coefficient), and (a layer's attribute, its router's attribute) that mark a routed layer; None: no aux loss
    moe_fields: tuple[str, str, str] | None = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    moe_router: tuple[str, str] = ("mlp", "gate")
    # the causal LM's forward scales the head's output: (config field, "div" | "mul"): logits = head(h) / or * it
    logit_scale: tuple[str, str] | None = None
    # the causal LM's forward soft-caps the head's output: logits = cap * tanh(logits / cap), cap this config field
    # (RecurrentGemma's logits_soft_cap); the CP losses that replace the head compute it in their kernels
    logit_softcap: str | None = None
    # recomputes non-persistent buffers that transformers' per-module initialisation cannot (load_pretrained calls it
    # after the weights are read): (model, its text config) -> the names of the modules whose buffers it set
    recompute_buffers: object = None
    attention_attribute: str | tuple[str, ...] = "self_attn"  # ... and its full attention
    # (text model) -> lists of modules that hold the SAME parameters (transformers ties them: Zamba2's shared blocks,
    # one instance per invocation): FSDP2 shards each list as one unit, before the decoder layers; None: none
    shared_modules: object = None
    text_attribute: str = "model"  # the causal LM's attribute holding the text model (Mamba2: "backbone")
    # its text model hands its attention_mask to transformers' mask helper as a 2-D tensor (Mamba2Model: no per-layer-
    # type dict): the CP context then reaches each decoder layer through a forward pre-hook (`models/inputs.py`)
    mask_through_layers: bool = False
    # its causal LM's forward hands its extra keywords (**kwargs: the packing keywords, position_ids) to the text
    # model; False (MambaForCausalLM, FalconMambaForCausalLM drop them): deltacp relays them past it
    # (`models/inputs.make_keyword_relay`), else a packed row would run as one document
    lm_passes_kwargs: bool = True
    # (text config) -> None: raises for what deltacp refuses of the family's config under CP (parallelize_cp calls
    # it before any collective); None: nothing beyond the layer checks
    check_config: object = None
    # per-token layers with a short causal window that need their own CP forward (Qwen4-Exp's PLE): (the decoder
    # layer's attribute, check(module) -> the configuration every rank shares, with "token_halo": the tokens it reads
    # before each piece, install(layers, cp group, balanced) -> the modules given a CP forward); None: none
    token_layers: tuple | None = None
    # checkpoint names (what transformers' conversion mapping of the family renames on load and back on save):
    # (module name parts, stored name parts) pairs, runs of whole dotted parts; and tensors stored as row pieces, each
    # (module name suffix, ((stored suffix, rows attribute of the owning module), ...)): the tensor's dim-0 rows are
    # the pieces' rows in order (e.g. one conv weight stored as three); or (module name suffix, a function (owning
    # module, text config) -> [(stored suffix, rows), ...]) for a config-dependent number of pieces
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # older stored names of released checkpoints: (stored name parts, older name parts) pairs, tried only where the
    # checkpoint lacks the stored name (Mamba2's `embedding.` for `embeddings.`, which transformers' load hook was
    # written for); saving writes the stored names
    checkpoint_load_aliases: tuple[tuple[str, str], ...] = ()
    checkpoint_row_pieces: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    # tensors stored fused: (stored suffix, (module suffixes, ...)): the module tensors, consecutive parameters of one
    # module, are the stored tensor's rows in order (LaRA-mini's in_proj = [in_proj_qkv | in_proj_z | in_proj_b |
    # in_proj_a])
    checkpoint_fused_rows: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # transformers' conversion mapping of the family keeps routed experts fused (gate_up_proj, down_proj) on save
    # (LaRA-mini's mapping has no per-expert split, and its from_pretrained reads no per-expert names)
    checkpoint_experts_fused: bool = False
    # the stored names of one routed expert's gate, up and down matrices when stored per expert
    checkpoint_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    def trainable_classes(self) -> tuple[str, ...]:
        """The classes with a language-model head: what the trainer builds."""
        return tuple(n for n in (self.causal_lm, self.conditional) if n is not None)

    def model_classes(self) -> tuple[str, ...]:
        """Every class parallelize_cp takes: the trainable ones and the bare text model."""
        return tuple(n for n in (self.causal_lm, self.text_model, self.conditional) if n is not None)

    def classes(self) -> dict[str, type] | None:
        """The role -> class map from the installed transformers (imports the modeling module), or None when
        transformers lacks the family."""
        try:
            mod = importlib.import_module(self.module)
        except ImportError:
            return None
        names = dict(causal_lm=self.causal_lm, text_model=self.text_model, linear_mixer=self.linear_mixer,
                     attention=self.attention, conditional=self.conditional, multimodal_model=self.multimodal_model)
        # a role the family does not have (None) is left out of the map
        found = {role: getattr(mod, name, None) for role, name in names.items() if name is not None}
        return found if all(found.values()) else None


_REGISTERED: list[Family] = []


def register_family(family: Family) -> Family:
    """Register a family (its home calls this at import); returns it. A name registered twice raises."""
    if any(f.name == family.name for f in _REGISTERED):
        raise ValueError(f"model family {family.name!r} is registered twice")
    _REGISTERED.append(family)
    return family


# the homes (`deltacp.families.<home>`), in registration order (the order of supported_classes())
HOMES = ("qwen3_5", "qwen3_next", "olmo_hybrid", "bamba", "nemotron_h", "granite_hybrid", "falcon_h1", "kimi_linear",
         "bailing_hybrid", "qwen4_exp", "glm5_next", "minimax", "lara_mini", "lfm2", "mamba2_lm", "mamba",
         "falcon_mamba", "jamba", "zamba2", "zamba", "recurrent_gemma")


# transformers classes deltacp refuses, with the reason (docs/design.md, "Refused: the stabilised recurrences"): their
# carried state is affine in real arithmetic, but they carry it through a max stabiliser (max-plus, not h_out = M h_in +
# S) and their outputs are not affine in the entering state, outside the recurrence contract every CP mode is built on
_STABILISED = ("; the carried state's max stabiliser (max-plus, not h_out = M h_in + S) and an output that is not "
               "affine in the entering state are outside the recurrence contract every CP mode is built on "
               "(docs/design.md, 'Refused: the stabilised recurrences')")
_XLSTM = ("xLSTM's mLSTM is refused: its output q C / (max(|q n|, exp(-m)) + eps) reads the stabiliser m, not only "
          "the state (C, n), through eps exp(m) and the max" + _STABILISED)
_RWKV = ("RWKV-4 is refused: its WKV output (num + exp(u + k) v) / (den + exp(u + k)) is a ratio of the carried state "
         "(num, den), kept under a running max exponent" + _STABILISED)
REFUSED = {"xLSTMForCausalLM": _XLSTM, "xLSTMModel": _XLSTM, "RwkvForCausalLM": _RWKV, "RwkvModel": _RWKV}


def refuse_class(class_name: str, what: str) -> None:
    """NotImplementedError naming a refused class (`REFUSED`) and why; nothing for any other class."""
    if class_name in REFUSED:
        raise NotImplementedError(f"{what}: {class_name}: {REFUSED[class_name]}")


def families() -> tuple[Family, ...]:
    """Every registered family, the HOMES loaded first (by name, at run time: the registry imports no home)."""
    for home in HOMES:
        importlib.import_module(f"deltacp.families.{home}")
    return tuple(_REGISTERED)


def __getattr__(name: str):
    if name == "FAMILIES":  # the registry as the constant of earlier versions
        return families()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def supported_classes() -> list[str]:
    """Every class name parallelize_cp takes, family by family."""
    return [name for family in families() for name in family.model_classes()]


def trainable_classes() -> tuple[str, ...]:
    """The class names the trainer builds (train.model.model_class), family by family."""
    return tuple(name for family in families() for name in family.trainable_classes())


def family_of(class_name: str) -> Family:
    """The family of a supported class name, or NotImplementedError naming it and the supported ones (a refused
    class: why, `REFUSED`)."""
    refuse_class(class_name, "deltacp")
    for family in families():
        if class_name in family.model_classes():
            return family
    raise NotImplementedError(f"{class_name} is not a supported class; expected one of {supported_classes()}")
