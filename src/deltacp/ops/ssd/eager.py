"""Eager (pure PyTorch) chunked scalar-decay recurrence: the reference of Mamba2's SSD under the recurrence contract.

    h_t = exp(g_t) h_{t-1} + k_t v_tᵀ,   v_t = scale_t x_t     h [B, H, N, P]  (N: state rows, the contract's K;
    o_t = h_tᵀ q_t + skip_t x_t                                                  P: its V)

Inputs (q, k, x, g, scale, skip): q, k [B, T, G, N] (shared by groups of heads, each group serving H / G consecutive
heads), x [B, T, H, P], and per head and token g (the log decay, <= 0), scale (the value scale; None: 1) and skip
(the skip weight; None: no skip term), each [B, T, H]. The scales act on x where it is read, so a backend need not
hold v = scale x, nor the skip term, as a [B, T, H, P] tensor: Mamba2 maps onto it as k = B_t, q = C_t, x its x_t,
g = dt_t A, scale = dt_t, skip = D (per head, expanded over the tokens).
M, the effect of a segment on the entering state, is the scalar exp(sum g) per head (`Transition("scalar")`),
zero where a document starts inside the segment.

Computation in float32 for float32 / bf16 inputs and float64 for float64 (`ops.precision.compute_dtype`); backward by
autograd. Packed documents (one row, `cu_seqlens` offsets or a `VarlenLayout`): the chunk-aligned layout and resets of
`ops/gdn/varlen.py` (a zero token leaves the state unchanged: g = 0, k = v = 0).

Shape legend inside: x_BHNCD [B, H, chunks, C = 64, D]; gam_BHNC the cumulative log decay inside each chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltacp.ops.gdn.contract import CHUNK_SIZE
from deltacp.ops.gdn.varlen import VarlenLayout, as_layout
from deltacp.ops.precision import compute_dtype
from deltacp.ops.recurrence import RecurrenceInputs, StagesNothing, Transition

SCALAR = Transition("scalar")


def _chunks(q, k, v, g):
    """Heads first, chunked, zero-padded in time; q/k repeated from groups to heads."""
    dt = compute_dtype(v)
    B, T, G, N = k.shape
    H = v.shape[2]
    C = CHUNK_SIZE
    pad = (-T) % C
    n = (T + pad) // C

    def heads_first(x):
        x = F.pad(x.to(dt), (0, 0, 0, 0, 0, pad)).transpose(1, 2)
        return x.reshape(B, x.shape[1], n, C, x.shape[-1])

    rep = H // G
    k, q = (None if x is None else heads_first(x.repeat_interleave(rep, dim=2) if rep > 1 else x) for x in (k, q))
    v = heads_first(v)
    gam = F.pad(g.to(dt), (0, 0, 0, pad)).transpose(1, 2).reshape(B, H, n, C).cumsum(-1)
    return q, k, v, gam, T


def _check(q, k, x, g, scale, skip):
    if k.dim() != 4 or x.dim() != 4 or g.shape != x.shape[:3] or (q is not None and q.shape != k.shape):
        raise ValueError(f"the scalar-decay recurrence takes q, k [B, T, G, N], x [B, T, H, P], g [B, T, H]; got "
                         f"q {None if q is None else tuple(q.shape)}, k {tuple(k.shape)}, x {tuple(x.shape)}, "
                         f"g {tuple(g.shape)}")
    if x.shape[2] % k.shape[2]:
        raise ValueError(f"heads ({x.shape[2]}) must be a multiple of the groups of q/k ({k.shape[2]})")
    for name, t in (("scale", scale), ("skip", skip)):
        if t is not None and t.shape != g.shape:
            raise ValueError(f"{name} must be shaped as g {tuple(g.shape)} (one weight per head and token), got "
                             f"{tuple(t.shape)}")


def _values(x, scale):
    """v = scale x in the compute dtype (x itself without a scale)."""
    return x if scale is None else x.to(compute_dtype(x)) * scale.to(compute_dtype(x))[..., None]


def chunk_scalar_decay(q, k, x, g, scale=None, skip=None, *, initial_state=None, output_final_state=False,
                       cu_seqlens: torch.Tensor | VarlenLayout | None = None):
    """(o [B, T, H, P] in the dtype of v = scale x (the compute dtype with a scale, else x's), final state
    [B, H, N, P] or None); differentiable in every input and the entering state."""
    _check(q, k, x, g, scale, skip)
    v = _values(x, scale)
    layout = as_layout(cu_seqlens, v.shape[1])
    if layout is not None:
        q, k, v_in, g = (layout.to_chunks(t) for t in (q, k, v, g))
    else:
        v_in = v
    qc, kc, vc, gam, T = _chunks(q, k, v_in, g)
    B, H, n, C, N = kc.shape
    causal = torch.ones(C, C, dtype=torch.bool, device=vc.device).tril()
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    qk = (qc @ kc.transpose(-1, -2)) * decay
    q_dec = qc * gam.exp()[..., None]
    k_tail = kc * (gam[..., -1:] - gam).exp()[..., None]
    chunk_decay = gam[..., -1].exp()
    h = vc.new_zeros(B, H, N, vc.shape[-1]) if initial_state is None else initial_state.to(vc.dtype)
    resets = layout.chunk_resets if layout is not None else [False] * n
    outs = []
    for c in range(n):
        if resets[c]:
            h = torch.zeros_like(h)
        outs.append(q_dec[:, :, c] @ h + qk[:, :, c] @ vc[:, :, c])
        h = chunk_decay[:, :, c, None, None] * h + k_tail[:, :, c].transpose(-1, -2) @ vc[:, :, c]
    o = torch.stack(outs, dim=2).reshape(B, H, n * C, -1)[:, :, :T].transpose(1, 2)
    if layout is not None:
        o = layout.from_chunks(o)
    if skip is not None:
        o = o + skip.to(o.dtype)[..., None] * x.to(o.dtype)
    return o.to(v.dtype), (h if output_final_state else None)


def summary_scalar_decay(k, x, g, scale=None, *, need_transition=True, cu_seqlens=None):
    """(M packed [B, H, N, 1] or None, S [B, H, N, P]): h_out = M h_in + S for this segment; M = 0 when a document
    starts inside it (or the first does not continue)."""
    _check(None, k, x, g, scale, None)
    v = _values(x, scale)
    layout = as_layout(cu_seqlens, v.shape[1])
    if layout is not None:
        k, v, g = (layout.to_chunks(t) for t in (k, v, g))
    _, kc, vc, gam, _ = _chunks(None, k, v, g)
    B, H, n, C, N = kc.shape
    k_tail = kc * (gam[..., -1:] - gam).exp()[..., None]
    chunk_decay = gam[..., -1].exp()
    m = torch.ones(B, H, dtype=vc.dtype, device=vc.device)
    s = vc.new_zeros(B, H, N, vc.shape[-1])
    resets = layout.chunk_resets if layout is not None else [False] * n
    for c in range(n):
        if resets[c]:
            m, s = torch.zeros_like(m), torch.zeros_like(s)
        m = chunk_decay[:, :, c] * m
        s = chunk_decay[:, :, c, None, None] * s + k_tail[:, :, c].transpose(-1, -2) @ vc[:, :, c]
    return (SCALAR.pack(m, N) if need_transition else None), s


def initial_state_grad(q, k, x, g, grad_o, *, cu_seqlens=None) -> torch.Tensor:
    """d sum(o * grad_o) / dh0, by autograd from a zero h0 (o is affine in h0, with a coefficient free of the
    values, their scale and the skip: none of them is read)."""
    B, H, N, P = x.shape[0], x.shape[2], k.shape[-1], x.shape[-1]
    layout = as_layout(cu_seqlens, x.shape[1])
    if layout is not None and layout.chunk_resets[0]:
        return torch.zeros(B, H, N, P, dtype=compute_dtype(x), device=x.device)
    with torch.enable_grad():
        h0 = torch.zeros(B, H, N, P, dtype=compute_dtype(x), device=x.device, requires_grad=True)
        o, _ = chunk_scalar_decay(q.detach(), k.detach(), x.detach(), g.detach(), initial_state=h0,
                                  cu_seqlens=layout)
        return torch.autograd.grad(o, h0, grad_o)[0]


class ScalarDecay(StagesNothing):
    """The scalar-decay recurrence under the contract (`ops/recurrence.py`), eager: inputs (q, k, x, g, scale, skip)
    with scale and skip optional (None: v = x; no skip term); M scalar per head. A backend of other kernels
    (`ops/ssd/triton`) subclasses it, giving its own ops (`_op`) and checks."""

    transition = SCALAR
    name = "eager"

    def _op(self, name: str):
        """This backend's op `name` (chunk_scalar_decay, summary_scalar_decay, initial_state_grad)."""
        return globals()[name]

    def check(self, x: RecurrenceInputs) -> None:
        q, k, v, g, scale, skip = self._unpack(x)
        _check(q, k, v, g, scale, skip)
        if not v.is_floating_point():
            raise ValueError(f"the scalar-decay recurrence needs floating-point inputs, got {v.dtype}")

    def state_shape(self, x: RecurrenceInputs) -> tuple[int, ...]:
        q, k, v, g, scale, skip = self._unpack(x)
        return (v.shape[0], v.shape[2], k.shape[-1], v.shape[-1])

    @staticmethod
    def _unpack(x: RecurrenceInputs) -> tuple:
        if len(x) != 6:
            raise ValueError(f"the scalar-decay recurrence takes six inputs (q, k, x, g, scale, skip; scale and skip "
                             f"may be None), got {len(x)}")
        return x.tensors

    def forward(self, x, *, initial_state=None, output_final_state=False, prepared=None, cu_seqlens=None):
        self._no_prepared(prepared)
        _check(*self._unpack(x))
        return self._op("chunk_scalar_decay")(*x, initial_state=initial_state, output_final_state=output_final_state,
                                              cu_seqlens=cu_seqlens)

    def summary(self, x, *, prepared=None, need_transition=True, cu_seqlens=None):
        self._no_prepared(prepared)
        q, k, v, g, scale, skip = self._unpack(x)
        _check(None, k, v, g, scale, None)
        return self._op("summary_scalar_decay")(k, v, g, scale, need_transition=need_transition,
                                                cu_seqlens=cu_seqlens)

    def initial_state_grad(self, x, grad_o, *, prepared=None, cu_seqlens=None):
        """d sum(o * grad_o) / dh0 (neither the values' scale nor the skip enters it)."""
        self._no_prepared(prepared)
        q, k, v, g, scale, skip = self._unpack(x)
        _check(q, k, v, g, None, None)
        return self._op("initial_state_grad")(q, k, v, g, grad_o, cu_seqlens=cu_seqlens)
