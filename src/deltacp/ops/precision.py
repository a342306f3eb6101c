"""The compute dtype of deltacp's ops (docs/design.md, "Precision policy"), shared by the GDN backends, the fused
kernels' launchers and full attention (`deltacp.parallel`). Imports torch only.

float64 inputs compute in float64; everything narrower (bf16, fp16, fp32) computes in float32, where transformers'
Qwen3.5 upcasts.
"""

from __future__ import annotations

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; everything narrower is computed in float32 (the transformers policy)."""
    return torch.promote_types(x.dtype, torch.float32)
