"""Qwen3-Next: its family record and its GDN view; its attention is Qwen3.5's gated attention.

GDN (`Qwen3NextGatedDeltaNet`): fused projections, interleaved per key-head group g (of Hk groups):

    in_proj_qkvz -> per group [q_g (K) | k_g (K) | v_g (r V) | z_g (r V)]      r = Hv / Hk
    in_proj_ba   -> per group [b_g (r) | a_g (r)]

de-interleaved exactly as transformers' `fix_query_key_value_ordering`: q, k of every group in group order, value
heads g*r .. g*r + r-1 in order; then [q | k | v] concatenated as the conv channels. beta = sigmoid(b).

Shape legend: *_BsGX per key-head group.
"""

from __future__ import annotations

import torch

from deltacp.families.gdn import GatedDeltaNetView, extras
from deltacp.families.qwen3_5 import GatedAttentionView
from deltacp.families.registry import Family, register_family


class Qwen3NextGDNView(GatedDeltaNetView):
    family = "qwen3_next"

    def project(self, x_BsD):
        m = self.module
        B, s, _ = x_BsD.shape
        Hk, Hv, K, V = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
        r = Hv // Hk
        qkvz_BsGX = m.in_proj_qkvz(x_BsD).view(B, s, Hk, 2 * K + 2 * r * V)
        ba_BsGX = m.in_proj_ba(x_BsD).view(B, s, Hk, 2 * r)
        q, k, v, z = torch.split(qkvz_BsGX, [K, K, r * V, r * V], dim=3)
        b, a = torch.split(ba_BsGX, [r, r], dim=3)
        pre_BsC = torch.cat([q.reshape(B, s, Hk * K), k.reshape(B, s, Hk * K), v.reshape(B, s, Hv * V)], dim=-1)
        return pre_BsC, extras(b.reshape(B, s, Hv), a.reshape(B, s, Hv)), z.reshape(B, s, Hv, V)


QWEN3_NEXT = register_family(Family(
    "qwen3_next", "transformers.models.qwen3_next.modeling_qwen3_next", causal_lm="Qwen3NextForCausalLM",
    text_model="Qwen3NextModel", linear_mixer="Qwen3NextGatedDeltaNet", attention="Qwen3NextAttention", norm="Qwen3NextRMSNorm",
    mlp="Qwen3NextMLP", text_config="Qwen3NextConfig",
    mixer_view=Qwen3NextGDNView, attention_view=GatedAttentionView))
