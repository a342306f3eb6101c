"""The input checks every Triton recurrence backend shares (device, dtypes, dims), before any launch: ValueError
naming the value and the allowed ones. The GDN backend has its own (`ops/gdn/triton/contract_check.py`: it also
checks the Triton version); the scalar-decay and KDA backends call this one."""

from __future__ import annotations

import os

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # q, k, v: one of them, all alike
GATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # gates: cast to the accumulator inside


def check_triton_inputs(what: str, values, gates, dims) -> None:
    """values: (name, tensor or None) of a dtype among DTYPES, the first three (q, k, v) of one dtype; gates: (name,
    tensor or None) of a dtype among GATE_DTYPES; dims: (what the dim is, its symbol, its value, the allowed values). CUDA
    tensors everywhere, unless Triton runs interpreted (TRITON_INTERPRET=1, the CPU tests)."""
    named = [(n, x) for n, x in (*values, *gates) if x is not None]
    if os.environ.get("TRITON_INTERPRET") != "1":
        for name, x in named:
            if x.device.type != "cuda":
                raise ValueError(f"{what} needs CUDA tensors; got {name} on device {str(x.device)!r}")
    for name, x in values:
        if x is not None and x.dtype not in DTYPES:
            raise ValueError(f"{what} supports {name}.dtype in {tuple(str(d) for d in DTYPES)}; got {x.dtype}")
    main = [(n, x) for n, x in values[:3] if x is not None]
    if len({x.dtype for _, x in main}) != 1:
        raise ValueError(f"{what} needs {', '.join(n for n, _ in main)} of one dtype; got "
                         + ", ".join(f"{n} {x.dtype}" for n, x in main))
    for name, x in gates:
        if x is not None and x.dtype not in GATE_DTYPES:
            raise ValueError(f"{what} supports {name}.dtype in {tuple(str(d) for d in GATE_DTYPES)}; got {x.dtype}")
    for label, symbol, value, allowed in dims:
        if value not in allowed:
            raise ValueError(f"{what} supports {label} {symbol} in {allowed}; got {symbol}={value}")
