"""The scalar-decay recurrence on Triton: the autograd Function over the kernels (kernels.py) and the public ops
(the forward, the summary, the entering state's gradient), with the semantics of `ops/ssd/eager.py`.

Outside the Function: padding of T to a multiple of 64 (packed documents: `VarlenLayout.to_chunks` of q, k, x, g,
scale, skip, and `from_chunks` of o), the chunk-local cumsum of g (so its backward, the suffix sum of dgam within each
chunk, is torch's), the casts of the per-token weights g, scale, skip ([B, T, H]) to the accumulator dtype. Inside:
state_fwd -> out_fwd (which forms scale * x and adds skip * x in registers); the backward recomputes the per-chunk
states (keeping them would cost N / 64 times x's memory), then state_bwd (dh per chunk, dh0) -> chunk_bwd (dq, dk
summed over each group's heads in the kernels; dx, dscale, dskip from dv in registers; dgam). No [B, T, H, P]
tensor is made but o and dx.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltacp.ops.gdn.varlen import VarlenLayout, as_layout
from deltacp.ops.ssd.eager import SCALAR
from deltacp.ops.ssd.triton.kernels import BT, chunk_bwd, out_fwd, state_bwd, state_fwd


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' accumulator (and states', summaries') dtype: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class ScalarDecayFunction(torch.autograd.Function):
    """(q, k, x, gam, scale or None, skip or None, h0 or None) chunk-laid-out and contiguous, the per-token weights
    gam, scale, skip in the accumulator dtype -> (o with the skip term, final state or None)."""

    @staticmethod
    def forward(ctx, q, k, x, gam, scale, skip, h0, output_final_state, resets):
        h, ht = state_fwd(k, x, gam, scale, h0, output_final_state=output_final_state, resets=resets)
        o = out_fwd(q, k, x, gam, h, scale, skip)
        ctx.save_for_backward(q, k, x, gam, scale, skip, h0)
        ctx.resets = resets
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, x, gam, scale, skip, h0 = ctx.saved_tensors
        resets = ctx.resets
        h, _ = state_fwd(k, x, gam, scale, h0, resets=resets)
        do = do.to(x.dtype).contiguous()
        dht = None if dht is None else dht.to(gam.dtype).contiguous()
        dh, dh0 = state_bwd(q, gam, do, dht, need_dh0=h0 is not None, resets=resets)
        dq, dk, dx, dgam, dscale, dskip = chunk_bwd(q, k, x, gam, h, dh, do, scale, skip)
        return dq, dk, dx, dgam, dscale, dskip, (None if dh0 is None else dh0.to(h0.dtype)), None, None


def _resets(layout: VarlenLayout | None, device) -> torch.Tensor | None:
    """The layout's per-chunk reset flags as int32 on the device (cached on the layout), or None without any."""
    if layout is None or not layout.any_reset:
        return None
    key = ("ssd_resets", torch.device(device))
    if key not in layout._index:
        layout._index[key] = torch.tensor(layout.chunk_resets, dtype=torch.int32).to(device)
    return layout._index[key]


def _laid_out(layout: VarlenLayout | None, T: int, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Token tensors [B, T, ...] -> [B, Tp, ...] contiguous: zero-padded to whole chunks, or the packed row laid out
    chunk-aligned (differentiable)."""
    if layout is not None:
        return [layout.to_chunks(x).contiguous() for x in xs]
    pad = (-T) % BT
    return [(F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x).contiguous() for x in xs]


def _gate_cumsum(g: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """g [B, Tp, H] (laid out) -> the chunk-local inclusive cumsum, in the accumulator dtype (differentiable)."""
    B, Tp, H = g.shape
    return g.to(acc).view(B, Tp // BT, BT, H).cumsum(2).view(B, Tp, H).contiguous()


def _check_dtypes(q, k, x) -> None:
    if len({t.dtype for t in (q, k, x) if t is not None}) != 1:
        raise ValueError(f"the Triton scalar-decay recurrence needs q, k, x of one dtype; got q "
                         f"{None if q is None else q.dtype}, k {k.dtype}, x {x.dtype}")


def _weights_laid_out(layout: VarlenLayout | None, T: int, acc: torch.dtype, *ws: torch.Tensor | None) -> list:
    """Per-token weights [B, T, H] or None -> laid out as the tokens, in the accumulator dtype (differentiable)."""
    return [None if w is None else _laid_out(layout, T, w.to(acc))[0] for w in ws]


def chunk_scalar_decay(q, k, x, g, scale=None, skip=None, *, initial_state=None, output_final_state=False,
                       cu_seqlens: torch.Tensor | VarlenLayout | None = None):
    """(o [B, T, H, P] in x's dtype, final state [B, H, N, P] fp32 (fp64 for fp64 inputs) or None); differentiable
    in q, k, x, g, scale, skip and the entering state. Semantics of `eager.chunk_scalar_decay`."""
    _check_dtypes(q, k, x)
    T = x.shape[1]
    layout = as_layout(cu_seqlens, T)
    acc = acc_dtype(x.dtype)
    ql, kl, xl, gl = _laid_out(layout, T, q, k, x, g)
    scl, skl = _weights_laid_out(layout, T, acc, scale, skip)
    gam = _gate_cumsum(gl, acc)
    h0 = None if initial_state is None else initial_state.to(acc).contiguous()
    o, ht = ScalarDecayFunction.apply(ql, kl, xl, gam, scl, skl, h0, output_final_state, _resets(layout, x.device))
    o = layout.from_chunks(o) if layout is not None else o[:, :T]
    return o, (ht if output_final_state else None)


def summary_scalar_decay(k, x, g, scale=None, *, need_transition=True, cu_seqlens=None):
    """(M packed [B, H, N, 1] or None, S [B, H, N, P]) in the accumulator dtype: h_out = M h_in + S; M = 0 when a
    document starts inside the row (or the first does not continue). S by the forward state kernel from a zero
    entering state (no per-chunk states stored). Forward only (p2p uses the value; differentiating raises)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (k, x, g, scale)):
        raise RuntimeError("the Triton scalar-decay summary has no backward; call it under torch.no_grad() or on "
                           "detached inputs (the eager recurrence differentiates it)")
    _check_dtypes(None, k, x)
    T = x.shape[1]
    layout = as_layout(cu_seqlens, T)
    acc = acc_dtype(x.dtype)
    kl, xl, gl = _laid_out(layout, T, k, x, g)
    (scl,) = _weights_laid_out(layout, T, acc, scale)
    gam = _gate_cumsum(gl, acc)
    _, s = state_fwd(kl, xl, gam, scl, None, store_h=False, output_final_state=True,
                     resets=_resets(layout, x.device))
    if not need_transition:
        return None, s
    if layout is not None and layout.any_reset:
        m = torch.zeros(x.shape[0], x.shape[2], dtype=acc, device=x.device)
    else:
        m = gam[:, BT - 1::BT].sum(1).exp()  # the product of the chunks' decays
    return SCALAR.pack(m, k.shape[-1]), s


def initial_state_grad(q, k, x, g, grad_o, *, cu_seqlens=None):
    """d sum(o * grad_o) / dh0 [B, H, N, P] (accumulator dtype): the reverse state kernel from no final-state
    gradient, nothing stored but dh0 (o is affine in h0; neither the values nor the skip read it). Zeros when the
    first chunk resets (nothing run)."""
    _check_dtypes(q, k, x)
    B, T, H, P = x.shape
    N = k.shape[-1]
    layout = as_layout(cu_seqlens, T)
    acc = acc_dtype(x.dtype)
    if layout is not None and layout.chunk_resets[0]:
        return torch.zeros(B, H, N, P, dtype=acc, device=x.device)
    with torch.no_grad():
        ql, gl, do = _laid_out(layout, T, q, g, grad_o.to(x.dtype))
        _, dh0 = state_bwd(ql, _gate_cumsum(gl, acc), do, None, store_dh=False, need_dh0=True,
                           resets=_resets(layout, x.device))
    return dh0
