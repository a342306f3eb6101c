"""CPU (TRITON_INTERPRET=1) tests of the Triton GDN backend at the head dims of its contract other than 128
(`contract_check.HEAD_DIMS`), K != V included, against the eager backend in float64 on the same values; and of the
fused glue (conv + q/k/v split by heads, gated RMSNorm) at those dims. Need triton (test.sh installs it).

Per (K, V) pair, one subprocess, shape as the first-use self-check's (`selfcheck.measure_shape`: B=1, T=80, Hk=1,
Hv=2; one sequence, and one packed row of documents 37, 1, 42): every operation - chunk_gated_delta_rule fwd+bwd
with an entering state, the final state and the q/k l2 norm (o, final state, dq, dk, dv, dg, dbeta, dh0),
initial_state_grad, state_summary (M, S) - and p2p's staged path (prepare_chunks / prepared_from_saved):
  - float32 inputs holding the bf16 values (the kernels then compute in fp32 end to end), one sequence and the
    packed row: rel-L2 <= FP32_BOUND = 1e-5 (fp32 has 2^-24 ~ 6e-8 unit roundoff; the interpreter's fp32 chain at
    K = V = 32 stays below 1e-5, tests/unit/test_triton_contract.py), M of the packed row exactly 0. A column that
    escaped its mask shows here: an unmasked load past a head dim of 96 reads the next head's values.
  - bf16 inputs (the production dtypes, so the bf16 hi/lo split products of wu_fwd and wy_bwd run), one sequence
    (but at (96, 192), a shape of the first-use self-check: its figures there, the same inputs and bounds and more
    cases, are test_triton_selfcheck.py's):
    within the self-check's bounds (BOUND_BF16 = 3e-2 for what passes through bf16; bf16 has 2^-9 ~
    2e-3 unit roundoff and the op rounds q, k, W, U, Vn and the per-chunk state to bf16: about 1.6e-2 measured;
    BOUND_FP32 = 3e-3 for M, an fp32 recurrence). The packed row and p2p's staged path in bf16 at K = 96, V = 192
    are the self-check's own (tests/unit/test_triton_selfcheck.py).
Pairs: (64, 64), (96, 192) (OLMo-Hybrid), (128, 256), (192, 96), (256, 256); about 15-40 s each here, run as many at
a time as the machine has cores.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the TRITON_INTERPRET=1 head-dim "
                                                         "tests run only where triton is (test.sh installs it)")

PAIRS = [(64, 64), (96, 192), (128, 256), (192, 96), (256, 256)]
FP32_BOUND = 1e-5

_OP_CODE = r"""
import sys, torch
sys.path.insert(0, {testdir!r})
import test_triton_contract as t
import os; sys.path.insert(0, os.path.dirname({testdir!r}))
import triton_interpreter
triton_interpreter.patch()  # the bf16 dot fix and the nested-call speed-up (tests/triton_interpreter.py)
from deltacp.ops.gdn.triton import selfcheck as sc

K, V = {K}, {V}
shape = sc.SelfCheckShape(K=K, V=V)
bad = []
figs = sc.measure_shape("cpu", shape, dtype=torch.float32, staged=(False,))
for f in figs:
    bound = f.bound if f.bound == 0.0 else {fp32_bound}  # M of a packed row: bound 0 (exactly 0)
    print("fp32 %-36s %.2e (bound %.1e)" % (f.name, f.value, bound))
    if not f.value <= bound:  # NaN fails
        bad.append("fp32 %s = %.2e > bound %.1e" % (f.name, f.value, bound))
if shape not in sc.SHAPES:  # a self-check shape's bf16 figures are the self-check's (test_triton_selfcheck.py)
    figs = sc.measure_shape("cpu", shape, dtype=torch.bfloat16, cases=("unpacked",), staged=(False,))
    for f in figs:
        print("bf16 %-36s %.2e (bound %.1e)" % (f.name, f.value, f.bound))
        if not f.ok:
            bad.append("bf16 " + str(f))
    assert len(figs) == 11, len(figs)
print("FAILED: " + "; ".join(bad) if bad else "ALL OK")
"""


def _interpreter(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


@needs_triton
def test_ops_at_head_dims_vs_eager_fp64():
    """Every pair, each in its own process, as many at a time as there are cores; a failure names its pair."""
    from helpers import concurrent_runs

    testdir = os.path.dirname(os.path.abspath(__file__))
    outs = concurrent_runs({f"K{K}-V{V}": [sys.executable, "-c", _OP_CODE.format(testdir=testdir, K=K, V=V,
                                                                                   fp32_bound=FP32_BOUND)]
                            for K, V in PAIRS}, env=dict(os.environ, TRITON_INTERPRET="1"))
    bad = []
    for pair, out in outs.items():
        print(f"{pair}\n{out.stdout}")
        if out.returncode != 0 or out.stdout.strip().splitlines()[-1:] != ["ALL OK"]:
            bad.append(f"{pair}: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    assert not bad, "\n".join(bad)


_GLUE_CODE = r"""
import sys, torch
sys.path.insert(0, {testdir!r})
import test_triton_contract as t
import os; sys.path.insert(0, os.path.dirname({testdir!r}))
import triton_interpreter
triton_interpreter.patch()  # the bf16 dot fix and the nested-call speed-up (tests/triton_interpreter.py)
from deltacp.ops.gdn import eager as E
from deltacp.ops.gdn.triton import TritonGDNBackend

be = TritonGDNBackend()
torch.manual_seed(0)
for Hk, K, V, Hv in ((1, 96, 192, 2), (1, 192, 96, 1)):
    C = 2 * Hk * K + Hv * V
    x, w, left = torch.randn(2, 9, C), torch.randn(C, 4), torch.randn(2, 3, C)
    xs = [a.clone().requires_grad_() for a in (x, w, left)]
    ours = be.conv_silu_split(xs[0], xs[1], None, 1, left_BhC=xs[2], heads=(Hk, K, V))
    xr = [a.double().clone().requires_grad_() for a in (x, w, left)]
    ref = E.conv_silu_split(xr[0], xr[1], None, 1, left_BhC=xr[2], heads=(Hk, K, V))
    for a, r, s in zip(ours, ref, [(2, 9, Hk, K), (2, 9, Hk, K), (2, 9, Hv, V)]):
        assert a.shape == r.shape == s, (a.shape, r.shape, s)
        assert t._rel(a, r) < 1e-6, ("conv", K, V, t._rel(a, r))
    dys = [torch.randn(a.shape) for a in ours]
    ga = torch.autograd.grad(sum((a * d).sum() for a, d in zip(ours, dys)), xs)
    gr = torch.autograd.grad(sum((r * d.double()).sum() for r, d in zip(ref, dys)), xr)
    for n, a, r in zip(("dx", "dw", "dleft"), ga, gr):
        assert t._rel(a, r) < 1e-6, ("conv", K, V, n, t._rel(a, r))
    # the gated RMSNorm over V of each value head (rows of V, V not a power of two: masked columns)
    o, z, wt = torch.randn(2, 9, Hv, V), torch.randn(2, 9, Hv, V), torch.randn(V)
    ns = [a.clone().requires_grad_() for a in (o, z, wt)]
    y = be.gated_rms_norm(*ns, 1e-6)
    nr = [a.double().clone().requires_grad_() for a in (o, z, wt)]
    yr = E.gated_rms_norm(*nr, 1e-6)
    assert t._rel(y, yr) < 1e-6, ("norm", V, t._rel(y, yr))
    dy = torch.randn(y.shape)
    for n, a, r in zip(("dx", "dz", "dweight"), torch.autograd.grad((y * dy).sum(), ns),
                       torch.autograd.grad((yr * dy.double()).sum(), nr)):
        assert t._rel(a, r) < 1e-6, ("norm", V, n, t._rel(a, r))
    print("K=%d V=%d ok" % (K, V))
print("ALL OK")
"""


@needs_triton
def test_fused_glue_at_head_dims_vs_eager_fp64():
    """conv + SiLU + q/k/v split by heads (head_k_dim, head_v_dim) = (96, 192), (192, 96), and the
    gated RMSNorm over V of each value head, fp32 kernels vs eager fp64 (forward and every gradient): rel-L2 < 1e-6
    (both are fp32 chains of a few ops, about 1e-7 here). The gates run per head, not per head dim."""
    out = _interpreter(_GLUE_CODE.format(testdir=os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ALL OK", out.stdout
