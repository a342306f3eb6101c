"""Triton GDN backend on packed documents (`cu_seqlens`) on CUDA, vs the eager backend in fp32 (the semantic
reference of varlen: chunk-aligned layout, state reset per document) and vs flash-linear-attention's varlen op.

B=1 packed row, Hv=32, Hk=16, K=V=128, T in 8K/16K/32K, documents of log-normal lengths (not aligned to 64, with
length-1 documents), gates as the model makes them (g = -exp(A_log) softplus(a + dt_bias)) with three settings of
(A_log, dt_bias): transformers' Qwen3.5 init (A ~ U(0, 16), dt_bias = 1: fast forgetting), slow
(`deltacp.models.gates.long_memory_gates_`: A_log ~ U(-5, -1), dt_bias ~ U(-1, 1)), near-frozen (A_log = -12).
Every output and gradient within the unpacked op's bound (rel-L2 < 1e-2, tests/gpu/test_triton_gdn.py).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from deltacp.testing.documents import cu_of, doc_lengths
from helpers import rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (Triton GDN kernels); the CPU interpreter test of varlen is "
                                       "tests/unit/test_triton_varlen.py")

TOL = 1e-2
NAMES = ("q", "k", "v", "g", "beta", "h0")


def gates(kind: str, T: int, Hv: int, gen: torch.Generator) -> torch.Tensor:
    """g [1, T, Hv] fp32 = -exp(A_log) softplus(a + dt_bias), a ~ N(0, 1) per token (the projection's output)."""
    dev = "cuda"
    if kind == "init":  # transformers' Qwen3.5 GatedDeltaNet init: A ~ U(0, 16), dt_bias = 1
        a_log = torch.empty(Hv, device=dev).uniform_(0, 16, generator=gen).clamp_min(1e-3).log()
        dt_bias = torch.ones(Hv, device=dev)
    elif kind == "slow":  # deltacp.models.gates.long_memory_gates_
        a_log = torch.empty(Hv, device=dev).uniform_(-5, -1, generator=gen)
        dt_bias = torch.empty(Hv, device=dev).uniform_(-1, 1, generator=gen)
    elif kind == "frozen":  # exp(g) within ~1e-5 of 1: the state of a long document barely decays
        a_log = torch.full((Hv,), -12.0, device=dev)
        dt_bias = torch.zeros(Hv, device=dev)
    else:
        raise ValueError(kind)
    a = torch.randn(1, T, Hv, device=dev, generator=gen)
    return -a_log.exp() * F.softplus(a + dt_bias)


def make_inputs(T, gate_kind, seed, Hk=16, Hv=32, K=128, V=128):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = r(1, T, Hk, K).bfloat16(), r(1, T, Hk, K).bfloat16(), r(1, T, Hv, V).bfloat16()
    g = gates(gate_kind, T, Hv, gen)
    beta = torch.sigmoid(r(1, T, Hv)).bfloat16()
    h0 = r(1, Hv, K, V) * 0.1
    return q, k, v, g, beta, h0


def _grads(fn, inputs, do, dht):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, ht = fn(*leaves)
    gr = torch.autograd.grad((o.float() * do).sum() + (ht.float() * dht).sum(), leaves, allow_unused=True)
    return o.detach(), ht.detach(), [torch.zeros_like(x) if a is None else a for a, x in zip(gr, leaves)]


def _reference(xs, do, dht, layout):
    """The eager backend in fp32 (inputs upcast), differentiated by autograd."""
    from deltacp.ops.gdn.eager import EagerGDNBackend

    be = EagerGDNBackend()

    def ref(q, k, v, g, beta, h0):
        return be.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=layout)

    return _grads(ref, [x.float() for x in xs], do, dht)


@pytest.mark.parametrize("first_continues", [True, False])
@pytest.mark.parametrize("gate_kind", ["init", "slow", "frozen"])
@pytest.mark.parametrize("T", [8192, 16384, 32768])
def test_varlen_vs_fp32_reference(T, gate_kind, first_continues):
    """Op (o, final state, six gradients), dH0 from dO (`initial_state_grad`) and summary (M, S) vs eager fp32."""
    from deltacp.ops.gdn.eager import EagerGDNBackend
    from deltacp.ops.gdn.triton import TritonGDNBackend
    from deltacp.ops.gdn.varlen import VarlenLayout

    be, eb = TritonGDNBackend(), EagerGDNBackend()
    seed = T + 3 * len(gate_kind) + first_continues
    lens = doc_lengths(T, median=T / 12, sigma=1.0, seed=seed)
    layout = VarlenLayout.build(cu_of(lens), T, first_continues=first_continues)
    xs = make_inputs(T, gate_kind, seed)
    q, k, v, g, beta, h0 = xs
    be.check(q, k, v, g, beta)
    do = torch.randn(1, T, 32, 128, device="cuda").bfloat16().float()
    dht = torch.randn(1, 32, 128, 128, device="cuda")

    def tri(q, k, v, g, beta, h0):
        return be.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=layout)

    o, ht, gr = _grads(tri, xs, do, dht)
    ro, rht, rg = _reference(xs, do, dht, layout)
    errs = {"o": rel_l2(o, ro), "ht": rel_l2(ht, rht)}
    errs.update({f"d{n}": rel_l2(a, b) for n, a, b in zip(NAMES, gr, rg)})
    dh0 = be.initial_state_grad(q, k, v, g, beta, do.bfloat16(), use_qk_l2norm_in_kernel=True, cu_seqlens=layout)
    rdh0 = eb.initial_state_grad(*(x.float() for x in (q, k, v, g, beta)), do, use_qk_l2norm_in_kernel=True,
                                 cu_seqlens=layout)
    errs["dH0 from dO"] = rel_l2(dh0, rdh0)
    with torch.no_grad():
        M, S = be.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=layout)
        RM, RS = eb.state_summary(*(x.float() for x in (k, v, g, beta)), use_qk_l2norm_in_kernel=True,
                                  cu_seqlens=layout)
    errs["S"] = rel_l2(S, RS)
    print(f"\nvarlen T={T} docs={len(lens)} (max {max(lens)}) gates={gate_kind} first_continues={first_continues} "
          + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    assert o.dtype == torch.bfloat16 and o.shape == (1, T, 32, 128)
    for x in (o, ht, *gr, dh0, M, S):
        assert torch.isfinite(x).all()
    assert torch.count_nonzero(M) == 0 and torch.count_nonzero(RM) == 0, "M must be 0 once a document starts"
    if not first_continues:
        assert torch.count_nonzero(gr[5]) == 0 and torch.count_nonzero(dh0) == 0, "dH0 must be 0"
    for n, e in errs.items():
        assert e < TOL, f"{n}: rel-L2 {e:.3e} >= {TOL}"


def test_one_document_is_the_unpacked_op():
    """cu_seqlens = [0, T] (first_continues): bitwise the unpacked op, every output and gradient."""
    from deltacp.ops.gdn.triton import TritonGDNBackend

    be = TritonGDNBackend()
    T = 8192 + 37
    xs = make_inputs(T, "slow", seed=1)
    do, dht = torch.randn(1, T, 32, 128, device="cuda"), torch.randn(1, 32, 128, 128, device="cuda")
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    runs = [_grads(lambda *a, c=c: be.chunk_gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True,
                                                            use_qk_l2norm_in_kernel=True, cu_seqlens=c), xs, do, dht)
            for c in (None, cu)]
    (o1, h1, g1), (o2, h2, g2) = runs
    assert torch.equal(o1, o2) and torch.equal(h1, h2) and all(torch.equal(a, b) for a, b in zip(g1, g2))


def _compiled_kernels() -> dict[str, int]:
    """Compiled variants per GDN kernel (Triton's per-device JIT cache)."""
    from deltacp.ops.gdn.triton import chunk_h, chunk_o, l2norm, wy

    counts = {}
    for mod in (chunk_h, chunk_o, l2norm, wy):
        for name, f in vars(mod).items():
            if name.endswith("_kernel"):
                counts[name] = sum(len(c[0]) for c in f.device_caches.values())
    return counts


def test_no_recompile_across_lengths():
    """A packed stream has a new length every step: after one step of every operation (packed and unpacked), steps
    at other lengths and document mixes compile no kernel again."""
    from deltacp.ops.gdn.triton import TritonGDNBackend

    be = TritonGDNBackend()

    def step(T, packed, seed):
        xs = make_inputs(T, "init", seed)
        q, k, v, g, beta, h0 = xs
        cu = cu_of(doc_lengths(T, median=T / 5, sigma=1.0, seed=seed)) if packed else None
        do = torch.randn(1, T, 32, 128, device="cuda").bfloat16()
        _grads(lambda *a: be.chunk_gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu),
               xs, do.float(), torch.randn_like(h0))
        be.initial_state_grad(q, k, v, g, beta, do, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        with torch.no_grad():
            P = be.prepare_chunks(k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
            be.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, prepared=P)
            be.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, need_transition=False)
        torch.cuda.synchronize()

    step(1000, True, 0)
    step(1000, False, 0)
    step(64, False, 0)  # one chunk: NT = 1 (a value Triton would otherwise specialise on)
    first = _compiled_kernels()
    for T, seed in ((4096 + 37, 1), (777, 2), (2048, 3), (64 * 17, 4), (1, 5)):
        step(T, T > 1, seed)
        step(T, False, seed)
    after = _compiled_kernels()
    print(f"\ncompiled kernels after the first lengths: {first}\nafter 5 more lengths: {after}")
    assert after == first, {n: (first.get(n), c) for n, c in after.items() if first.get(n) != c}


@pytest.mark.parametrize("T", [16384, 32768])
def test_varlen_vs_fla(T):
    """Same documents through FLA's varlen chunk_gated_delta_rule (its Hopper backward guard BYPASSED: FLA 0.6.0
    refuses its backward on Hopper with Triton 3.4-3.7.0). Both vs the fp32 reference; ours must be within TOL.
    Ours vs FLA is printed and must be within 2*TOL unless FLA itself is off the reference by more than TOL."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
    from fla_ref import load_fla_varlen

    fla = load_fla_varlen(bypass_hopper_guard=True)
    if fla is None:
        pytest.skip("flash-linear-attention is not installed (carry its wheels in .whl/)")
    from deltacp.ops.gdn.triton import TritonGDNBackend
    from deltacp.ops.gdn.varlen import VarlenLayout

    be = TritonGDNBackend()
    lens = doc_lengths(T, median=T / 12, sigma=1.0, seed=T)
    N = len(lens)
    cu_cpu = cu_of(lens)
    cu = cu_cpu.cuda()
    layout = VarlenLayout.build(cu_cpu, T)
    xs = make_inputs(T, "slow", seed=T)
    do = torch.randn(1, T, 32, 128, device="cuda").bfloat16().float()
    dht = torch.randn(1, 32, 128, 128, device="cuda")

    def ours(q, k, v, g, beta, h0):
        return be.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=layout)

    def theirs(q, k, v, g, beta, h0):  # h0 enters document 0; the others start from 0; the last final state
        h0n = torch.cat([h0, h0.new_zeros(N - 1, *h0.shape[1:])])
        o, ht = fla[1](q, k, v, g, beta, h0n, cu, cu_cpu)
        return o, ht[-1:]

    res = {"ours": _grads(ours, xs, do, dht), fla[0]: _grads(theirs, xs, do, dht)}
    ro, rht, rg = _reference(xs, do, dht, layout)
    errs = {}
    for name, (o, ht, gr) in res.items():
        e = {"o": rel_l2(o, ro), "ht": rel_l2(ht, rht)}
        e.update({f"d{n}": rel_l2(a, b) for n, a, b in zip(NAMES, gr, rg)})
        errs[name] = e
        print(f"\nT={T} docs={N} {name} vs fp32 reference: " + " ".join(f"{n}={x:.2e}" for n, x in e.items()))
    (o, ht, gr), (fo, fht, fgr) = res.values()
    vs = {"o": rel_l2(o, fo), "ht": rel_l2(ht, fht)}
    vs.update({f"d{n}": rel_l2(a, b) for n, a, b in zip(NAMES, gr, fgr)})
    print(f"T={T} ours vs {fla[0]}: " + " ".join(f"{n}={x:.2e}" for n, x in vs.items()))
    for n, e in errs["ours"].items():
        assert e < TOL, f"ours {n}: rel-L2 {e:.3e} >= {TOL}"
    fla_off = {n: e for n, e in errs[fla[0]].items() if e >= TOL}
    if fla_off:
        pytest.xfail(f"{fla[0]} itself is off the fp32 reference: {fla_off}")
    for n, e in vs.items():
        assert e < 2 * TOL, f"ours vs FLA {n}: rel-L2 {e:.3e}"
