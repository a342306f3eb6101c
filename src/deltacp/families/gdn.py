"""What every Gated DeltaNet mixer of transformers 5.25 shares, read through one family's module: the head layout
(pre-conv channels [q | k | v], key heads serving consecutive value heads), the gates (g = -exp(A_log) softplus(a +
dt_bias) per value head; beta = beta_scale * sigmoid(b)), the recurrence (`ops/recurrence.GatedDeltaRule`, q/k
l2-normalised inside the op) and the output path (gated RMSNorm of the recurrence output with the output gate, then
the output projection). A family's view subclasses `GatedDeltaNetView` and says where its projections are
(`project`) and the names of its norm and output projection.

Shape legend: x_BsD local hidden states; pre_BsC pre-conv [q | k | v]; z_BsHV output gate per value head;
extras_BsHX [b | a] per value head; o_BsHV recurrence output.
"""

from __future__ import annotations

import torch

from deltacp.ops.recurrence import GatedDeltaRule, RecurrenceInputs
from deltacp.parallel.views import HeadLayout, LinearMixerView


class GatedDeltaNetView(LinearMixerView):
    """A GDN module: subclasses implement `project` and name `norm` / `out_proj` (module attributes)."""

    extras = 2  # b, a per value head
    norm_name = "norm"  # the gated RMSNorm: weight, variance_epsilon
    out_proj_name = "out_proj"
    beta_scale = 1.0  # OLMo-Hybrid's linear_allow_neg_eigval: 2

    @property
    def layout(self) -> HeadLayout:
        m = self.module
        return HeadLayout(m.num_k_heads, m.num_v_heads,
                          (("key", m.head_k_dim), ("key", m.head_k_dim), ("value", m.head_v_dim)),
                          key_setting="linear_num_key_heads", value_setting="linear_num_value_heads")

    @property
    def conv_activation(self) -> str:
        return self.module.activation

    @property
    def state_dims(self) -> tuple[int, int]:
        return self.module.head_k_dim, self.module.head_v_dim

    def conv_heads(self, key_heads: int) -> tuple[int, int, int]:
        return key_heads, self.module.head_k_dim, self.module.head_v_dim

    def inputs(self, parts, extras_BnHX: torch.Tensor, heads: slice, backend) -> RecurrenceInputs:
        """(q, k, v) from the conv, the gates of value heads `heads` from b, a: the recurrence inputs."""
        q, k, v = parts
        m = self.module
        g, beta = backend.gates(extras_BnHX[..., 1], extras_BnHX[..., 0], m.A_log[heads], m.dt_bias[heads])
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        return RecurrenceInputs(q, k, v, g, beta)

    def recurrence(self, backend) -> GatedDeltaRule:
        return GatedDeltaRule(backend, qk_l2norm=True)

    def output(self, o_BsHV: torch.Tensor, z_BsHV: torch.Tensor, backend) -> torch.Tensor:
        norm = getattr(self.module, self.norm_name)
        B, s = o_BsHV.shape[:2]
        o_BsHV = backend.gated_rms_norm(o_BsHV, z_BsHV, norm.weight, norm.variance_epsilon)
        return getattr(self.module, self.out_proj_name)(o_BsHV.reshape(B, s, -1))


def extras(b_BsH: torch.Tensor, a_BsH: torch.Tensor) -> torch.Tensor:
    """[B, s, Hv, 2]: b and a per value head, the order `GatedDeltaNetView.inputs` reads."""
    return torch.stack([b_BsH, a_BsH], dim=-1)
