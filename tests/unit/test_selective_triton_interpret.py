"""CPU (TRITON_INTERPRET=1) tests of the Triton selective scan (`deltacp.ops.selective.triton`, Mamba1) against the
eager one (`ops/selective/eager.py`, itself checked against transformers' `mamba_selective_scan` and a token
recurrence in tests/unit/test_selective_scan.py) in float64 on the same values. Need triton (test.sh installs it).

One subprocess per dtype (the interpreter must be on before triton loads) runs every case through
`TritonSelectiveScan` and prints one figure per quantity (`recurrence_checks.compare_case`); the tests read them.
  - blocks cut small (LAUNCH): chunks of BT = 8 tokens, BD = 8 channels per program, one channel group in chunk_bwd
    (each program loops over the two blocks, the dB, dC partials summed in place), so that T = 21 crosses two chunk
    boundaries into a partial chunk and I = 12 ends in a partial block;
  - rows: two rows, R = 2, N = 2, with an entering state, D and the gate z, A and D expanded over the rows (stride
    0, as the Mamba view passes them); packed: one row of three documents (9, 1, 11 tokens: a length-1 document,
    starts inside chunks), the first continuing the entering state, and one fresh (the entering state reaches
    nothing); one case without D and z;
  - B and C per group of channels ([rows, T, G, N], G = 2 groups of 6: Zamba's Mamba heads), rows and packed, each
    group one scan of the kernels;
  - three gate regimes: fast (A = -exp(U(0.5, 2)): decays e^-1..e^-5 a token), slow (A ~ -0.01), near-frozen
    (A = -1e-4 dt: the state barely decays);
  - per case: y and the final state, the gradients of x, dt, A, B, C, D, z and the entering state (autograd through
    the kernels' Function vs autograd of the eager op), the summary (M, S), `initial_state_grad`;
  - the launchers' layouts of B, C and A (`kernels.BC_TOKEN_MAJOR`; the other cases run the source's, chunk_bwd
    token-major): every launcher token-major (the "tm_" cases: rows, packed and grouped, float64 and float32),
    chunk_state alone, none;
  - chunk_out's and chunk_bwd's tokens in HS = 2 and 4 segments ("hs" cases, rows and packed, in both tile layouts:
    "s" [HS, J, BD], "t" [J, HS, BD]; the source's HS is 1); chunk_bwd's channels in two groups ("ng2" cases: a
    program per block, two dB, dC partials);
  - dtypes: float64, every case (the kernels compute in fp64: bound 1e-10, figures ~1e-16), and float32, rows with
    fast gates and the packed row with near-frozen ones (fp32 kernels vs eager fp64 on the same values: bound 1e-5,
    figures ~2e-7; the GPU tests run fp32 on the whole grid);
Two processes side by side, fourteen cases each.
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
                                                         "the Triton selective-scan kernels run only where triton is "
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
from deltacp.ops.selective.eager import SelectiveScan
from deltacp.ops.selective.triton import TritonSelectiveScan
from deltacp.ops.selective.triton.kernels import LAUNCH

tri, ref = TritonSelectiveScan(), SelectiveScan()
LAUNCH["chunk"]["BT"] = 8
for name in ("chunk_state", "chunk_out", "chunk_bwd"):
    LAUNCH[name]["BD"] = 8
LAUNCH["chunk_bwd"]["NG"] = 1
LAUNCH["state_pass"]["BS"] = 16
GATES = {"fast": (0.5, 2.0), "slow": (-4.7, -4.5), "frozen": None}
NAMES = ("dx", "ddt", "dA", "dB", "dC", "dD", "dz", "dh0")

def inputs(R, T, I, N, gate, seed, G=1):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    x, dt = r(R, T, I), F.softplus(r(R, T, I))
    if GATES[gate] is None:
        A = torch.full((I, N), -1e-4, dtype=torch.float64)
    else:
        A = -torch.empty(I, N, dtype=torch.float64).uniform_(*GATES[gate], generator=gen).exp()
    bc = (R, T, N) if G == 1 else (R, T, G, N)  # per group of I / G channels: Zamba's Mamba heads
    return [x, dt, A.expand(R, I, N), r(*bc), r(*bc), r(I).expand(R, I), r(R, T, I), r(R, I, N)]

def case(name, dtype, gate, R, seed, cu=None, first_continues=True, gated=True, G=1):
    lay = None if cu is None else VarlenLayout.build(torch.tensor(cu), 21, first_continues=first_continues)
    vals = inputs(R, 21, 12, 2, gate, seed, G)
    if not gated:
        vals[5] = vals[6] = None
    compare_case(name, dtype, tri, ref, vals, NAMES, seed + 1, lay)

f64, f32 = torch.float64, torch.float32
CASES = [(f"rows_{g}", f64, g, 2, 10 * i) for i, g in enumerate(GATES)]
CASES += [(f"packed_{g}", f64, g, 1, 10 * i + 1, [0, 9, 10, 21]) for i, g in enumerate(GATES)]
CASES += [("packed_fresh", f64, "fast", 1, 40, [0, 9, 10, 21], False), ("rows_plain", f64, "slow", 2, 50, None, True,
                                                                        False),
          ("rows_fast", f32, "fast", 2, 0), ("packed_frozen", f32, "frozen", 1, 21, [0, 9, 10, 21]),
          # two groups of 6 channels (each ends in a partial block of 8), one scan each
          ("rows_grouped", f64, "fast", 2, 60, None, True, True, 2),
          ("packed_grouped", f64, "slow", 1, 61, [0, 9, 10, 21], True, True, 2)]
for c in CASES[PART::2]:  # two processes side by side
    case(*c)
# the launchers' layouts of B, C and A (kernels.BC_TOKEN_MAJOR; the source: chunk_bwd token-major, its dB, dC partials
# [N, Tp]): every launcher token-major ("tm_" cases), then chunk_state alone and none
import deltacp.ops.selective.triton.kernels as K
source_layout = K.BC_TOKEN_MAJOR
K.BC_TOKEN_MAJOR = K.TOKEN_MAJOR_KERNELS
TOKEN_MAJOR = [("tm_rows_fast", f64, "fast", 2, 70), ("tm_packed_slow", f64, "slow", 1, 71, [0, 9, 10, 21]),
               ("tm_rows_grouped", f64, "frozen", 2, 72, None, True, True, 2),
               ("tm_packed_fast", f32, "fast", 1, 73, [0, 9, 10, 21])]
for c in TOKEN_MAJOR[PART::2]:
    case(*c)
K.BC_TOKEN_MAJOR = (("chunk_state",), ())[PART]
case("tm_" + ("only_chunk_state", "none")[PART], f64, "slow", 1, 74 + PART, [0, 9, 10, 21])
K.BC_TOKEN_MAJOR = source_layout
# chunk_out's and chunk_bwd's tokens in HS segments (LAUNCH[...]["HS"], 1 in the table: the chunk of 8 tokens here
# in 2 and 4 segments, the carries between them: packed rows put resets inside and across segments)
# in both tile layouts ([HS, J, BD] and [J, HS, BD]: kernels.seg_first, which the installed Triton decides)
source_seg_first = K.seg_first
for hs in (2, 4):
    LAUNCH["chunk_out"]["HS"] = LAUNCH["chunk_bwd"]["HS"] = hs
    for sf in (True, False):
        K.seg_first = lambda sf=sf: sf
        tag = f"hs{hs}{'s' if sf else 't'}"
        for c in [(f"{tag}_rows_fast", f64, "fast", 2, 80 + hs), (f"{tag}_packed_slow", f64, "slow", 1, 81 + hs,
                                                                   [0, 9, 10, 21])][PART::2]:
            case(*c)
K.seg_first = source_seg_first
LAUNCH["chunk_out"]["HS"] = LAUNCH["chunk_bwd"]["HS"] = 1
# chunk_bwd's channels in two groups (NG = 2: a program per block of 8 channels, the second partial; two dB, dC
# partials summed after the kernel), the grid `fill_groups` widens at short rows on a GPU (kernels.FILL_NG)
LAUNCH["chunk_bwd"]["NG"] = 2
for c in [("ng2_rows_fast", f64, "fast", 2, 90), ("ng2_packed_slow", f64, "slow", 1, 91, [0, 9, 10, 21])][PART::2]:
    case(*c)
LAUNCH["chunk_bwd"]["NG"] = 1
# the summary is forward only
if PART == 0:
    x, dt, A, B, C, D, z, h0 = (t.float() for t in inputs(1, 10, 12, 2, "fast", 4))
    try:
        tri.summary(RecurrenceInputs(x, dt.requires_grad_(), A, B, C, D, z))
        print("SUMMARY_GRAD no error")
    except RuntimeError as e:
        print("SUMMARY_GRAD", "no backward" in str(e))
else:
    print("SUMMARY_GRAD skipped")
print("DONE")
"""


@pytest.fixture(scope="module")
def figures():
    from helpers import interpreter_figures

    return interpreter_figures(_CODE, parts=2)


CASES = {"float64": ("rows_fast", "packed_fast", "rows_slow", "packed_slow", "rows_frozen", "packed_frozen",
                     "packed_fresh", "rows_plain", "rows_grouped", "packed_grouped", "tm_rows_fast", "tm_packed_slow",
                     "tm_rows_grouped", "tm_only_chunk_state", "tm_none",
                     *(f"hs{h}{sf}_{c}" for h in (2, 4) for sf in "st" for c in ("rows_fast", "packed_slow")),
                     "ng2_rows_fast", "ng2_packed_slow"),
         "float32": ("rows_fast", "packed_frozen", "tm_packed_fast")}
PARTS = {"forward": ("o", "final_state"),
         "gradients": ("dx", "ddt", "dA", "dB", "dC", "dD", "dz", "dh0"),
         "summary_and_initial_state_grad": ("summary_M", "summary_S", "initial_state_grad")}


@needs_triton
@pytest.mark.parametrize("part", list(PARTS))
@pytest.mark.parametrize("dtype,case", [(d, c) for d, cs in CASES.items() for c in cs])
def test_vs_eager_fp64(figures, case, dtype, part):
    """The part's figures (forward; gradients by autograd; the contract's summary and dh0 from the outputs)."""
    names = [n for n in PARTS[part] if not (case.startswith("rows_plain") and n in ("dD", "dz"))]
    assert all((case, dtype, n) in figures for n in names), f"{case} {dtype}: a figure is missing"
    bad = {n: figures[(case, dtype, n)] for n in names if not figures[(case, dtype, n)] <= BOUNDS[dtype]}
    assert not bad, f"{case} {dtype}: above {BOUNDS[dtype]:.0e}: {bad}"


@needs_triton
def test_fresh_first_document_ignores_the_entering_state(figures):
    """first_continues=False: the entering state reaches nothing (gradients exactly 0); M = 0 when a document
    starts inside the row."""
    assert figures[("packed_fresh", "float64", "dh0")] == 0.0
    assert figures[("packed_fresh", "float64", "initial_state_grad")] == 0.0
    assert figures[("packed_fast", "float64", "summary_M")] == 0.0
    assert figures[("packed_frozen", "float32", "summary_M")] == 0.0


@needs_triton
def test_summary_refuses_to_be_differentiated(figures):
    assert figures["summary_grad"] == "True"


@needs_triton
@pytest.mark.fast
def test_fill_groups_widens_chunk_bwd_to_one_wave():
    """FILL_NG: NG doubles while twice the grid fits one wave (132 SMs x 8 one-warp programs = 1,056 on an H100),
    never past the channel blocks: Falcon-Mamba-7B's 512 blocks of 16 channels, chunks of 32 tokens."""
    from deltacp.ops.selective.triton.kernels import fill_groups

    assert fill_groups(8, 512, 64, 132, 8) == 16  # 2K tokens, one row: 512 -> 1,024 programs
    assert fill_groups(8, 512, 32, 132, 8) == 32  # 1K
    assert fill_groups(8, 512, 128, 132, 8) == 8  # 4K: 1,024 programs already
    assert fill_groups(8, 512, 66, 132, 8) == 16  # twice the grid exactly one wave (1,056)
    assert fill_groups(8, 512, 64 * 4, 132, 8) == 8  # 2K tokens in four rows
    assert fill_groups(8, 16, 1, 132, 8) == 16  # capped at the channel blocks
    assert fill_groups(1, 2, 1, 132, 8) == 2


# The contract check: no kernel, no triton needed.

def _x(R=1, T=8, I=4, N=3, dtype=torch.bfloat16, gate_dtype=torch.float32):
    from deltacp.ops.recurrence import RecurrenceInputs

    return RecurrenceInputs(torch.zeros(R, T, I, dtype=dtype), torch.zeros(R, T, I, dtype=gate_dtype),
                            torch.zeros(R, I, N), torch.zeros(R, T, N, dtype=dtype), torch.zeros(R, T, N, dtype=dtype),
                            torch.zeros(R, I), torch.zeros(R, T, I, dtype=dtype))


@pytest.mark.fast
def test_check_refuses_outside_the_contract(monkeypatch):
    from deltacp.ops.recurrence import RecurrenceInputs
    from deltacp.ops.selective.triton import TritonSelectiveScan

    rec = TritonSelectiveScan()
    assert rec.name == "triton" and rec.transition.kind == "diagonal" and rec.prepare(_x()) is None
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA tensors; got x on device 'cpu'"):
        rec.check(_x())
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check, to reach the others
    rec.check(_x())
    with pytest.raises(ValueError, match=r"x.dtype in .*bfloat16.*; got torch.float64"):
        rec.check(_x(dtype=torch.float64))
    with pytest.raises(ValueError, match=r"dt.dtype in .*float32.*; got torch.int32"):
        rec.check(_x(gate_dtype=torch.int32))
    x, dt, A, B, C, D, z = _x().tensors
    with pytest.raises(ValueError, match="one dtype"):
        rec.check(RecurrenceInputs(x, dt, A, B.float(), C, D, z))
    with pytest.raises(ValueError, match="z must be shaped as x"):
        rec.check(RecurrenceInputs(x, dt, A, B, C, D, z[:, :4]))
    with pytest.raises(ValueError, match="seven inputs"):
        rec.check(RecurrenceInputs(x, dt, A, B, C, D))
    with pytest.raises(TypeError, match="stages nothing"):
        rec.prepared_from_saved(())


def test_importing_the_backend_imports_no_triton():
    code = ("import sys, deltacp.ops.selective.triton as t; t.TritonSelectiveScan(); "
            "assert 'triton' not in sys.modules, 'triton imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@needs_triton
def test_an_unknown_launcher_in_the_layout_switch_is_refused(monkeypatch):
    import deltacp.ops.selective.triton.kernels as K

    monkeypatch.setattr(K, "BC_TOKEN_MAJOR", ("chunk_bwdd",))
    with pytest.raises(ValueError, match="BC_TOKEN_MAJOR=.*chunk_bwdd.*chunk_state"):
        K._columns(torch.zeros(1, 4, 2), "chunk_bwd")


@needs_triton
def test_token_segments_that_do_not_divide_the_chunk_are_refused(monkeypatch):
    import deltacp.ops.selective.triton.kernels as K

    monkeypatch.setitem(K.LAUNCH, "chunk_bwd", dict(K.LAUNCH["chunk_bwd"], HS=3))
    with pytest.raises(ValueError, match=r"LAUNCH\['chunk_bwd'\]\['HS'\] = 3: .*power of two dividing"):
        K._opts("chunk_bwd")
