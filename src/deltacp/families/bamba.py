"""Bamba (`BambaForCausalLM`, `BambaModel`; transformers 5.25): its family record, Mamba2 view and attention view.

Mixer (`BambaMixer`, `layer.mamba`): in_proj -> [z | xBC | dt], a depthwise conv with bias over [x | B | C], the SSD
scan with the D skip, the gated RMSNorm (gate before norm, RMS over groups of intermediate / n_groups channels),
out_proj (`families/mamba2.py`). Attention (`BambaAttention`, `layer.self_attn`): GQA, no q/k norm, no output gate,
RoPE on the first half of the head dim (`partial_rotary_factor` 0.5). Decoder layers pre-norm (`input_layernorm`,
`pre_ff_layernorm`), a SwiGLU `feed_forward`, the final norm `final_layernorm`; no MoE.
"""

from __future__ import annotations

from deltacp.families.attention import PlainAttentionView
from deltacp.families.mamba2 import Mamba2View
from deltacp.families.registry import Family, register_family


class BambaMamba2View(Mamba2View):
    family = "bamba"


BAMBA = register_family(Family(
    "bamba", "transformers.models.bamba.modeling_bamba", causal_lm="BambaForCausalLM", text_model="BambaModel",
    linear_mixer="BambaMixer", attention="BambaAttention", norm="BambaRMSNorm", mlp="BambaMLP",
    text_config="BambaConfig", mixer_view=BambaMamba2View, attention_view=PlainAttentionView, fused_decoder=False,
    linear_attribute="mamba"))
