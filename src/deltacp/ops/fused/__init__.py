"""Fused Triton kernels (forward and backward) around the model's large ops. Importing this package imports no
Triton: each module imports it, and callers import a module lazily, only on the Triton path.

    linear_ce.py  cross entropy of one chunk of logits: per-row loss and softmax - onehot written over the logits
    gated_norm.py  the GDN layer's gated RMSNorm (transformers' Qwen3_5RMSNormGated): y; dx, dgate, dweight
    gates.py       the GDN gates g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), and their gradients
    decoder.py     decoder-layer glue: RMSNorm ((1 + w) form), residual add + RMSNorm, SwiGLU (Qwen3.5 numerics)
"""
