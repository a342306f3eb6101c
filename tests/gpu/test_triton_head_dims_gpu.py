"""Triton GDN backend at the head dims of its contract other than K = V = 128 (`contract_check.HEAD_DIMS`, K != V
included), bf16, vs the eager backend in fp32 (inputs upcast) on CUDA.

B=1, T=8192, Hk=16, Hv=32 (grouped heads), every (K, V) of PAIRS, three gate regimes as the model makes them
(`test_triton_varlen_gpu.gates`: transformers' init = fast forgetting, slow = long_memory_gates_, near-frozen =
exp(g) within ~1e-5 of 1) and beta = 2 sigmoid(b) in (0, 2) (OLMo-Hybrid's scaling; beta > 1 makes the per-token
factor I - beta k k^T a reflection along k, no longer a contraction):
  - chunk_gated_delta_rule fwd+bwd with an entering state, the final state and the q/k l2 norm: o, final state and
    the six gradients, rel-L2 < TOL = 1e-2 (the bound of the K = V = 128 op tests, tests/gpu/test_triton_gdn.py;
    bf16 has 2^-9 unit roundoff and the op rounds q, k, W, U, Vn and the per-chunk state to bf16).
  - initial_state_grad (dH0 from dO alone) < TOL; state_summary S < TOL, M < M_TOL = 1e-3 where it is not
    negligible (k l2-normalised once and given to both sides, as tests/gpu/test_triton_gdn.py's summary test
    does: M is so ill-conditioned that k's own bf16 rounding would move it by ~1e-2).
  - packed documents (slow gates, log-normal lengths not aligned to 64, length-1 documents) at K = 96, V = 192.
Prints one line per case, then a table of the worst figure per (K, V).
H100, Triton 3.6 (2026-12-05): every figure below 8.5e-3 (worst: near-frozen gates, dk/dg) except K = V = 256 with
fast-forgetting gates, dg 1.04e-2 (fails; fp32 under the interpreter matches eager to 1e-5 at K = 256, so a
rounding effect of bf16 there is suspected, not yet shown). M was negligible in every regime at 8K with beta up to
2 (checked to be < 1e-3 instead); M's accuracy at these dims is the self-check's (K = 96, V = 192) and the
interpreter tests'.
"""

from __future__ import annotations

import pytest
import torch

from helpers import rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (Triton GDN kernels); the CPU interpreter test of the head "
                                       "dims is tests/unit/test_triton_head_dims.py")

PAIRS = [(64, 64), (96, 192), (128, 256), (192, 96), (256, 256), (64, 128)]
REGIMES = ["init", "slow", "frozen"]
T, HK, HV = 8192, 16, 32
TOL = 1e-2
M_TOL = 1e-3
NAMES = ("q", "k", "v", "g", "beta", "h0")
WORST: dict[tuple[int, int], tuple[float, str]] = {}


def make_inputs(K, V, regime, seed):
    from test_triton_varlen_gpu import gates

    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = r(1, T, HK, K).bfloat16(), r(1, T, HK, K).bfloat16(), r(1, T, HV, V).bfloat16()
    g = gates(regime, T, HV, gen)
    beta = (2 * torch.sigmoid(r(1, T, HV))).bfloat16()
    h0 = r(1, HV, K, V) * 0.1
    return q, k, v, g, beta, h0


def _grads(be, xs, do, dht, cu):
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    o, ht = be.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    gr = torch.autograd.grad((o.float() * do).sum() + (ht.float() * dht).sum(), leaves, allow_unused=True)
    return [o.detach(), ht.detach()] + [torch.zeros_like(x) if a is None else a for a, x in zip(gr, leaves)]


def _check(K, V, tag, errs, bounds):
    print(f"\nK={K} V={V} {tag}: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    for n, e in errs.items():
        worst = WORST.get((K, V), (0.0, ""))
        if e / bounds.get(n, TOL) > worst[0]:
            WORST[(K, V)] = (e / bounds.get(n, TOL), f"{tag} {n}={e:.2e}")
    bad = {n: e for n, e in errs.items() if not e < bounds.get(n, TOL)}  # NaN fails
    assert not bad, f"K={K} V={V} {tag}: " + ", ".join(f"{n} rel-L2 {e:.3e} >= {bounds.get(n, TOL)}"
                                                       for n, e in bad.items())


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("K,V", PAIRS, ids=[f"K{k}-V{v}" for k, v in PAIRS])
def test_ops_at_head_dims_vs_eager_fp32(K, V, regime):
    from deltacp.ops.gdn.eager import EagerGDNBackend
    from deltacp.ops.gdn.triton import TritonGDNBackend

    be, eb = TritonGDNBackend(), EagerGDNBackend()
    xs = make_inputs(K, V, regime, seed=K * 1000 + V + REGIMES.index(regime))
    be.check(*xs[:5])
    gen = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(1, T, HV, V, device="cuda", generator=gen).bfloat16().float()
    dht = torch.randn(1, HV, K, V, device="cuda", generator=gen)
    ours = _grads(be, xs, do, dht, None)
    ref = _grads(eb, [x.float() for x in xs], do, dht, None)
    errs = {"o": rel_l2(ours[0], ref[0]), "ht": rel_l2(ours[1], ref[1])}
    errs.update({f"d{n}": rel_l2(a, b) for n, a, b in zip(NAMES, ours[2:], ref[2:])})
    assert ours[0].dtype == torch.bfloat16 and all(torch.isfinite(x).all() for x in ours)
    q, k, v, g, beta, _ = xs
    dh0 = be.initial_state_grad(q, k, v, g, beta, do.bfloat16(), use_qk_l2norm_in_kernel=True)
    rdh0 = eb.initial_state_grad(*(x.float() for x in (q, k, v, g, beta)), do, use_qk_l2norm_in_kernel=True)
    errs["dH0 from dO"] = rel_l2(dh0, rdh0)
    kf = k.float()
    kn = (kf * torch.rsqrt(kf.pow(2).sum(-1, keepdim=True) + 1e-6)).bfloat16()
    with torch.no_grad():
        M, S = be.state_summary(kn, v, g, beta)
        RM, RS = eb.state_summary(kn.float(), v.float(), g, beta.float())
    errs["S"] = rel_l2(S, RS)
    if RM.norm() > 1e-3 * (HV * K) ** 0.5:  # fast forgetting: M (a product of 8K contractions) underflows to ~0
        errs["M"] = rel_l2(M, RM)
    else:
        assert M.abs().max() < 1e-3, M.abs().max()
    _check(K, V, regime, errs, {"M": M_TOL})


def test_packed_documents_at_k96_v192_vs_eager_fp32():
    from deltacp.ops.gdn.eager import EagerGDNBackend
    from deltacp.ops.gdn.triton import TritonGDNBackend
    from deltacp.ops.gdn.varlen import VarlenLayout
    from deltacp.testing.documents import cu_of, doc_lengths

    K, V = 96, 192
    lens = doc_lengths(T, median=700, sigma=1.3, seed=3)  # two of length 1
    cu = cu_of(lens)
    layout = VarlenLayout.build(cu, T)
    xs = make_inputs(K, V, "slow", seed=11)
    gen = torch.Generator(device="cuda").manual_seed(8)
    do = torch.randn(1, T, HV, V, device="cuda", generator=gen).bfloat16().float()
    dht = torch.randn(1, HV, K, V, device="cuda", generator=gen)
    ours = _grads(TritonGDNBackend(), xs, do, dht, layout)
    ref = _grads(EagerGDNBackend(), [x.float() for x in xs], do, dht, layout)
    errs = {"o": rel_l2(ours[0], ref[0]), "ht": rel_l2(ours[1], ref[1])}
    errs.update({f"d{n}": rel_l2(a, b) for n, a, b in zip(NAMES, ours[2:], ref[2:])})
    _check(K, V, f"packed ({len(lens)} documents)", errs, {})


def test_worst_figures_table():
    """Runs last: the worst figure per (K, V) over the cases above (relative to its bound)."""
    if not WORST:
        pytest.skip("no case ran")
    print(f"\n{'K':>4} {'V':>4}  worst/bound  case")
    for (K, V), (ratio, what) in sorted(WORST.items()):
        print(f"{K:>4} {V:>4}  {ratio:10.2f}  {what}")
