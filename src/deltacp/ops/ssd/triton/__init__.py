"""Triton backend of the scalar-decay recurrence (Mamba2's SSD; `ops/ssd/eager.py` is the reference and the
semantics): `TritonScalarDecay`, the recurrence contract of `ops/recurrence.py`.

Importing this package imports no Triton: the kernels load on first use.
    kernels.py  the kernels (state_scan, forward and reverse; out_fwd; chunk_bwd), their math and launchers
    chunk.py    the autograd Function and the public ops (forward, summary, entering state's gradient)

Contract (`check`, before any launch; never falls back): CUDA tensors (or TRITON_INTERPRET=1, for tests); q, k, v
(and skip) of one dtype among bf16, fp16, fp32, g a floating dtype (cast to fp32); state size N in STATE_SIZES,
head dim P in HEAD_DIMS; heads a multiple of the groups. `cu_seqlens`: None, document offsets of one packed row,
or a `VarlenLayout`, as the eager op.
"""

from __future__ import annotations

import os

import torch

from deltacp.ops.recurrence import RecurrenceInputs
from deltacp.ops.ssd.eager import SCALAR, _check

STATE_SIZES = (16, 32, 64, 128, 256)
HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_triton_scalar_decay(q, k, v, g, skip) -> None:
    """Raise ValueError naming the offending value and the allowed ones if the inputs are outside the contract."""
    _check(q, k, v, g, skip)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("skip", skip)):
        if x is not None and x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the Triton scalar-decay recurrence needs CUDA tensors; got {name} on device "
                             f"{str(x.device)!r}")
    for name, x in (("q", q), ("k", k), ("v", v), ("skip", skip)):
        if x is not None and x.dtype not in DTYPES:
            raise ValueError(f"the Triton scalar-decay recurrence supports {name}.dtype in "
                             f"{tuple(str(d) for d in DTYPES)}; got {x.dtype}")
    if len({x.dtype for x in (q, k, v)}) != 1:
        raise ValueError(f"the Triton scalar-decay recurrence needs q, k, v of one dtype; got q {q.dtype}, "
                         f"k {k.dtype}, v {v.dtype}")
    if g.dtype not in GATE_DTYPES:
        raise ValueError(f"the Triton scalar-decay recurrence supports g.dtype in "
                         f"{tuple(str(d) for d in GATE_DTYPES)}; got {g.dtype}")
    N, P = k.shape[-1], v.shape[-1]
    if N not in STATE_SIZES:
        raise ValueError(f"the Triton scalar-decay recurrence supports state size N in {STATE_SIZES}; got N={N}")
    if P not in HEAD_DIMS:
        raise ValueError(f"the Triton scalar-decay recurrence supports head dim P in {HEAD_DIMS}; got P={P}")


class TritonScalarDecay:
    """The scalar-decay recurrence under the contract (`ops/recurrence.py`) on Triton: inputs (q, k, v, g, skip),
    skip optional; M scalar per head. As `eager.ScalarDecay`, but: the summary is forward only (differentiating it
    raises, as the Triton GDN backend's), states and summaries are fp32 (fp64 for fp64 inputs)."""

    transition = SCALAR
    name = "triton"

    def check(self, x: RecurrenceInputs) -> None:
        check_triton_scalar_decay(*x.tensors)

    def state_shape(self, x: RecurrenceInputs) -> tuple[int, ...]:
        q, k, v, g, skip = x.tensors
        return (v.shape[0], v.shape[2], k.shape[-1], v.shape[-1])

    def forward(self, x, *, initial_state=None, output_final_state=False, prepared=None, cu_seqlens=None):
        _no_prepared(prepared)
        q, k, v, g, skip = x.tensors
        _check(q, k, v, g, skip)
        from deltacp.ops.ssd.triton.chunk import chunk_scalar_decay

        return chunk_scalar_decay(q, k, v, g, skip, initial_state=initial_state,
                                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)

    def prepare(self, x, *, cu_seqlens=None):
        return None  # nothing staged

    def prepared_from_saved(self, tensors):
        raise TypeError("the Triton scalar-decay recurrence stages nothing (prepare returns None)")

    def summary(self, x, *, prepared=None, need_transition=True, cu_seqlens=None):
        _no_prepared(prepared)
        q, k, v, g, skip = x.tensors
        _check(None, k, v, g, None)
        from deltacp.ops.ssd.triton.chunk import summary_scalar_decay

        return summary_scalar_decay(k, v, g, need_transition=need_transition, cu_seqlens=cu_seqlens)

    def initial_state_grad(self, x, grad_o, *, prepared=None, cu_seqlens=None):
        """d sum(o * grad_o) / dh0 (the skip does not read h0)."""
        _no_prepared(prepared)
        q, k, v, g, skip = x.tensors
        _check(q, k, v, g, None)
        from deltacp.ops.ssd.triton.chunk import initial_state_grad

        return initial_state_grad(q, k, v, g, grad_o, cu_seqlens=cu_seqlens)


def _no_prepared(prepared) -> None:
    if prepared is not None:
        raise TypeError(f"the Triton scalar-decay recurrence takes no prepared chunks (got {type(prepared).__name__})")


__all__ = ["TritonScalarDecay", "check_triton_scalar_decay", "STATE_SIZES", "HEAD_DIMS"]
