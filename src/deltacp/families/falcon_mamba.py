"""FalconMamba (`FalconMambaForCausalLM`, `FalconMambaModel`; transformers 5.25, tiiuae/falcon-mamba-7b): Mamba1
(`families/mamba.py`) with weightless RMSNorms (`FalconMambaWeightlessRMSNorm`, eps `mixer_rms_eps`: x * rsqrt(mean
x^2 + eps) in float32, cast back; its `weight` is a non-persistent buffer of ones that the forward never reads) on dt
(over the `time_step_rank` dims), B and C, between x_proj and dt_proj. No fused `mamba_inner_fn` path. The
`_is_quantized` branch of dt_proj computes the same product. Blocks, norms, names and padding as Mamba's.
"""

from __future__ import annotations

import torch

from deltacp.families.mamba import MambaView, mamba_family
from deltacp.families.registry import register_family
from deltacp.ops.precision import compute_dtype


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' FalconMambaWeightlessRMSNorm, its float32 upcast widened to float64 for float64 inputs."""
    h = x.to(compute_dtype(x))
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class FalconMambaView(MambaView):
    family = "falcon_mamba"

    def dt_b_c(self, proj):
        eps = self.module.rms_eps
        return tuple(weightless_rms_norm(t, eps) for t in super().dt_b_c(proj))


FALCON_MAMBA = register_family(mamba_family("falcon_mamba", "FalconMamba", FalconMambaView))
