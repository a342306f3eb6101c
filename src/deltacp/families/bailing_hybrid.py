"""Bailing-Hybrid / Ling (`BailingHybridForCausalLM`, `BailingHybridModel`; transformers 5.25): its family record, KDA
view and MLA view.

Decoder layers (`BailingHybridDecoderLayer`, pre-norm, Kimi-Linear's layout): `layer.self_attn` holds KDA
(`BailingHybridDeltaAttention`) or MLA (`BailingHybridAttention`), told apart by class; `layer.mlp` a SwiGLU MLP or
routed experts (DeepSeek-V3's router, `routed_scaling_factor`, shared experts; the experts' and shared experts' SwiGLU
optionally clamped per layer, `swiglu_limits` / `swiglu_limits_shared`; no auxiliary loss), which CP leaves as they
are. Every decoder layer gets the rotary cos / sin, the KDA ones too (they ignore them). The decoder norm is weight * x.
KDA (`families/kda.py`): H = num_attention_heads heads of D = the config's head_dim; the conv over [q | k | v] keeps
float32 weights (transformers creates it so and keeps it float32 on load: the conv rounds to float32, as
`ops/gdn/eager.causal_conv_silu` does for any weight dtype); the forget gate full-rank f_proj, x = f + dt_bias (float32)
and, with `kda_safe_gate` (the default), g = kda_lower_bound sigmoid(exp(A_log) x), in [kda_lower_bound, 0]; without
it g = -exp(A_log) softplus(x); g is cast back to the hidden dtype. The output gate is full-rank g_proj.
MLA (`families/mla.py`): interleaved RoPE (DeepSeek's: pairs of the rope slice) on the rope slices of q and of the
shared k_rot; the softmax scale is the module's `scaling` (qk_head_dim^-1/2 with YaRN's mscale_all_dim folded in);
a per-head sigmoid output gate g_proj (hidden -> heads, sigmoid in float32) multiplies each head's output before
o_proj.
Checkpoints: the released names (transformers' conversion mapping: word_embeddings, attention, dense, the forget
gate's tensors under the attention, the conv as q/k/v_conv1d, expert_bias, experts per expert) in
`Family.checkpoint_renames` / `checkpoint_row_pieces`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltacp.families.kda import KimiDeltaAttentionView
from deltacp.families.mla import LatentAttentionView, rotate_interleaved
from deltacp.families.registry import Family, register_family
from deltacp.ops.precision import compute_dtype


class BailingHybridKDAView(KimiDeltaAttentionView):
    family = "bailing_hybrid"
    heads_setting = "num_attention_heads"  # linear_num_heads follows it

    def forget_projection(self, x_BsD):
        return self.module.forget_gate.f_proj(x_BsD)

    def forget_gate(self, f_BsHD, heads: slice):
        gate = self.module.forget_gate
        x = f_BsHD.to(compute_dtype(f_BsHD)) + gate.dt_bias.view(gate.num_heads, gate.head_dim)[heads]
        rate = gate.A_log[heads].exp()[:, None]
        g = gate.lower_bound * torch.sigmoid(rate * x) if gate.safe_gate else -rate * F.softplus(x)
        return g.to(f_BsHD.dtype)

    def output_gate(self, x_BsD):
        return self.module.g_proj(x_BsD)


class BailingHybridAttentionView(LatentAttentionView):
    family = "bailing_hybrid"

    def rotate(self, q_rot_BsHR, k_rot_Bs1R, position_embeddings):
        if position_embeddings is None:
            raise ValueError(f"{type(self.module).__name__} rotates the rope slices of q and k: it needs the model's "
                             f"position embeddings (cos, sin)")
        cos, sin = position_embeddings
        return rotate_interleaved(q_rot_BsHR, cos, sin), rotate_interleaved(k_rot_Bs1R, cos, sin)

    def gate(self, x_BsD):
        g = self.module.g_proj(x_BsD)
        return torch.sigmoid(g.to(compute_dtype(g))).to(x_BsD.dtype)


BAILING_HYBRID = register_family(Family(
    "bailing_hybrid", "transformers.models.bailing_hybrid.modeling_bailing_hybrid",
    causal_lm="BailingHybridForCausalLM", text_model="BailingHybridModel", linear_mixer="BailingHybridDeltaAttention",
    attention="BailingHybridAttention", norm="BailingHybridRMSNorm", mlp="BailingHybridMLP",
    text_config="BailingHybridConfig", mixer_view=BailingHybridKDAView,
    attention_view=BailingHybridAttentionView, fused_decoder=False, linear_attribute="self_attn",
    attention_attribute="self_attn", moe_fields=None,  # its router has no auxiliary loss
    # transformers 5.25's "bailing_hybrid" conversion mapping (the released names; experts per expert, as for every
    # MoE family): the embedding, the mixers as `attention` with the forget gate's tensors directly under it, MLA's
    # o_proj as `dense`, the router's bias, and the conv stored as one weight per q, k, v
    checkpoint_renames=(("embed_tokens", "word_embeddings"),
                        ("self_attn.forget_gate.f_proj", "attention.f_proj"),
                        ("self_attn.forget_gate.dt_bias", "attention.dt_bias"),
                        ("self_attn.forget_gate.A_log", "attention.A_log"),
                        ("self_attn.o_proj", "attention.dense"), ("self_attn", "attention"),
                        ("mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias")),
    checkpoint_row_pieces=(("self_attn.conv1d.weight", (("self_attn.q_conv1d.weight", "qkv_dim"),
                                                        ("self_attn.k_conv1d.weight", "qkv_dim"),
                                                        ("self_attn.v_conv1d.weight", "qkv_dim"))),)))
