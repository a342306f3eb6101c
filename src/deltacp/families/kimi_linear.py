"""Kimi-Linear (`KimiLinearForCausalLM`, `KimiLinearModel`; transformers 5.25): its family record, KDA view and MLA
view.

Decoder layers (`KimiLinearDecoderLayer`, pre-norm): `layer.self_attn` holds either KDA (`KimiLinearDeltaAttention`,
`layer_types` "linear_attention") or MLA (`KimiLinearAttention`, "full_attention"), told apart by class; `layer.mlp`
is a SwiGLU MLP ("dense" in `mlp_layer_types`) or routed experts ("sparse": DeepSeek-V3's sigmoid router with the
score correction bias, group-limited top-k, `routed_scaling_factor`, plus shared experts; no auxiliary loss), which CP
leaves as they are. The decoder norm is weight * x (not the fused glue's (1 + w)).
KDA (`families/kda.py`): q_proj, k_proj, v_proj (H heads of D = linear_head_dim), one conv over [q | k | v] without
bias; the forget gate (`forget_gate`) low-rank f_b_proj(f_a_proj(x)), g = -exp(A_log) softplus(f + dt_bias) per key
channel in float32, unbounded, with transformers' softplus (x above 20 kept as it is); beta = sigmoid(b_proj); the
output gate low-rank g_b_proj(g_a_proj(x)).
MLA (`families/mla.py`): no rotary anywhere in the model (the shared "rope" slice of the keys passes unrotated; the
model has no rotary module and the layer gets no position embeddings), no output gate, scaling qk_head_dim^-1/2.
Checkpoints (transformers' "kimi_linear" conversion mapping): the forget gate's tensors stored under self_attn, the
conv as q/k/v_conv1d (qkv_dim rows each), the MLPs under block_sparse_moe (transformers 5.25 writes every layer's so;
a dense one stored under mlp reads too), the experts per expert as experts.{e}.w1 (gate), w3 (up), w2 (down).
"""

from __future__ import annotations

import torch

from deltacp.families.kda import KimiDeltaAttentionView
from deltacp.families.mla import LatentAttentionView
from deltacp.families.registry import Family, register_family
from deltacp.ops.precision import compute_dtype


class KimiLinearKDAView(KimiDeltaAttentionView):
    family = "kimi_linear"

    def forget_projection(self, x_BsD):
        gate = self.module.forget_gate
        return gate.f_b_proj(gate.f_a_proj(x_BsD))

    def forget_gate(self, f_BsHD, heads: slice):
        gate = self.module.forget_gate
        H, D = gate.num_heads, gate.head_dim
        dt = compute_dtype(f_BsHD)
        x = f_BsHD.to(dt) + gate.dt_bias.to(dt).view(H, D)[heads]
        # transformers' softplus: x itself above 20, else log(1 + exp(x)) (its exp clamped in the branch not taken:
        # the same values, and no inf * 0 in the gradient)
        softplus = torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x.clamp(max=20.0))))
        return -gate.A_log.to(dt).reshape(H)[heads].exp()[:, None] * softplus

    def output_gate(self, x_BsD):
        return self.module.g_b_proj(self.module.g_a_proj(x_BsD))


class KimiLinearAttentionView(LatentAttentionView):
    family = "kimi_linear"


KIMI_LINEAR = register_family(Family(
    "kimi_linear", "transformers.models.kimi_linear.modeling_kimi_linear", causal_lm="KimiLinearForCausalLM",
    text_model="KimiLinearModel", linear_mixer="KimiLinearDeltaAttention", attention="KimiLinearAttention",
    norm="KimiLinearRMSNorm", mlp="KimiLinearMLP", text_config="KimiLinearConfig",
    mixer_view=KimiLinearKDAView, attention_view=KimiLinearAttentionView, fused_decoder=False,
    linear_attribute="self_attn", attention_attribute="self_attn",
    moe_fields=None,  # its router has no auxiliary loss
    checkpoint_renames=(("self_attn.forget_gate", "self_attn"), ("mlp", "block_sparse_moe")),
    checkpoint_row_pieces=(("self_attn.conv1d.weight", (("self_attn.q_conv1d.weight", "qkv_dim"),
                                                        ("self_attn.k_conv1d.weight", "qkv_dim"),
                                                        ("self_attn.v_conv1d.weight", "qkv_dim"))),),
    checkpoint_expert_names=("w1", "w3", "w2")))
