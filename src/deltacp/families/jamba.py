"""Jamba (`JambaForCausalLM`, `JambaModel`; transformers 5.25, ai21labs/Jamba-v0.1): its family record, Mamba1 view
and attention view.

Layers (`config.layers_block_type`): attention (`JambaAttentionDecoderLayer`, `layer.self_attn`) where i %
`attn_layer_period` == `attn_layer_offset`, else Mamba1 (`JambaMambaDecoderLayer`, `layer.mamba`); each pre-norm
(`input_layernorm`, `pre_ff_layernorm`, `JambaRMSNorm`: weight x (x * rsqrt(mean x^2 + eps) in float32, cast back))
with a `feed_forward` that is routed experts (`JambaSparseMoeBlock`) where i % `expert_layer_period` ==
`expert_layer_offset`, else a SwiGLU `JambaMLP`; the final norm `final_layernorm`.
- Mixer (`JambaMambaMixer`): Mamba1's (`families/mamba.py`: in_proj [x | z] with bias under `mamba_proj_bias`, the
  conv (`mamba_d_conv`, bias under `mamba_conv_bias`), x_proj -> (dt, B, C), dt_proj, A = -exp(A_log), D, the
  silu(z) gate, out_proj, the padding mask before in_proj and after the conv) with RMSNorms WITH weights
  (`dt_layernorm`, `b_layernorm`, `c_layernorm`: `JambaRMSNorm`, eps `rms_norm_eps`) on dt (the `mamba_dt_rank`
  dims), B and C between x_proj and dt_proj, in float32 (float64 here for float64 inputs), the weight applied after
  the cast back, as transformers does. The `_is_quantized` branch of dt_proj computes the same product.
- Attention (`JambaAttention`): GQA q/k/v/o without biases, NoPE (the decoder hands it no rotary), scaling
  head_dim^-1/2.
- Experts: softmax over the router logits (float32), top `num_experts_per_tok` of `num_experts`, the selected weights
  NOT renormalised (`JambaTopKRouter`): per-token code, transformers' own under CP. The auxiliary loss (with
  `output_router_logits`: `load_balancing_loss_func` x `router_aux_loss_coef`) is made global over the CP group
  (`models/moe.py`; the router is `feed_forward.router`).
`JambaForCausalLM.forward` hands its **kwargs to the text model (no keyword relay). The released checkpoint stores
the experts one by one (`feed_forward.experts.<e>.gate_proj / up_proj / down_proj`, transformers' "jamba" conversion
mapping).

CP: as Mamba's, the Mamba1 layers are a head per channel (`families/mamba.py`): every mode and layout, Ulysses and
the 2-D layout splitting the channels (degrees dividing mamba_expand x hidden_size) with x_proj's partial products
summed over the ranks holding the others; the attention takes any full-attention method; eager or Triton scan.
"""

from __future__ import annotations

import torch

from deltacp.families.attention import PlainAttentionView
from deltacp.families.mamba import MambaView
from deltacp.families.registry import Family, register_family
from deltacp.ops.precision import compute_dtype


def weighted_rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """transformers' JambaRMSNorm `norm` on x: weight * (x * rsqrt(mean x^2 + eps)) computed in float32 (widened to
    float64 for float64 inputs) and cast back to x's dtype before the weight."""
    h = x.to(compute_dtype(x))
    return norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)


class JambaMambaView(MambaView):
    family = "jamba"
    channels_setting = "mamba_expand x hidden_size"

    def dt_b_c(self, proj):
        m = self.module
        dt, b, c = super().dt_b_c(proj)
        return (weighted_rms_norm(m.dt_layernorm, dt), weighted_rms_norm(m.b_layernorm, b),
                weighted_rms_norm(m.c_layernorm, c))


class JambaAttentionView(PlainAttentionView):
    family = "jamba"


JAMBA = register_family(Family(
    "jamba", "transformers.models.jamba.modeling_jamba", causal_lm="JambaForCausalLM", text_model="JambaModel",
    linear_mixer="JambaMambaMixer", attention="JambaAttention", norm="JambaRMSNorm", mlp="JambaMLP",
    text_config="JambaConfig", mixer_view=JambaMambaView, attention_view=JambaAttentionView, fused_decoder=False,
    linear_attribute="mamba", moe_fields=("num_experts", "num_experts_per_tok", "router_aux_loss_coef"),
    moe_router=("feed_forward", "router")))
