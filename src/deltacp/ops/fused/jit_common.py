"""Triton helpers shared by the fused kernels (imports triton: only on the Triton path)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def up(x, F64: tl.constexpr):
    """x in the compute dtype: float64 for float64 inputs, float32 otherwise."""
    if F64:
        return x.to(tl.float64)
    else:
        return x.to(tl.float32)
