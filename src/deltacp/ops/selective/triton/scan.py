"""The selective scan on Triton: the autograd Function over the kernels (kernels.py) and the public ops (the forward,
the summary, the entering state's gradient), with the semantics of `ops/selective/eager.py`.

Forward: chunk_state (S_c, dts_c) -> state_pass (the entering state H_c of every chunk, the final state) ->
chunk_out (y). Saved for the backward: the inputs and H ([rows, T / BT, N, I] in the accumulator dtype). Backward:
chunk_state reversed (dS_c) -> state_pass reversed (dH_c, dh0) -> chunk_bwd (every gradient; the per-chunk partial
dA, dD and the per-group partial dB, dC summed here). No input is copied or padded (strides passed, the last chunk
masked) unless its channel stride is not 1.
"""

from __future__ import annotations

import torch

from deltacp.ops.gdn.varlen import VarlenLayout, as_layout
from deltacp.ops.selective.eager import document_resets
from deltacp.ops.selective.triton import kernels as K


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' accumulator (and states', summaries') dtype: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _unit(t: torch.Tensor | None) -> torch.Tensor | None:
    """t with a unit last stride (a copy only when it has not)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _resets_i32(layout: VarlenLayout | None, T: int, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(per-token reset flags [T] int32, per-chunk flags [NC] int32: a document starts in the chunk) on the device,
    or (None, None) without a reset. Built on the host from the layout (no device sync) and cached on it."""
    if layout is None or not layout.any_reset:
        return None, None
    BT = K.chunk_len()
    key = ("selective_resets", BT, torch.device(device))
    if key not in layout._index:
        r = document_resets(layout, T, "cpu")
        chunks = torch.nn.functional.pad(r, (0, (-T) % BT)).view(-1, BT).any(1)
        layout._index[key] = (r.to(torch.int32).to(device), chunks.to(torch.int32).to(device))
    return layout._index[key]


class SelectiveScanFunction(torch.autograd.Function):
    """(x, dt, A, B, C, D or None, z or None, h0 or None) -> (y in x's dtype, final state or None)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, h0, output_final_state, resets, creset):
        acc = acc_dtype(x.dtype)
        s, dts = K.chunk_state(x, dt, None, A, B, resets, reverse=False, acc=acc)
        h, ht = K.state_pass(A, dts, creset, s, h0, T=x.shape[1], reverse=False, store_st=output_final_state)
        del s
        y = K.chunk_out(x, dt, z, A, B, C, D, resets, h)
        ctx.save_for_backward(x, dt, A, B, C, D, z, h0, h)
        ctx.resets, ctx.creset = resets, creset
        return y, ht

    @staticmethod
    def backward(ctx, dy, dht):
        x, dt, A, B, C, D, z, h0, h = ctx.saved_tensors
        resets, creset = ctx.resets, ctx.creset
        acc = h.dtype
        dy = _unit(dy)
        ds, dts = K.chunk_state(dy, dt, z, A, C, resets, reverse=True, acc=acc)
        dht = None if dht is None else dht.to(acc).contiguous()
        dh, dh0 = K.state_pass(A, dts, creset, ds, dht, T=x.shape[1], reverse=True, store_st=h0 is not None)
        del ds
        dx, ddt, dz, dA, dD, dB, dC = K.chunk_bwd(x, dt, z, dy, A, B, C, D, resets, h, dh)
        return (dx, ddt, dA.to(A.dtype), dB.to(B.dtype), dC.to(C.dtype), None if dD is None else dD.to(D.dtype),
                dz, None if dh0 is None else dh0.to(h0.dtype), None, None, None)


def _inputs(x, dt, A, B, C, D, z):
    return [_unit(t) for t in (x, dt, A, B, C, D, z)]


def _groups(B: torch.Tensor, I: int) -> list[tuple[int, slice]]:
    """(g, the channels of group g) for B (or C) given per group, [rows, T, G, N] (Zamba's Mamba heads: each an
    independent scan over its I / G channels, run as one of its own: the kernels take one group)."""
    P = I // B.shape[2]
    return [(g, slice(g * P, (g + 1) * P)) for g in range(B.shape[2])]


def _part(t: torch.Tensor | None, sl: slice, dim: int) -> torch.Tensor | None:
    return None if t is None else t.narrow(dim, sl.start, sl.stop - sl.start)


def _cat(parts: list, dim: int) -> torch.Tensor | None:
    return None if parts[0] is None else torch.cat(parts, dim)


def selective_scan(x, dt, A, B, C, D=None, z=None, *, initial_state=None, output_final_state=False,
                   cu_seqlens: torch.Tensor | VarlenLayout | None = None):
    """(y [rows, T, I] in x's dtype, final state [rows, I, N] fp32 (fp64 for fp64 inputs) or None); differentiable
    in every input and the entering state. Semantics of `eager.selective_scan`; B, C per group ([rows, T, G, N]):
    one scan per group of channels, the outputs joined."""
    if B.dim() == 4:
        parts = [selective_scan(_part(x, sl, 2), _part(dt, sl, 2), _part(A, sl, 1), B[:, :, g], C[:, :, g],
                                _part(D, sl, 1), _part(z, sl, 2), initial_state=_part(initial_state, sl, 1),
                                output_final_state=output_final_state, cu_seqlens=cu_seqlens)
                 for g, sl in _groups(B, x.shape[2])]
        return _cat([y for y, _ in parts], 2), _cat([h for _, h in parts], 1)
    T = x.shape[1]
    resets, creset = _resets_i32(as_layout(cu_seqlens, T), T, x.device)
    h0 = None if initial_state is None else initial_state.to(acc_dtype(x.dtype)).contiguous()
    y, ht = SelectiveScanFunction.apply(*_inputs(x, dt, A, B, C, D, z), h0, output_final_state, resets, creset)
    return y, (ht if output_final_state else None)


def summary_selective_scan(x, dt, A, B, *, need_transition=True, cu_seqlens=None):
    """(M [rows, I, N] or None, S [rows, I, N]) in the accumulator dtype: h_out = M ⊙ h_in + S; M = 0 when a
    document starts inside the row (or the first does not continue). Forward only (p2p uses the value;
    differentiating raises). B per group ([rows, T, G, N]): one summary per group of channels, joined."""
    if B.dim() == 4:
        parts = [summary_selective_scan(_part(x, sl, 2), _part(dt, sl, 2), _part(A, sl, 1), B[:, :, g],
                                        need_transition=need_transition, cu_seqlens=cu_seqlens)
                 for g, sl in _groups(B, x.shape[2])]
        return _cat([m for m, _ in parts], 1), _cat([st for _, st in parts], 1)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, dt, A, B)):
        raise RuntimeError("the Triton selective-scan summary has no backward; call it under torch.no_grad() or on "
                           "detached inputs (the eager recurrence differentiates it)")
    T = x.shape[1]
    acc = acc_dtype(x.dtype)
    resets, creset = _resets_i32(as_layout(cu_seqlens, T), T, x.device)
    x, dt, A, B = (_unit(t) for t in (x, dt, A, B))
    s, dts = K.chunk_state(x, dt, None, A, B, resets, reverse=False, acc=acc)
    _, st = K.state_pass(A, dts, creset, s, None, T=T, reverse=False, store_h=False)
    if not need_transition:
        return None, st
    m = torch.exp(A.to(acc) * dt.to(acc).sum(1)[:, :, None])
    if resets is not None:
        m = torch.zeros_like(m)
    return m, st


def initial_state_grad(x, dt, A, C, z, grad_y, *, cu_seqlens=None) -> torch.Tensor:
    """d sum(y * grad_y) / dh_in [rows, I, N] (accumulator dtype): the reversed chunk_state and state_pass from no
    final-state gradient, nothing stored but dh0 (y is affine in h_in). C per group ([rows, T, G, N]): per group of
    channels, joined."""
    if C.dim() == 4:
        return torch.cat([initial_state_grad(_part(x, sl, 2), _part(dt, sl, 2), _part(A, sl, 1), C[:, :, g],
                                             _part(z, sl, 2), _part(grad_y, sl, 2), cu_seqlens=cu_seqlens)
                          for g, sl in _groups(C, x.shape[2])], 1)
    T = x.shape[1]
    acc = acc_dtype(x.dtype)
    resets, creset = _resets_i32(as_layout(cu_seqlens, T), T, x.device)
    with torch.no_grad():
        dt, A, C, z, gy = (_unit(t) for t in (dt, A, C, z, grad_y.to(x.dtype)))
        ds, dts = K.chunk_state(gy, dt, z, A, C, resets, reverse=True, acc=acc)
        _, dh0 = K.state_pass(A, dts, creset, ds, None, T=T, reverse=True, store_h=False)
    return dh0
