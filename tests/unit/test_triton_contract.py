"""CPU tests of the Triton GDN backend: capability errors, laziness, and (with triton installed) an interpreter
parity test of the kernels in fp32 against the token recurrence. CI installs no triton: those tests skip.
The Triton version policy (verified versions at once, others after the self-check) is tested here with the self-check
stubbed; the self-check itself in test_triton_selfcheck.py."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from deltacp.ops.gdn.triton import TritonGDNBackend
from deltacp.ops.gdn.triton.contract_check import check_triton_contract, check_triton_version

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _inputs(device="meta", T=128, Hk=2, Hv=4, K=128, V=128, dt=torch.bfloat16, gdt=torch.float32):
    q = torch.empty(1, T, Hk, K, device=device, dtype=dt)
    k = torch.empty(1, T, Hk, K, device=device, dtype=dt)
    v = torch.empty(1, T, Hv, V, device=device, dtype=dt)
    g = torch.empty(1, T, Hv, device=device, dtype=gdt)
    beta = torch.empty(1, T, Hv, device=device, dtype=dt)
    return q, k, v, g, beta


class _FakeCuda:
    """Stands in for a CUDA tensor (device/dtype/shape/dim are all the check reads)."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.device = torch.device("cuda", 0)
        self.dtype, self.shape = t.dtype, t.shape

    def dim(self):
        return self.t.dim()


def _cuda_like(*a, **kw):
    return [_FakeCuda(x) for x in _inputs(*a, **kw)]


@pytest.mark.fast
def test_device_error():
    with pytest.raises(RuntimeError, match=r"needs CUDA tensors; got q on device 'cpu'"):
        TritonGDNBackend().check(*_inputs("cpu"))


@pytest.mark.fast
@pytest.mark.parametrize("name,idx,bad", [("q", 0, torch.float32), ("k", 1, torch.float16), ("v", 2, torch.float32),
                                          ("beta", 4, torch.float32), ("g", 3, torch.bfloat16)])
def test_dtype_errors(name, idx, bad):
    xs = _cuda_like()
    xs[idx].dtype = bad
    with pytest.raises(ValueError, match=rf"needs {name}\.dtype="):
        check_triton_contract(*xs, triton_version="3.6.0")


@pytest.mark.fast
@pytest.mark.parametrize("K,V,name", [(32, 128, "head_k_dim"), (128, 80, "head_v_dim"), (100, 96, "head_k_dim"),
                                      (512, 512, "head_k_dim"), (96, 160, "head_v_dim")])
def test_head_dim_error(K, V, name):
    with pytest.raises(ValueError, match=rf"supports {name} in \(64, 96, 128, 192, 256\) \(head_k_dim and "
                                         rf"head_v_dim may differ\); got head_k_dim={K}, head_v_dim={V}$"):
        check_triton_contract(*_cuda_like(K=K, V=V), triton_version="3.6.0")


@pytest.mark.fast
def test_head_dims_accepted(self_check_calls):
    """Every combination of HEAD_DIMS, K != V included (OLMo-Hybrid: 96, 192)."""
    from deltacp.ops.gdn.triton.contract_check import HEAD_DIMS

    assert HEAD_DIMS == (64, 96, 128, 192, 256)
    for K in HEAD_DIMS:
        for V in HEAD_DIMS:
            check_triton_contract(*_cuda_like(K=K, V=V), triton_version="3.6.0")


@pytest.mark.fast
def test_head_ratio_error():
    with pytest.raises(ValueError, match=r"Hv=5, Hk=2"):
        check_triton_contract(*_cuda_like(Hv=5), triton_version="3.6.0")


@pytest.mark.fast
def test_no_chunk_divisibility_requirement():
    """The op pads every sequence to whole chunks itself: no length condition (p2p ranks' slices included)."""
    check_triton_contract(*_cuda_like(T=100), triton_version="3.6.0")
    check_triton_contract(*_cuda_like(T=1), triton_version="3.6.0")


@pytest.mark.fast
@pytest.mark.parametrize("ver", ["3.3.1", "3.4.0", "3.5.9", "4.0.0", "4.1.0+git1234"])
def test_version_outside_range_errors(ver):
    with pytest.raises(RuntimeError, match=rf"^triton=={re.escape(ver)} is outside the range the Triton GDN kernels "
                                           r"accept \(>=3\.6,<4; verified on a GPU: 3\.6; any other version in "
                                           r"the range after a first-use self-check\)"):
        check_triton_version(ver, device="cuda:0")


@pytest.fixture
def self_check_calls(monkeypatch):
    """Records the self-check runs instead of running them."""
    from deltacp.ops.gdn.triton import selfcheck

    calls = []
    monkeypatch.setattr(selfcheck, "run_self_check", lambda device, **kw: calls.append((str(device), kw)))
    return calls


@pytest.mark.fast
@pytest.mark.parametrize("ver", ["3.6.0", "3.6.1", "3.6.0+git1234"])
def test_verified_version_accepted_without_self_check(ver, self_check_calls):
    check_triton_contract(*_cuda_like(), triton_version=ver)
    assert self_check_calls == []


@pytest.mark.fast
@pytest.mark.parametrize("ver", ["3.7.0", "3.8.2", "3.9.0", "3.10.0"])
def test_unverified_version_runs_the_self_check_on_the_inputs_device(ver, self_check_calls):
    check_triton_contract(*_cuda_like(), triton_version=ver)
    assert self_check_calls == [("cuda:0", {"triton_version": ver})]


@pytest.mark.fast
def test_self_check_refusal_propagates(monkeypatch):
    from deltacp.ops.gdn.triton import selfcheck

    def refuse(device, **kw):
        raise selfcheck.TritonSelfCheckError("triton==3.8.0 failed deltacp's self-check ...")

    monkeypatch.setattr(selfcheck, "run_self_check", refuse)
    with pytest.raises(selfcheck.TritonSelfCheckError, match=r"^triton==3\.8\.0 failed"):
        check_triton_contract(*_cuda_like(), triton_version="3.8.0")


@pytest.mark.fast
def test_version_checked_from_installed(monkeypatch):
    import deltacp.ops.gdn.triton.contract_check as cc

    monkeypatch.setattr(cc, "_triton_version", lambda: "3.2.0")
    with pytest.raises(RuntimeError, match=r"triton==3\.2\.0 is outside"):
        check_triton_contract(*_cuda_like())


@pytest.mark.fast
def test_pyproject_triton_extra_is_the_accepted_range():
    """pyproject's `triton` extra and the runtime check say the same range."""
    import tomllib
    from pathlib import Path

    from deltacp.ops.gdn.triton.version import TRITON_VERIFIED_ON_GPU, TRITON_VERSION_RANGE, triton_requirement

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["triton"]
    assert extra == [f"triton{triton_requirement()}"] == ["triton>=3.6,<4"]
    assert TRITON_VERSION_RANGE[0] == min(TRITON_VERIFIED_ON_GPU)


@pytest.mark.fast
def test_state_kernels_fill_one_wave():
    """The state kernels' BV (launch.fill_bv): halved, down to FILL_BV, while twice the grid fits one wave of the
    device's SMs; the table's BV on the interpreter (no SMs) and where the grid already fills half the device."""
    from deltacp.ops.gdn.triton.launch import fill_bv, launch_config

    assert [fill_bv(32, 16, rows * heads, 128, 132) for rows, heads in ((1, 32), (1, 16), (1, 8), (2, 16), (4, 1))] \
        == [32, 16, 16, 32, 16]
    assert fill_bv(64, 8, 1, 128, 132) == 8 and fill_bv(32, 32, 1, 128, 132) == 32
    for name in ("state_fwd", "state_bwd", "summary_state_fwd"):
        assert launch_config(name, V=128, K=128, programs=16, sms=132)[0]["BV"] == 16
        assert launch_config(name, V=128, K=128, programs=32, sms=132)[0]["BV"] == 32
        assert launch_config(name, V=128, K=128, programs=16, sms=None)[0]["BV"] == 32
        assert launch_config(name, V=128, K=256, programs=16, sms=132)[0]["BV"] == 16  # LAUNCH_WIDE_K's state_bwd
        with pytest.raises(ValueError, match="FILL_BV needs programs"):
            launch_config(name, V=128, K=128)


def test_import_is_lazy():
    """Importing the backend package and constructing it imports no kernel module."""
    code = ("import sys; import deltacp.ops.gdn.triton as t; t.TritonGDNBackend(); "
            "print(any(m.startswith('deltacp.ops.gdn.triton.') and m.split('.')[-1] in "
            "('chunk', 'wy', 'chunk_h', 'chunk_o') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- interpreter parity (needs triton; runs the real kernels on CPU) -------------------------------------------

def _ref_recurrent(q, k, v, g, beta, h0=None, l2=True, v_zero=False):
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if l2:
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(rep, 2) * q.shape[-1] ** -0.5, k.repeat_interleave(rep, 2)
    if v_zero:
        v = torch.zeros_like(v)
    B, T, H, K = q.shape
    h = q.new_zeros(B, H, K, v.shape[-1]) if h0 is None else h0.double()
    out = []
    for t in range(T):
        h = h * g[:, t].exp()[..., None, None]
        r = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], h)
        h = h + torch.einsum("bhk,bhv->bhkv", k[:, t], r * beta[:, t, :, None])
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], h))
    return torch.stack(out, 1), h


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


_INTERP_CODE = r"""
import sys, torch
sys.path.insert(0, {testdir!r})
import test_triton_contract as t
import os; sys.path.insert(0, os.path.dirname({testdir!r}))
import triton_interpreter
triton_interpreter.patch()  # the bf16 dot fix and the nested-call speed-up (tests/triton_interpreter.py)
from deltacp.ops.gdn.triton.chunk import chunk_gated_delta_rule, initial_state_grad, state_summary
torch.manual_seed(0)
B, T, Hk, Hv, K, V = 1, 150, 1, 2, 32, 32       # T=150: a partial last chunk; Hv=2*Hk: grouped heads
q, k = torch.randn(B, T, Hk, K), torch.randn(B, T, Hk, K)
v, g = torch.randn(B, T, Hv, V), -torch.rand(B, T, Hv) * 0.2
beta, h0 = torch.rand(B, T, Hv), torch.randn(B, Hv, K, V)
xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
do, dht = torch.randn_like(o), torch.randn_like(ht)
gr = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), xs)
rs = [x.double().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
ro, rht = t._ref_recurrent(*rs[:5], h0=rs[5])
rg = torch.autograd.grad((ro * do.double()).sum() + (rht * dht.double()).sum(), rs, retain_graph=True)
errs = [t._rel(o, ro), t._rel(ht, rht)] + [t._rel(a, b) for a, b in zip(gr, rg)]
# the state kernels' one-wave rule (launch.fill_bv) on a device with SMs to spare: BV 16 rather than 32. On a GPU the
# same bits (tests/gpu); here tl.dot is a NumPy matmul, whose summation order follows the block shape on some CPUs
# (1.4e-6 of 5.3 seen, 2026-12-07): fp32 rounding, held to 1e-5 of each tensor's largest entry
def near(a, b):
    return bool((a - b).abs().max() <= 1e-5 * b.abs().max())
from deltacp.ops.gdn.triton import chunk_h
sm_count, chunk_h.sm_count = chunk_h.sm_count, lambda device: 10 ** 6
xs3 = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
o3, ht3 = chunk_gated_delta_rule(*xs3[:5], initial_state=xs3[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
gr3 = torch.autograd.grad((o3 * do).sum() + (ht3 * dht).sum(), xs3)
assert all(near(a, b) for a, b in zip([o3, ht3, *gr3], [o, ht, *gr])), "state kernels at BV 16"
chunk_h.sm_count = sm_count
# the entering state's gradient from the outputs alone (p2p's dH_in before dH_out arrives)
dh0_o = initial_state_grad(q, k, v, g, beta, do, use_qk_l2norm_in_kernel=True)
rdh0_o = torch.autograd.grad((ro * do.double()).sum(), rs[5])[0]
errs.append(t._rel(dh0_o, rdh0_o))
# summary (forward only on this backend): slow gates and small beta so that M stays O(1)
gs_, bs_ = g * 0.05, beta * 0.1
zs = [x.double() for x in (k, v, gs_, bs_)]
q0 = torch.zeros(B, T, Hk, K, dtype=torch.float64)
_, RS = t._ref_recurrent(q0, *zs)
_, RM = t._ref_recurrent(q0, *zs, h0=torch.eye(K, dtype=torch.float64).expand(B, Hv, K, K), v_zero=True)
assert RM.norm() > 0.2 * (Hv * K) ** 0.5, "M must not be negligible in this check: %g" % RM.norm()
with torch.no_grad():
    M, S = state_summary(k, v, gs_, bs_, use_qk_l2norm_in_kernel=True)
    chunk_h.sm_count = lambda device: 10 ** 6  # the one-wave rule's BV 16 in the summary's recurrences too
    M4, S4 = state_summary(k, v, gs_, bs_, use_qk_l2norm_in_kernel=True)
    chunk_h.sm_count = sm_count
assert near(M4, M) and near(S4, S), "summary at BV 16"
errs += [t._rel(M, RM), t._rel(S, RS)]
# p2p's staged path: one prepare_chunks shared by summary, output pass and dH_in pass changes no number
from deltacp.ops.gdn.triton.chunk import PreparedChunks, prepare_chunks
P = prepare_chunks(k, v, gs_, bs_, use_qk_l2norm_in_kernel=True)
with torch.no_grad():
    M2, S2 = state_summary(k, v, gs_, bs_, use_qk_l2norm_in_kernel=True, prepared=P)
    M3, S3 = state_summary(k, v, gs_, bs_, use_qk_l2norm_in_kernel=True, need_transition=False)
assert M3 is None and torch.equal(S3, S) and torch.equal(M2, M) and torch.equal(S2, S), "summary from prepared"
try:  # the summary releases the prepared normalised k: a second summary from it must say so
    state_summary(k, v, gs_, bs_, use_qk_l2norm_in_kernel=True, prepared=P)
    raise SystemExit("a second summary from the same prepared chunks was accepted")
except ValueError as e:
    assert "already used" in str(e), e
P = prepare_chunks(k, v, g, beta, use_qk_l2norm_in_kernel=True)
xs2 = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
o2, ht2 = chunk_gated_delta_rule(*xs2[:5], initial_state=xs2[5], output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, prepared=P)
assert P.w is None and P.u is None, "the output pass consumes W and U"
gr2 = torch.autograd.grad((o2 * do).sum() + (ht2 * dht).sum(), xs2)
assert all(torch.equal(a, b) for a, b in zip([o2, ht2, *gr2], [o, ht, *gr])), "output pass from prepared"
dh0_p = initial_state_grad(q, k, v, g, beta, do, use_qk_l2norm_in_kernel=True,
                           prepared=PreparedChunks.from_saved(P.tensors_for_backward()))
assert torch.equal(dh0_p, dh0_o), "dH_in pass from prepared"
try:  # differentiating it must raise, not return a silent zero gradient
    state_summary(k.clone().requires_grad_(), v, gs_, bs_)
    raise SystemExit("state_summary accepted inputs that require grad")
except RuntimeError as e:
    assert "no backward" in str(e), e
print(max(errs))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the TRITON_INTERPRET=1 kernel parity test "
                                           "runs only where triton is (test.sh installs it)")
def test_interpreter_parity_fp32():
    """Real kernels under TRITON_INTERPRET=1 with fp32 inputs (so fp32 math end to end) vs an fp64 recurrence:
    output, final state, all six gradients, the entering state's gradient from the outputs alone, and the
    summary (M, S) (forward only: differentiating it raises)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = _INTERP_CODE.format(testdir=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-5


_INTERP_VARIANTS_CODE = r"""
import sys, torch
sys.path.insert(0, {testdir!r})
import test_triton_contract as t
import os; sys.path.insert(0, os.path.dirname({testdir!r}))
import triton_interpreter
triton_interpreter.patch()  # the bf16 dot fix and the nested-call speed-up (tests/triton_interpreter.py)
from deltacp.ops.gdn.triton import chunk as C
from deltacp.ops.gdn.triton.launch import LAUNCH
from deltacp.ops.gdn.triton.wy import wu_fwd, wy_bwd, wy_fwd
from deltacp.testing.wy_reference import wu_reference, wy_bwd_reference
torch.manual_seed(0)
B, T, Hk, Hv, K, V = 1, 128, 1, 2, 64, 64
k = C.l2norm(torch.randn(B, T, Hk, K)).bfloat16()
v, g, beta = torch.randn(B, T, Hv, V).bfloat16(), -torch.rand(B, T, Hv) * 0.3, torch.rand(B, T, Hv).bfloat16()
gc = C.chunk_cumsum(g)
dw, du, dk_in = torch.randn(B, T, Hv, K), torch.randn(B, T, Hv, V).bfloat16(), torch.randn(B, T, Hv, K)
ai, _, _ = wy_fwd(k, v, beta, gc)
rw, _ = wu_reference(k, v, beta, gc)
rb = wy_bwd_reference(k, v, beta, gc, dw, du, dk_in)
errs = {{}}
for split in (0, 1):
    LAUNCH["wu_fwd"]["SPLIT"] = split
    w, u = wu_fwd(k, v, beta, gc, ai, w_dtype=torch.float32)
    errs["wu_fwd SPLIT=%d W" % split] = t._rel(w, rw)
for split in (0, 1):
    LAUNCH["wy_bwd"]["SPLIT"] = split
    for name, x, r in zip(("dk", "dv", "dbeta", "dg"), wy_bwd(k, v, beta, gc, ai, dw, du, dk_in), rb):
        errs["wy_bwd SPLIT=%d %s" % (split, name)] = t._rel(x, r)
for n, e in errs.items():
    print(n, e)
print(max(errs.values()))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the TRITON_INTERPRET=1 variant test needs it")
def test_interpreter_product_variants():
    """Every product variant the launch table can select, vs fp64 (bf16 inputs, so the bf16 hi/lo splits really
    run): wu_fwd and wy_bwd (each output) with SPLIT 0 and 1. A split that dropped its low half would be off by
    ~4e-3 (bf16 rounding), far above the bound."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = _INTERP_VARIANTS_CODE.format(testdir=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-4, out.stdout


_INTERP_GROUP_SUM_CODE = r"""
import torch
from deltacp.ops.gdn.triton.heads import group_sum
torch.manual_seed(0)
for G in (1, 2, 3, 4):
    for T in (1, 37):  # rows not a multiple of the kernel's row block
        x = torch.randn(2, T, 3 * G, 32)
        ref = x[:, :, 0::G]  # the fp32 sum, heads added in order: value head j belongs to key head j // G
        for i in range(1, G):
            ref = ref + x[:, :, i::G]
        y = group_sum(x, G, torch.float32)
        assert torch.equal(y, ref), (G, T, (y - ref).abs().max())
        # rounded once to bf16: within one bf16 ulp (the interpreter truncates where the GPU rounds to nearest)
        y = group_sum(x, G, torch.bfloat16)
        assert y.dtype == torch.bfloat16 and y.shape == ref.shape
        err = ((y.float() - ref).abs() / ref.abs()).max().item()
        assert err <= 2 ** -7, (G, T, err)
        assert torch.equal(y, group_sum(x, G, torch.bfloat16)), "not deterministic"
print("ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the TRITON_INTERPRET=1 head-sum test needs it")
def test_interpreter_gva_head_sum():
    """The GVA head sum of dq/dk (value heads onto their key head, one rounding to the output dtype) vs the fp32
    sum in head order, for 1-4 value heads per key head and row counts that do not fill the last block."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERP_GROUP_SUM_CODE], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


_NEUTRAL_CODE = r"""
import os, sys, time, torch
sys.path.insert(0, os.path.dirname({testdir!r}))
import triton_interpreter
from deltacp.ops.gdn.triton.chunk import chunk_gated_delta_rule

def run():
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v, h0 = r(1, 70, 1, 32), r(1, 70, 1, 32), r(1, 70, 2, 32), r(1, 2, 32, 32)
    g, beta = -torch.rand(1, 70, 2, generator=gen) * 0.2, torch.rand(1, 70, 2, generator=gen)
    xs = [x.bfloat16().requires_grad_() if i < 3 else x.requires_grad_() for i, x in enumerate((q, k, v, g, beta, h0))]
    o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
    grads = torch.autograd.grad(o.float().sum() + ht.sum(), xs)
    return [o, ht, *grads]

triton_interpreter.patch(nested_calls=False)
t0 = time.perf_counter(); base = run(); t1 = time.perf_counter()
triton_interpreter.patch()
fast = run(); t2 = time.perf_counter()
assert all(torch.equal(a, b) for a, b in zip(base, fast)), "the nested-call patch changed a result"
print(f"bitwise equal; {{t1 - t0:.2f}} s -> {{t2 - t1:.2f}} s")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the interpreter patch test runs only where "
                                           "triton is")
def test_interpreter_patch_is_bitwise_neutral():
    """tests/triton_interpreter.py's nested-call patch (no re-patching of triton.language inside a launch) leaves every
    output and gradient of an interpreted GDN fwd+bwd (bf16 q, k, v: the widened bf16 products too) bitwise equal."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = _NEUTRAL_CODE.format(testdir=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    print(out.stdout)
