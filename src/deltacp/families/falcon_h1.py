"""Falcon-H1 (`FalconH1ForCausalLM`, `FalconH1Model`; transformers 5.25): its family record, Mamba2 view and attention
view.

Every decoder layer (`FalconH1DecoderLayer`, layer type "hybrid") runs `layer.mamba` and `layer.self_attn` in
parallel on the same normed input (x + mamba(n) ssm_out_multiplier + attn(n attention_in_multiplier)
attention_out_multiplier: the layer's own forward, which CP keeps; both mixers are made CP).
Mixer (`FalconH1Mixer`): the input scaled by `ssm_in_multiplier`, in_proj's output by the buffer `mup_vector`
(`ssm_multipliers` on its z / x / B / C / dt segments), then Bamba's conv and scan (`families/mamba2.py`); the
output is the module's gated RMSNorm over groups when `mamba_rms_norm` (its `mamba_norm_before_gate` order), else
y silu(z); then out_proj. Attention (`FalconH1Attention`): GQA, k scaled by `key_multiplier` before the full RoPE, no
q/k norm, no gate.
"""

from __future__ import annotations

import torch.nn.functional as F

from deltacp.families.attention import PlainAttentionView
from deltacp.families.mamba2 import Mamba2View
from deltacp.families.registry import Family, register_family


class FalconH1Mamba2View(Mamba2View):
    family = "falcon_h1"

    def project(self, x_BsD):
        m = self.module
        projected = m.in_proj(x_BsD * m.ssm_in_multiplier) * m.mup_vector
        z, pre_BsC, dt = projected.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        return pre_BsC, dt[..., None], (z, x_BsD.dtype)

    def output(self, o_BsHV, out, backend):
        m = self.module
        z, dtype = out
        B, s = o_BsHV.shape[:2]
        y = o_BsHV.reshape(B, s, -1)
        y = m.norm(y, z) if m.mamba_rms_norm else y * F.silu(z)
        return m.out_proj(y.to(dtype))


def recompute_mup_vectors(model, text_config) -> list[str]:
    """Every FalconH1Mixer's non-persistent `mup_vector` from the text config, as transformers' FalconH1Model
    initialisation computes it (`compute_mup_vector`); the names of the mixers set."""
    import torch
    from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector

    mixers = [(name, m) for name, m in model.named_modules() if type(m).__name__ == "FalconH1Mixer"]
    if mixers:
        vector = compute_mup_vector(text_config)
        with torch.no_grad():
            for _, mixer in mixers:
                mixer.mup_vector.copy_(vector.to(mixer.mup_vector.device, mixer.mup_vector.dtype))
    return [name for name, _ in mixers]


class FalconH1AttentionView(PlainAttentionView):
    family = "falcon_h1"

    def norm_k(self, k_BsX):
        return k_BsX * self.module.key_multiplier


FALCON_H1 = register_family(Family(
    "falcon_h1", "transformers.models.falcon_h1.modeling_falcon_h1", causal_lm="FalconH1ForCausalLM",
    text_model="FalconH1Model", linear_mixer="FalconH1Mixer", attention="FalconH1Attention", norm="FalconH1RMSNorm",
    mlp="FalconH1MLP", text_config="FalconH1Config", mixer_view=FalconH1Mamba2View,
    attention_view=FalconH1AttentionView, fused_decoder=False, linear_attribute="mamba",
    logit_scale=("lm_head_multiplier", "mul"), recompute_buffers=recompute_mup_vectors))
