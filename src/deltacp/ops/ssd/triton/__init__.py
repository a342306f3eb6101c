"""Triton backend of the scalar-decay recurrence (Mamba2's SSD; `ops/ssd/eager.py` is the reference and the
semantics): `TritonScalarDecay`, the recurrence contract of `ops/recurrence.py`.

Importing this package imports no Triton: the kernels load on first use.
    kernels.py  the kernels (state_scan, forward and reverse; out_fwd; chunk_bwd), their math and launchers
    chunk.py    the autograd Function and the public ops (forward, summary, entering state's gradient)

Contract (`check`, before any launch; never falls back; `ops/triton_inputs.py`): CUDA tensors (or
TRITON_INTERPRET=1, for tests); q, k, x of one dtype among bf16, fp16, fp32; the per-token weights g, scale, skip
any floating dtype (cast to fp32); state size N in STATE_SIZES, head dim P in HEAD_DIMS; heads a multiple of the
groups. `cu_seqlens`: None, document offsets of one packed row,
or a `VarlenLayout`, as the eager op.
"""

from __future__ import annotations

from deltacp.ops.ssd.eager import ScalarDecay, _check
from deltacp.ops.triton_inputs import check_triton_inputs

STATE_SIZES = (16, 32, 64, 128, 256)
HEAD_DIMS = (16, 32, 64, 128)


def check_triton_scalar_decay(q, k, x, g, scale, skip) -> None:
    """Raise ValueError naming the offending value and the allowed ones if the inputs are outside the contract."""
    _check(q, k, x, g, scale, skip)
    check_triton_inputs("the Triton scalar-decay recurrence", (("q", q), ("k", k), ("x", x)),
                        (("g", g), ("scale", scale), ("skip", skip)),
                        (("state size", "N", k.shape[-1], STATE_SIZES), ("head dim", "P", x.shape[-1], HEAD_DIMS)))


class TritonScalarDecay(ScalarDecay):
    """The scalar-decay recurrence under the contract (`ops/recurrence.py`) on Triton: inputs (q, k, x, g, scale,
    skip), scale and skip optional; M scalar per head. As `eager.ScalarDecay`, but: the summary is forward only (differentiating it
    raises, as the Triton GDN backend's), states and summaries are fp32 (fp64 for fp64 inputs)."""

    name = "triton"

    def _op(self, name: str):
        from deltacp.ops.ssd.triton import chunk

        return getattr(chunk, name)

    def check(self, x) -> None:
        super().check(x)
        check_triton_scalar_decay(*self._unpack(x))


__all__ = ["TritonScalarDecay", "check_triton_scalar_decay", "STATE_SIZES", "HEAD_DIMS"]
