"""What every Kimi delta attention (KDA) mixer of transformers 5.25 shares (Kimi-Linear's `KimiLinearDeltaAttention`,
Bailing-Hybrid's `BailingHybridDeltaAttention`), read through one family's module: the head layout (pre-conv channels
[q | k | v], one key head per value head: H heads of dim D each), the recurrence (`KimiDeltaRule`, q/k
l2-normalised inside the op, query scale D^-1/2) and the output path (RMSNorm of each head's output times
sigmoid(output gate), norm and gate computed in float32, then `o_proj`).

The per-token inputs that skip the conv are, per head, the forget-gate projection (D channels, before dt_bias) and b
(one): the extras [B, s, H, D + 1]. A family's view says how its module projects the forget gate and the output gate
(`forget_projection`, `output_gate`) and its gate formula (`forget_gate`: g [.., heads, D] <= 0 from the projection of
a slice of heads). beta = sigmoid(b), in the hidden dtype (as transformers computes it).

The recurrence runs on the eager backend (`ops/kda/eager.py`) or the Triton one (`ops/kda/triton`, the same
contract; q, k, v from the conv in the hidden dtype, g and beta cast inside).

Shape legend: x_BsD local hidden states; pre_BsC pre-conv [q | k | v]; f_BsHD forget-gate projection; z_BsHD output
gate per head; o_BsHD recurrence output.
"""

from __future__ import annotations

import torch

from deltacp.ops.precision import compute_dtype
from deltacp.ops.recurrence import RecurrenceInputs
from deltacp.parallel.views import HeadLayout, LinearMixerView


class KimiDeltaAttentionView(LinearMixerView):
    """A KDA module with transformers' attribute names (q_proj, k_proj, v_proj, conv1d, forget_gate, b_proj, o_norm,
    o_proj; num_heads, head_dim, activation). Subclasses write `forget_projection`, `forget_gate`, `output_gate`."""

    heads_setting = "linear_num_heads"  # the config field that sets the head count (error messages)

    @property
    def extras(self) -> int:  # the forget-gate projection (D per head) and b
        return self.module.head_dim + 1

    @property
    def layout(self) -> HeadLayout:
        m = self.module
        D = m.head_dim
        return HeadLayout(m.num_heads, m.num_heads, (("key", D), ("key", D), ("value", D)),
                          key_setting=self.heads_setting, value_setting=self.heads_setting)

    @property
    def conv_activation(self) -> str:
        return self.module.activation

    @property
    def state_dims(self) -> tuple[int, int]:
        return self.module.head_dim, self.module.head_dim

    def conv_heads(self, key_heads: int) -> tuple[int, int, int]:
        return key_heads, self.module.head_dim, self.module.head_dim

    def forget_projection(self, x_BsD: torch.Tensor) -> torch.Tensor:
        """[B, s, H * D]: the forget gate's projection of the hidden states (before dt_bias)."""
        raise NotImplementedError

    def forget_gate(self, f_BsHD: torch.Tensor, heads: slice) -> torch.Tensor:
        """g [B, s, h, D] (log decay per key channel) of the heads `heads` from their projection f."""
        raise NotImplementedError

    def output_gate(self, x_BsD: torch.Tensor) -> torch.Tensor:
        """[B, s, H * D]: the output gate's projection (before the sigmoid)."""
        raise NotImplementedError

    def project(self, x_BsD):
        m = self.module
        B, s, _ = x_BsD.shape
        H, D = m.num_heads, m.head_dim
        pre_BsC = torch.cat([m.q_proj(x_BsD), m.k_proj(x_BsD), m.v_proj(x_BsD)], dim=-1)
        f_BsHD = self.forget_projection(x_BsD).reshape(B, s, H, D)
        b_BsH = m.b_proj(x_BsD)
        extras_BsHX = torch.cat([f_BsHD, b_BsH.to(f_BsHD.dtype)[..., None]], dim=-1)
        return pre_BsC, extras_BsHX, self.output_gate(x_BsD).reshape(B, s, H, D)

    def inputs(self, parts, extras_BnHX: torch.Tensor, heads: slice, backend) -> RecurrenceInputs:
        """(q, k, v) from the conv; g from the forget-gate projection of heads `heads`, beta = sigmoid(b)."""
        q, k, v = parts
        D = self.module.head_dim
        g = self.forget_gate(extras_BnHX[..., :D], heads)
        return RecurrenceInputs(q, k, v, g, extras_BnHX[..., D].sigmoid())

    def recurrence(self, backend):
        if backend.name == "triton":
            from deltacp.ops.kda.triton import TritonKimiDeltaRule

            return TritonKimiDeltaRule(qk_l2norm=True, scale=None)
        from deltacp.ops.kda.eager import KimiDeltaRule

        return KimiDeltaRule(qk_l2norm=True, scale=None)

    def output(self, o_BsHD: torch.Tensor, z_BsHD: torch.Tensor, backend) -> torch.Tensor:
        """transformers' Kimi / Bailing RMSNormGated per head (RMS, weight and sigmoid gate in float32, widened to
        float64 for float64), then o_proj."""
        norm = self.module.o_norm
        B, s = o_BsHD.shape[:2]
        dt = compute_dtype(o_BsHD)
        h = o_BsHD.to(dt)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        h = norm.weight.to(dt) * h
        h = (h * torch.sigmoid(z_BsHD.to(dt))).to(o_BsHD.dtype)
        return self.module.o_proj(h.reshape(B, s, -1))
