"""Eager GDN backend against the token recurrence, and the algebra of state summaries."""

import pytest
import torch

from deltacp.ops.gdn import eager, naive, summary
from helpers import rel_l2

pytestmark = pytest.mark.fast


def _inputs(B=2, T=150, Hk=2, Hv=4, K=16, V=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, K, dtype=dtype, generator=gen)
    k = torch.randn(B, T, Hk, K, dtype=dtype, generator=gen)
    v = torch.randn(B, T, Hv, V, dtype=dtype, generator=gen)
    g = -torch.rand(B, T, Hv, dtype=dtype, generator=gen) * 0.3
    beta = torch.rand(B, T, Hv, dtype=dtype, generator=gen)
    h0 = torch.randn(B, Hv, K, V, dtype=dtype, generator=gen)
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("T", [1, 63, 64, 150, 256])
@pytest.mark.parametrize("l2norm", [True, False])
def test_chunked_matches_recurrent_float64(T, l2norm):
    q, k, v, g, beta, h0 = _inputs(T=T)
    if not l2norm:  # keep the unnormalised recurrence contractive
        q, k = q / 4, k / 4
    kwargs = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm, scale=0.3)
    o_ref, h_ref = naive.recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    o, h = eager.chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    assert o.dtype == torch.float64 and h.dtype == torch.float64
    assert rel_l2(o, o_ref) < 1e-12 and rel_l2(h, h_ref) < 1e-12


def test_bf16_inputs_compute_in_fp32_and_return_input_dtype():
    q, k, v, g, beta, h0 = _inputs(dtype=torch.float32)
    o_ref, h_ref = naive.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    bf = [x.bfloat16() for x in (q, k, v, beta)]
    o, h = eager.chunk_gated_delta_rule(bf[0], bf[1], bf[2], g, bf[3], initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16 and h.dtype == torch.float32
    assert rel_l2(o, o_ref) < 2e-2 and rel_l2(h, h_ref) < 2e-2


def test_summary_applied_equals_scan_from_state():
    q, k, v, g, beta, h0 = _inputs(T=200)
    m, s = eager.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True)
    _, h_ref = naive.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    assert m.shape == (2, 4, 16, 16) and s.shape == (2, 4, 16, 8)
    assert rel_l2(summary.apply_summary(m, s, h0), h_ref) < 1e-12
    _, s_ref = naive.recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    assert rel_l2(s, s_ref) < 1e-12  # S is the final state from zero


def test_compose_is_associative_and_not_commutative():
    q, k, v, g, beta, h0 = _inputs(T=192)
    parts = [eager.state_summary(k[:, i:i + 64], v[:, i:i + 64], g[:, i:i + 64], beta[:, i:i + 64],
                                 use_qk_l2norm_in_kernel=True) for i in (0, 64, 128)]
    a, b, c = parts
    left = summary.compose_summaries(c, summary.compose_summaries(b, a))
    right = summary.compose_summaries(summary.compose_summaries(c, b), a)
    whole = eager.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True)
    for x, y in zip(left, right):
        assert rel_l2(x, y) < 1e-12
    for x, y in zip(left, whole):
        assert rel_l2(x, y) < 1e-12
    swapped = summary.compose_summaries(a, b)
    assert rel_l2(swapped[0], summary.compose_summaries(b, a)[0]) > 1e-3


def test_gradient_summary_equals_autograd():
    q, k, v, g, beta, h0 = _inputs(T=130)
    m, s = eager.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True)
    h_in = h0.clone().requires_grad_()
    o, h_out = eager.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h_in, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    d_o, d_h_out = torch.randn_like(o), torch.randn_like(h_out)
    (grad_total,) = torch.autograd.grad((o * d_o).sum() + (h_out * d_h_out).sum(), h_in, retain_graph=True)
    (grad_local,) = torch.autograd.grad((o * d_o).sum(), h_in)  # dS_local: from the outputs alone
    assert rel_l2(summary.summary_grad(m, d_h_out, grad_local), grad_total) < 1e-12
    # p2p's dH_in pass: the same local part without any H_in (o is affine in H_in)
    assert rel_l2(eager.initial_state_grad(q, k, v, g, beta, d_o, use_qk_l2norm_in_kernel=True), grad_local) < 1e-12


def test_final_state_gradient_gives_what_the_summary_gradient_gives():
    """p2p's backward: the local backward with dH_out on the final state yields the same input gradients as
    autograd through H_out = M @ H_in + S (both forms differentiate the same function of k, v, g, beta)."""
    q, k, v, g, beta, h0 = _inputs(T=130)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, h_out = eager.chunk_gated_delta_rule(*leaves, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    d_o, d_h_out = torch.randn_like(o), torch.randn_like(h_out)
    via_final_state = torch.autograd.grad((o * d_o).sum() + (h_out * d_h_out).sum(), leaves)
    o2, _ = eager.chunk_gated_delta_rule(*leaves, initial_state=h0, use_qk_l2norm_in_kernel=True)
    m, s = eager.state_summary(*leaves[1:], use_qk_l2norm_in_kernel=True)
    via_summary = torch.autograd.grad((o2 * d_o).sum() + (summary.apply_summary(m, s, h0) * d_h_out).sum(), leaves,
                                      allow_unused=True)
    assert via_summary[0] is not None
    for a, b in zip(via_final_state, via_summary):
        assert rel_l2(a, b) < 1e-10


def test_gradcheck_tiny():
    # fast_mode: gradcheck compares the Jacobian along random directions (torch's documented fast mode) instead of
    # column by column: the same check of the backward, 0.6 s instead of 17 s on the 2-core VM
    q, k, v, g, beta, h0 = _inputs(B=1, T=70, Hk=1, Hv=2, K=4, V=3)
    args = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]

    def fn(q, k, v, g, beta, h0):
        o, h = eager.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
        return o, h

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, fast_mode=True)

    def summary(k, v, g, beta):
        return eager.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True)

    assert torch.autograd.gradcheck(summary, args[1:5], eps=1e-6, atol=1e-7, fast_mode=True)


def test_eager_backend_stage_contract():
    """The eager backend stages nothing: prepare_chunks is None, need_transition=False drops M only, and a
    prepared object from another backend is refused rather than ignored."""
    q, k, v, g, beta, _ = _inputs(T=128)
    be = eager.EagerGDNBackend()
    assert be.prepare_chunks(k, v, g, beta, use_qk_l2norm_in_kernel=True) is None
    m, s = be.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True)
    m0, s0 = be.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True, need_transition=False)
    assert m0 is None and m is not None and torch.equal(s0, s)
    with pytest.raises(TypeError, match="no prepared chunks"):
        be.chunk_gated_delta_rule(q, k, v, g, beta, prepared=object())
    with pytest.raises(TypeError, match="no prepared chunks"):
        be.state_summary(k, v, g, beta, prepared=object())
    with pytest.raises(TypeError, match="no prepared chunks"):
        be.initial_state_grad(q, k, v, g, beta, torch.randn_like(v), prepared=object())


@pytest.mark.parametrize("first_continues", [True, False])
def test_eager_varlen_equals_token_recurrence_per_document(first_continues):
    """Packed row: each document from its own start (the first from H0 only when it continues), final state
    and S the last document's, M zero once a document starts in the row; float64 token recurrence as reference."""
    from deltacp.ops.gdn import eager, naive
    from deltacp.ops.gdn.varlen import VarlenLayout

    torch.manual_seed(0)
    T, Hk, Hv, K, V = 200, 2, 4, 16, 8
    q, k = (torch.randn(1, T, Hk, K, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, Hv, V, dtype=torch.float64)
    g = -torch.rand(1, T, Hv, dtype=torch.float64) * 0.05
    beta = torch.rand(1, T, Hv, dtype=torch.float64)
    h0 = torch.randn(1, Hv, K, V, dtype=torch.float64)
    cu = torch.tensor([0, 1, 5, 70, 128, 129, 200])
    layout = VarlenLayout.build(cu, T, first_continues=first_continues)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, ht = eager.chunk_gated_delta_rule(*inputs, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=layout)
    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    outs = []
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        oo, hh = naive.recurrent_gated_delta_rule(*(x[:, a:b] for x in ref_inputs),
                                                  initial_state=h0 if i == 0 and first_continues else None,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(oo)
    ref = torch.cat(outs, 1)
    assert rel_l2(o, ref) < 1e-12 and rel_l2(ht, hh) < 1e-12
    d_o = torch.randn_like(o)
    (o * d_o).sum().backward()
    (ref * d_o).sum().backward()
    for x, r in zip(inputs, ref_inputs):
        assert rel_l2(x.grad, r.grad) < 1e-11
    m, s = eager.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=layout)
    assert m.abs().max() == 0 and rel_l2(s, hh) < 1e-12
    dh0 = eager.initial_state_grad(q, k, v, g, beta, d_o, use_qk_l2norm_in_kernel=True, cu_seqlens=layout)
    if first_continues:  # only the first document reads H0
        h = h0.clone().requires_grad_()
        o1, _ = naive.recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=h,
                                                 use_qk_l2norm_in_kernel=True)
        (o1 * d_o[:, :1]).sum().backward()
        assert rel_l2(dh0, h.grad) < 1e-12
    else:
        assert dh0.abs().max() == 0
