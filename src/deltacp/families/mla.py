"""Multi-head latent attention (MLA, DeepSeek-V3's) as Kimi-Linear (`KimiLinearAttention`) and Bailing-Hybrid
(`BailingHybridAttention`) compute it in transformers 5.25, read through one family's module.

Queries: q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj when `q_lora_rank` is set; per head [nope | rope] of
qk_head_dim = qk_nope_head_dim + qk_rope_head_dim. Keys and values from one latent: kv_a_proj_with_mqa -> [latent
(kv_lora_rank) | k_rot (rope, shared by every head)], the latent through kv_a_layernorm and kv_b_proj -> per head
[k_nope | v (v_head_dim)]; k = [k_nope | k_rot]. The value head dim may differ from the query/key one (the attention
CP pads the narrower side, `parallel/attention.py`). Every head has its own keys and values (num_kv_heads = heads).
The softmax scale is the module's `scaling` (Bailing folds YaRN's mscale into it). A family's view says how the rope
slices rotate (`rotate`: Kimi none, Bailing interleaved RoPE) and whether an output gate multiplies each head's output
before o_proj (`gate`).

Shape legend: x_BsD local hidden states; q_BsHD per head; o_BsX [B, s, heads * v_head_dim].
"""

from __future__ import annotations

import torch

from deltacp.ops.precision import compute_dtype
from deltacp.parallel.views import AttentionView


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """transformers' Llama-form RMSNorm module `norm` (weight * (x normalised in float32, cast back)), float32 widened
    to float64 for float64."""
    h = x.to(compute_dtype(x))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


class LatentAttentionView(AttentionView):
    """An MLA module with transformers' attribute names (q_proj or q_a_proj / q_a_layernorm / q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim, qk_head_dim, scaling)."""

    @property
    def num_heads(self) -> int:
        return self.module.num_heads

    @property
    def num_kv_heads(self) -> int:  # the latent expands to keys and values per head
        return self.module.num_heads

    @property
    def head_dim(self) -> int:  # of queries and keys (values: v_head_dim)
        return self.module.qk_head_dim

    def rotate(self, q_rot_BsHR: torch.Tensor, k_rot_Bs1R: torch.Tensor, position_embeddings):
        """The rope slices of q (per head) and k (shared) after the family's rotary; none here."""
        return q_rot_BsHR, k_rot_Bs1R

    def gate(self, x_BsD: torch.Tensor):
        """What multiplies each head's output before o_proj ([B, s, H]), or None."""
        return None

    def project(self, x_BsD, position_embeddings):
        m = self.module
        B, s, _ = x_BsD.shape
        H, nope, rope = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim
        q = m.q_proj(x_BsD) if m.q_lora_rank is None else m.q_b_proj(rms_norm(m.q_a_proj(x_BsD), m.q_a_layernorm))
        q_pass, q_rot = torch.split(q.view(B, s, H, m.qk_head_dim), [nope, rope], dim=-1)
        latent, k_rot = torch.split(m.kv_a_proj_with_mqa(x_BsD), [m.kv_lora_rank, rope], dim=-1)
        kv = m.kv_b_proj(rms_norm(latent, m.kv_a_layernorm)).view(B, s, H, nope + m.v_head_dim)
        k_nope, v = torch.split(kv, [nope, m.v_head_dim], dim=-1)
        q_rot, k_rot = self.rotate(q_rot, k_rot.view(B, s, 1, rope), position_embeddings)
        q = torch.cat([q_pass, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(B, s, H, rope)], dim=-1)
        return q, k, v, self.gate(x_BsD)

    def output(self, o_BsX, gate_BsH):
        if gate_BsH is not None:
            B, s, _ = o_BsX.shape
            o_BsX = (o_BsX.view(B, s, gate_BsH.shape[-1], -1) * gate_BsH[..., None]).reshape(B, s, -1)
        return self.module.o_proj(o_BsX)


def rotate_interleaved(x_BsHR: torch.Tensor, cos_BsR: torch.Tensor, sin_BsR: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE: the pairs (x0, x1), (x2, x3), ... each turned by one angle, the result laid out
    [turned firsts | turned seconds]; cos / sin [B, s, R] hold each angle twice (the first half is read)."""
    half = cos_BsR.shape[-1] // 2
    cos, sin = cos_BsR[..., None, :half], sin_BsR[..., None, :half]
    first, second = x_BsHR[..., 0::2], x_BsHR[..., 1::2]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
