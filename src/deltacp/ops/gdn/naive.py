"""Token-by-token reference of the gated delta rule: slow, obviously right, for tests only.

Shapes as in `contract.py`. Computes in the promoted dtype of (inputs, float32), so a float64 call
is float64-accurate.
"""

from __future__ import annotations

import torch

from deltacp.ops.precision import compute_dtype


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # Same formula as transformers' Qwen3.5 (and flash-linear-attention): rsqrt(sum(x^2) + eps).
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """H_t = exp(g_t) (I - beta_t k_t k_tᵀ) H_{t-1} + beta_t k_t v_tᵀ ;  o_t = H_tᵀ q_t."""
    out_dtype = v.dtype
    dt = compute_dtype(v)
    B, T, Hk, K = k.shape
    Hv, V = v.shape[-2:]
    rep = Hv // Hk
    q, k = (x.to(dt).repeat_interleave(rep, dim=2) for x in (q, k))
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (K**-0.5 if scale is None else scale)
    h = q.new_zeros(B, Hv, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(T):
        k_t, v_t, q_t = k[:, t], v[:, t], q[:, t]  # [B, Hv, K|V]
        h = h * g[:, t].exp()[..., None, None]
        # delta rule: correct the value the state predicts for k_t towards v_t, by beta_t
        pred = torch.einsum("bhk,bhkv->bhv", k_t, h)
        h = h + torch.einsum("bhk,bhv->bhkv", k_t, (v_t - pred) * beta[:, t, :, None])
        outs.append(torch.einsum("bhk,bhkv->bhv", q_t, h))
    o = torch.stack(outs, dim=1).to(out_dtype)
    return o, (h if output_final_state else None)
