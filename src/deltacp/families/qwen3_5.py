"""Qwen3.5 (dense, MoE, multimodal): its family records, its GDN view and its gated attention view.

GDN (`Qwen3_5GatedDeltaNet`): separate projections in_proj_qkv ([q | k | v] channels), in_proj_z (the output gate),
in_proj_b, in_proj_a; beta = sigmoid(b); `norm` (Qwen3_5RMSNormGated) and `out_proj`.
Attention (`Qwen3_5Attention`, also Qwen3-Next's): gated, q_proj emits per head the query and an output gate
(sigmoid on the output); per-head q/k RMSNorm of the (1 + w) form; partial RoPE (mRoPE in the multimodal model).
Every decoder layer is pre-norm; the released dense sizes are `models/presets.py`'s.
"""

from __future__ import annotations

import torch

from deltacp.families.gdn import GatedDeltaNetView, extras
from deltacp.families.registry import Family, register_family
from deltacp.ops.precision import compute_dtype
from deltacp.parallel.views import AttentionView


class Qwen3_5GDNView(GatedDeltaNetView):
    family = "qwen3_5"

    def project(self, x_BsD):
        m = self.module
        B, s, _ = x_BsD.shape
        return (m.in_proj_qkv(x_BsD), extras(m.in_proj_b(x_BsD), m.in_proj_a(x_BsD)),
                m.in_proj_z(x_BsD).reshape(B, s, -1, m.head_v_dim))


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5RMSNorm (scale 1 + w), with its float32 upcast widened to float64 for float64."""
    dt = compute_dtype(x)
    h = x.to(dt)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(dt))).type_as(x)


class GatedAttentionView(AttentionView):
    """Qwen3.5's / Qwen3-Next's gated attention."""

    def project(self, x_BsD, position_embeddings):
        m, D = self.module, self.head_dim
        B, s, _ = x_BsD.shape
        q_BsHD, gate = torch.chunk(m.q_proj(x_BsD).view(B, s, self.num_heads, 2 * D), 2, dim=-1)
        q_BsHD = zero_centered_rms_norm(q_BsHD, m.q_norm.weight, m.q_norm.eps)
        k_BsHD = zero_centered_rms_norm(m.k_proj(x_BsD).view(B, s, self.num_kv_heads, D), m.k_norm.weight,
                                        m.k_norm.eps)
        v_BsHD = m.v_proj(x_BsD).view(B, s, self.num_kv_heads, D)
        q_BsHD, k_BsHD = self.apply_rotary(q_BsHD, k_BsHD, position_embeddings)
        return q_BsHD, k_BsHD, v_BsHD, gate.reshape(B, s, -1)

    def output(self, o_BsX, gate):
        return self.module.o_proj(o_BsX * torch.sigmoid(gate))


QWEN3_5 = register_family(Family(
    "qwen3_5", "transformers.models.qwen3_5.modeling_qwen3_5", causal_lm="Qwen3_5ForCausalLM",
    text_model="Qwen3_5TextModel", linear_mixer="Qwen3_5GatedDeltaNet", attention="Qwen3_5Attention", norm="Qwen3_5RMSNorm",
    mlp="Qwen3_5MLP", text_config="Qwen3_5TextConfig",
    conditional="Qwen3_5ForConditionalGeneration", multimodal_model="Qwen3_5Model", multimodal_config="Qwen3_5Config",
    vision_config="Qwen3_5VisionConfig", mrope=True, presets=True,
    mixer_view=Qwen3_5GDNView, attention_view=GatedAttentionView))
QWEN3_5_MOE = register_family(Family(
    "qwen3_5_moe", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", causal_lm="Qwen3_5MoeForCausalLM",
    text_model="Qwen3_5MoeTextModel", linear_mixer="Qwen3_5MoeGatedDeltaNet", attention="Qwen3_5MoeAttention",
    norm="Qwen3_5MoeRMSNorm", mlp="Qwen3_5MoeMLP", text_config="Qwen3_5MoeTextConfig",
    conditional="Qwen3_5MoeForConditionalGeneration", multimodal_model="Qwen3_5MoeModel",
    multimodal_config="Qwen3_5MoeConfig", vision_config="Qwen3_5MoeVisionConfig", mrope=True,
    mixer_view=Qwen3_5GDNView, attention_view=GatedAttentionView))
