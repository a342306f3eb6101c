"""Fused Triton kernels of the model glue around the GDN core (forward and backward). Importing this package
imports no Triton: each module imports it and is imported on first use (by the Triton GDN backend).

    gated_norm.py  gated RMSNorm of the GDN output (transformers' Qwen3_5RMSNormGated): y, dx, dgate, dweight
    gates.py       the GDN gates g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), with their gradients
"""
