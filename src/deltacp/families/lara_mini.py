"""LaRA-mini (`LaraMiniForCausalLM`, `LaraMiniModel`; transformers 5.25, `modeling_lara_mini.py`): its family record,
its GDN view and its attention view.

GDN (`LaraMiniGatedDeltaNet`): Qwen3.5's mixer (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; the conv over
[q | k | v]; beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias)), with GLM's gated norm `norm`
(`LaraMiniRMSNormGated`: RMS, then the weight and the SiLU gate in float32, one rounding at the end), then `out_proj`.
Attention (`LaraMiniAttention`, Qwen3's): q_proj, k_proj, v_proj (bias: `attention_bias`), per-head q/k RMSNorms of
the Helium form (weight in float32, times x), no output gate, GQA, o_proj. Layers of type "sliding_attention" have
`sliding_window` (a query sees itself and window - 1 tokens before it) and RoPE; "full_attention" layers get no
position embeddings (NoPE: the text model passes None). The sliding layers run the K/V halo under CP in every
full-attention method (`parallel/sliding_attention.py`), the full ones the configured method.
Decoder layers are pre-norm with `LaraMiniRMSNorm` (weight x, not Qwen3.5's (1 + w): the fused Triton decoder glue
does not apply); MoE (`LaraMiniSparseMoeBlock`): a float32 softmax top-k router, every expert, plus an ungated shared
expert (transformers' per-token code under CP); tied embeddings by default.
Checkpoints (transformers' "lara_mini" conversion mapping): the gated norm stored as `linear_attn.out_norm`
(`Family.checkpoint_renames`); the four input projections stored as one `linear_attn.in_proj` whose rows are
in_proj_qkv's, in_proj_z's, in_proj_b's and in_proj_a's ([q | k | v | z | b | a]; `Family.checkpoint_fused_rows`);
the routed experts fused (gate_up_proj, down_proj: the mapping has no per-expert split, `checkpoint_experts_fused`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltacp.families.olmo_hybrid import rms_norm
from deltacp.families.qwen3_5 import Qwen3_5GDNView
from deltacp.families.registry import Family, register_family
from deltacp.ops.precision import compute_dtype
from deltacp.parallel.views import AttentionView


class LaraMiniGDNView(Qwen3_5GDNView):
    family = "lara_mini"

    def output(self, o_BsHV: torch.Tensor, z_BsHV: torch.Tensor, backend) -> torch.Tensor:
        """transformers' LaraMiniRMSNormGated per value head (RMS, weight and SiLU gate in float32, widened to float64
        for float64; one rounding to o's dtype), then out_proj. Not the backend's Qwen3.5 norm, which rounds before
        the weight."""
        norm = self.module.norm
        B, s = o_BsHV.shape[:2]
        dt = compute_dtype(o_BsHV)
        h = o_BsHV.to(dt)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        h = (norm.weight.to(dt) * h * F.silu(z_BsHV.to(dt))).to(o_BsHV.dtype)
        return self.module.out_proj(h.reshape(B, s, -1))


class LaraMiniAttentionView(AttentionView):
    """Qwen3's attention: per-head q/k norms (Helium's weight x in float32), no output gate; a sliding window on the
    "sliding_attention" layers (the module's `sliding_window`, read by the view's default)."""

    family = "lara_mini"

    def project(self, x_BsD, position_embeddings):
        m, D = self.module, self.head_dim
        B, s, _ = x_BsD.shape
        q = rms_norm(m.q_proj(x_BsD).view(B, s, -1, D), m.q_norm.weight, m.q_norm.variance_epsilon)
        k = rms_norm(m.k_proj(x_BsD).view(B, s, -1, D), m.k_norm.weight, m.k_norm.variance_epsilon)
        v = m.v_proj(x_BsD).view(B, s, -1, D)
        q, k = self.apply_rotary(q, k, position_embeddings)
        return q, k, v, None

    def output(self, o_BsX, out):
        return self.module.o_proj(o_BsX)


LARA_MINI = register_family(Family(
    "lara_mini", "transformers.models.lara_mini.modeling_lara_mini", causal_lm="LaraMiniForCausalLM",
    text_model="LaraMiniModel", linear_mixer="LaraMiniGatedDeltaNet", attention="LaraMiniAttention",
    norm="LaraMiniRMSNorm", mlp="LaraMiniMLP", text_config="LaraMiniConfig",
    mixer_view=LaraMiniGDNView, attention_view=LaraMiniAttentionView, fused_decoder=False,
    checkpoint_renames=(("linear_attn.norm", "linear_attn.out_norm"),), checkpoint_experts_fused=True,
    checkpoint_fused_rows=(("linear_attn.in_proj.weight", tuple(f"linear_attn.in_proj_{part}.weight"
                                                                for part in ("qkv", "z", "b", "a"))),)))
