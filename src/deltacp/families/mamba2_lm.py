"""Mamba2 (`Mamba2ForCausalLM`, `Mamba2Model`; transformers 5.25): its family record and Mamba2 view. A pure SSM: no
attention, no MLP (`Family.attention` and `Family.mlp` None).

Blocks (`Mamba2Block`, `backbone.layers`): `residual + mixer(norm(x))`, the norm `Mamba2RMSNorm` (weight x form, eps
`layer_norm_epsilon`), the residual cast to float32 first under `residual_in_fp32` (transformers' own block forward
under CP: it does that). Mixer (`Mamba2Mixer`, `layer.mixer`): textually Bamba's (`families/mamba2.py`): in_proj ->
[z | xBC | dt] (bias under `use_bias`), a depthwise conv over [x | B | C] (bias under `use_conv_bias`), the SSD scan
with the D skip, dt = softplus(dt_raw + dt_bias) clamped to `time_step_limit`, B and C per group of heads
(`n_groups`), the gated RMSNorm `Mamba2RMSNormGated` (gate before the norm, RMS over groups of intermediate / n_groups
channels, eps `layer_norm_epsilon`), out_proj (bias under `use_bias`); the padding mask applied before in_proj and
after the conv (`apply_mask_to_padding_states`), as the CP layer does for every Mamba2 family. The final norm is
`norm_f`, the input embedding `embeddings` (older checkpoints store it as `embedding`: `load_pretrained` reads that
too, `Family.checkpoint_load_aliases`, as transformers' `Mamba2Model.load_hook` meant to, though 5.25's from_pretrained
never calls the hook and initialises the embedding anew); the causal LM holds the model as `backbone` (also its
checkpoint prefix: no renames) and unties the head by default (`tie_word_embeddings` False). `rescale_prenorm_residual`,
`time_step_min/max/floor` and `initializer_range` touch initialisation only.
"""

from __future__ import annotations

from deltacp.families.mamba2 import Mamba2View
from deltacp.families.registry import Family, register_family


class Mamba2LMView(Mamba2View):
    family = "mamba2"
    groups_setting = "n_groups"
    heads_setting = "num_heads"


MAMBA2 = register_family(Family(
    "mamba2", "transformers.models.mamba2.modeling_mamba2", causal_lm="Mamba2ForCausalLM", text_model="Mamba2Model",
    linear_mixer="Mamba2Mixer", attention=None, norm="Mamba2RMSNorm", mlp=None, text_config="Mamba2Config",
    mixer_view=Mamba2LMView, fused_decoder=False, linear_attribute="mixer", text_attribute="backbone",
    moe_fields=None, mask_through_layers=True,  # Mamba2Model calls create_recurrent_attention_mask on its mask
    checkpoint_load_aliases=(("embeddings", "embedding"),)))  # the older checkpoints' name (module docstring)
