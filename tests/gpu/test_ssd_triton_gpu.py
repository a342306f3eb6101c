"""The Triton scalar-decay recurrence (`deltacp.ops.ssd.triton`, Mamba2's SSD) on CUDA vs the eager one in float64
on the same values (the inputs rounded to the kernel dtype first).

T = 8192, H = 8 heads, G = 1 and 2 groups, state size N = 128 and 256, head dim P = 64 (Mamba2's), an entering
state, the value scale dt (v = dt x, formed in the kernels) and the skip weight D (one per head, expanded over the
tokens, as the Mamba2 view passes it); one unpacked pair of rows and one packed row of log-normal documents (not
aligned to 64, with length-1 ones; the first continuing the entering state). Gates as Mamba2 makes them, g = dt A with dt =
softplus(randn) per token and A = -exp(U(lo, hi)) per head, in three regimes: fast forgetting (A ~ -0.4..-1.6:
g ~ -1..-0.3), slow (A ~ -0.01) and near-frozen (g ~ -1e-4: a long document's state barely decays).
Every output and gradient (o, final state, dq, dk, dx, dg, dscale, dskip, dh0), the summary (M, S) and the
entering state's gradient from the outputs alone within rel-L2 FP32_TOL = 1e-4 (fp32 inputs: fp32 accumulation, tf32x3 products)
or BF16_TOL = 2e-2 (bf16 inputs: bf16 products and per-chunk states; bf16's unit roundoff is 2^-9 ~ 2e-3).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltacp.ops.recurrence import RecurrenceInputs
from deltacp.testing.documents import cu_of, doc_lengths
from helpers import rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (Triton scalar-decay kernels); the CPU interpreter test is "
                                       "tests/unit/test_ssd_triton_interpret.py")

TOLS = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
GATES = {"fast": (-1.0, 0.5), "slow": (-4.9, -4.3), "frozen": None}
T, H, P = 8192, 8, 64


def make_inputs(B, G, N, gate, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k = r(B, T, G, N) * N ** -0.5, r(B, T, G, N)
    x = r(B, T, H, P)
    dt = F.softplus(r(B, T, H))
    if GATES[gate] is None:
        A = torch.full((H,), -1.5e-4, device="cuda")
    else:
        A = -torch.empty(H, device="cuda").uniform_(*GATES[gate], generator=gen).exp()
    D = torch.rand(H, device="cuda", generator=gen) + 0.5
    h0 = r(B, H, N, P) * 0.1
    return [t.to(dtype) for t in (q, k, x)] + [dt * A, dt, D.expand(B, T, H), h0]


def _run(rec, vals, layout, do, dht):
    xs = [t.detach().clone().requires_grad_() for t in vals]
    o, ht = rec.forward(RecurrenceInputs(*xs[:6]), initial_state=xs[6], output_final_state=True, cu_seqlens=layout)
    grads = torch.autograd.grad((o * do.to(o.dtype)).sum() + (ht * dht.to(ht.dtype)).sum(), xs)
    x = RecurrenceInputs(*vals[:6])
    with torch.no_grad():
        m, s = rec.summary(x, cu_seqlens=layout)
    dh0 = rec.initial_state_grad(x, do.to(vals[2].dtype), cu_seqlens=layout)
    return dict(zip(("o", "final_state", "dq", "dk", "dx", "dg", "dscale", "dskip", "dh0", "M", "S",
                     "initial_state_grad"), (o, ht, *grads, m, s, dh0)))


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("N,G", [(128, 1), (128, 2), (256, 1), (256, 2)], ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", list(TOLS), ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_triton_vs_eager_fp64(packed, dtype, N, G, gate):
    from deltacp.ops.gdn.varlen import VarlenLayout
    from deltacp.ops.ssd.eager import ScalarDecay
    from deltacp.ops.ssd.triton import TritonScalarDecay

    rec = TritonScalarDecay()
    B = 1 if packed else 2
    vals = make_inputs(B, G, N, gate, dtype, seed=N + G)
    rec.check(RecurrenceInputs(*vals[:6]))
    layout = VarlenLayout.build(cu_of(doc_lengths(T, 900, 1.0, seed=3)), T) if packed else None
    gen = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(B, T, H, P, device="cuda", generator=gen, dtype=torch.float64)
    dht = torch.randn(B, H, N, P, device="cuda", generator=gen, dtype=torch.float64)
    got = _run(rec, vals, layout, do, dht)
    ref = _run(ScalarDecay(), [x.double() for x in vals], layout, do, dht)
    tol = TOLS[dtype]
    errs = {n: rel_l2(got[n], ref[n]) if ref[n].norm() > 0 else got[n].norm().item() for n in ref}
    print(f"{'packed' if packed else 'rows'} {dtype} N={N} G={G} {gate}: "
          + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    assert got["o"].dtype == dtype and got["final_state"].dtype == torch.float32
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"above {tol:.0e}: {bad}"
