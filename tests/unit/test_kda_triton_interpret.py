"""CPU (TRITON_INTERPRET=1) tests of the Triton KDA (`deltacp.ops.kda.triton`, Kimi delta attention) against the
eager one (`ops/kda/eager.py`: `chunk_kda` and autograd through it, `summary_kda`, `initial_state_grad`) in float64
on the same values. Need triton (test.sh installs it).

One subprocess (the interpreter must be on before triton loads; the rest of the suite runs compiled Triton) runs
every case through `TritonKimiDeltaRule` (q/k l2-normalised inside, the default scale) and prints one figure per
quantity; the tests below read them. Head dims K = 16, V = 16 / 32 are inside the contract (HEAD_DIMS), no bypass.
  - cases (each with an entering state): B=2, T=100, H=2, K=V=16, fast gates; B=1, T=130, H=2, K=16, V=32, slow
    gates and the same shape near-frozen (fp64 only), and very fast; one packed row of three documents (57, 1, 72
    tokens: a length-1 document, documents not aligned to 64) with fast gates, the first continuing the entering
    state and not; K = V = 128 at T = 100 (Kimi-Linear's head: several K and V blocks per kernel, the state in two
    row blocks), fp64;
  - gates per token and key channel: fast g ~ -U(0, 5) (down to -5: products over 64 tokens reach e^-300, the
    regime where splitting e^{gam_i - gam_j} would overflow), very fast g ~ -U(0, 50) (Kimi-Linear's gate is
    unbounded below: in-chunk log decays to -3200, every factor through a sub-chunk reference e^{-50} to e^{-800}),
    slow g ~ -U(0, 0.05), near-frozen g ~ -U(0, 1e-4);
  - per case: o and the final state, the gradients of q, k, v, g, beta and the entering state (autograd through the
    kernels' Function vs autograd of the eager op), the summary (M, S), `initial_state_grad`;
  - dtypes: float64 (the kernels compute in fp64: bound 1e-10, figures ~1e-15) and float32 (fp32 kernels vs eager
    fp64 on the same values: bound 1e-5; 1e-4 under very fast gates, where the fp32 cumsum of g, |gam| up to 3200,
    rounds each log decay by ~1e-4: figures ~1e-5).
  - the kernels' module switches (SAVE_STATES, DECAYED, INVERSE, WY_SPLIT) each against the source's settings, fp64;
    STATE16 (h, dh, and at 2 vn and dvn too, stored as scaled fp16) under bf16 inputs: each stored block against the
    fp32 the same kernel stores, and the op at 1 and 2 against 0.
Every figure finite (a nan or inf fails every bound). Two processes side by side (the fp64 cases; the fp32 ones,
K = V = 128 and the switches): about 30 s on 2 cores.
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
                                                         "the Triton KDA kernels run only where triton is (CI "
                                                         "installs none)")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # recurrence_checks, for the subprocess
BOUNDS = {"float64": 1e-10, "float32": 1e-5}
VERYFAST_FP32_BOUND = 1e-4  # the fp32 cumsum of g under g down to -50 (module docstring)

_CODE = f"import sys; sys.path.insert(0, {TESTS!r})\n" + r"""
import os, torch
import triton_interpreter
triton_interpreter.patch()  # tests/triton_interpreter.py
from recurrence_checks import compare_case
from deltacp.ops.gdn.varlen import VarlenLayout
from deltacp.ops.kda.eager import KimiDeltaRule
from deltacp.ops.kda.triton import TritonKimiDeltaRule
from deltacp.ops.recurrence import RecurrenceInputs

tri, ref = TritonKimiDeltaRule(), KimiDeltaRule()
GATES = {"fast": 5.0, "veryfast": 50.0, "slow": 0.05, "frozen": 1e-4}

def inputs(B, T, H, K, V, gate, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, T, H, K, generator=gen, dtype=torch.float64) * GATES[gate]
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), g, beta, r(B, H, K, V)

def case(name, dtype, B, T, H, K, V, gate, seed, cu=None, first_continues=True):
    lay = None if cu is None else VarlenLayout.build(torch.tensor(cu), T, first_continues=first_continues)
    compare_case(name, dtype, tri, ref, inputs(B, T, H, K, V, gate, seed), ("dq", "dk", "dv", "dg", "dbeta", "dh0"),
                 seed + 1, lay)

for dtype in ((torch.float64,), (torch.float32,))[PART]:  # two processes side by side (interpreter_figures)
    case("T100_fast", dtype, 2, 100, 2, 16, 16, "fast", 0)
    if dtype == torch.float64:  # the slow regimes' fp32 figures add nothing the fast ones do not show
        case("T130_slow", dtype, 1, 130, 2, 16, 32, "slow", 1)
        case("T130_frozen", dtype, 1, 130, 2, 16, 32, "frozen", 2)
    case("T130_veryfast", dtype, 1, 130, 2, 16, 32, "veryfast", 7)
    case("packed3", dtype, 1, 130, 2, 16, 32, "fast", 3, cu=[0, 57, 58, 130])
    case("packed3_fresh", dtype, 1, 130, 2, 16, 32, "fast", 4, cu=[0, 57, 58, 130], first_continues=False)
if PART == 0:  # the summary is forward only
    q, k, v, g, beta, h0 = (t.float() for t in inputs(1, 70, 2, 16, 16, "slow", 5))
    try:
        tri.summary(RecurrenceInputs(q, k.requires_grad_(), v, g, beta))
        print("SUMMARY_GRAD no error")
    except RuntimeError as e:
        print("SUMMARY_GRAD", "no backward" in str(e))
    # STATE16 (bf16 inputs, K = 16, V = 128: four column blocks of the state kernels' 32, out_fwd's blocks of 64
    # reading two): v's and the entering state's column blocks scaled 1e5 (h past fp16's 65504), 1, 1e-6 and 0;
    # dO's ten times those (dh past it too). Each stored h, vn, dh and dvn block against the fp32 one from the same
    # kernel, and the op's outputs and gradients with STATE16 1 and 2 against 0.
    from deltacp.ops.kda.triton import chunk, kernels
    blocks = torch.tensor([1e5, 1.0, 1e-6, 0.0], dtype=torch.float64).repeat_interleave(32)
    q, k, v, g, beta, h0 = inputs(1, 130, 2, 16, 128, "slow", 9)
    v, h0 = v * blocks, h0 * blocks
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64) * blocks * 10
    q, k, v, do = (x.to(torch.bfloat16) for x in (q, k, v, do))
    g, beta, h0 = g.float(), beta.float(), h0.float()
    def block_max(t, E):  # [B, NT, H, V / E]: each stored block's largest |entry|
        t = t.abs()
        if t.dim() == 4:  # a chunk's rows of vn / dvn: [B, Tp, H, V] -> [B, NT, H, 64, V]
            t = t.unflatten(1, (-1, 64)).transpose(2, 3)
        return t.unflatten(-1, (-1, E)).amax(dim=(-3, -1))
    def stored_figures(name, plain, scaled):
        E = scaled.block
        top = block_max(plain.values, E)
        err = block_max(scaled.dense() - plain.values, E)
        nz = top > 0
        print("FIG %s bfloat16 err_over_bound %r" % (name, (err[nz] / (2.0 ** -11 * top[nz])).max().item()))
        off = (scaled.exps[nz] - torch.floor(torch.log2(top[nz]))).abs().max().item()
        print("FIG %s bfloat16 exps_off %r" % (name, off))
        print("FIG %s bfloat16 zero_blocks %r" % (name, err[~nz].max().item() if (~nz).any() else -1.0))
        print("FIG %s bfloat16 over_65504 %r" % (name, top.max().item() / 65504))
    with torch.no_grad():
        ql, kl, vl, gam, bl = chunk._inputs(q, k, v, g, beta, None, True, None, 130)
        (dol,) = chunk._laid_out(None, 130, do)
        tm, p, w, u, kt, qg = kernels.wy_fwd(ql, kl, vl, gam, bl, chunk.operand_dtype(vl, gam, True))
        plain, scaled = (kernels.state_fwd(w, u, kl, gam, kt, h0, inputs=vl.dtype, scaled=s) for s in (0, 2))
        stored_figures("state16_h", plain[0], scaled[0])
        stored_figures("state16_vn", plain[1], scaled[1])
        dvl = kernels.dv_local(ql, p, dol, vl.dtype)
        plain, scaled = (kernels.state_bwd(ql, kl, gam, kt, qg, w, dol, dvl, None, inputs=vl.dtype, scaled=s)
                         for s in (0, 2))
        stored_figures("state16_dh", plain[0], scaled[0])
        stored_figures("state16_dvn", plain[1], scaled[1])
    def op_run(state16):
        kernels.STATE16, before = state16, kernels.STATE16
        try:
            leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
            o, ht = chunk.chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
            return [o, ht, *torch.autograd.grad((o.float() * do.float()).sum() + ht.sum(), leaves)]
        finally:
            kernels.STATE16 = before
    plain = op_run(0)
    for level in (1, 2):
        print("FIG STATE16_%d bfloat16 max_rel_l2 %r" % (level, max(
            ((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(op_run(level), plain))))
else:  # the heavier K = 128 case, and the switches, beside the fp64 cases (the two parts about even)
    case("T100_K128_fast", torch.float64, 1, 100, 1, 128, 128, "fast", 6)
    # the kernels' switches against the source's settings: SAVE_STATES 1 (h and vn kept from the forward, not
    # recomputed), DECAYED 0 / 1 (the decayed operands formed in each kernel or stored by wy_fwd: the same
    # arithmetic) and WY_SPLIT 0 (W and U in wy_fwd, from Tm held in registers) bitwise; INVERSE 0 / 1 (the
    # forward substitution's product widths: other summation orders) to rounding. Everything: o, the final state,
    # every gradient, the summary (M, S) and initial_state_grad.
    from deltacp.ops.kda.triton import chunk, kernels
    xs = inputs(1, 130, 2, 16, 32, "fast", 8)
    def run_with(**switches):
        before = {n: getattr(kernels, n) for n in switches}
        for n, v in switches.items():
            setattr(kernels, n, v)
        try:
            leaves = [x.clone().requires_grad_() for x in xs]
            o, ht = chunk.chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
            grads = torch.autograd.grad((o * torch.cos(o)).sum() + ht.sum(), leaves)
            m, s = chunk.summary_kda(*xs[1:5], use_qk_l2norm_in_kernel=True)
            dh0 = chunk.initial_state_grad(*xs[:5], torch.cos(o.detach()), use_qk_l2norm_in_kernel=True)
            return [o, ht, *grads, m, s, dh0]
        finally:
            for n, v in before.items():
                setattr(kernels, n, v)
    source = run_with()
    def diff(run):
        return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(run, source))
    for name, value in (("SAVE_STATES", 1), ("DECAYED", 0), ("DECAYED", 1), ("INVERSE", 0), ("INVERSE", 1),
                        ("WY_SPLIT", 0)):
        print("FIG %s_%d float64 max_rel_diff %r" % (name, value, diff(run_with(**{name: value}))))
print("DONE")
"""


@pytest.fixture(scope="module")
def figures():
    from helpers import interpreter_figures

    return interpreter_figures(_CODE, parts=2)


CASES = ("T100_fast", "T130_slow", "T130_frozen", "T130_veryfast", "packed3", "packed3_fresh")
PARTS = {"forward": ("o", "final_state"),
         "gradients": ("dq", "dk", "dv", "dg", "dbeta", "dh0"),
         "summary_and_initial_state_grad": ("summary_M", "summary_S", "initial_state_grad")}


@needs_triton
@pytest.mark.parametrize("part", list(PARTS))
@pytest.mark.parametrize("case,dtype", [(c, d) for c in CASES for d in BOUNDS
                                        if d == "float64" or c not in ("T130_slow", "T130_frozen")])
def test_vs_eager_fp64(figures, case, dtype, part):
    """The part's figures (forward; gradients by autograd; the contract's summary and dh0 from the outputs)."""
    bound = VERYFAST_FP32_BOUND if (case, dtype) == ("T130_veryfast", "float32") else BOUNDS[dtype]
    bad = {n: figures[(case, dtype, n)] for n in PARTS[part] if not figures[(case, dtype, n)] <= bound}
    assert not bad, f"{case} {dtype}: above {bound:.0e}: {bad}"


@needs_triton
@pytest.mark.parametrize("part", list(PARTS))
def test_kimi_linear_head_dims(figures, part):
    """K = V = 128: several K and V blocks in every kernel, the state kernels' two row blocks."""
    bad = {n: figures[("T100_K128_fast", "float64", n)] for n in PARTS[part]
           if not figures[("T100_K128_fast", "float64", n)] <= BOUNDS["float64"]}
    assert not bad, f"above 1e-10: {bad}"


@needs_triton
def test_fresh_first_document_ignores_the_entering_state(figures):
    """first_continues=False: the entering state reaches nothing (gradients exactly 0), M = 0."""
    for dtype in BOUNDS:
        assert figures[("packed3_fresh", dtype, "dh0")] == 0.0
        assert figures[("packed3_fresh", dtype, "initial_state_grad")] == 0.0
        assert figures[("packed3", dtype, "summary_M")] == 0.0  # a document starts inside the row


@needs_triton
@pytest.mark.parametrize("switch", ["SAVE_STATES_1", "DECAYED_0", "DECAYED_1", "INVERSE_0", "INVERSE_1", "WY_SPLIT_0"])
def test_kernel_switches_against_the_source(figures, switch):
    """Each of the kernels' module switches against the source's settings (o, the final state, every gradient, the
    summary, initial_state_grad; fp64): SAVE_STATES 1 (h and vn kept from the forward instead of recomputed), DECAYED
    (the decayed operands formed in each kernel or stored by wy_fwd) and WY_SPLIT 0 (W, U, Kt, Qg in wy_fwd from Tm
    in registers, not in their own kernel from the stored Tm) bitwise; INVERSE (the forward
    substitution's product widths) to fp64 rounding."""
    bound = 1e-13 if switch.startswith("INVERSE") else 0.0
    assert figures[(switch, "float64", "max_rel_diff")] <= bound


@needs_triton
@pytest.mark.parametrize("stored", ["state16_h", "state16_vn", "state16_dh", "state16_dvn"])
def test_scaled_fp16_states(figures, stored):
    """STATE16: h and vn (state_fwd), dh and dvn (state_bwd) as scaled fp16 against the fp32 the same kernel stores:
    each block's ([K, 32] of a state, [64, 32] of a chunk's rows) exponent that of its largest |entry|, every entry
    within 2^-11 of it (fp16 rounds to nearest at 11 bits; the scaled block's largest entry is in [2^14, 2^15)), a
    zero block 0, and blocks past fp16's 65504 (1e5-scaled values) stored without overflow."""
    assert figures[(stored, "bfloat16", "exps_off")] == 0.0
    assert figures[(stored, "bfloat16", "err_over_bound")] <= 1.0
    assert figures[(stored, "bfloat16", "zero_blocks")] == 0.0
    assert figures[(stored, "bfloat16", "over_65504")] > 1.0  # the case reaches past fp16's range


@needs_triton
@pytest.mark.parametrize("level", [1, 2])
def test_scaled_fp16_states_in_the_op(figures, level):
    """STATE16 1 (h, dh) and 2 (vn, dvn too) against 0 under bf16 inputs: the output, the final state and every
    gradient within rel-L2 2^-8 + 2^-11: each side rounded to bf16 (2^-9 relative at most, the two apart by up to
    twice that where the rounding flips), around a difference of at most 2^-11 relative from the fp16 blocks (2^-11
    of a block's largest entry)."""
    assert figures[(f"STATE16_{level}", "bfloat16", "max_rel_l2")] <= 2.0 ** -8 + 2.0 ** -11


@needs_triton
def test_summary_refuses_to_be_differentiated(figures):
    assert figures["summary_grad"] == "True"


# The contract check: no kernel, no triton needed.

def _x(B=1, T=8, H=2, K=16, V=16, dtype=torch.bfloat16, g_dtype=torch.float32):
    from deltacp.ops.recurrence import RecurrenceInputs

    return RecurrenceInputs(torch.zeros(B, T, H, K, dtype=dtype), torch.zeros(B, T, H, K, dtype=dtype),
                            torch.zeros(B, T, H, V, dtype=dtype), torch.zeros(B, T, H, K, dtype=g_dtype),
                            torch.zeros(B, T, H, dtype=g_dtype))


@needs_triton
@pytest.mark.fast
def test_launch_entries_by_input_dtype(monkeypatch):
    """kernels._launch: fp32 / fp64 inputs take a "<name>/fp32" entry where there is one, 16-bit inputs (and callers
    that name no dtype) the plain one; blocks clipped to the head dims."""
    from deltacp.ops.kda.triton import kernels

    monkeypatch.setitem(kernels.LAUNCH, "bwd_intra", dict(num_warps=4, num_stages=2, BK=64))
    monkeypatch.setitem(kernels.LAUNCH, "bwd_intra/fp32", dict(num_warps=8, num_stages=1, BK=16))
    assert kernels._launch("bwd_intra", 128, 128, torch.bfloat16) == dict(num_warps=4, num_stages=2, BK=64)
    assert kernels._launch("bwd_intra", 32, 128, torch.bfloat16)["BK"] == 32  # clipped to K
    assert kernels._launch("bwd_intra", 128, 128) == dict(num_warps=4, num_stages=2, BK=64)
    for wide in (torch.float32, torch.float64):
        assert kernels._launch("bwd_intra", 128, 128, wide) == dict(num_warps=8, num_stages=1, BK=16)
    monkeypatch.delitem(kernels.LAUNCH, "bwd_intra/fp32")
    assert kernels._launch("bwd_intra", 128, 128, torch.float32)["BK"] == 64


@needs_triton
@pytest.mark.fast
def test_fp16_operands_only_where_bounded(monkeypatch):
    """OPERANDS16: W, Kt, Qg in fp16 only under 16-bit inputs with q and k normalised in the op (bounded operands)
    and fp32 accumulators; the accumulator's dtype otherwise, and always with the switch off."""
    from deltacp.ops.kda.triton import chunk, kernels

    g32, g64 = torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.float64)
    monkeypatch.setattr(kernels, "OPERANDS16", 1)
    for dtype in (torch.bfloat16, torch.float16):
        assert chunk.operand_dtype(torch.zeros(1, dtype=dtype), g32, True) == torch.float16
        assert chunk.operand_dtype(torch.zeros(1, dtype=dtype), g32, False) == torch.float32  # unnormalised
    assert chunk.operand_dtype(torch.zeros(1), g32, True) == torch.float32
    assert chunk.operand_dtype(torch.zeros(1, dtype=torch.float64), g64, True) == torch.float64
    monkeypatch.setattr(kernels, "OPERANDS16", 0)
    assert chunk.operand_dtype(torch.zeros(1, dtype=torch.bfloat16), g32, True) == torch.float32


@pytest.mark.fast
def test_check_refuses_outside_the_contract(monkeypatch):
    from deltacp.ops.kda.eager import KimiDeltaRule
    from deltacp.ops.kda.triton import TritonKimiDeltaRule
    from deltacp.ops.recurrence import RecurrenceInputs

    rec = TritonKimiDeltaRule()
    assert rec.name == "triton" and rec.transition.kind == "full" and rec.prepare(_x()) is None
    assert {m for m in dir(KimiDeltaRule) if not m.startswith("_")} <= set(dir(rec))
    assert rec.state_shape(_x(B=3, K=32, V=64)) == (3, 2, 32, 64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA tensors; got q on device 'cpu'"):
        rec.check(_x())
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check, to reach the others
    rec.check(_x())
    for x, match in ((_x(K=48), r"key head dim K in \(16, 32, 64, 128\); got K=48"),
                     (_x(V=256), r"value head dim V in \(16, 32, 64, 128\); got V=256"),
                     (_x(dtype=torch.float64), r"q.dtype in .*bfloat16.*; got torch.float64"),
                     (_x(g_dtype=torch.int32), "floating-point inputs"),
                     (_x(g_dtype=torch.float64), r"g.dtype in .*float32.*; got torch.float64")):
        with pytest.raises(ValueError, match=match):
            rec.check(x)
    q, k, v, g, beta = _x().tensors
    with pytest.raises(ValueError, match="one dtype"):
        rec.check(RecurrenceInputs(q, k, v.float(), g, beta))
    with pytest.raises(ValueError, match=r"\(q, k, v, g, beta\)"):
        rec.check(RecurrenceInputs(q, k, v, g))
    with pytest.raises(TypeError, match="stages nothing"):
        rec.prepared_from_saved(())
    with pytest.raises(TypeError, match="no prepared chunks"):
        rec.forward(_x(), prepared=object())


def test_importing_the_backend_imports_no_triton():
    code = ("import sys, deltacp.ops.kda, deltacp.ops.kda.triton as t; t.TritonKimiDeltaRule(); "
            "assert 'triton' not in sys.modules, 'triton imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
