"""The Triton KDA (`deltacp.ops.kda.triton`, Kimi delta attention) on CUDA vs the eager one in float64 on the same
values (the inputs rounded to the kernel dtype first).

T = 8192, H = 4 heads, K = V = 128 (Kimi-Linear's), q/k l2-normalised inside, an entering state; one unpacked pair
of rows and one packed row of log-normal documents (not aligned to 64, with length-1 ones; the first continuing
the entering state). Gates per token and key channel in three regimes: fast g ~ -U(0, 5) (down to -5: in-chunk
decays reach e^-300, past fp32's range), slow g ~ -U(0, 0.05), near-frozen g ~ -U(0, 1e-4).
Every output and gradient (o, final state, dq, dk, dv, dg, dbeta, dh0), the summary (M, S) and the entering
state's gradient from the outputs alone within rel-L2 1e-4 (fp32 inputs) or 2e-2 (bf16 q, k, v; fp32 g, beta).
Where the reference is below fp32's range (M under fast gates, ~e^-40000) the figure is the absolute error.
"""

from __future__ import annotations

import pytest
import torch

from deltacp.ops.recurrence import RecurrenceInputs
from deltacp.testing.documents import cu_of, doc_lengths
from helpers import rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (Triton KDA kernels); the CPU interpreter test is "
                                       "tests/unit/test_kda_triton_interpret.py")

TOLS = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
GATES = {"fast": 5.0, "slow": 0.05, "frozen": 1e-4}
T, H, K, V = 8192, 4, 128, 128


def make_inputs(B, gate, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    g = -torch.rand(B, T, H, K, device="cuda", generator=gen) * GATES[gate]
    beta = torch.rand(B, T, H, device="cuda", generator=gen)
    h0 = r(B, H, K, V) * 0.1
    return [x.to(dtype) for x in (q, k, v)] + [g, beta, h0]


def _run(rec, vals, layout, do, dht):
    xs = [x.detach().clone().requires_grad_() for x in vals]
    o, ht = rec.forward(RecurrenceInputs(*xs[:5]), initial_state=xs[5], output_final_state=True, cu_seqlens=layout)
    grads = torch.autograd.grad((o * do.to(o.dtype)).sum() + (ht * dht.to(ht.dtype)).sum(), xs)
    x = RecurrenceInputs(*vals[:5])
    with torch.no_grad():
        m, s = rec.summary(x, cu_seqlens=layout)
    dh0 = rec.initial_state_grad(x, do.to(vals[2].dtype), cu_seqlens=layout)
    return dict(zip(("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0", "M", "S", "initial_state_grad"),
                    (o, ht, *grads, m, s, dh0)))


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("dtype", list(TOLS), ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_triton_vs_eager_fp64(packed, dtype, gate):
    from deltacp.ops.gdn.varlen import VarlenLayout
    from deltacp.ops.kda.eager import KimiDeltaRule
    from deltacp.ops.kda.triton import TritonKimiDeltaRule

    rec = TritonKimiDeltaRule()
    B = 1 if packed else 2
    vals = make_inputs(B, gate, dtype, seed=11)
    rec.check(RecurrenceInputs(*vals[:5]))
    layout = VarlenLayout.build(cu_of(doc_lengths(T, 900, 1.0, seed=3)), T) if packed else None
    gen = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(B, T, H, V, device="cuda", generator=gen, dtype=torch.float64)
    dht = torch.randn(B, H, K, V, device="cuda", generator=gen, dtype=torch.float64)
    got = _run(rec, vals, layout, do, dht)
    ref = _run(KimiDeltaRule(), [x.double() for x in vals], layout, do, dht)
    tol = TOLS[dtype]
    errs = {n: rel_l2(got[n], ref[n]) if ref[n].norm() > 1e-20 else (got[n].double() - ref[n]).norm().item()
            for n in ref}
    print(f"{'packed' if packed else 'rows'} {dtype} {gate}: " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    assert got["o"].dtype == dtype and got["final_state"].dtype == torch.float32
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"above {tol:.0e}: {bad}"
