"""Triton backend of KDA (Kimi delta attention; `ops/kda/eager.py` is the reference and the semantics):
`TritonKimiDeltaRule`, the recurrence contract of `ops/recurrence.py`, M full.

Importing this package imports no Triton: the kernels load on first use.
    kernels.py  the kernels (prep, wy_diag, wy_fwd, state_fwd, out_fwd / dv_local, state_bwd, bwd_wy, bwd_intra,
                intra_diag, prep_bwd), their math, tiling and launchers; the in-chunk pair products on tensor cores
    chunk.py    the autograd Function and the public ops (forward, summary, entering state's gradient)

On a GPU the kernels fit a Hopper program at K = V = 128 (bench/kernel_resources.py gives each kernel's shared
memory, registers and spills offline; NOTES.md, KDA); under TRITON_INTERPRET=1 they run on the CPU (the tests).

Contract (`check`, before any launch; never falls back): CUDA tensors (or TRITON_INTERPRET=1, for tests); q, k, v
of one dtype among bf16, fp16, fp32; g, beta floating (cast to fp32); head dims K, V in HEAD_DIMS (K = V = 128 is
Kimi-Linear's). `cu_seqlens`: None, document offsets of one packed row, or a `VarlenLayout`, as the eager op.

Gates: exact for every finite g <= 0 (the kernels form every decay factor as e^x with x <= 0, kernels.py), so
Kimi-Linear's unbounded gate and Bailing-Hybrid's g >= kda_lower_bound alike. g > 0 (outside both models) is
computed as written, no clamp: exact while each chunk's partial sums of g stay below ~80 (fp32 exp range). Not
checked (it would need a device sync).
"""

from __future__ import annotations

from deltacp.ops.kda.eager import KimiDeltaRule, _check
from deltacp.ops.triton_inputs import check_triton_inputs

HEAD_DIMS = (16, 32, 64, 128)


def check_triton_kda(q, k, v, g, beta) -> None:
    """Raise ValueError naming the offending value and the allowed ones if the inputs are outside the contract."""
    _check(q, k, v, g, beta)
    check_triton_inputs("the Triton KDA", (("q", q), ("k", k), ("v", v)), (("g", g), ("beta", beta)),
                        (("key head dim", "K", k.shape[-1], HEAD_DIMS),
                         ("value head dim", "V", v.shape[-1], HEAD_DIMS)))


class TritonKimiDeltaRule(KimiDeltaRule):
    """KDA under the recurrence contract (`ops/recurrence.py`) on Triton: inputs (q, k, v, g, beta), M full. As
    `eager.KimiDeltaRule`, but: the summary is forward only (differentiating it raises, as the Triton GDN
    backend's); states and summaries are fp32 (fp64 for fp64 inputs)."""

    name = "triton"

    def _op(self, name: str):
        from deltacp.ops.kda.triton import chunk

        return getattr(chunk, name)

    def check(self, x) -> None:
        super().check(x)
        check_triton_kda(*x.tensors)


__all__ = ["TritonKimiDeltaRule", "check_triton_kda", "HEAD_DIMS"]
