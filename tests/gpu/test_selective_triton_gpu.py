"""The Triton selective scan (`deltacp.ops.selective.triton`, Mamba1) on CUDA vs the eager one in float64 on the same
values (the inputs rounded to the kernel dtype first).

T = 4000 (125 chunks of 32 and a partial one, by the launch table), I = 1024 channels, N = 16 (Mamba1's state size),
an entering state, D and the silu(z) gate, A and D expanded over the rows (stride 0, as the Mamba view passes them);
one unpacked pair of rows and one packed row of log-normal documents (not aligned to the chunks, with length-1 ones;
the first continuing the entering state). Three gate regimes, dt after softplus as the view makes it: fast (|A| in [1,
16], Mamba1's initial range, dt ~ softplus(randn) ~ 0.7: a token decays by e^-0.1 to e^-30), slow (|A| in [0.01, 0.1],
dt ~ 0.05) and near-frozen (A = -1e-4: a long document's state barely decays). Every output and gradient (y, final
state, dx, ddt, dA, dB, dC, dD, dz, dh0), the summary (M, S) and the entering state's gradient from the outputs alone
within rel-L2 FP32_TOL = 1e-4 (fp32 inputs: fp32 accumulation) or BF16_TOL = 2e-2 (bf16 inputs and outputs; bf16's
unit roundoff is 2^-9 ~ 2e-3). The released channel counts (I = 5120-8192) run in the family mixer test
(tests/gpu/test_family_gdn_shapes_gpu.py, Mamba1 rows) and the bench (bench/selective_op.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltacp.ops.recurrence import RecurrenceInputs
from deltacp.testing.documents import cu_of, doc_lengths
from helpers import rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (Triton selective-scan kernels); the CPU interpreter test is "
                                       "tests/unit/test_selective_triton_interpret.py")

TOLS = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
GATES = {"fast": ((1.0, 16.0), 0.0), "slow": ((0.01, 0.1), -3.0), "frozen": ((1e-4, 1e-4), -3.0)}  # |A|, dt shift
T, I, N = 4000, 1024, 16
NAMES = ("y", "final_state", "dx", "ddt", "dA", "dB", "dC", "dD", "dz", "dh0", "M", "S", "initial_state_grad")


def make_inputs(R, gate, dtype, seed, T=T):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    (lo, hi), shift = GATES[gate]
    x, z = r(R, T, I), r(R, T, I)
    dt = F.softplus(r(R, T, I) + shift)
    A = -torch.empty(I, N, device="cuda").uniform_(lo, hi, generator=gen)
    B, C = r(R, T, N), r(R, T, N)
    D = torch.rand(I, device="cuda", generator=gen) + 0.5
    h0 = r(R, I, N)
    return [x.to(dtype), dt.to(dtype), A.expand(R, I, N), B.to(dtype), C.to(dtype), D.expand(R, I), z.to(dtype), h0]


def _run(rec, vals, layout, dy, dht):
    xs = [t.detach().clone().requires_grad_() for t in vals]
    R, _, I_ = vals[0].shape
    h0 = xs[7].reshape(R, 1, I_ * N, 1)
    y, ht = rec.forward(RecurrenceInputs(*xs[:7]), initial_state=h0, output_final_state=True, cu_seqlens=layout)
    grads = torch.autograd.grad((y * dy.to(y.dtype)).sum() + (ht * dht.to(ht.dtype)).sum(), xs)
    x = RecurrenceInputs(*vals[:7])
    with torch.no_grad():
        m, s = rec.summary(x, cu_seqlens=layout)
    dh0 = rec.initial_state_grad(x, dy.to(vals[0].dtype), cu_seqlens=layout)
    return dict(zip(NAMES, (y, ht, *grads[:7], grads[7], m, s, dh0)))


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("dtype", list(TOLS), ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_triton_vs_eager_fp64(packed, dtype, gate):
    from deltacp.ops.gdn.varlen import VarlenLayout
    from deltacp.ops.selective.eager import SelectiveScan
    from deltacp.ops.selective.triton import TritonSelectiveScan

    rec = TritonSelectiveScan()
    R = 1 if packed else 2
    vals = make_inputs(R, gate, dtype, seed=11)
    rec.check(RecurrenceInputs(*vals[:7]))
    layout = VarlenLayout.build(cu_of(doc_lengths(T, 700, 1.0, seed=3)), T) if packed else None
    gen = torch.Generator(device="cuda").manual_seed(7)
    dy = torch.randn(R, T, 1, I, device="cuda", generator=gen, dtype=torch.float64)
    dht = torch.randn(R, 1, I * N, 1, device="cuda", generator=gen, dtype=torch.float64)
    got = _run(rec, vals, layout, dy, dht)
    ref = _run(SelectiveScan(), [t.double() for t in vals], layout, dy, dht)
    tol = TOLS[dtype]
    errs = {n: rel_l2(got[n], ref[n]) if ref[n].norm() > 0 else got[n].norm().item() for n in ref}
    print(f"{'packed' if packed else 'rows'} {dtype} {gate}: " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    assert got["y"].dtype == dtype and got["final_state"].dtype == torch.float32
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"above {tol:.0e}: {bad}"


def test_one_compilation_across_lengths():
    """T is never a compile-time constant: rows and packed rows at five lengths compile each kernel once per
    variant (chunk_state forward / reverse, state_pass forward / reverse and the summary's, chunk_out,
    chunk_bwd), with no variant per length."""
    from deltacp.ops.gdn.varlen import VarlenLayout
    from deltacp.ops.selective.triton import TritonSelectiveScan
    from deltacp.ops.selective.triton import kernels

    rec = TritonSelectiveScan()
    names = ("sel_chunk_state_kernel", "sel_state_pass_kernel", "sel_chunk_out_kernel", "sel_chunk_bwd_kernel")

    def counts():
        return {n: sum(len(c[0]) for c in getattr(kernels, n).device_caches.values()) for n in names}

    for i, L in enumerate((1000, 2048, 3001, 4096, 777)):
        vals = make_inputs(1, "slow", torch.bfloat16, seed=i, T=L)
        layout = VarlenLayout.build(cu_of(doc_lengths(L, 300, 1.0, seed=i)), L) if i % 2 else None
        _run(rec, vals, layout, torch.randn(1, L, 1, I, device="cuda"), torch.randn(1, 1, I * N, 1, device="cuda"))
        if i == 1:
            first = counts()
    print(f"compiled variants per kernel after 2 and 5 lengths: {first} {counts()}")
    assert counts() == first, (first, counts())
