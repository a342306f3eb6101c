"""KDA, the gated delta rule with a decay per key channel (`ops/kda/eager.py`), float64 on the CPU:

- against a token-by-token recurrence written here (h_t = (I - β k kᵀ) diag(exp g_t) h_{t-1} + β k vᵀ, o_t = h_tᵀ q_t,
  q and k l2-normalised, q scaled), for lengths not multiples of the chunk, K = V and K != V, entering and final
  states, and in the gate regimes KDA meets: near-frozen, slow, fast (Bailing's safe gate down to -5 per token and
  channel), channels mixing both, and Kimi's unbounded gate;
- against transformers' own `recurrent_kimi_delta_attention` and `chunk_kimi_delta_attention` (kept float64 by
  `float64_upcasts`; and in float32 as they run);
- gradients of every input and of the entering state against autograd of the token recurrence;
- the contract's pieces: the summary (h_out = M h_in + S, M full), the entering state's gradient, packed documents.
"""

import pytest
import torch

from deltacp.ops.gdn.varlen import VarlenLayout
from deltacp.ops.kda.eager import KimiDeltaRule, chunk_kda, summary_kda
from deltacp.ops.recurrence import FULL, RecurrenceInputs

pytestmark = pytest.mark.fast


def token_recurrence(q, k, v, g, beta, h0=None, starts=(), l2=True):
    """The reference: one token at a time, in the dtype of the inputs."""
    if l2:
        q, k = (x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    B, T, H, K = k.shape
    h = torch.zeros(B, H, K, v.shape[-1], dtype=v.dtype) if h0 is None else h0
    outs = []
    for t in range(T):
        if t in starts:
            h = torch.zeros_like(h)
        h = h * g[:, t].exp()[..., None]
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], h)
        h = h + beta[:, t, :, None, None] * k[:, t, :, :, None] * (v[:, t] - pred)[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], h))
    return torch.stack(outs, dim=1), h


GATES = {
    "near_frozen": lambda r: -1e-7 * r,
    "slow": lambda r: -0.05 * r,
    "fast": lambda r: -5.0 * r,  # Bailing's kda_lower_bound
    "mixed": lambda r: torch.where(torch.arange(r.shape[-1]) % 2 == 0, -5.0 + 0 * r, -1e-6 * r),
    "unbounded": lambda r: -40.0 * r,  # Kimi's gate has no lower bound
}


def _inputs(T=100, B=2, H=2, K=16, V=16, gate="slow", seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    g, beta, h0 = GATES[gate](u(B, T, H, K)), u(B, T, H), r(B, H, K, V)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta, h0))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("T,K,V", [(100, 16, 16), (200, 16, 32)])
def test_matches_the_token_recurrence_with_states(T, K, V):
    q, k, v, g, beta, h0 = _inputs(T=T, K=K, V=V)
    for l2 in (True, False):
        kk = k if l2 else k / K**0.5  # unnormalised keys of a norm that keeps the delta rule contractive
        o, ht = chunk_kda(q, kk, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
        o_ref, ht_ref = token_recurrence(q, kk, v, g, beta, h0, l2=l2)
        assert _rel(o, o_ref) < 1e-12 and _rel(ht, ht_ref) < 1e-12, l2
    o, ht = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert ht is None and _rel(o, token_recurrence(q, k, v, g, beta)[0]) < 1e-12


@pytest.mark.parametrize("gate", sorted(GATES))
def test_gate_regimes(gate):
    q, k, v, g, beta, h0 = _inputs(T=150, B=1, gate=gate, seed=1)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, ht_ref = token_recurrence(q, k, v, g, beta, h0)
    assert _rel(o, o_ref) < 1e-12 and _rel(ht, ht_ref) < 1e-12
    m, s = summary_kda(k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert _rel(FULL.apply(m, s, h0), ht_ref) < 1e-12
    # float32 (what bf16 models compute in): finite, gradients too, and at float32 distance from float64
    x32 = [t.float().requires_grad_() for t in (q, k, v, g, beta, h0)]
    o32, ht32 = chunk_kda(*x32[:5], initial_state=x32[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert _rel(o32.double(), o_ref) < 3e-5 and _rel(ht32.double(), ht_ref) < 3e-5
    grads = torch.autograd.grad((o32.sum() + ht32.sum()), x32)
    assert all(torch.isfinite(d).all() for d in grads)


def test_matches_transformers_kimi_delta_attention():
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid as bailing
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    from helpers import float64_upcasts

    q, k, v, g, beta, h0 = _inputs(T=100, K=16, V=32, gate="fast", seed=2)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    refs = [kimi.recurrent_kimi_delta_attention, kimi.chunk_kimi_delta_attention, bailing.chunk_kimi_delta_attention]
    for i, fn in enumerate(refs):
        with float64_upcasts():  # their float32 casts kept float64
            o_ref, ht_ref = fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
        assert o_ref.dtype == torch.float64
        assert _rel(o, o_ref) < 1e-12 and _rel(ht, ht_ref) < 1e-12, i
    # as they run: float32
    x32 = [t.float() for t in (q, k, v, g, beta, h0)]
    o32, ht32 = chunk_kda(*x32[:5], initial_state=x32[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, ht_ref = kimi.chunk_kimi_delta_attention(*x32[:3], g=x32[3], beta=x32[4], initial_state=x32[5],
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o32.dtype == torch.float32 and _rel(o32, o_ref) < 1e-5 and _rel(ht32, ht_ref) < 1e-5


def test_gradients_of_every_input_and_the_entering_state():
    x = [t.requires_grad_() for t in _inputs(T=100, B=1, K=16, V=32, gate="fast", seed=3)]
    gen = torch.Generator().manual_seed(4)
    go, gh = torch.randn(1, 100, 2, 32, generator=gen, dtype=torch.float64), torch.randn(1, 2, 16, 32, generator=gen,
                                                                                          dtype=torch.float64)
    o, ht = chunk_kda(*x[:5], initial_state=x[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
    got = torch.autograd.grad((o * go).sum() + (ht * gh).sum(), x)
    o, ht = token_recurrence(*x[:5], x[5])
    ref = torch.autograd.grad((o * go).sum() + (ht * gh).sum(), x)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), got, ref):
        assert _rel(a, b) < 1e-10, name


def test_contract_summary_and_entering_state_gradient():
    q, k, v, g, beta, h0 = _inputs(T=97, K=16, V=32, seed=5)
    rec = KimiDeltaRule()
    x = RecurrenceInputs(q, k, v, g, beta)
    rec.check(x)
    assert rec.state_shape(x) == tuple(h0.shape) and rec.transition.kind == "full" and rec.name == "eager"
    assert rec.prepare(x) is None
    with pytest.raises(TypeError):
        rec.prepared_from_saved(())
    m, s = rec.summary(x)
    assert m.shape == (2, 2, 16, 16)
    _, ht_ref = token_recurrence(q, k, v, g, beta, h0)
    assert _rel(FULL.apply(m, s, h0), ht_ref) < 1e-12
    m_none, s_only = rec.summary(x, need_transition=False)
    assert m_none is None and _rel(s_only, s) < 1e-14
    grad_o = torch.randn_like(v)
    h0v = h0.clone().requires_grad_()
    (ref,) = torch.autograd.grad((token_recurrence(q, k, v, g, beta, h0v)[0] * grad_o).sum(), h0v)
    assert _rel(rec.initial_state_grad(x, grad_o), ref) < 1e-12


def test_packed_documents_restart_the_state():
    q, k, v, g, beta, h0 = (t[:1] for t in _inputs(T=200, K=16, V=32, gate="fast", seed=6))
    cu = torch.tensor([0, 37, 150, 200])
    rec, x = KimiDeltaRule(), RecurrenceInputs(q, k, v, g, beta)
    grad_o = torch.randn_like(v)
    for continues in (True, False):
        layout = VarlenLayout.build(cu, 200, first_continues=continues)
        o, ht = rec.forward(x, initial_state=h0, output_final_state=True, cu_seqlens=layout)
        outs = []
        for d, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):  # each document on its own
            h_enter = h0 if d == 0 and continues else None
            o_d, ht_ref = token_recurrence(*(t[:, a:b] for t in (q, k, v, g, beta)), h_enter)
            outs.append(o_d)
        assert _rel(o, torch.cat(outs, dim=1)) < 1e-12 and _rel(ht, ht_ref) < 1e-12, continues
        m, s = rec.summary(x, cu_seqlens=layout)
        assert m.abs().max() == 0 and _rel(s, ht_ref) < 1e-12  # the entering state cannot reach the end
        h0v = h0.clone().requires_grad_()
        o_ref = token_recurrence(q, k, v, g, beta, h0v, starts=(37, 150) if continues else (0, 37, 150))[0]
        dh0 = rec.initial_state_grad(x, grad_o, cu_seqlens=layout)
        if continues:
            (ref,) = torch.autograd.grad((o_ref * grad_o).sum(), h0v)
            assert _rel(dh0, ref) < 1e-12
        else:
            assert dh0.abs().max() == 0


def test_rejects_inputs_outside_the_contract():
    q, k, v, g, beta, h0 = _inputs(T=10)
    rec = KimiDeltaRule()
    with pytest.raises(ValueError, match="g \\[B, T, H, K\\]"):
        rec.check(RecurrenceInputs(q, k, v, g[..., 0], beta))  # GDN's scalar gate
    with pytest.raises(ValueError, match="one key head per value head"):
        rec.check(RecurrenceInputs(q[:, :, :1], k[:, :, :1], v, g[:, :, :1], beta))
    with pytest.raises(ValueError, match="floating-point"):
        rec.check(RecurrenceInputs(q, k, v.long(), g, beta))
    with pytest.raises(ValueError, match="inputs \\(q, k, v, g, beta\\)"):
        rec.check(RecurrenceInputs(q, k, v, g))
