"""Fused Triton kernels of the model's glue around the GDN core (imports no Triton: each module does, and callers
import a module lazily, only on the Triton path).

    conv.py      causal depthwise conv1d + SiLU + q/k/v split (CP halo and per-document taps), forward and backward
"""
