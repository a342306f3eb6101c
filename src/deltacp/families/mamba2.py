"""What every Mamba2 (SSD) mixer of transformers 5.25 shares, read through one family's module: the head layout (the
pre-conv channels [x | B | C]: x per head, B and C per group of heads, `n_groups` in the role of key heads), the
inputs of the scalar-decay recurrence (`ops/ssd/eager.py`: k = B, q = C, x, g = dt A, the value scale dt and the skip
weight D, with dt = softplus(dt_raw + dt_bias) clamped to `time_step_limit` and A = -exp(A_log); the recurrence forms
v = dt x and the skip D x where it reads x, so no [B, T, H, P] tensor is made here) on the eager or the Triton backend
(`ops/ssd/triton`), and the output path (the module's own gated RMSNorm, then the output projection).

Padding: transformers zeroes padded tokens' hidden states before `in_proj` and multiplies the conv's output by the
padding mask again (the conv has a bias, so a zeroed input token would still write the state). The CP layer does
both for every family (`parallel/linear_layer.py`, `parallel/shard.py`): padded tokens write nothing into the state,
and their pre-conv values (zero, or `in_proj`'s bias) enter the conv windows of the valid tokens after them, as in
transformers.

Shape legend: x_BsD local hidden states; pre_BsC pre-conv [x | B | C]; extras_BsHX [dt_raw] per head.
"""

from __future__ import annotations

import torch.nn.functional as F

from deltacp.ops.precision import compute_dtype
from deltacp.ops.recurrence import RecurrenceInputs
from deltacp.parallel.views import HeadLayout, LinearMixerView


class Mamba2View(LinearMixerView):
    """A Mamba2 module with transformers' attribute names (`in_proj` = [z | xBC | dt], conv1d, dt_bias, A_log, D,
    norm, out_proj; num_heads, head_dim, n_groups, ssm_state_size, intermediate_size, time_step_limit). A family
    whose module differs overrides `project` / `output`."""

    extras = 1  # dt_raw
    groups_setting = "mamba_n_groups"
    heads_setting = "mamba_n_heads"

    @property
    def layout(self) -> HeadLayout:
        m = self.module
        return HeadLayout(m.n_groups, m.num_heads,
                          (("value", m.head_dim), ("key", m.ssm_state_size), ("key", m.ssm_state_size)),
                          key_setting=self.groups_setting, value_setting=self.heads_setting)

    @property
    def conv_activation(self) -> str:
        return self.module.activation

    @property
    def state_dims(self) -> tuple[int, int]:
        return self.module.ssm_state_size, self.module.head_dim

    def conv_heads(self, key_heads: int) -> tuple[tuple[int, int], ...]:
        m = self.module
        return ((-1, m.head_dim), (key_heads, m.ssm_state_size), (key_heads, m.ssm_state_size))

    def project(self, x_BsD):
        m = self.module
        z, pre_BsC, dt = m.in_proj(x_BsD).split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        return pre_BsC, dt[..., None], (z, x_BsD.dtype)

    def inputs(self, parts, extras_BnHX, heads: slice, backend) -> RecurrenceInputs:
        m = self.module
        x, b, c = parts
        dt_ = compute_dtype(x)
        lo, hi = m.time_step_limit
        dt = F.softplus(extras_BnHX[..., 0].to(dt_) + m.dt_bias[heads].to(dt_)).clamp(min=lo, max=hi)
        a = -m.A_log[heads].to(dt_).exp()
        return RecurrenceInputs(c, b, x, dt * a, dt, m.D[heads].to(dt_).expand_as(dt))

    def recurrence(self, backend):
        if backend.name == "triton":
            from deltacp.ops.ssd.triton import TritonScalarDecay

            return TritonScalarDecay()
        from deltacp.ops.ssd.eager import ScalarDecay

        return ScalarDecay()

    def output(self, o_BsHV, out, backend):
        z, dtype = out
        B, s = o_BsHV.shape[:2]
        y = self.module.norm(o_BsHV.reshape(B, s, -1), z)
        return self.module.out_proj(y.to(dtype))
