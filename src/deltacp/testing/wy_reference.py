"""fp64 references of the WY form of a chunk, per 64-token chunk, for checking the Triton WY kernels stage by
stage (bench/gdn_kernels.py --sweep, the interpreter tests).

A = strict-lower(beta_i k_i.k_j e^{g_i - g_j}), T = (I + A)^-1, W = T (beta e^g K), U = T (beta V), with g the
chunk-local gate cumsum. Layouts as in deltacp.ops.gdn.triton.wy (k [B,T,Hk,K], v [B,T,Hv,V], beta, gc [B,T,Hv]).
"""

from __future__ import annotations

import torch

BT = 64


def _chunks(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, D] -> [B, N, H, 64, D];  [B, T, H] -> [B, N, H, 64]."""
    B, T = x.shape[:2]
    return x.view(B, T // BT, BT, *x.shape[2:]).transpose(2, 3)


def _unchunk(x: torch.Tensor) -> torch.Tensor:
    B, N, H, _, D = x.shape
    return x.transpose(2, 3).reshape(B, N * BT, H, D)


def _wy(k, v, beta, gc):
    Hv = v.shape[2]
    kc = _chunks(k.repeat_interleave(Hv // k.shape[2], 2))
    vc, bc, gcc = _chunks(v), _chunks(beta), _chunks(gc)
    lower = torch.ones(BT, BT, dtype=torch.bool, device=k.device).tril(-1)
    gam = (gcc[..., :, None] - gcc[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    A = (kc @ kc.transpose(-1, -2)) * gam * bc[..., :, None]
    Tm = torch.linalg.inv(torch.eye(BT, dtype=A.dtype, device=k.device) + A)
    W = Tm @ (kc * (bc * gcc.exp())[..., None])
    U = Tm @ (vc * bc[..., None])
    return W, U


def wu_reference(k, v, beta, gc):
    """-> W [B,T,Hv,K], U [B,T,Hv,V] in fp64."""
    W, U = _wy(*(x.double() for x in (k, v, beta, gc)))
    return _unchunk(W), _unchunk(U)


def wy_bwd_reference(k, v, beta, gc, dw, du, dk_in):
    """fp64 autograd of W, U against dW, dU -> [dk_in + dK, dV, dbeta, dg] like the Triton wy_bwd (dK per value
    head, dg for the chunk-local cumsum)."""
    kk = k.double().repeat_interleave(v.shape[2] // k.shape[2], 2).requires_grad_()
    vv, bb, gg = (x.double().requires_grad_() for x in (v, beta, gc))
    W, U = _wy(kk, vv, bb, gg)
    loss = (W * _chunks(dw.double())).sum() + (U * _chunks(du.double())).sum()
    dk, dv, db, dg = torch.autograd.grad(loss, (kk, vv, bb, gg))
    return [dk_in.double() + dk, dv, db, dg]
