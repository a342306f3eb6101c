"""KDA on Triton: the autograd Function over the kernels (kernels.py) and the public ops (the forward, the summary,
the entering state's gradient), with the semantics of `ops/kda/eager.py`.

Outside the Function: the layout (padding T to a multiple of 64, or a packed row's chunk-aligned layout,
`VarlenLayout.to_chunks`, and `from_chunks` of o; torch, differentiable), then `KDAPrep` (the l2 norm of q and k, the
query scale and the chunk-local cumsum of g into the accumulator dtype, one kernel each way). Inside: wy_fwd (Tm, P, W,
U, and the decayed Kt, Qg: kernels.DECAYED) -> state_fwd (h per chunk, vn) -> out_fwd. The backward keeps Tm, P, W,
U, Kt, Qg from the forward, recomputes h and vn (kernels.SAVE_STATES 1: keeps them too), then dv_local (Pᵀ dO) ->
state_bwd (dh per chunk, dvn, dh0) -> chunk_bwd (bwd_wy, then bwd_intra: dq, dk, dv, dbeta, dgam).
"""

from __future__ import annotations

import torch

from deltacp.ops.gdn.varlen import VarlenLayout, as_layout
from deltacp.ops.kda.triton import kernels
from deltacp.ops.kda.triton.kernels import (BT, Stored, chunk_bwd, dv_local, out_fwd, prep, prep_bwd, state_bwd,
                                            state_fwd, wy_fwd)
# the accumulator dtype, the layout (padding / chunk-aligned packed row) and the reset flags: the SSD backend's (its
# chunk is 64 tokens too)
from deltacp.ops.ssd.triton.chunk import _laid_out, _resets, acc_dtype


class KDAPrep(torch.autograd.Function):
    """(q, k, g) laid out, in the inputs' dtypes -> (qn, kn, gam) in the accumulator dtype: q, k l2-normalised (norm)
    and q scaled, gam the chunk-local cumsum of g; one kernel each way (`kernels.prep`, `prep_bwd`)."""

    @staticmethod
    def forward(ctx, q, k, g, scale, norm, acc):
        qn, kn, gam, rq, rk, sc = prep(q, k, g, scale, norm, acc)
        ctx.save_for_backward(qn, kn, rq, rk, sc)
        ctx.dtypes = (q.dtype, k.dtype, g.dtype)
        return qn, kn, gam

    @staticmethod
    def backward(ctx, dqn, dkn, dgam):
        qn, kn, rq, rk, sc = ctx.saved_tensors
        dq, dk, dg = prep_bwd(qn, kn, rq, rk, sc, dqn.contiguous(), dkn.contiguous(), dgam.contiguous(), ctx.dtypes)
        return dq, dk, dg, None, None, None


def operand_dtype(v: torch.Tensor, gam: torch.Tensor, norm: bool) -> torch.dtype:
    """The dtype of W, Kt, Qg between the kernels (`kernels.OPERANDS16`): fp16 under bf16 / fp16 inputs with q and k
    l2-normalised in the op (bounded operands), else the accumulator's."""
    if kernels.OPERANDS16 and norm and v.dtype in (torch.bfloat16, torch.float16) and gam.dtype == torch.float32:
        return torch.float16
    return gam.dtype


def scaled_states(v: torch.Tensor, gam: torch.Tensor) -> int:
    """Which of h, dh (from 1) and vn, dvn (2) are stored as scaled fp16 between the kernels (`kernels.STATE16`):
    under bf16 / fp16 inputs, whose readers' products are one tf32 pass; 0 otherwise."""
    if v.dtype in (torch.bfloat16, torch.float16) and gam.dtype == torch.float32:
        return int(kernels.STATE16)
    return 0


class KDAFunction(torch.autograd.Function):
    """(q normalised and scaled, k normalised, v, gam, beta, h0) laid out and contiguous -> (o, final state or
    None); `operands`: the dtype of W, Kt, Qg (`operand_dtype`)."""

    @staticmethod
    def forward(ctx, q, k, v, gam, beta, h0, output_final_state, resets, operands):
        ctx.scaled = scaled_states(v, gam)
        tm, p, w, u, kt, qg = wy_fwd(q, k, v, gam, beta, operands)
        h, vn, ht = state_fwd(w, u, k, gam, kt, h0, inputs=v.dtype, output_final_state=output_final_state,
                              resets=resets, scaled=ctx.scaled)
        o = out_fwd(q, gam, qg, p, h, vn, v.dtype)
        ctx.saved_states = bool(kernels.SAVE_STATES)
        states = (*h, *vn) if ctx.saved_states else ()
        ctx.save_for_backward(q, k, v, gam, beta, h0, tm, p, w, u, kt, qg, *states)
        ctx.resets = resets
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gam, beta, h0, tm, p, w, u, kt, qg, *states = ctx.saved_tensors
        resets = ctx.resets
        if ctx.saved_states:
            h, vn = Stored(*states[:2]), Stored(*states[2:])
        else:
            h, vn, _ = state_fwd(w, u, k, gam, kt, h0, inputs=v.dtype, resets=resets, scaled=ctx.scaled)
        do = do.contiguous()  # in o's dtype: the kernels cast on load
        dht = None if dht is None else dht.to(gam.dtype).contiguous()
        dvl = dv_local(q, p, do, v.dtype)
        dh, dvn, dh0 = state_bwd(q, k, gam, kt, qg, w, do, dvl, dht, inputs=v.dtype, need_dh0=h0 is not None,
                                 resets=resets, scaled=ctx.scaled)
        dq, dk, dv, dbeta, dgam = chunk_bwd(q, k, v, gam, beta, tm, h, dh, vn, dvn, do)
        return (dq.to(q.dtype), dk.to(k.dtype), dv, dgam, dbeta.to(beta.dtype),
                None if dh0 is None else dh0.to(h0.dtype), None, None, None)


def _inputs(q, k, v, g, beta, scale, qk_l2norm, layout, T):
    """-> laid-out (q or None, k, v, gam, beta): q, k normalised (and q scaled) in the accumulator dtype, gam the
    chunk-local cumsum of g, beta in the accumulator dtype, v as given."""
    acc = acc_dtype(v.dtype)
    K = k.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    xs = _laid_out(layout, T, *(x for x in (q, k, v, g, beta.to(acc)) if x is not None))
    if q is None:
        _, k, gam, _, _, _ = prep(None, xs[0], xs[2], scale, qk_l2norm, acc)
        return None, k, xs[1], gam, xs[3]
    q, k, v, g, beta = xs
    q, k, gam = KDAPrep.apply(q, k, g, scale, qk_l2norm, acc)
    return q, k, v, gam, beta


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens: torch.Tensor | VarlenLayout | None = None):
    """(o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32 (fp64 for fp64 inputs) or None);
    differentiable in q, k, v, g, beta and the entering state. Semantics of `eager.chunk_kda`."""
    T = v.shape[1]
    layout = as_layout(cu_seqlens, T)
    q, k, v, gam, beta = _inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, layout, T)
    h0 = None if initial_state is None else initial_state.to(gam.dtype).contiguous()
    o, ht = KDAFunction.apply(q, k, v, gam, beta, h0, output_final_state, _resets(layout, v.device),
                              operand_dtype(v, gam, use_qk_l2norm_in_kernel))
    o = layout.from_chunks(o) if layout is not None else o[:, :T]
    return o, (ht if output_final_state else None)


def summary_kda(k, v, g, beta, *, use_qk_l2norm_in_kernel=False, need_transition=True, cu_seqlens=None):
    """(M [B, H, K, K] or None, S [B, H, K, V]) in the accumulator dtype: h_out = M h_in + S; M = 0 when a document
    starts inside the row (or the first does not continue). S: the state kernel from a zero entering state; M: the
    same kernel from I with no values (K columns), W in the accumulator dtype (not `operand_dtype`: M cancels
    strongly). Forward only (p2p uses the value; differentiating raises)."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (k, v, g, beta)):
        raise RuntimeError("the Triton KDA summary has no backward; call it under torch.no_grad() or on detached "
                           "inputs (the eager KDA differentiates it)")
    T = v.shape[1]
    layout = as_layout(cu_seqlens, T)
    _, k, v, gam, beta = _inputs(None, k, v, g, beta, None, use_qk_l2norm_in_kernel, layout, T)
    resets = _resets(layout, v.device)
    _, _, w, u, kt, _ = wy_fwd(None, k, v, gam, beta)
    _, _, s = state_fwd(w, u, k, gam, kt, None, inputs=v.dtype, store_h=False, store_vn=False,
                        output_final_state=True, resets=resets)
    if not need_transition:
        return None, s
    B, _, H, K = k.shape
    if layout is not None and layout.any_reset:
        return torch.zeros(B, H, K, K, dtype=gam.dtype, device=v.device), s
    eye = torch.eye(K, dtype=gam.dtype, device=v.device).expand(B, H, K, K).contiguous()
    _, _, m = state_fwd(w, None, k, gam, kt, eye, inputs=v.dtype, cols=K, store_h=False, store_vn=False,
                        output_final_state=True)
    return m, s


@torch.no_grad()
def initial_state_grad(q, k, v, g, beta, grad_o, *, scale=None, use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """d sum(o * grad_o) / dh0 [B, H, K, V] (accumulator dtype): W, Pᵀ dO, then the reverse state kernel with
    nothing stored but dh0 (o is affine in h0). Zeros when the first chunk resets (nothing run)."""
    B, T, H, V = v.shape
    K = k.shape[-1]
    layout = as_layout(cu_seqlens, T)
    acc = acc_dtype(v.dtype)
    if layout is not None and layout.chunk_resets[0]:
        return torch.zeros(B, H, K, V, dtype=acc, device=v.device)
    q, k, v, gam, beta = _inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, layout, T)
    (do,) = _laid_out(layout, T, grad_o)  # the kernels cast on load
    _, p, w, _, kt, qg = wy_fwd(q, k, v, gam, beta, operand_dtype(v, gam, use_qk_l2norm_in_kernel))
    dvl = dv_local(q, p, do, v.dtype)
    _, _, dh0 = state_bwd(q, k, gam, kt, qg, w, do, dvl, None, inputs=v.dtype, store=False, need_dh0=True,
                          resets=_resets(layout, v.device))
    return dh0
