"""CPU (TRITON_INTERPRET=1) tests of the Triton scalar-decay recurrence (`deltacp.ops.ssd.triton`, Mamba2's SSD)
against the eager one (`ops/ssd/eager.py`) in float64 on the same values. Need triton (test.sh installs it).

One subprocess (the interpreter must be on before triton loads; the rest of the suite runs compiled Triton) runs
every case through `TritonScalarDecay` and prints one figure per quantity; the tests below read them:
  - shapes: B=2, T=100, G=1, H=4, N=16, P=16 and B=2, T=130, G=2, H=4, N=16, P=32 (partial last chunks, grouped
    q/k), with an entering state, the value scale (Mamba2's dt) and the skip weight (Mamba2's D, per token here)
    (the first case's q, k, x as non-contiguous views; the second without the skip); one packed row of three
    documents (57, 1, 72 tokens: a length-1 document, documents not aligned to 64), the first continuing the
    entering state and not; B=1, T=100, G=2, H=6, N=P=32, every kernel's blocks cut to 16 (LAUNCH): the score
    gradient and dq, dk summed over three heads per group, dq, dk in two N blocks (dgam in three parts: the in-chunk
    one and one per N block, summed), q kᵀ, o and dx in two N and P blocks (dscale and dskip summed over them), each
    head in its own out_fwd and chunk_dx program (GROUP_HEADS = 1: the score gradient in three parts, summed by
    chunk_dqk);
    B=1, T=100, G=1, H=2, N=P=16 with neither scale nor skip (v = x);
  - per case: o and the final state, the gradients of q, k, x, g, scale, skip and the entering state (by autograd
    through the kernels' Function vs autograd of the eager op), the summary (M, S), the entering state's gradient
    from the outputs alone (`initial_state_grad`);
  - dtypes: float64 inputs (the kernels accumulate and multiply in fp64: bound 1e-10, the figures are ~1e-15) and
    float32 (fp32 accumulation; the interpreter's fp32 products: bound 1e-5, figures <= 3e-6, the largest M = exp of a
    sum of ~100 fp32 gates, and dg; fp32's unit roundoff is 6e-8 and a chunk sums 64 products).
The gates are Mamba2's, g = dt A with dt = softplus(randn), A = -exp(U(-1, 1)) per head (fast decay: the state keeps
a few chunks' worth), on rows long enough to cross chunks.
About 25 s on 2 cores (one interpreter run of every kernel per case).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the TRITON_INTERPRET=1 tests of "
                                                         "the Triton scalar-decay kernels run only where triton is "
                                                         "(test.sh installs it)")

BOUNDS = {"float64": 1e-10, "float32": 1e-5}
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # recurrence_checks, for the subprocess

_CODE = f"import sys; sys.path.insert(0, {TESTS!r})\n" + r"""
import torch, torch.nn.functional as F
import triton_interpreter
triton_interpreter.patch()  # tests/triton_interpreter.py
from recurrence_checks import compare_case
from deltacp.ops.gdn.varlen import VarlenLayout
from deltacp.ops.recurrence import RecurrenceInputs
from deltacp.ops.ssd.eager import ScalarDecay
from deltacp.ops.ssd.triton import TritonScalarDecay
from deltacp.ops.ssd.triton import kernels
from deltacp.ops.ssd.triton.kernels import LAUNCH

tri, ref = TritonScalarDecay(), ScalarDecay()

def inputs(B, T, G, H, N, P, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    A = -torch.empty(H, dtype=torch.float64).uniform_(-1, 1, generator=gen).exp()
    dt = F.softplus(r(B, T, H))
    return r(B, T, G, N), r(B, T, G, N), r(B, T, H, P), dt * A, dt, r(B, T, H), r(B, H, N, P)

def case(name, dtype, B, T, G, H, N, P, seed, cu=None, first_continues=True, strided=False, scale=True, skip=True):
    lay = None if cu is None else VarlenLayout.build(torch.tensor(cu), T, first_continues=first_continues)
    vals = list(inputs(B, T, G, H, N, P, seed))
    vals[4] = vals[4] if scale else None
    vals[5] = vals[5] if skip else None
    compare_case(name, dtype, tri, ref, vals, ("dq", "dk", "dx", "dg", "dscale", "dskip", "dh0"), seed + 1, lay,
                 strided)

for dtype in (torch.float64, torch.float32):
    case("T100_G1_P16", dtype, 2, 100, 1, 4, 16, 16, 0, strided=True)
    case("T130_G2_P32_noskip", dtype, 2, 130, 2, 4, 16, 32, 1, skip=False)
    case("packed3", dtype, 1, 130, 2, 4, 16, 32, 2, cu=[0, 57, 58, 130])
    case("packed3_fresh", dtype, 1, 130, 2, 4, 16, 32, 3, cu=[0, 57, 58, 130], first_continues=False)
    # blocks of 16 over N = P = 32: dq, dk and dgam in two N blocks (dgam's parts summed), o and dx in two P blocks
    # (dscale and dskip summed over them), q kᵀ and k dh in two N steps
    saved = {n: dict(c) for n, c in LAUNCH.items()}
    for c in LAUNCH.values():
        c.update(BN=16, BP=16)
    kernels.GROUP_HEADS = 1  # each of a group's three heads in its own program: dS in three parts, summed
    case("blocks16", dtype, 1, 100, 2, 6, 32, 32, 5)
    LAUNCH.update(saved)
    kernels.GROUP_HEADS = 16
    case("plain", dtype, 1, 100, 1, 2, 16, 16, 6, scale=False, skip=False)

# the summary is forward only
q, k, x, g, scale, skip, h0 = (t.float() for t in inputs(1, 70, 1, 2, 16, 16, 4))
try:
    tri.summary(RecurrenceInputs(q, k, x, g, scale.requires_grad_(), skip))
    print("SUMMARY_GRAD no error")
except RuntimeError as e:
    print("SUMMARY_GRAD", "no backward" in str(e))
print("DONE")
"""


@pytest.fixture(scope="module")
def figures():
    from helpers import interpreter_figures

    return interpreter_figures(_CODE)


CASES = ("T100_G1_P16", "T130_G2_P32_noskip", "packed3", "packed3_fresh", "blocks16", "plain")
PARTS = {"forward": ("o", "final_state"),
         "gradients": ("dq", "dk", "dx", "dg", "dscale", "dskip", "dh0"),
         "summary_and_initial_state_grad": ("summary_M", "summary_S", "initial_state_grad")}


@needs_triton
@pytest.mark.parametrize("part", list(PARTS))
@pytest.mark.parametrize("dtype", list(BOUNDS))
@pytest.mark.parametrize("case", CASES)
def test_vs_eager_fp64(figures, case, dtype, part):
    """The part's figures (forward; gradients by autograd; the contract's summary and dh0 from the outputs)."""
    absent = {"T130_G2_P32_noskip": ("dskip",), "plain": ("dscale", "dskip")}.get(case, ())
    names = [n for n in PARTS[part] if n not in absent]
    assert all((case, dtype, n) in figures for n in names), f"{case} {dtype}: a figure is missing"
    bad = {n: figures[(case, dtype, n)] for n in names if not figures[(case, dtype, n)] <= BOUNDS[dtype]}
    assert not bad, f"{case} {dtype}: above {BOUNDS[dtype]:.0e}: {bad}"


@needs_triton
def test_fresh_first_document_ignores_the_entering_state(figures):
    """first_continues=False: the entering state reaches nothing (gradients exactly 0), M = 0."""
    for dtype in BOUNDS:
        assert figures[("packed3_fresh", dtype, "dh0")] == 0.0
        assert figures[("packed3_fresh", dtype, "initial_state_grad")] == 0.0
        assert figures[("packed3", dtype, "summary_M")] == 0.0  # a document starts inside the row


@needs_triton
def test_summary_refuses_to_be_differentiated(figures):
    assert figures["summary_grad"] == "True"


@needs_triton
@pytest.mark.fast
def test_launch_entries_by_dtype_and_state_size(monkeypatch):
    """kernels._config: an "/fp32" entry for fp32 / fp64 inputs, a "/n<N>" entry for 16-bit inputs of that state
    size, else the plain entry; blocks clipped to N and P (what `launch_sweep.py --shape` proposes for another state size)."""
    from deltacp.ops.ssd.triton import kernels

    monkeypatch.setitem(kernels.LAUNCH, "chunk_dx/n256", dict(BN=64, BP=16, num_warps=4, num_stages=3))
    bf16, fp32 = torch.bfloat16, torch.float32
    plain, wide = kernels.LAUNCH["chunk_dx"], kernels.LAUNCH["chunk_dx/fp32"]
    assert kernels._config("chunk_dx", 256, 64, bf16) == (dict(BN=64, BP=16), dict(num_warps=4, num_stages=3))
    assert kernels._config("chunk_dx", 128, 64, bf16) == (
        dict(BN=plain["BN"], BP=plain["BP"]), dict(num_warps=plain["num_warps"], num_stages=plain["num_stages"]))
    assert kernels._config("chunk_dx", 256, 64, fp32)[1] == dict(num_warps=wide["num_warps"],
                                                                 num_stages=wide["num_stages"])
    assert kernels._config("chunk_dx", 256, 8, bf16)[0] == dict(BN=64, BP=8)  # clipped to P
    monkeypatch.delitem(kernels.LAUNCH, "state_fwd/n256", raising=False)
    assert kernels._config("state_fwd", 256, 64, bf16)[0]["BN"] == kernels.LAUNCH["state_fwd"]["BN"]  # no n256 entry
    # an n<N> entry is swept under 16-bit inputs: fp32 inputs without an /fp32 entry take the plain one
    monkeypatch.setitem(kernels.LAUNCH, "state_bwd/n256", dict(BN=16, BP=16, num_warps=2, num_stages=1))
    plain = kernels.LAUNCH["state_bwd"]
    assert kernels._config("state_bwd", 256, 64, fp32) == (
        dict(BN=plain["BN"], BP=plain["BP"]), dict(num_warps=plain["num_warps"], num_stages=plain["num_stages"]))
    assert kernels._config("state_bwd", 256, 64, bf16)[1] == dict(num_warps=2, num_stages=1)


# The contract check: no kernel, no triton needed.

def _x(B=1, T=8, G=1, H=2, N=16, P=16, dtype=torch.bfloat16, g_dtype=torch.float32):
    from deltacp.ops.recurrence import RecurrenceInputs

    return RecurrenceInputs(torch.zeros(B, T, G, N, dtype=dtype), torch.zeros(B, T, G, N, dtype=dtype),
                            torch.zeros(B, T, H, P, dtype=dtype), torch.zeros(B, T, H, dtype=g_dtype),
                            torch.zeros(B, T, H, dtype=g_dtype), torch.zeros(B, T, H))


@pytest.mark.fast
def test_check_refuses_outside_the_contract(monkeypatch):
    from deltacp.ops.ssd.triton import TritonScalarDecay

    rec = TritonScalarDecay()
    assert rec.name == "triton" and rec.transition.kind == "scalar" and rec.prepare(_x()) is None
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA tensors; got q on device 'cpu'"):
        rec.check(_x())
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check, to reach the others
    rec.check(_x())
    for x, match in ((_x(N=48), r"state size N in \(16, 32, 64, 128, 256\); got N=48"),
                     (_x(P=256), r"head dim P in \(16, 32, 64, 128\); got P=256"),
                     (_x(dtype=torch.float64), r"q.dtype in .*bfloat16.*; got torch.float64"),
                     (_x(g_dtype=torch.int32), r"g.dtype in .*float32.*; got torch.int32"),
                     (_x(H=3, G=2), "multiple of the groups")):
        with pytest.raises(ValueError, match=match):
            rec.check(x)
    q, k, x, g, scale, skip = _x().tensors
    from deltacp.ops.recurrence import RecurrenceInputs

    with pytest.raises(ValueError, match="one dtype"):
        rec.check(RecurrenceInputs(q, k, x.float(), g, None, None))
    with pytest.raises(ValueError, match="skip must be shaped as g"):
        rec.check(RecurrenceInputs(q, k, x, g, scale, x))
    with pytest.raises(ValueError, match=r"scale.dtype in .*float32.*; got torch.int32"):
        rec.check(RecurrenceInputs(q, k, x, g, scale.int(), skip))
    with pytest.raises(ValueError, match="six inputs"):
        rec.check(RecurrenceInputs(q, k, x, g, skip))
    with pytest.raises(TypeError, match="stages nothing"):
        rec.prepared_from_saved(())


def test_importing_the_backend_imports_no_triton():
    code = ("import sys, deltacp.ops.ssd, deltacp.ops.ssd.triton as t; t.TritonScalarDecay(); "
            "assert 'triton' not in sys.modules, 'triton imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
