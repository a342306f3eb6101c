"""Fused Triton kernels (forward and backward) around the model's large ops. Importing this package imports no
Triton: each module imports it, and callers import a module lazily, only on the Triton path.

    conv.py       causal depthwise conv1d + SiLU + q/k/v split (CP halo and per-document taps), forward and backward
    linear_ce.py  cross entropy of one chunk of logits: per-row loss and softmax - onehot written over the logits
    token_logprobs.py  tempered log-probabilities and entropy of a chunk of logits; their gradient over the logits
    gated_norm.py  the GDN layer's gated RMSNorm (transformers' Qwen3_5RMSNormGated): y; dx, dgate, dweight
    gates.py       the GDN gates g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), and their gradients
    decoder.py     decoder-layer glue: RMSNorm ((1 + w) form), residual add + RMSNorm, SwiGLU (Qwen3.5 numerics)
    jit_common.py  Triton helpers the kernels share

`check_device` is the one device rule of every Triton path (these kernels and the GDN op): CUDA tensors, or any
device under TRITON_INTERPRET=1 (the CPU tests). It never falls back: elsewhere it raises the documented error.
"""

from __future__ import annotations

import os

import torch


def device_error(name: str, x: torch.Tensor, setting: str = "backend='triton'") -> RuntimeError:
    return RuntimeError(f"{setting} needs CUDA tensors; got {name} on device {str(x.device)!r}")


def check_device(name: str, x: torch.Tensor, setting: str = "backend='triton'") -> None:
    """Raise the documented device error, naming the setting that chose Triton, unless x is a CUDA tensor (or
    Triton runs interpreted, for tests)."""
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise device_error(name, x, setting)
