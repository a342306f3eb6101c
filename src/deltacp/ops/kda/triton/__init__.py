"""Triton backend of KDA (Kimi delta attention; `ops/kda/eager.py` is the reference and the semantics):
`TritonKimiDeltaRule`, the recurrence contract of `ops/recurrence.py`, M full.

Importing this package imports no Triton: the kernels load on first use.
    kernels.py  the kernels (wy_fwd, state_fwd, out_fwd / dv_local, state_bwd, chunk_bwd), their math, launchers
    chunk.py    the autograd Function and the public ops (forward, summary, entering state's gradient)

Contract (`check`, before any launch; never falls back): CUDA tensors (or TRITON_INTERPRET=1, for tests); q, k, v
of one dtype among bf16, fp16, fp32; g, beta floating (cast to fp32); head dims K, V in HEAD_DIMS (K = V = 128 is
Kimi-Linear's). `cu_seqlens`: None, document offsets of one packed row, or a `VarlenLayout`, as the eager op.

Gates: exact for every finite g <= 0 (the kernels form every decay factor as e^x with x <= 0, kernels.py), so
Kimi-Linear's unbounded gate and Bailing-Hybrid's g >= kda_lower_bound alike. g > 0 (outside both models) is
computed as written, no clamp: exact while each chunk's partial sums of g stay below ~80 (fp32 exp range). Not
checked (it would need a device sync).
"""

from __future__ import annotations

import os

import torch

from deltacp.ops.kda.eager import _check
from deltacp.ops.recurrence import FULL, RecurrenceInputs

HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_triton_kda(q, k, v, g, beta) -> None:
    """Raise ValueError naming the offending value and the allowed ones if the inputs are outside the contract."""
    _check(q, k, v, g, beta)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the Triton KDA needs CUDA tensors; got {name} on device {str(x.device)!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in DTYPES:
            raise ValueError(f"the Triton KDA supports {name}.dtype in {tuple(str(d) for d in DTYPES)}; got {x.dtype}")
    if len({x.dtype for x in (q, k, v)}) != 1:
        raise ValueError(f"the Triton KDA needs q, k, v of one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    for name, x in (("g", g), ("beta", beta)):
        if x.dtype not in GATE_DTYPES:
            raise ValueError(f"the Triton KDA supports {name}.dtype in {tuple(str(d) for d in GATE_DTYPES)}; "
                             f"got {x.dtype}")
    K, V = k.shape[-1], v.shape[-1]
    if K not in HEAD_DIMS:
        raise ValueError(f"the Triton KDA supports key head dim K in {HEAD_DIMS}; got K={K}")
    if V not in HEAD_DIMS:
        raise ValueError(f"the Triton KDA supports value head dim V in {HEAD_DIMS}; got V={V}")


class TritonKimiDeltaRule:
    """KDA under the recurrence contract (`ops/recurrence.py`) on Triton: inputs (q, k, v, g, beta), M full. As
    `eager.KimiDeltaRule`, but: the summary is forward only (differentiating it raises, as the Triton GDN
    backend's); states and summaries are fp32 (fp64 for fp64 inputs)."""

    transition = FULL
    name = "triton"

    def __init__(self, *, qk_l2norm: bool = True, scale: float | None = None):
        self.qk_l2norm = qk_l2norm
        self.scale = scale

    def check(self, x: RecurrenceInputs) -> None:
        if len(x) != 5:
            raise ValueError(f"KDA takes the inputs (q, k, v, g, beta), got {len(x)} tensors")
        check_triton_kda(*x.tensors)

    def state_shape(self, x: RecurrenceInputs) -> tuple[int, ...]:
        q, k, v, g, beta = x.tensors
        return (v.shape[0], v.shape[2], k.shape[-1], v.shape[-1])

    def forward(self, x, *, initial_state=None, output_final_state=False, prepared=None, cu_seqlens=None):
        _no_prepared(prepared)
        _check(*x.tensors)
        from deltacp.ops.kda.triton.chunk import chunk_kda

        return chunk_kda(*x.tensors, scale=self.scale, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=self.qk_l2norm,
                         cu_seqlens=cu_seqlens)

    def prepare(self, x, *, cu_seqlens=None):
        return None  # nothing staged

    def prepared_from_saved(self, tensors):
        raise TypeError("the Triton KDA stages nothing (prepare returns None)")

    def summary(self, x, *, prepared=None, need_transition=True, cu_seqlens=None):
        _no_prepared(prepared)
        q, k, v, g, beta = x.tensors
        _check(None, k, v, g, beta)
        from deltacp.ops.kda.triton.chunk import summary_kda

        return summary_kda(k, v, g, beta, use_qk_l2norm_in_kernel=self.qk_l2norm, need_transition=need_transition,
                           cu_seqlens=cu_seqlens)

    def initial_state_grad(self, x, grad_o, *, prepared=None, cu_seqlens=None):
        _no_prepared(prepared)
        _check(*x.tensors)
        from deltacp.ops.kda.triton.chunk import initial_state_grad

        return initial_state_grad(*x.tensors, grad_o, scale=self.scale, use_qk_l2norm_in_kernel=self.qk_l2norm,
                                  cu_seqlens=cu_seqlens)


def _no_prepared(prepared) -> None:
    if prepared is not None:
        raise TypeError(f"the Triton KDA takes no prepared chunks (got {type(prepared).__name__})")


__all__ = ["TritonKimiDeltaRule", "check_triton_kda", "HEAD_DIMS"]
