"""CPU (TRITON_INTERPRET=1) tests of the fused GDN glue kernels (`deltacp.ops.fused`: gated RMSNorm, gates)
against their eager references (`deltacp.ops.gdn.eager.gated_rms_norm`, `gdn_gates`). Need triton (CI installs
none: skip). One subprocess runs every case (the interpreter must be chosen before triton is imported).

The interpreter's fp32 -> bf16 cast truncates (and its "rtne" mode rounds half up without carrying into the
exponent); a GPU rounds to nearest even, as torch does. The subprocess replaces that cast by torch's, so that the
bf16 rounding points of the kernels can be compared bit for bit with the eager chain.

Gated RMSNorm (x, gate [..., H, V]; rows = tokens * H, counts not a multiple of the 16-row block):
  - fp32: y, dx, dgate, dweight vs eager fp32, rel-L2 < 1e-6; vs eager fp64 on the same values no worse than
    eager fp32 (x 2, + 1e-7).
  - fp64: vs eager fp64, rel-L2 < 1e-13.
  - bf16 (x, gate, weight bf16): y vs the eager bf16 chain: at most 0.1% of the elements differ, by at most 2
    bf16 ulp (same rounding points; the fp32 row sums may differ in the last bit, by their order, which can flip
    the bf16 rounding of the normalised value, 1 ulp there being up to 2 ulp of y; on this CPU none differ: the
    report prints the count; dropping a rounding point makes about 25% differ). Gradients
    vs eager fp64 on the same bf16 values: rel-L2 < 1e-2 and no worse than eager bf16's own (x 1.05), which
    rounds its intermediate gradients to bf16 (the fused kernel keeps them in fp32).
  - bf16 x/gate with an fp32 weight (weight * h then in fp32, no rounding): the same bound.
  - layouts: gate a strided slice of a wider projection (no copy: checked), head slice (token stride != H * V),
    column stride 2, leading dims that do not merge (copy path), V = 48 (masked columns), 2-D [N, V] input.
  - the backward's program loop: with at most 3 programs, dx and dgate bitwise as with one block per program;
    two identical calls give bitwise identical results.
Gates (a, b [B, T, H] slices of a projection [B, T, 20], A_log, dt_bias [H]; T * B not a multiple of the block;
a + dt_bias spans the softplus threshold 20, both sides, and large negative values):
  - fp32: g, beta and da, db, dA_log, ddt_bias vs eager fp32, rel-L2 < 1e-6; fp64 vs eager fp64 < 1e-13 (which
    sees the threshold: softplus(x) - x = 3e-7 at x = 15).
  - bf16 a, b with fp32 and with bf16 parameters: beta and db BITWISE, g rel-L2 < 1e-6, da within 1 bf16 ulp of
    eager, dA_log, ddt_bias rel-L2 < 1e-5 vs eager.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fast

HAS_TRITON = importlib.util.find_spec("triton") is not None

_CODE = r"""
import numpy as np, torch
import triton.language as tl
from triton.runtime import interpreter as it

def _bf16_rne(data):  # any float array -> bf16 bits, round to nearest even (torch's cast)
    t = torch.from_numpy(np.ascontiguousarray(data.astype(np.float32)))
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

_cast, _fp_to_fp = it.InterpreterBuilder.cast_impl, it.InterpreterBuilder.create_fp_to_fp
def cast_impl(self, src, dst_type):
    if dst_type.scalar == tl.bfloat16 and src.dtype.scalar in (tl.float32, tl.float64):
        return it.TensorHandle(_bf16_rne(src.data), tl.bfloat16)
    return _cast(self, src, dst_type)
def create_fp_to_fp(self, src, dst_type, rounding_mode):
    if dst_type.scalar == tl.bfloat16 and src.dtype.scalar in (tl.float32, tl.float64):
        return it.TensorHandle(_bf16_rne(src.data), tl.bfloat16)
    return _fp_to_fp(self, src, dst_type, rounding_mode)
it.InterpreterBuilder.cast_impl, it.InterpreterBuilder.create_fp_to_fp = cast_impl, create_fp_to_fp

from deltacp.ops.fused import gated_norm as GN, gates as GT
from deltacp.ops.gdn import eager as E

def rel(a, b):
    a, b = a.double(), b.double()
    n = b.norm()
    return ((a - b).norm() / n).item() if n > 0 else a.norm().item()

def ulps_bf16(a, b):  # largest difference in units of the bf16 spacing (at the larger magnitude)
    a, b = a.double(), b.double()
    spacing = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp_min(1e-30))) - 7)
    return ((a - b).abs() / spacing).max().item()

def run(fn, xs, douts):
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.double() * d.double()).sum() for o, d in zip(outs, douts))
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, leaves))

def gen(seed):
    g_ = torch.Generator().manual_seed(seed)
    return lambda *s: torch.randn(*s, generator=g_)

EPS = 1e-6
report = []

# ---------------- gated RMSNorm ----------------
def norm_inputs(layout, dt, wdt, seed):
    g_ = gen(seed)
    r = lambda *s: (g_(*s) * 2).to(dt)  # noqa: E731  (base tensors in dt, then sliced: the views stay views)
    B, s, H, V = 2, 37, 3, 128   # 222 rows: not a multiple of 16
    if layout == "proj slice":     # x contiguous, gate = columns [32, 32 + H V) of a [B, s, H V + 64] projection
        x = r(B, s, H, V)
        z = r(B, s, H * V + 64)[..., 32:32 + H * V].view(B, s, H, V)
    elif layout == "head slice":   # heads 1..3 of 5: token stride 5 V, head stride V
        x, z = r(B, s, 5, V)[:, :, 1:4], r(B, s, 5, V)[:, :, 1:4]
    elif layout == "col stride 2":
        x, z = r(B, s, H, V), r(B, s, H, 2 * V)[..., ::2]
    elif layout == "no merge":     # [s, B] storage seen as [B, s]: the leading dims do not merge (copy path)
        x, z = r(s, B, H, V).transpose(0, 1), r(s, B, H, V).transpose(0, 1)
    elif layout == "V=48":
        x, z = r(B, s, H, 48), r(B, s, H, 48)
    elif layout == "2-D":
        x, z = r(B * s * H, V), r(B * s * H, V)
    w = (1 + 0.3 * g_(x.shape[-1])).to(wdt)
    return x, z, w

norm_fused = lambda x, z, w: GN.gated_rms_norm(x, z, w, EPS)
norm_eager = lambda x, z, w: E.gated_rms_norm(x, z, w, EPS)
NORM_NAMES = ("y", "dx", "dgate", "dweight")

for i, layout in enumerate(("proj slice", "head slice", "col stride 2", "no merge", "V=48", "2-D")):
    x, z, w = norm_inputs(layout, torch.float32, torch.float32, i)
    if layout in ("proj slice", "head slice", "col stride 2"):
        assert not z.is_contiguous() and GN._rows(z).data_ptr() == z.data_ptr(), (layout, "must be read in place")
    dy = gen(100 + i)(*x.shape)
    f32, e32 = run(norm_fused, (x, z, w), [dy]), run(norm_eager, (x, z, w), [dy])
    e64 = run(norm_eager, [t.double() for t in (x, z, w)], [dy])
    f64 = run(norm_fused, [t.double() for t in (x, z, w)], [dy])
    for n, a, b, c, d, e in zip(NORM_NAMES, f32, e32, e64, f64, e64):
        assert a.dtype == b.dtype and a.shape == b.shape, (layout, n, a.dtype, b.dtype, a.shape, b.shape)
        assert rel(a, b) < 1e-6, ("norm fp32 vs eager fp32", layout, n, rel(a, b))
        assert rel(a, c) <= 2 * rel(b, c) + 1e-7, ("norm fp32 vs eager fp64", layout, n, rel(a, c), rel(b, c))
        assert d.dtype == torch.float64 and rel(d, e) < 1e-13, ("norm fp64 vs eager fp64", layout, n, rel(d, e))
    report.append("norm fp32 %-12s " % layout + " ".join("%s=%.1e" % (n, rel(a, b)) for n, a, b in zip(NORM_NAMES, f32, e32))
                  + " | fp64 " + " ".join("%.1e" % rel(d, e) for d, e in zip(f64, e64)))

for wdt in (torch.bfloat16, torch.float32):
    for i, layout in enumerate(("proj slice", "head slice", "V=48")):
        x, z, w = norm_inputs(layout, torch.bfloat16, wdt, 10 + i)
        dy = gen(200 + i)(*x.shape).bfloat16()
        fb, eb = run(norm_fused, (x, z, w), [dy]), run(norm_eager, (x, z, w), [dy])
        ref = run(norm_eager, [t.double() for t in (x, z, w)], [dy])
        differ = (fb[0] != eb[0]).sum().item()
        assert fb[0].dtype == torch.bfloat16 and differ <= 1e-3 * fb[0].numel() and ulps_bf16(fb[0], eb[0]) <= 2, \
            ("norm bf16 y vs eager bf16", layout, wdt, differ, ulps_bf16(fb[0], eb[0]))
        for n, a, b, c in zip(NORM_NAMES[1:], fb[1:], eb[1:], ref[1:]):
            assert a.dtype == b.dtype, (n, a.dtype, b.dtype)
            assert rel(a, c) < 1e-2 and rel(a, c) <= 1.05 * rel(b, c), ("norm bf16 grads vs fp64", layout, wdt, n,
                                                                      rel(a, c), rel(b, c))
        report.append("norm bf16 w=%s %-10s y: %d of %d differ from eager; vs fp64 fused/eager "
                      % (str(wdt)[6:], layout, differ, fb[0].numel())
                      + " ".join("%s=%.1e/%.1e" % (n, rel(a, c), rel(b, c))
                                 for n, a, b, c in zip(NORM_NAMES[1:], fb[1:], eb[1:], ref[1:])))

# the backward's loop over blocks: 3 programs instead of one per block
x, z, w = norm_inputs("proj slice", torch.bfloat16, torch.bfloat16, 30)
dy = gen(300)(*x.shape).bfloat16()
one = run(norm_fused, (x, z, w), [dy])
assert all(torch.equal(a, b) for a, b in zip(one, run(norm_fused, (x, z, w), [dy]))), "not deterministic"
GN.MAX_PROGRAMS_BWD = 3
few = run(norm_fused, (x, z, w), [dy])
GN.MAX_PROGRAMS_BWD = 1024
assert torch.equal(one[1], few[1]) and torch.equal(one[2], few[2]), "dx/dgate depend on the program count"
assert rel(one[3], few[3]) < 1e-2, rel(one[3], few[3])
report.append("norm bwd with 3 programs: dx, dgate bitwise; dweight rel %.1e" % rel(one[3], few[3]))

# ---------------- gates ----------------
def gate_inputs(dt, pdt, seed):
    r = gen(seed)
    B, T, H = 3, 201, 6    # 603 tokens: 1.2 blocks of 512 (H pads to 8)
    proj = r(B, T, 20) * 4
    A_log, dt_bias = (r(H) * 0.5).to(pdt), r(H).to(pdt)
    # x = a + dt_bias on both sides of the threshold 20 (and far below 0)
    proj[0, :12, 2] = torch.tensor([19.5, 19.9, 20.0, 20.1, 25.0, 15.0, 12.0, -30.0, -100.0, 90.0, 0.0, -15.0]) \
        - dt_bias[0].double()
    proj = proj.to(dt)
    return proj[..., 2:8], proj[..., 10:16], A_log, dt_bias

GATE_NAMES = ("g", "beta", "da", "db", "dA_log", "ddt_bias")
for dt in (torch.float32, torch.float64):
    a, b, A_log, dt_bias = gate_inputs(dt, dt, 40)
    assert not a.is_contiguous() and GT._tokens(a).data_ptr() == a.data_ptr()
    r = gen(41)
    dg, dbeta = r(*a.shape), r(*b.shape)
    f, e = run(GT.gdn_gates, (a, b, A_log, dt_bias), [dg, dbeta]), run(E.gdn_gates, (a, b, A_log, dt_bias), [dg, dbeta])
    tol = 1e-6 if dt == torch.float32 else 1e-13
    for n, x_, y_ in zip(GATE_NAMES, f, e):
        assert x_.dtype == y_.dtype and x_.shape == y_.shape, (n, x_.dtype, y_.dtype)
        assert rel(x_, y_) < tol, ("gates", dt, n, rel(x_, y_))
    report.append("gates %s " % str(dt)[6:] + " ".join("%s=%.1e" % (n, rel(x_, y_)) for n, x_, y_ in zip(GATE_NAMES, f, e)))

for pdt in (torch.float32, torch.bfloat16):
    a, b, A_log, dt_bias = gate_inputs(torch.bfloat16, pdt, 50)
    r = gen(51)
    dg, dbeta = r(*a.shape), r(*b.shape).bfloat16()
    f, e = run(GT.gdn_gates, (a, b, A_log, dt_bias), [dg, dbeta]), run(E.gdn_gates, (a, b, A_log, dt_bias), [dg, dbeta])
    for n, x_, y_ in zip(GATE_NAMES, f, e):
        assert x_.dtype == y_.dtype, (n, x_.dtype, y_.dtype)
    assert torch.equal(f[1], e[1]) and torch.equal(f[3], e[3]), ("beta/db not bitwise", pdt)
    assert rel(f[0], e[0]) < 1e-6, ("g", pdt, rel(f[0], e[0]))
    assert ulps_bf16(f[2], e[2]) <= 1, ("da", pdt, ulps_bf16(f[2], e[2]))
    assert rel(f[4], e[4]) < 1e-5 and rel(f[5], e[5]) < 1e-5, ("param grads", pdt, rel(f[4], e[4]), rel(f[5], e[5]))
    report.append("gates bf16 params=%s beta, db bitwise; g=%.1e da=%d ulp (%d differ) dA_log=%.1e ddt_bias=%.1e"
                  % (str(pdt)[6:], rel(f[0], e[0]), ulps_bf16(f[2], e[2]), (f[2] != e[2]).sum().item(),
                     rel(f[4], e[4]), rel(f[5], e[5])))
print("\n".join(report))
print("ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the TRITON_INTERPRET=1 tests of the fused GDN "
                                           "glue kernels run only where triton is (test.sh installs it)")
def test_fused_glue_kernels_vs_eager_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-4000:] + out.stderr[-4000:]
    print(out.stdout)
