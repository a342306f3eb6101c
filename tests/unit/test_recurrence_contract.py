"""The recurrence contract (`ops/recurrence.py`) and the family homes (`deltacp.families`).

- Transition: the packed algebra of M for each declared structure (full, diagonal, scalar) against the dense K x K
  matrices it stands for, in float64: apply, compose, the transposed gradient, and the scan's compositions
  (`parallel/scan.simulate_exclusive_scan`) against a sequential fold of dense maps.
- GatedDeltaRule over the eager backend: forward from an entering state, summary and initial-state gradient against
  the token recurrence (`ops/gdn/naive.py`), through RecurrenceInputs, for K != V.
- The registry: every family registered once, in order; its views name the module attributes that exist.
"""

import pytest
import torch

from deltacp.ops.recurrence import FULL, GatedDeltaRule, RecurrenceInputs, Transition
from deltacp.parallel.scan import simulate_exclusive_scan

pytestmark = pytest.mark.fast

B, H, K, V = 2, 3, 5, 4


def _packed(kind, gen):
    if kind == "full":
        native = torch.randn(B, H, K, K, generator=gen, dtype=torch.float64) / K
    elif kind == "diagonal":
        native = torch.rand(B, H, K, generator=gen, dtype=torch.float64)
    else:
        native = torch.rand(B, H, generator=gen, dtype=torch.float64)
    tr = Transition(kind)
    m = tr.pack(native, K)
    assert m.shape == (B, H, K, tr.width(K))
    return tr, m


@pytest.mark.parametrize("kind", ["full", "diagonal", "scalar"])
def test_transition_algebra_matches_dense_matrices(kind):
    gen = torch.Generator().manual_seed(0)
    tr, m0 = _packed(kind, gen)
    _, m1 = _packed(kind, gen)
    s0, s1, h, d = (torch.randn(B, H, K, V, generator=gen, dtype=torch.float64) for _ in range(4))
    dense0, dense1 = tr.dense(m0), tr.dense(m1)
    assert torch.allclose(tr.apply(m0, s0, h), dense0 @ h + s0, rtol=0, atol=1e-14)
    mc, sc = tr.compose((m1, s1), (m0, s0))
    assert torch.allclose(tr.dense(mc), dense1 @ dense0, rtol=0, atol=1e-14)
    assert torch.allclose(sc, dense1 @ s0 + s1, rtol=0, atol=1e-14)
    assert torch.allclose(tr.grad_in(m0, d, s1), dense0.mT @ d + s1, rtol=0, atol=1e-14)
    if kind != "full":  # what the scan and the chain move per state row: w + V columns, not K + V
        assert tr.width(K) == 1


@pytest.mark.parametrize("kind", ["full", "diagonal", "scalar"])
@pytest.mark.parametrize("n", [2, 5, 8])
def test_scan_composes_every_transition(kind, n):
    gen = torch.Generator().manual_seed(n)
    maps = [_packed(kind, gen)[1] for _ in range(n)]
    ss = [torch.randn(B, H, K, V, generator=gen, dtype=torch.float64) for _ in range(n)]
    tr = Transition(kind)
    got = simulate_exclusive_scan([None] + maps[1:], ss[:-1] + [None], transition=tr)
    state = torch.zeros(B, H, K, V, dtype=torch.float64)
    assert got[0] is None
    for p in range(1, n):
        state = tr.dense(maps[p - 1]) @ state + ss[p - 1]
        assert torch.allclose(got[p], state, rtol=0, atol=1e-12), (kind, n, p)


def test_transition_kind_is_checked():
    with pytest.raises(ValueError, match="transition kind 'sparse' is not one of"):
        Transition("sparse")


def test_gated_delta_rule_through_the_contract_matches_the_token_recurrence():
    from deltacp.ops.gdn.eager import EagerGDNBackend
    from deltacp.ops.gdn.naive import recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(1)
    T, Hk, Hv, Kd, Vd = 37, 1, 2, 12, 24
    q, k = (torch.randn(1, T, Hk, Kd, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, Hv, Vd, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, T, Hv, generator=gen, dtype=torch.float64) * 0.1
    beta = 2 * torch.rand(1, T, Hv, generator=gen, dtype=torch.float64)  # up to 2: the state may flip sign
    h0 = torch.randn(1, Hv, Kd, Vd, generator=gen, dtype=torch.float64)
    rec = GatedDeltaRule(EagerGDNBackend(), qk_l2norm=True)
    x = RecurrenceInputs(q, k, v, g, beta)
    assert rec.transition == FULL and rec.state_shape(x) == (1, Hv, Kd, Vd)
    rec.check(x)
    o, ht = rec.forward(x, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    assert (o - o_ref).norm() / o_ref.norm() < 1e-12
    assert (ht - ht_ref).norm() / ht_ref.norm() < 1e-12
    m, s = rec.summary(x)
    assert (FULL.apply(m, s, h0) - ht_ref).norm() / ht_ref.norm() < 1e-12
    grad_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    h0_var = h0.clone().requires_grad_()
    (o_var, _) = rec.forward(x, initial_state=h0_var)
    (dh0_ref,) = torch.autograd.grad((o_var * grad_o).sum(), h0_var)
    dh0 = rec.initial_state_grad(x, grad_o)
    assert (dh0 - dh0_ref).norm() / dh0_ref.norm() < 1e-12


def test_every_family_registered_once_with_views_that_read_its_modules():
    import transformers  # noqa: F401

    from deltacp.families import olmo_hybrid, qwen3_5, qwen3_next
    from deltacp.families.registry import families, register_family

    names = [f.name for f in families()]
    # registration order follows the first imports (this test's own import registers olmo_hybrid first when run alone)
    assert sorted(names) == sorted(["qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "bamba", "nemotron_h",
                                    "granitemoehybrid", "falcon_h1", "kimi_linear", "bailing_hybrid", "qwen4_exp",
                                    "glm5_next", "minimax", "lara_mini", "lfm2", "lfm2_moe", "lfm3", "mamba2", "mamba",
                                    "falcon_mamba", "jamba", "zamba2", "zamba",
                                    "recurrent_gemma"])
    with pytest.raises(ValueError, match="registered twice"):
        register_family(qwen3_5.QWEN3_5)
    for home, family in ((qwen3_5, qwen3_5.QWEN3_5), (qwen3_next, qwen3_next.QWEN3_NEXT),
                         (olmo_hybrid, olmo_hybrid.OLMO_HYBRID)):
        classes = family.classes()
        assert classes is not None, family.name
        assert family.mixer_view.__module__ == home.__name__ or family.mixer_view.__module__.startswith("deltacp")
    assert olmo_hybrid.OLMO_HYBRID.fused_decoder is False
