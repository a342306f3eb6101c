"""Eager (pure PyTorch) chunked Kimi delta attention (KDA): the gated delta rule with a decay per key channel.

State h [B, H, K, V], oriented as transformers' `recurrent_kimi_delta_attention` keeps it (keys on the rows):

    h_t = (I - beta_t k_t k_tᵀ) diag(exp(g_t)) h_{t-1} + beta_t k_t v_tᵀ        o_t = h_tᵀ q_t

(transposed, S_t = h_tᵀ [V, K]: S_t = S_{t-1} diag(α_t) (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ, o_t = S_t q_t). The
decay acts first, then the delta-rule write reads the decayed state. q, k [B, T, H, K], v [B, T, H, V], g [B, T, H,
K] (log decay per token and key channel, <= 0), beta [B, T, H]. With `use_qk_l2norm_in_kernel`, q and k are l2-normalised
inside the op as transformers does (x / sqrt(sum x² + 1e-6)); the query is then multiplied by `scale` (None:
K ** -0.5), as `GatedDeltaRule` does for GDN. M, the effect of a segment on the entering state, is a full K x K matrix
per head (`Transition("full")`), zero where a document starts inside the segment.

Inside a chunk of C = 64 tokens with cumulative log decay gam (per channel, non-increasing), the WY form is GDN's with
the scalar decay replaced by a diagonal one:

    A[i, j] = beta_i sum_c k_ic k_jc exp(gam_ic - gam_jc)   (j < i)     Tm = (I + A)^-1
    W = Tm (beta k exp(gam)),  U = Tm (beta v)                            v_new = U - W h
    o = (q exp(gam)) h + P v_new,  P[i, j] = sum_c q_ic k_jc exp(gam_ic - gam_jc)   (j <= i)
    h <- exp(gam_C) h + (k exp(gam_C - gam))ᵀ v_new

A and P are per-channel-decayed products. exp(gam_i - gam_j) cannot be split as exp(gam_i) exp(-gam_j) without
overflow (fast gates: g down to -5 per token and channel, 64 tokens). `_decayed_products` splits them dyadically: the
pairs (i, j) whose halves of a block of 2h tokens differ are one [h, K] x [K, h] product through the block's middle r
(the last token of the first half), exp(gam_i - gam_r) exp(gam_r - gam_j), both exponents <= 0; the pairs inside a half
are the next level down. Every exponent is <= 0, nothing overflows, and an underflow only drops terms below the
dtype's range; no [C, C, K] tensor and no [T, T] one.

Computation in float32 for float32 / bf16 inputs and float64 for float64 (`ops.precision.compute_dtype`); backward by
autograd. Packed documents (one row, `cu_seqlens` offsets or a `VarlenLayout`): the chunk-aligned layout and resets of
`ops/gdn/varlen.py` (a zero token leaves the state unchanged: g = 0, beta = 0, k = v = q = 0).

Shape legend inside: x_BHNCD [B, H, chunks, C = 64, D]; gam_BHNCK the cumulative log decay inside each chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltacp.ops.gdn.contract import CHUNK_SIZE
from deltacp.ops.gdn.varlen import VarlenLayout, as_layout
from deltacp.ops.precision import compute_dtype
from deltacp.ops.recurrence import FULL, RecurrenceInputs, StagesNothing


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' KDA l2norm (FLA's): x / sqrt(sum x² + eps) over the last dim."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _decayed_products(a: torch.Tensor, b: torch.Tensor, gam: torch.Tensor) -> torch.Tensor:
    """[..., C, C] with [i, j] = sum_c a_ic b_jc exp(gam_ic - gam_jc) for j < i, zero on and above the diagonal;
    a, b, gam [..., C, K] (C a power of two, gam non-increasing along C). Built bottom-up: at half-width h, each block
    of 2h tokens is [[first half, 0], [cross, second half]], the cross block one product through the block's middle."""
    *lead, C, K = a.shape
    out = a.new_zeros(*lead, C, 1, 1)  # the strictly lower part of each 1 x 1 block
    h = 1
    while h < C:
        nb = C // (2 * h)
        a4, b4, g4 = (x.reshape(*lead, nb, 2, h, K) for x in (a, b, gam))
        mid = g4[..., 0, h - 1:h, :]  # [..., nb, 1, K] the last token of each first half
        rows = a4[..., 1, :, :] * (g4[..., 1, :, :] - mid).exp()
        cols = b4[..., 0, :, :] * (mid - g4[..., 0, :, :]).exp()
        cross = rows @ cols.transpose(-1, -2)  # [..., nb, h, h]
        halves = out.reshape(*lead, nb, 2, h, h)
        top = torch.cat([halves[..., 0, :, :], torch.zeros_like(cross)], dim=-1)
        bottom = torch.cat([cross, halves[..., 1, :, :]], dim=-1)
        out = torch.cat([top, bottom], dim=-2)  # [..., nb, 2h, 2h]
        h *= 2
    return out.reshape(*lead, C, C)


@dataclass
class _Chunked:
    """Per-chunk WY quantities shared by the output scan and the summary scan."""

    q: torch.Tensor | None  # [B,H,N,C,K] q ⊙ exp(gam), scaled
    qk: torch.Tensor | None  # [B,H,N,C,C] P: causal (diagonal included) decayed q kᵀ
    w: torch.Tensor  # [B,H,N,C,K] W = Tm (beta k exp(gam))
    u: torch.Tensor  # [B,H,N,C,V] U = Tm (beta v)
    k_tail: torch.Tensor  # [B,H,N,C,K] k ⊙ exp(gam_C - gam)
    chunk_decay: torch.Tensor  # [B,H,N,K] exp(gam_C)
    T: int


def _prepare(q, k, v, g, beta, *, scale, use_qk_l2norm_in_kernel, need_output: bool) -> _Chunked:
    dt = compute_dtype(v)
    B, T, H, K = k.shape
    C = CHUNK_SIZE
    pad = (-T) % C
    N = (T + pad) // C

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [B,T,H,D] -> [B,H,N,C,D], zero-padded in time
        x = F.pad(x.to(dt), (0, 0, 0, 0, 0, pad)).transpose(1, 2)
        return x.reshape(B, H, N, C, x.shape[-1])

    if use_qk_l2norm_in_kernel:
        k = l2norm(k.to(dt))
    k, v = heads_first(k), heads_first(v)
    # Padded tokens have g = 0 and beta = 0: they neither decay nor write the state.
    gam = heads_first(g).cumsum(-2)
    beta = F.pad(beta.to(dt), (0, 0, 0, pad)).transpose(1, 2).reshape(B, H, N, C, 1)

    a = beta * _decayed_products(k, k, gam)  # strictly lower: the unit diagonal of I + A is implied
    rhs = torch.cat([beta * k * gam.exp(), beta * v], dim=-1)
    wu = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    w, u = wu.split([K, v.shape[-1]], dim=-1)
    k_tail = k * (gam[..., -1:, :] - gam).exp()
    chunk_decay = gam[..., -1, :].exp()

    q_dec = qk = None
    if need_output:
        if use_qk_l2norm_in_kernel:
            q = l2norm(q.to(dt))
        q = heads_first(q) * (K**-0.5 if scale is None else scale)
        qk = _decayed_products(q, k, gam) + torch.diag_embed((q * k).sum(-1))
        q_dec = q * gam.exp()
    return _Chunked(q_dec, qk, w, u, k_tail, chunk_decay, T)


def _scan(c: _Chunked, u: torch.Tensor, h: torch.Tensor, layout: VarlenLayout | None
          ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The chunk-to-chunk recurrence from h [B, H, K, cols] with U = u [B, H, N, C, cols] (the op: cols = V; the
    summary: [0 | U] on [M | S]): (per-chunk outputs, [] without c.q; the final h). h restarts at zero where a
    document starts (nothing before it reaches it)."""
    outs = []
    for n in range(u.shape[2]):
        if layout is not None and layout.chunk_resets[n]:
            h = torch.zeros_like(h)
        v_new = u[:, :, n] - c.w[:, :, n] @ h  # the part of U the entering state does not predict
        if c.q is not None:
            outs.append(c.q[:, :, n] @ h + c.qk[:, :, n] @ v_new)
        h = c.chunk_decay[:, :, n, :, None] * h + c.k_tail[:, :, n].transpose(-1, -2) @ v_new
    return outs, h


def _check(q, k, v, g, beta) -> None:
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or g.shape != k.shape or beta.shape != v.shape[:3] \
            or (q is not None and q.shape != k.shape):
        raise ValueError(f"KDA takes q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] (one key head per value "
                         f"head); got q {None if q is None else tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    if not all(x.is_floating_point() for x in (k, v, g, beta) + (() if q is None else (q,))):
        raise ValueError(f"KDA needs floating-point inputs, got k {k.dtype}, v {v.dtype}, g {g.dtype}, "
                         f"beta {beta.dtype}{'' if q is None else f', q {q.dtype}'}")


def _chunked(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens) -> tuple[_Chunked, VarlenLayout | None]:
    """Checked inputs -> (their chunk quantities, the packed row's layout or None); q None: no output terms."""
    _check(q, k, v, g, beta)
    layout = as_layout(cu_seqlens, v.shape[1])
    if layout is not None:
        q, k, v, g, beta = (None if x is None else layout.to_chunks(x) for x in (q, k, v, g, beta))
    return _prepare(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    need_output=q is not None), layout


def chunk_kda(q, k, v, g, beta, *, scale: float | None = None, initial_state: torch.Tensor | None = None,
              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
              cu_seqlens: torch.Tensor | VarlenLayout | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o [B, T, H, V] in v's dtype, final state [B, H, K, V] in the compute dtype or None); differentiable in every
    input and the entering state. With `cu_seqlens` (one packed row, B = 1) the state restarts at every document
    start; `initial_state` feeds the first document when the layout says it continues; the final state is the last
    document's."""
    c, layout = _chunked(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens)
    B, H, N, C, K = c.w.shape
    V = c.u.shape[-1]
    h = c.u.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(c.u.dtype)
    outs, h = _scan(c, c.u, h, layout)
    o = torch.stack(outs, dim=2).reshape(B, H, N * C, V)[:, :, :c.T].transpose(1, 2)
    if layout is not None:
        o = layout.from_chunks(o)
    return o.to(v.dtype), (h if output_final_state else None)


def summary_kda(k, v, g, beta, *, use_qk_l2norm_in_kernel: bool = False, need_transition: bool = True,
                cu_seqlens: torch.Tensor | VarlenLayout | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(M [B, H, K, K] or None, S [B, H, K, V]): h_out = M h_in + S for this segment; M = 0 when a document starts
    inside it (or the first does not continue), and S is then the last document's final state.

    The chunk scan run on X = [M | S] from [I | 0] with no write into the M columns: X <- exp(gam_C) X + k_tailᵀ
    ([0 | U] - W X), zeroed where a document starts."""
    c, layout = _chunked(None, k, v, g, beta, None, use_qk_l2norm_in_kernel, cu_seqlens)
    B, H, N, C, K = c.w.shape
    u = torch.cat([c.u.new_zeros(*c.u.shape[:-1], K), c.u], dim=-1) if need_transition else c.u
    x = c.u.new_zeros(B, H, K, u.shape[-1])
    if need_transition:
        x[..., :K] = torch.eye(K, dtype=x.dtype, device=x.device)
    _, x = _scan(c, u, x, layout)
    return (x[..., :K], x[..., K:]) if need_transition else (None, x)


def initial_state_grad(q, k, v, g, beta, grad_o, *, scale=None, use_qk_l2norm_in_kernel=False, cu_seqlens=None
                       ) -> torch.Tensor:
    """d sum(o * grad_o) / dh0, by autograd through the chunked op from a zero h0 (o is affine in h0)."""
    B, H, K, V = v.shape[0], v.shape[2], k.shape[3], v.shape[3]
    layout = as_layout(cu_seqlens, v.shape[1])
    if layout is not None and layout.chunk_resets[0]:  # the entering state reaches no output
        return torch.zeros(B, H, K, V, dtype=compute_dtype(v), device=v.device)
    with torch.enable_grad():
        h0 = torch.zeros(B, H, K, V, dtype=compute_dtype(v), device=v.device, requires_grad=True)
        o, _ = chunk_kda(*(x.detach() for x in (q, k, v, g, beta)), scale=scale, initial_state=h0,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=layout)
        return torch.autograd.grad(o, h0, grad_o)[0]


class KimiDeltaRule(StagesNothing):
    """KDA under the recurrence contract (`ops/recurrence.py`), eager: inputs (q, k, v, g, beta), q, k, g [rows, T, H,
    K], v [rows, T, H, V], beta [rows, T, H]; M full. `qk_l2norm`: q and k l2-normalised inside the op (Kimi-Linear and
    Bailing-Hybrid in transformers 5.25 both do); `scale`: the query scale (None: K ** -0.5). A backend of other
    kernels (`ops/kda/triton`) subclasses it, giving its own ops (`_op`) and checks."""

    transition = FULL
    name = "eager"

    def __init__(self, *, qk_l2norm: bool = True, scale: float | None = None):
        self.qk_l2norm = qk_l2norm
        self.scale = scale

    def _op(self, name: str):
        """This backend's op `name` (chunk_kda, summary_kda, initial_state_grad)."""
        return globals()[name]

    def check(self, x: RecurrenceInputs) -> None:
        if len(x) != 5:
            raise ValueError(f"KDA takes the inputs (q, k, v, g, beta), got {len(x)} tensors")
        _check(*x)

    def state_shape(self, x: RecurrenceInputs) -> tuple[int, ...]:
        q, k, v, g, beta = x.tensors
        return (v.shape[0], v.shape[2], k.shape[-1], v.shape[-1])

    def forward(self, x, *, initial_state=None, output_final_state=False, prepared=None, cu_seqlens=None):
        self._no_prepared(prepared)
        _check(*x.tensors)
        return self._op("chunk_kda")(*x, scale=self.scale, initial_state=initial_state,
                                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=self.qk_l2norm,
                                     cu_seqlens=cu_seqlens)

    def summary(self, x, *, prepared=None, need_transition=True, cu_seqlens=None):
        self._no_prepared(prepared)
        q, k, v, g, beta = x.tensors
        _check(None, k, v, g, beta)
        return self._op("summary_kda")(k, v, g, beta, use_qk_l2norm_in_kernel=self.qk_l2norm,
                                       need_transition=need_transition, cu_seqlens=cu_seqlens)

    def initial_state_grad(self, x, grad_o, *, prepared=None, cu_seqlens=None):
        self._no_prepared(prepared)
        _check(*x.tensors)
        return self._op("initial_state_grad")(*x, grad_o, scale=self.scale, use_qk_l2norm_in_kernel=self.qk_l2norm,
                                              cu_seqlens=cu_seqlens)
