"""The scalar-decay recurrence (`ops/ssd/eager.py`, Mamba2's SSD under the recurrence contract), float64 on the CPU:

- against a token-by-token recurrence written here (h_t = exp(g_t) h_{t-1} + k_t v_tᵀ, o_t = h_tᵀ q_t + skip_t x_t,
  v_t = scale_t x_t), lengths not multiples of the chunk, grouped q/k, an entering state, packed documents (one
  continuing); without the scale and the skip (v = x, no skip term);
- the contract's pieces: the summary (h_out = M h_in + S, M a packed scalar per head), the entering state's gradient;
- Mamba2's own reference, transformers' `mamba2_chunk_scan` (Bamba's torch path), through the mapping k = B, q = C,
  x, g = dt A, scale = dt, skip = D.
"""

import pytest
import torch

from deltacp.ops.recurrence import RecurrenceInputs
from deltacp.ops.ssd.eager import SCALAR, ScalarDecay, chunk_scalar_decay

pytestmark = pytest.mark.fast


def token_recurrence(q, k, x, g, scale=None, skip=None, h0=None, starts=()):
    v = x if scale is None else x * scale[..., None]
    B, T, G, N = k.shape
    H, P = v.shape[2], v.shape[3]
    rep = H // G
    q, k = (x.repeat_interleave(rep, dim=2) for x in (q, k))
    h = torch.zeros(B, H, N, P, dtype=v.dtype) if h0 is None else h0.clone()
    outs = []
    for t in range(T):
        if t in starts:
            h = torch.zeros_like(h)
        h = h * g[:, t].exp()[..., None, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhn,bhnp->bhp", q[:, t], h))
    o = torch.stack(outs, dim=1)
    return (o if skip is None else o + skip[..., None] * x), h


def _inputs(T=150, B=2, G=2, H=4, N=6, P=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = r(B, T, G, N), r(B, T, G, N)
    x = r(B, T, H, P)
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.2
    scale = torch.rand(B, T, H, generator=gen, dtype=torch.float64) + 0.1
    return q, k, x, g, scale, r(B, T, H), r(B, H, N, P)


@pytest.mark.parametrize("weights", [True, False], ids=["scale_and_skip", "plain"])
def test_matches_the_token_recurrence_with_state_and_skip(weights):
    q, k, x, g, scale, skip, h0 = _inputs()
    if not weights:
        scale = skip = None
    o, ht = chunk_scalar_decay(q, k, x, g, scale, skip, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = token_recurrence(q, k, x, g, scale, skip, h0)
    assert (o - o_ref).norm() / o_ref.norm() < 1e-12
    assert (ht - ht_ref).norm() / ht_ref.norm() < 1e-12


def test_packed_documents_restart_the_state():
    from deltacp.ops.gdn.varlen import VarlenLayout

    q, k, x, g, scale, skip, h0 = (t[:1] for t in _inputs(T=140))
    cu = torch.tensor([0, 1, 40, 41, 107, 140])
    for continues in (True, False):
        layout = VarlenLayout.build(cu, 140, first_continues=continues)
        o, ht = chunk_scalar_decay(q, k, x, g, scale, skip, initial_state=h0, output_final_state=True,
                                   cu_seqlens=layout)
        o_ref, ht_ref = token_recurrence(q, k, x, g, scale, skip, h0,
                                         starts=(() if continues else (0,)) + (1, 40, 41, 107))
        assert (o - o_ref).norm() / o_ref.norm() < 1e-12, continues
        assert (ht - ht_ref).norm() / ht_ref.norm() < 1e-12, continues
        m, s = ScalarDecay().summary(RecurrenceInputs(q, k, x, g, scale, skip), cu_seqlens=layout)
        assert m.abs().max() == 0  # documents start inside: the entering state cannot reach the end
        fresh = token_recurrence(q, k, x, g, scale, None, None, starts=(1, 40, 41, 107))[1]
        assert (s - (ht_ref if not continues else fresh)).norm() < 1e-10


def test_contract_summary_and_entering_state_gradient():
    q, k, v, g, scale, skip, h0 = _inputs(T=97)
    rec = ScalarDecay()
    x = RecurrenceInputs(q, k, v, g, scale, skip)
    rec.check(x)
    assert rec.state_shape(x) == tuple(h0.shape) and rec.transition.kind == "scalar"
    m, s = rec.summary(x)
    assert m.shape == (*h0.shape[:3], 1)
    _, ht = rec.forward(x, initial_state=h0, output_final_state=True)
    assert (SCALAR.apply(m, s, h0) - ht).norm() / ht.norm() < 1e-12
    grad_o = torch.randn_like(v)
    h0v = h0.clone().requires_grad_()
    o, _ = rec.forward(x, initial_state=h0v)
    (ref,) = torch.autograd.grad((o * grad_o).sum(), h0v)
    assert (rec.initial_state_grad(x, grad_o) - ref).norm() / ref.norm() < 1e-12


def test_mamba2_through_the_mapping_matches_transformers_chunk_scan():
    import torch.nn.functional as F
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    from helpers import float64_upcasts

    gen = torch.Generator().manual_seed(3)
    B, T, H, P, G, N = 2, 150, 4, 5, 2, 6
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x, Bm, Cm, dt_raw = r(B, T, H, P), r(B, T, G, N), r(B, T, G, N), r(B, T, H)
    A_log, dt_bias, D = r(H) * 0.5, r(H), r(H)
    with float64_upcasts():  # transformers' float32 casts kept float64
        ref = mamba2_chunk_scan(x, dt_raw, -A_log.exp(), Bm, Cm, chunk_size=32, D=D, dt_bias=dt_bias,
                                dt_softplus=True, dt_limit=(0.0, float("inf")))
    dt = F.softplus(dt_raw + dt_bias)
    o, _ = chunk_scalar_decay(Cm, Bm, x, dt * -A_log.exp(), dt, D.expand_as(dt))
    assert (o - ref).norm() / ref.norm() < 1e-12
