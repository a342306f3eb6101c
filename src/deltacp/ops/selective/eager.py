"""Eager (pure PyTorch) chunked selective scan: Mamba1's recurrence under the recurrence contract.

    h_t[d, n] = exp(dt_t[d] A[d, n]) h_{t-1}[d, n] + dt_t[d] B_t[n] x_t[d]        h [I, N] per row
    y_t[d]    = (sum_n C_t[n] h_t[d, n] + D[d] x_t[d]) * silu(z_t[d])

as transformers' `mamba_selective_scan` (models/mamba) computes it token by token, with dt already softplus'd (the
caller adds dt_proj's bias and applies softplus: no clamp in Mamba1). B and C are shared by all I channels, or by
each of G equal groups of channels (Zamba's Mamba heads: B, C [rows, T, G, N], the channels group-major). The
decay differs per (channel, state index), so over a segment h_out = M ⊙ h_in + S with M = exp(A ⊙ sum dt) elementwise:
under the contract (`ops/recurrence.py`) the state is one "head" per group, of K = (I / G) * N rows and V = 1 column,
and M is `Transition("diagonal")`, packed [rows, G, K, 1]: the chain and the scan move two numbers per (d, n).

The entering state's contribution, sum_n C_t[n] (prod_{s<=t} a_s[d, n]) h_in[d, n], is added BEFORE the silu(z)
gate, as in the single-device scan whose state it continues.

Chunked form (no [T, T] tensor, no exponent > 0): the tokens are cut into chunks of `chunk` tokens; a loop over the
positions inside a chunk runs every chunk at once from a zero state (a_t = exp(dt A) <= 1, products only), a loop
over the chunks carries the chunk-end states, and the entering state's reach is the running product of the decays
(<= 1). Python iterations: chunk + T / chunk (chunk ~ sqrt(T)). Memory: a few [rows, T, I, N] tensors, as the
token loop of transformers. Packed documents (one row, `cu_seqlens`): a document start sets that token's decay to 0,
so the state (and the entering state's reach) restart there; no chunk alignment is needed.

Computation in float32 for float32 / bf16 inputs and float64 for float64 (`ops.precision.compute_dtype`); backward
by autograd; the entering state's gradient in closed form.

Shape legend: x_RTI [rows, tokens, channels]; *_RncIN chunked [rows, chunks, chunk, I, N]; G channel groups of
P = I / G channels (B and C per group).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from deltacp.ops.gdn.varlen import VarlenLayout, as_layout
from deltacp.ops.precision import compute_dtype
from deltacp.ops.recurrence import RecurrenceInputs, StagesNothing, Transition

DIAGONAL = Transition("diagonal")


def chunk_size(T: int) -> int:
    """The chunk of a local call of T tokens: a power of two near sqrt(T), in [8, 256] (the two Python loops then
    run about 2 sqrt(T) iterations)."""
    return max(8, min(256, 1 << max(0, math.ceil(math.log2(max(T, 1)) / 2))))


def _check(x, dt, A, B, C, D, z):
    R, T, I = x.shape if x.dim() == 3 else (None, None, None)
    if x.dim() != 3 or dt.shape != x.shape or A.dim() != 3 or A.shape[:2] != (R, I) or B.dim() not in (3, 4) \
            or B.shape != C.shape or B.shape[:2] != (R, T) or B.shape[-1] != A.shape[-1] \
            or (B.dim() == 4 and I % B.shape[2]):
        raise ValueError(f"the selective scan takes x, dt [rows, T, I], A [rows, I, N], B, C [rows, T, N] or [rows, "
                         f"T, G, N] (G dividing I); got x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)}")
    if D is not None and D.shape != (R, I):
        raise ValueError(f"D must be [rows, I] = {(R, I)}, got {tuple(D.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must be shaped as x {tuple(x.shape)}, got {tuple(z.shape)}")


def document_resets(layout: VarlenLayout | None, T: int, device) -> torch.Tensor | None:
    """[T] bool: the tokens whose previous state is dropped (document starts; token 0 unless the first document
    continues); None without documents."""
    if layout is None:
        return None
    r = torch.zeros(T, dtype=torch.bool)
    r[layout.cu_seqlens[1:-1]] = True
    r[0] = not layout.first_continues
    return r.to(device)


def groups(B: torch.Tensor) -> int:
    """G: the channel groups B (or C) is given for ([rows, T, N]: one)."""
    return 1 if B.dim() == 3 else B.shape[2]


def _grouped(t: torch.Tensor, G: int) -> torch.Tensor:
    """[rows, T, I, ...] -> [rows, T, G, I / G, ...] (a view)."""
    return t.unflatten(2, (G, -1))


def _per_group(B: torch.Tensor) -> torch.Tensor:
    """B or C as [rows, T, G, N]."""
    return B[:, :, None] if B.dim() == 3 else B


def _decays_and_inputs(x, dt, A, B, resets):
    """a [rows, T, I, N] = exp(dt A) (0 at a reset) and b = dt B x, in the compute dtype."""
    cd = compute_dtype(x)
    dt_ = dt.to(cd)
    a = torch.exp(dt_[..., None] * A.to(cd)[:, None])
    if resets is not None:
        a = a * (~resets).to(cd)[None, :, None, None]
    G = groups(B)
    b = (_grouped(dt_ * x.to(cd), G)[..., None] * _per_group(B).to(cd)[:, :, :, None, :]).flatten(2, 3)
    return a, b


def _chunked(t_RT, c: int):
    """[R, T, ...] -> [R, n, c, ...], zero-padded in time (a zero token: decay 1 below, input 0)."""
    R, T = t_RT.shape[:2]
    pad = (-T) % c
    t_RT = F.pad(t_RT, (0,) * (2 * (t_RT.dim() - 2)) + (0, pad))
    return t_RT.reshape(R, (T + pad) // c, c, *t_RT.shape[2:])


def chunked_scan(a, b):
    """(local states h [R, T, I, N] from a zero state, reach P [R, T, I, N] = prod_{s<=t} a_s): the chunked scan of
    h_t = a_t ⊙ h_{t-1} + b_t over any trailing shape (also the RG-LRU's, `ops/selective/diagonal.py`)."""
    R, T, I, N = a.shape
    c = chunk_size(T)
    a_c = _chunked(a - 1, c) + 1  # padded tokens decay by 1
    b_c = _chunked(b, c)
    h = b_c.new_zeros(R, a_c.shape[1], I, N)
    hs = []
    for j in range(c):  # every chunk at once, from zero
        h = a_c[:, :, j] * h + b_c[:, :, j]
        hs.append(h)
    h_local = torch.stack(hs, dim=2)  # [R, n, c, I, N]
    p_local = torch.cumprod(a_c, dim=2)  # within-chunk reach (<= 1)
    carried, reach = [], []
    h = b_c.new_zeros(R, I, N)
    m = torch.ones_like(h)
    for k in range(a_c.shape[1]):  # the chunk-end states, chunk to chunk
        carried.append(h)
        reach.append(m)
        h = p_local[:, k, -1] * h + h_local[:, k, -1]
        m = p_local[:, k, -1] * m
    h_all = h_local + p_local * torch.stack(carried, dim=1)[:, :, None]
    p_all = p_local * torch.stack(reach, dim=1)[:, :, None]
    return h_all.flatten(1, 2)[:, :T], p_all.flatten(1, 2)[:, :T]


def selective_scan(x, dt, A, B, C, D=None, z=None, *, initial_state=None, output_final_state=False,
                   cu_seqlens: torch.Tensor | VarlenLayout | None = None):
    """(y [rows, T, I] in the compute dtype, final state [rows, I, N] or None). x, dt [rows, T, I] (dt after
    softplus), A [rows, I, N] (negative), B, C [rows, T, N] (every channel) or [rows, T, G, N] (per group of I / G
    channels), D [rows, I] or None, z [rows, T, I] or None (no gate); initial_state [rows, I, N]. Differentiable in
    every input and the entering state."""
    _check(x, dt, A, B, C, D, z)
    cd = compute_dtype(x)
    layout = as_layout(cu_seqlens, x.shape[1])
    a, b = _decays_and_inputs(x, dt, A, B, document_resets(layout, x.shape[1], x.device))
    h, reach = chunked_scan(a, b)
    G = groups(C)
    Cc = _per_group(C).to(cd)
    y = torch.einsum("rtgpn,rtgn->rtgp", _grouped(h, G), Cc)
    if initial_state is not None:  # the entering state's contribution, before the gate
        y = y + torch.einsum("rtgpn,rgpn,rtgn->rtgp", _grouped(reach, G), initial_state.to(cd).unflatten(1, (G, -1)),
                             Cc)
    y = y.flatten(2, 3)
    if D is not None:
        y = y + x.to(cd) * D.to(cd)[:, None]
    if z is not None:
        y = y * F.silu(z.to(cd))
    final = None
    if output_final_state:
        final = h[:, -1] if initial_state is None else h[:, -1] + reach[:, -1] * initial_state.to(cd)
    return y, final


def summary_selective_scan(x, dt, A, B, *, need_transition=True, cu_seqlens=None):
    """(M [rows, I, N] or None, S [rows, I, N]): h_out = M ⊙ h_in + S over this segment (M = 0 where a document
    starts inside it)."""
    layout = as_layout(cu_seqlens, x.shape[1])
    a, b = _decays_and_inputs(x, dt, A, B, document_resets(layout, x.shape[1], x.device))
    h, reach = chunked_scan(a, b)
    return (reach[:, -1] if need_transition else None), h[:, -1]


def initial_state_grad(x, dt, A, C, z, grad_y, *, cu_seqlens=None) -> torch.Tensor:
    """d sum(y * grad_y) / dh_in [rows, I, N], in closed form: sum_t reach_t ⊙ C_t (grad_y_t silu(z_t))."""
    cd = compute_dtype(x)
    layout = as_layout(cu_seqlens, x.shape[1])
    a, _ = _decays_and_inputs(x, dt, A, C, document_resets(layout, x.shape[1], x.device))
    reach = torch.cumprod(a, dim=1)
    g = grad_y.to(cd) if z is None else grad_y.to(cd) * F.silu(z.to(cd))
    G = groups(C)
    return torch.einsum("rtgpn,rtgn,rtgp->rgpn", _grouped(reach, G), _per_group(C).to(cd), _grouped(g, G)).flatten(1, 2)


class SelectiveScan(StagesNothing):
    """Mamba1's selective scan under the contract (`ops/recurrence.py`), eager. Inputs (x, dt, A, B, C, D, z) in
    transformers' `mamba_selective_scan` order: x, dt, z [rows, T, I] (dt after softplus; z the gate, or None),
    A [rows, I, N] and D [rows, I] (or None) per row (no token dimension: the modes never cut the inputs by tokens),
    B, C [rows, T, N] (one head) or [rows, T, G, N] (G heads of P = I / G channels each: Zamba's Mamba heads).
    State [rows, G, P * N, 1] (a head of P * N rows per group, V = 1); outputs [rows, T, G, P]; M diagonal, packed
    [rows, G, P * N, 1]."""

    transition = DIAGONAL
    name = "eager"

    def _op(self, name: str):
        """The implementation's op `name` (selective_scan, summary_selective_scan, initial_state_grad): this
        module's; the Triton backend (`ops/selective/triton`) gives its own."""
        return globals()[name]

    @staticmethod
    def _unpack(x: RecurrenceInputs) -> tuple:
        if len(x) != 7:
            raise ValueError(f"the selective scan takes seven inputs (x, dt, A, B, C, D, z; D and z may be None), "
                             f"got {len(x)}")
        return x.tensors

    def check(self, x: RecurrenceInputs) -> None:
        xs = self._unpack(x)
        _check(*xs)
        if not xs[0].is_floating_point():
            raise ValueError(f"the selective scan needs floating-point inputs, got {xs[0].dtype}")

    def state_shape(self, x: RecurrenceInputs) -> tuple[int, ...]:
        x_, dt, A, B, C, D, z = self._unpack(x)
        G = groups(B)
        return (x_.shape[0], G, A.shape[1] // G * A.shape[2], 1)

    def forward(self, x, *, initial_state=None, output_final_state=False, prepared=None, cu_seqlens=None):
        self._no_prepared(prepared)
        x_, dt, A, B, C, D, z = self._unpack(x)
        R, T, I = x_.shape
        N = A.shape[-1]
        h0 = None if initial_state is None else initial_state.reshape(R, I, N)
        y, ht = self._op("selective_scan")(x_, dt, A, B, C, D, z, initial_state=h0,
                                           output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        G = groups(B)
        return y.unflatten(2, (G, -1)), (None if ht is None else ht.reshape(R, G, I // G * N, 1))

    def summary(self, x, *, prepared=None, need_transition=True, cu_seqlens=None):
        self._no_prepared(prepared)
        x_, dt, A, B, C, D, z = self._unpack(x)
        R, I, N = A.shape
        m, s = self._op("summary_selective_scan")(x_, dt, A, B, need_transition=need_transition,
                                                  cu_seqlens=cu_seqlens)
        G = groups(B)
        K = I // G * N
        return (None if m is None else DIAGONAL.pack(m.reshape(R, G, K), K)), s.reshape(R, G, K, 1)

    def initial_state_grad(self, x, grad_o, *, prepared=None, cu_seqlens=None):
        self._no_prepared(prepared)
        x_, dt, A, B, C, D, z = self._unpack(x)
        R, I, N = A.shape
        g = self._op("initial_state_grad")(x_, dt, A, C, z, grad_o.reshape(x_.shape), cu_seqlens=cu_seqlens)
        G = groups(B)
        return g.reshape(R, G, I // G * N, 1)
