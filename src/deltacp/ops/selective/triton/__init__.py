"""Triton backend of the selective scan (Mamba1; `ops/selective/eager.py` is the reference and the semantics):
`TritonSelectiveScan`, the recurrence contract of `ops/recurrence.py`, M diagonal.

Importing this package imports no Triton: the kernels load on first use.
    kernels.py  the kernels (chunk_state, forward and reverse; state_pass, forward and reverse; chunk_out;
                chunk_bwd), their math and launchers
    scan.py     the autograd Function and the public ops (forward, summary, entering state's gradient)

Contract (`check`, before any launch; never falls back): CUDA tensors (or TRITON_INTERPRET=1, for tests); x, B, C
of one dtype among bf16, fp16, fp32; B, C of one group [rows, T, N] or per group of channels [rows, T, G, N] (Zamba's
Mamba heads: one scan per group, `scan.py`); dt, A, D, z floating (widened to the fp32 accumulator inside); any
channel count I and state size N (the released models: I = 5120-8192, N = 16). `cu_seqlens`: None, document offsets
of one packed row, or a `VarlenLayout`, as the eager op.
"""

from __future__ import annotations

from deltacp.ops.selective.eager import SelectiveScan, _check
from deltacp.ops.triton_inputs import check_triton_inputs


def check_triton_selective_scan(x, dt, A, B, C, D, z) -> None:
    """Raise ValueError naming the offending value and the allowed ones if the inputs are outside the contract."""
    _check(x, dt, A, B, C, D, z)
    check_triton_inputs("the Triton selective scan", (("x", x), ("B", B), ("C", C)),
                        (("dt", dt), ("A", A), ("D", D), ("z", z)), ())


class TritonSelectiveScan(SelectiveScan):
    """Mamba1's selective scan under the contract (`ops/recurrence.py`) on Triton: inputs (x, dt, A, B, C, D, z) as
    `eager.SelectiveScan`'s, M diagonal. As the eager one, but: outputs in x's dtype; the summary is forward only
    (differentiating it raises, as the other Triton backends'); states and summaries are fp32 (fp64 for fp64
    inputs)."""

    name = "triton"

    def check(self, x) -> None:
        super().check(x)
        check_triton_selective_scan(*self._unpack(x))

    def _op(self, name: str):
        from deltacp.ops.selective.triton import scan

        return getattr(scan, name)


__all__ = ["TritonSelectiveScan", "check_triton_selective_scan"]
