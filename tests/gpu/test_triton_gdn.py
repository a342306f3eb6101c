"""Triton GDN backend vs an fp32 PyTorch reference on CUDA.

B=1, H=32, K=V=128, T in 8K/16K/32K, Hk in {32, 16}; random H0, dO, dHT; every gradient by name, rel-L2 < 1e-2.
The reference is a self-contained fp32 chunked WY implementation (differentiated by torch.autograd), checked
here against the fp32 token recurrence at a short length.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton GDN kernels)")

TOL = 1e-2
C = 64


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _prep(q, k, v, g, beta, scale, l2):
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if l2:
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    rep = v.shape[2] // q.shape[2]
    q = q.repeat_interleave(rep, 2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    k = k.repeat_interleave(rep, 2)
    return q, k, v, g, beta


def ref_recurrent(q, k, v, g, beta, *, scale=None, h0=None, l2=True):
    """fp32 token recurrence H_t = e^{g_t}(I - b k k^T) H_{t-1} + b k v^T, o_t = H_t^T q_t."""
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale, l2)
    B, T, H, K = q.shape
    h = q.new_zeros(B, H, K, v.shape[-1]) if h0 is None else h0.float()
    out = []
    for t in range(T):
        h = h * g[:, t].exp()[..., None, None]
        r = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], h)
        h = h + torch.einsum("bhk,bhv->bhkv", k[:, t], r * beta[:, t,:, None])
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], h))
    return torch.stack(out, 1), h


def ref_chunk(q, k, v, g, beta, *, scale=None, h0=None, l2=True, v_zero=False):
    """fp32 chunked WY form (docs/design.md); T must be a multiple of 64. Returns o [B,T,H,V], H_T."""
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale, l2)
    if v_zero:
        v = torch.zeros_like(v)
    B, T, H, K = q.shape
    V, N = v.shape[-1], T // C
    q, k, v = (x.transpose(1, 2).reshape(B, H, N, C, -1) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).reshape(B, H, N, C) for x in (g, beta))
    gc = g.cumsum(-1)
    tri = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    dexp = (gc[...,:, None] - gc[..., None,:]).masked_fill(~tri, float("-inf")).exp()
    A = (beta[...,:, None] * (k @ k.transpose(-1, -2)) * dexp).tril(-1)
    eye = torch.eye(C, device=q.device)
    Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False)
    W = Tinv @ (k * (beta * gc.exp())[..., None])
    U = Tinv @ (v * beta[..., None])
    P = (q @ k.transpose(-1, -2)) * dexp
    h = q.new_zeros(B, H, K, V) if h0 is None else h0.float()
    out = []
    for n in range(N):
        vn = U[:,:, n] - W[:,:, n] @ h
        out.append((q[:,:, n] * gc[:,:, n,:, None].exp()) @ h + P[:,:, n] @ vn)
        gl = gc[:,:, n, -1:]
        h = gl[..., None].exp() * h + (k[:,:, n] * (gl - gc[:,:, n]).exp()[..., None]).transpose(-1, -2) @ vn
    o = torch.stack(out, 2).reshape(B, H, T, V).transpose(1, 2)
    return o, h


def make_inputs(T, Hk, Hv=32, K=128, V=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = r(1, T, Hk, K).bfloat16(), r(1, T, Hk, K).bfloat16(), r(1, T, Hv, V).bfloat16()
    g = F.logsigmoid(r(1, T, Hv) + 2.0) * 0.5          # log decay in about (-0.7, 0), mostly near -0.05
    beta = torch.sigmoid(r(1, T, Hv)).bfloat16()
    h0 = r(1, Hv, K, V) * 0.1
    return q, k, v, g, beta, h0


def test_reference_matches_recurrence():
    q, k, v, g, beta, h0 = make_inputs(192, 2, Hv=4, K=32, V=32)
    o1, h1 = ref_chunk(q, k, v, g, beta, h0=h0)
    o2, h2 = ref_recurrent(q, k, v, g, beta, h0=h0)
    assert rel_l2(o1, o2) < 1e-5 and rel_l2(h1, h2) < 1e-5


def _grads(fn, inputs, do, dht):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, ht = fn(*leaves)
    grads = torch.autograd.grad((o.float() * do).sum() + (ht.float() * dht).sum(), leaves)
    return o.detach(), ht.detach(), grads


NAMES = ("q", "k", "v", "g", "beta", "h0")


@pytest.mark.parametrize("Hk", [32, 16])
@pytest.mark.parametrize("T", [8192, 16384, 32768])
def test_chunk_gdn_vs_fp32_reference(T, Hk):
    from deltacp.ops.gdn.triton import TritonGDNBackend

    be = TritonGDNBackend()
    q, k, v, g, beta, h0 = make_inputs(T, Hk, seed=T + Hk)
    be.check(q, k, v, g, beta)
    do = torch.randn(1, T, 32, 128, device="cuda")
    dht = torch.randn(1, 32, 128, 128, device="cuda")

    def tri(q, k, v, g, beta, h0):
        return be.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)

    def ref(q, k, v, g, beta, h0):
        return ref_chunk(q, k, v, g, beta, h0=h0)

    o, ht, gr = _grads(tri, (q, k, v, g, beta, h0), do.bfloat16().float(), dht)
    ro, rht, rg = _grads(ref, (q.float(), k.float(), v.float(), g, beta.float(), h0), do.bfloat16().float(), dht)
    errs = {"o": rel_l2(o, ro), "ht": rel_l2(ht, rht)}
    errs.update({f"d{n}": rel_l2(a, b) for n, a, b in zip(NAMES, gr, rg)})
    print(f"\nT={T} Hk={Hk} " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    for x in (o, ht, *gr):
        assert torch.isfinite(x).all()
    for n, e in errs.items():
        assert e < TOL, f"{n}: rel-L2 {e:.3e} >= {TOL}"


def summary_case(T, Hk, seed):
    """Inputs of the summary test and its fp32 reference (M, S).

    Gates scaled to a total log-decay of about -20 so that M (a product of T contractions) stays well inside
    fp32's normal range: with the op test's gates M underflows to exactly 0 at 8K tokens.
    k is l2-normalised once here (fp32, rounded to bf16) and given to both sides: M at 8K is so ill-conditioned
    that the bf16 rounding of the normalised k alone moves it by ~1e-2 rel-L2 (measured in an fp64 simulation),
    which would hide the kernels' own error. The l2norm path itself is covered by the op tests."""
    q, k, v, g, beta, _ = make_inputs(T, Hk, seed=seed)
    g = g * (256.0 / T)
    kf = k.float()
    k = (kf * torch.rsqrt(kf.pow(2).sum(-1, keepdim=True) + 1e-6)).bfloat16()
    Tp = -(-T // C) * C
    pad = lambda x: F.pad(x, [0, 0] * (x.dim() - 2) + [0, Tp - T])  # noqa: E731  (neutral tokens)
    kk, vv, gg, bb = (pad(x.float()) for x in (k, v, g, beta))
    qz = torch.zeros_like(kk)
    _, RS = ref_chunk(qz, kk, vv, gg, bb, l2=False)
    eye = torch.eye(128, device="cuda").expand(1, 32, 128, 128)
    _, RM = ref_chunk(qz, kk, vv[...,:128], gg, bb, h0=eye, v_zero=True, l2=False)
    return (k, v, g, beta), RM, RS


@pytest.mark.parametrize("prec", ["tf32", "tf32x3"])
@pytest.mark.parametrize("Hk", [32, 16])
@pytest.mark.parametrize("T", [1024 + 100, 8192])
def test_state_summary_vs_fp32_reference(T, Hk, prec, monkeypatch):
    """Summary (M, S) vs the fp32 reference (inputs: summary_case). Forward only: differentiating it raises."""
    from deltacp.ops.gdn.triton import TritonGDNBackend

    import deltacp.ops.gdn.triton.chunk as chunk_mod

    monkeypatch.setattr(chunk_mod, "SUMMARY_DOT_PRECISION", prec)
    be = TritonGDNBackend()
    inputs, RM, RS = summary_case(T, Hk, seed=7 * T + Hk)
    with torch.no_grad():
        M, S = be.state_summary(*inputs, use_qk_l2norm_in_kernel=False)
    errs = {"M": rel_l2(M, RM), "S": rel_l2(S, RS)}
    print(f"\nsummary T={T} Hk={Hk} {prec} " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    assert M.dtype == torch.float32 and S.dtype == torch.float32
    assert torch.isfinite(M).all() and torch.isfinite(S).all()
    with pytest.raises(RuntimeError, match="no backward"):
        be.state_summary(inputs[0].clone().requires_grad_(), *inputs[1:])
    assert errs["S"] < TOL, f"S: rel-L2 {errs['S']:.3e} >= {TOL}"
    # tf32 is not the shipped precision (tf32x3 is): its M is held to the error it is known to have (2.1e-2 at 8K
    # on the H200, 2026-12-02), so a regression of either variant fails here instead of turning into an xfail
    bound = 1e-4 if prec == "tf32x3" else 3e-2
    assert errs["M"] < bound, f"M ({prec}): rel-L2 {errs['M']:.3e} >= {bound}"


@pytest.mark.parametrize("T", [8192, 32768])
def test_initial_state_grad_vs_fp32_reference(T):
    """p2p's dH_in before dH_out arrives: d sum(o * dO) / dH0, vs autograd through the fp32 reference."""
    from deltacp.ops.gdn.triton import TritonGDNBackend

    be = TritonGDNBackend()
    q, k, v, g, beta, h0 = make_inputs(T, 16, seed=5)
    do = torch.randn(1, T, 32, 128, device="cuda")
    dh0 = be.initial_state_grad(q, k, v, g, beta, do.bfloat16(), use_qk_l2norm_in_kernel=True)
    rl = [x.detach().float() for x in (q, k, v, g, beta)]
    rh0 = torch.zeros_like(h0).requires_grad_()
    ro, _ = ref_chunk(*rl, h0=rh0)
    rdh0 = torch.autograd.grad((ro * do.bfloat16().float()).sum(), rh0)[0]
    err = rel_l2(dh0, rdh0)
    print(f"\ninitial_state_grad T={T}: dH0 rel-L2 {err:.2e}")
    assert dh0.dtype == torch.float32 and torch.isfinite(dh0).all()
    assert err < TOL


def test_unaligned_length_no_initial_state():
    """ulysses-style call: T not a multiple of 64, no H0, no final state."""
    from deltacp.ops.gdn.triton import TritonGDNBackend

    be = TritonGDNBackend()
    T = 4096 + 37
    q, k, v, g, beta, _ = make_inputs(T, 16, seed=3)
    be.check(q, k, v, g, beta)
    do = torch.randn(1, T, 32, 128, device="cuda")
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, ht = be.chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)
    assert ht is None and o.shape == (1, T, 32, 128)
    gr = torch.autograd.grad((o.float() * do).sum(), leaves)
    Tp = -(-T // C) * C
    rl = [x.detach().float().clone().requires_grad_() for x in (q, k, v, g, beta)]
    padded = [F.pad(x, [0, 0] * (x.dim() - 2) + [0, Tp - T]) for x in rl]
    ro, _ = ref_chunk(*padded)
    ro = ro[:,:T]
    rg = torch.autograd.grad((ro * do).sum(), rl)
    assert rel_l2(o, ro) < TOL
    for n, a, b in zip(NAMES, gr, rg):
        assert rel_l2(a, b) < TOL, n


def test_repeated_runs_stable():
    """20 consecutive fwd/bwd: finite, and no growth of allocated memory."""
    from deltacp.ops.gdn.triton import TritonGDNBackend

    be = TritonGDNBackend()
    q, k, v, g, beta, h0 = make_inputs(8192, 16, seed=11)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    mem = []
    for _ in range(20):
        o, ht = be.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
        gr = torch.autograd.grad(o.float().square().mean() + ht.square().mean(), leaves)
        assert all(torch.isfinite(x).all() for x in (o, ht, *gr))
        del o, ht, gr
        torch.cuda.synchronize()
        mem.append(torch.cuda.memory_allocated())
    assert mem[-1] <= mem[1], f"allocated memory grew: {mem}"


def test_prepared_chunks_change_no_number():
    """p2p's staged path (one prepare_chunks shared by the summary, the output pass and the dH_in pass) gives
    bitwise the numbers of the unstaged calls: output, final state, every gradient, dH0 from dO, (M, S)."""
    from deltacp.ops.gdn.triton import TritonGDNBackend

    be = TritonGDNBackend()
    q, k, v, g, beta, h0 = make_inputs(8192, 16, seed=11)
    do, dht = torch.randn_like(v), torch.randn_like(h0)

    def run(staged):
        prepared = be.prepare_chunks(k, v, g, beta, use_qk_l2norm_in_kernel=True) if staged else None
        with torch.no_grad():
            m, s = be.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True, prepared=prepared)
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, ht = be.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True, prepared=prepared)
        grads = torch.autograd.grad((o.float() * do.float()).sum() + (ht * dht).sum(), xs)
        saved = None if prepared is None else be.prepared_from_saved(prepared.tensors_for_backward())
        dh0 = be.initial_state_grad(q, k, v, g, beta, do, use_qk_l2norm_in_kernel=True, prepared=saved)
        return [m, s, o, ht, *grads, dh0]

    names = ["M", "S", "o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0", "dH0 from dO"]
    unequal = [n for n, a, b in zip(names, run(False), run(True)) if not torch.equal(a, b)]
    assert not unequal, f"staged path differs from unstaged in {unequal}"


@pytest.mark.parametrize("Hv", [8, 16])
def test_one_wave_rule_changes_no_number(Hv, monkeypatch):
    """The state kernels' one-wave rule (launch.fill_bv: BV 16 where the grid of 32-wide blocks fills less than half
    the device's SMs, Qwen3.5-2B's 16 heads on a row) gives bitwise the numbers of the table's BV: output, final
    state, every gradient, dH0 from dO, and the summary (M, S) on summary_case's slow gates."""
    from deltacp.ops.gdn.triton import TritonGDNBackend
    from deltacp.ops.gdn.triton.launch import LAUNCH, launch_config, sm_count

    sms = sm_count(torch.device("cuda"))
    if launch_config("state_fwd", V=128, programs=Hv, sms=sms)[0]["BV"] != 16:
        pytest.skip(f"{Hv} heads fill half of this device's {sms} SMs: the rule keeps BV 32, nothing to compare")
    be = TritonGDNBackend()
    q, k, v, g, beta, h0 = make_inputs(4096, Hv, Hv=Hv, seed=5)
    do, dht = torch.randn_like(v), torch.randn_like(h0)
    summary_inputs = summary_case(4096, Hv, seed=11)[0]

    def run():
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, ht = be.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
        grads = torch.autograd.grad((o.float() * do.float()).sum() + (ht * dht).sum(), xs)
        dh0 = be.initial_state_grad(q, k, v, g, beta, do, use_qk_l2norm_in_kernel=True)
        with torch.no_grad():
            m, s = be.state_summary(*summary_inputs, use_qk_l2norm_in_kernel=False)
        return [o, ht, *grads, dh0, m, s]

    narrowed = run()
    for name in ("state_fwd", "state_bwd", "summary_state_fwd"):
        monkeypatch.setitem(LAUNCH, name, {k: v for k, v in LAUNCH[name].items() if k != "FILL_BV"})
    names = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0", "dH0 from dO", "M", "S"]
    unequal = [n for n, a, b in zip(names, narrowed, run()) if not torch.equal(a, b)]
    assert not unequal, f"BV 16 differs from BV 32 in {unequal}"
