"""Full attentions without an output gate that several families share: GQA, per-projection hooks for q/k norms over
the whole projected width (identity here), the family's rotary (full or partial, in its cos/sin; None: NoPE)."""

from __future__ import annotations

import torch

from deltacp.parallel.views import AttentionView


class PlainAttentionView(AttentionView):
    """q_proj, k_proj, v_proj, o_proj; `norm_q` / `norm_k` act on the projections before the reshape to heads."""

    def norm_q(self, q_BsX: torch.Tensor) -> torch.Tensor:
        return q_BsX

    def norm_k(self, k_BsX: torch.Tensor) -> torch.Tensor:
        return k_BsX

    def project(self, x_BsD, position_embeddings):
        m, D = self.module, self.head_dim
        B, s, _ = x_BsD.shape
        q = self.norm_q(m.q_proj(x_BsD)).view(B, s, -1, D)
        k = self.norm_k(m.k_proj(x_BsD)).view(B, s, -1, D)
        v = m.v_proj(x_BsD).view(B, s, -1, D)
        q, k = self.apply_rotary(q, k, position_embeddings)
        return q, k, v, None

    def output(self, o_BsX, out):
        return self.module.o_proj(o_BsX)
