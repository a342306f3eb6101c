"""The selective scan (`ops/selective/eager.py`, Mamba1's recurrence under the recurrence contract), float64 on the
CPU: against a token recurrence written here and transformers' `mamba_selective_scan` (its torch loop), with an
entering state (added before the silu(z) gate), lengths off the chunk, packed documents (the first continuing);
the contract's summary (h_out = M ⊙ h_in + S, M diagonal), the entering state's gradient, and every input gradient;
B and C shared by every channel, or per group of channels (Zamba's Mamba heads: one contract head per group)."""

import pytest
import torch
import torch.nn.functional as F

from deltacp.ops.recurrence import RecurrenceInputs
from deltacp.ops.selective.eager import DIAGONAL, SelectiveScan, selective_scan

pytestmark = pytest.mark.fast


def token_recurrence(x, dt, A, B, C, D, z, h0=None, starts=()):
    R, T, I = x.shape
    if B.dim() == 4:  # per group of channels: each channel reads its group's B and C
        B, C = (t.repeat_interleave(I // t.shape[2], dim=2) for t in (B, C))
        return _channel_recurrence(x, dt, A, B, C, D, z, h0, starts)
    return _channel_recurrence(x, dt, A, B[:, :, None], C[:, :, None], D, z, h0, starts)


def _channel_recurrence(x, dt, A, B, C, D, z, h0, starts):
    """B, C [R, T, I or 1, N]."""
    R, T, I = x.shape
    h = torch.zeros(R, I, A.shape[-1], dtype=x.dtype) if h0 is None else h0.clone()
    ys = []
    for t in range(T):
        if t in starts:
            h = torch.zeros_like(h)
        h = (dt[:, t, :, None] * A).exp() * h + (dt[:, t] * x[:, t])[..., None] * B[:, t]
        ys.append(((h * C[:, t]).sum(-1) + D * x[:, t]) * F.silu(z[:, t]))
    return torch.stack(ys, dim=1), h


def _inputs(R=2, T=45, I=6, N=5, seed=0, G=None):
    """G: B and C per group of I / G channels ([R, T, G, N]); None: shared ([R, T, N])."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    f32 = lambda t: t.float().double()  # noqa: E731  (transformers' loop reads x and B in float32)
    bc = (R, T, N) if G is None else (R, T, G, N)
    x, B = f32(r(R, T, I)), f32(r(*bc))
    dt = F.softplus(r(R, T, I))
    A = -(r(I, N).exp())
    return x, dt, A.expand(R, I, N), B, r(*bc), r(I).expand(R, I), r(R, T, I), r(R, I, N)


def test_matches_the_token_recurrence_and_transformers_loop():
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    x, dt, A, B, C, D, z, h0 = _inputs()
    for T in (1, 45):  # one token; several chunks with a partial one
        xs = (x[:, :T], dt[:, :T], A, B[:, :T], C[:, :T], D, z[:, :T])
        ref, ref_h = token_recurrence(*xs, h0=h0)
        y, h = selective_scan(*xs, initial_state=h0, output_final_state=True)
        torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h, ref_h, rtol=1e-12, atol=1e-12)
    hf, hf_h = mamba_selective_scan(x.mT, dt.mT, A[0], B.mT, C.mT, D=D[0], z=z.mT, return_last_state=True)
    y, h = selective_scan(x, dt, A, B, C, D, z, output_final_state=True)
    torch.testing.assert_close(y, hf.mT, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, hf_h, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("G", [None, 3])
def test_contract_summary_state_grad_documents_and_gradients(G):
    x, dt, A, B, C, D, z, h0 = _inputs(T=40, seed=1, G=G)
    rec = SelectiveScan()
    R, I, N = A.shape
    H = G or 1  # the contract's heads: one per group
    inp = RecurrenceInputs(x, dt, A, B, C, D, z)
    rec.check(inp)
    assert rec.state_shape(inp) == (R, H, I // H * N, 1)
    h0_c = h0.reshape(R, H, I // H * N, 1)
    starts = (0, 13, 30)  # documents at 13 and 30; the first continues the entering state
    for cu in (None, torch.tensor([0, 13, 30, 40])):
        kw = dict(starts=starts[1:] if cu is not None else ())
        ref, ref_h = token_recurrence(x[:1], dt[:1], A[:1], B[:1], C[:1], D[:1], z[:1], h0[:1], **kw)
        one = inp.rows(slice(0, 1))
        o, ht = rec.forward(one, initial_state=h0_c[:1], output_final_state=True, cu_seqlens=cu)
        torch.testing.assert_close(o.flatten(2), ref, rtol=1e-12, atol=1e-12)
        m, s = rec.summary(one, cu_seqlens=cu)
        torch.testing.assert_close(DIAGONAL.apply(m, s, h0_c[:1]), ht, rtol=1e-12, atol=1e-12)
        assert (m.abs().max() == 0) == (cu is not None)  # a document starts inside: the entering state cannot reach
        g_o = torch.randn_like(o)
        h_in = h0_c[:1].clone().requires_grad_()
        (rec.forward(one, initial_state=h_in, cu_seqlens=cu)[0] * g_o).sum().backward()
        torch.testing.assert_close(rec.initial_state_grad(one, g_o, cu_seqlens=cu), h_in.grad, rtol=1e-12,
                                   atol=1e-12)
    leaves = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D, z, h0)]
    y, h = selective_scan(*leaves[:7], initial_state=leaves[7], output_final_state=True)
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    grads = torch.autograd.grad((y * gy).sum() + (h * gh).sum(), leaves)
    ry, rh = token_recurrence(*leaves[:7], h0=leaves[7])
    for got, ref in zip(grads, torch.autograd.grad((ry * gy).sum() + (rh * gh).sum(), leaves)):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_diagonal_scan_against_token_recurrence_and_transformers_rnn_scan():
    """The RG-LRU's diagonal scan (`ops/selective/diagonal.py`): outputs and final state against a token recurrence
    and transformers' `RecurrentGemmaRglru._rnn_scan` (its loop, accumulating in float64 here), with an entering
    state and resets; the contract's summary, the entering state's gradient with documents, every input gradient."""
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    from deltacp.ops.selective.diagonal import DiagonalScan, diagonal_scan

    gen = torch.Generator().manual_seed(5)
    R, T, H, K = 2, 37, 3, 4
    a = torch.rand(R, T, H, K, generator=gen, dtype=torch.float64) * 0.3 + 0.7
    reset = torch.zeros(R, T, 1, 1, dtype=torch.bool)
    reset[:, 0] = reset[1, 20] = True
    a = a * ~reset
    b = torch.randn(R, T, H, K, generator=gen, dtype=torch.float64)
    h0 = torch.randn(R, H, K, generator=gen, dtype=torch.float64)

    def token(a, b, h, starts=()):
        ys = []
        for t in range(a.shape[1]):
            h = (0 if t in starts else a[:, t]) * h + b[:, t]
            ys.append(h)
        return torch.stack(ys, dim=1), h

    ref, ref_h = token(a, b, h0)
    y, h = diagonal_scan(a, b, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, ref_h, rtol=1e-12, atol=1e-12)
    hf, hf_h = RecurrentGemmaRglru._rnn_scan(None, b.flatten(2), a.flatten(2), reset.expand(R, T, H, K).flatten(2),
                                             None, acc_dtype=torch.float64)
    y, h = diagonal_scan(a, b, output_final_state=True)
    torch.testing.assert_close(y.flatten(2), hf, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.flatten(1), hf_h, rtol=1e-12, atol=1e-12)

    rec, one = DiagonalScan(), RecurrenceInputs(a[1:], b[1:])
    rec.check(one)
    h_in = h0[1:, ..., None]
    for cu in (None, torch.tensor([0, 9, 37])):  # a document at 9; the first continues the entering state
        ref, ref_h = token(a[1:], b[1:], h0[1:], starts=(9,) if cu is not None else ())
        o, ht = rec.forward(one, initial_state=h_in, output_final_state=True, cu_seqlens=cu)
        torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)
        m, s = rec.summary(one, cu_seqlens=cu)
        torch.testing.assert_close(DIAGONAL.apply(m, s, h_in), ht, rtol=1e-12, atol=1e-12)
        g_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
        leaf = h_in.clone().requires_grad_()
        (rec.forward(one, initial_state=leaf, cu_seqlens=cu)[0] * g_o).sum().backward()
        torch.testing.assert_close(rec.initial_state_grad(one, g_o, cu_seqlens=cu), leaf.grad, rtol=1e-12,
                                   atol=1e-12)
    leaves = [t.clone().requires_grad_() for t in (a, b, h0)]
    y, h = diagonal_scan(*leaves[:2], initial_state=leaves[2], output_final_state=True)
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    ry, rh = token(*leaves)
    for got, want in zip(torch.autograd.grad((y * gy).sum() + (h * gh).sum(), leaves),
                         torch.autograd.grad((ry * gy).sum() + (rh * gh).sum(), leaves)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
