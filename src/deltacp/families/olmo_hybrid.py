"""OLMo-Hybrid (`OlmoHybridForCausalLM`, `OlmoHybridModel`; transformers 5.25): its family record, GDN view and
attention view.

GDN (`OlmoHybridGatedDeltaNet`): separate projections q_proj, k_proj (key_dim each), v_proj (value_dim), a_proj,
b_proj (one per value head) and g_proj (the output gate, value_dim), all without bias; one depthwise conv over
cat[q, k, v]; beta = sigmoid(b), times 2 under `linear_allow_neg_eigval` (the state may then flip sign); gated
RMSNorm `o_norm` (norm before gate, weight * x, eps 1e-5) and `o_proj`. Head dims are free (the config defaults:
K = 0.75 hidden / key heads, V = 2 K).
Attention (`OlmoHybridAttention`, Olmo3's): no output gate; q_norm / k_norm are RMSNorms (weight * x) over the WHOLE
projected width (heads x head_dim) before the reshape to heads; RoPE only when the config sets a rope theta (the
text model's `rotary_emb` is then present; otherwise NoPE, and the layer receives position_embeddings=None).
Decoder layers: the GDN ones pre-norm, the attention ones post-norm (no input norm); the decoder norm is weight * x,
not Qwen3.5's (1 + w), so the fused Triton decoder glue does not apply (`Family.fused_decoder`).
Checkpoints: the decoder norms are stored as attention_layer_norm / feedforward_layer_norm and the conv as q_conv1d,
k_conv1d, v_conv1d (transformers' conversion mapping; `Family.checkpoint_renames`, `checkpoint_row_pieces`).
"""

from __future__ import annotations

import torch

from deltacp.families.attention import PlainAttentionView
from deltacp.families.gdn import GatedDeltaNetView, extras
from deltacp.families.registry import Family, register_family
from deltacp.ops.precision import compute_dtype


class OlmoHybridGDNView(GatedDeltaNetView):
    family = "olmo_hybrid"
    norm_name = "o_norm"
    out_proj_name = "o_proj"

    @property
    def beta_scale(self) -> float:
        return 2.0 if self.module.allow_neg_eigval else 1.0

    def project(self, x_BsD):
        m = self.module
        B, s, _ = x_BsD.shape
        pre_BsC = torch.cat([m.q_proj(x_BsD), m.k_proj(x_BsD), m.v_proj(x_BsD)], dim=-1)
        return pre_BsC, extras(m.b_proj(x_BsD), m.a_proj(x_BsD)), m.g_proj(x_BsD).reshape(B, s, -1, m.head_v_dim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' OlmoHybridRMSNorm (weight * x, the product in float32), float32 widened to float64 for
    float64."""
    dt = compute_dtype(x)
    h = x.to(dt)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


class OlmoHybridAttentionView(PlainAttentionView):
    """No output gate; q_norm / k_norm over the whole projected width, before the reshape to heads."""

    family = "olmo_hybrid"

    def norm_q(self, q_BsX):
        return rms_norm(q_BsX, self.module.q_norm.weight, self.module.q_norm.variance_epsilon)

    def norm_k(self, k_BsX):
        return rms_norm(k_BsX, self.module.k_norm.weight, self.module.k_norm.variance_epsilon)


OLMO_HYBRID = register_family(Family(
    "olmo_hybrid", "transformers.models.olmo_hybrid.modeling_olmo_hybrid", causal_lm="OlmoHybridForCausalLM",
    text_model="OlmoHybridModel", linear_mixer="OlmoHybridGatedDeltaNet", attention="OlmoHybridAttention",
    norm="OlmoHybridRMSNorm", mlp="OlmoHybridMLP", text_config="OlmoHybridConfig",
    mixer_view=OlmoHybridGDNView, attention_view=OlmoHybridAttentionView, fused_decoder=False,
    # transformers 5.25's "olmo_hybrid" conversion mapping: the released names of the decoder norms, and the conv
    # stored as one weight per q, k, v
    checkpoint_renames=(("input_layernorm", "attention_layer_norm"),
                        ("post_attention_layernorm", "feedforward_layer_norm")),
    checkpoint_row_pieces=(("linear_attn.conv1d.weight", (("linear_attn.q_conv1d.weight", "key_dim"),
                                                          ("linear_attn.k_conv1d.weight", "key_dim"),
                                                          ("linear_attn.v_conv1d.weight", "value_dim"))),)))
