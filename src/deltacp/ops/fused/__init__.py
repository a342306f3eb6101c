"""Fused Triton kernels for the parts of a decoder layer around the token mixers (forward and backward each).
This package imports no triton; each module does, when it is imported.

    decoder      RMSNorm ((1 + w) form), residual add + RMSNorm, SwiGLU: transformers' Qwen3.5 numerics
"""
