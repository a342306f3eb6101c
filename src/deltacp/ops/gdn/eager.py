"""Eager (pure PyTorch) chunked gated delta rule: the semantic reference of every backend.

Shapes as in `contract.py`; inside this file, after `_prepare`, tensors are head-major and chunked:
    x_BHNCK   [B, Hv, N chunks, C=64, K]
    g_BHNC    per-token log decay; gam_BHNC its cumulative sum inside each chunk
Computation runs in float32 for float32/bf16/fp16 inputs and in float64 for float64 inputs
(`deltacp.ops.precision.compute_dtype`), upcasting exactly where transformers' Qwen3.5 torch path upcasts.
Backward is PyTorch autograd through these ops (the gradient summary of P2P lives in the CP layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltacp.ops.gdn.contract import CHUNK_SIZE
from deltacp.ops.gdn.naive import l2norm
from deltacp.ops.gdn.varlen import VarlenLayout, as_layout
from deltacp.ops.precision import compute_dtype


@dataclass
class _Chunked:
    """Per-chunk WY quantities shared by the output scan and the summary scan."""

    q: torch.Tensor | None  # [B,H,N,C,K] q ⊙ exp(gamma), scaled
    qk: torch.Tensor | None  # [B,H,N,C,C] causal (incl. diagonal) decayed q kᵀ
    w: torch.Tensor  # [B,H,N,C,K] W = T (beta ⊙ exp(gamma) ⊙ K)
    u: torch.Tensor  # [B,H,N,C,V] U = T (beta V)
    k_tail: torch.Tensor  # [B,H,N,C,K] K~ = K ⊙ exp(gamma_C - gamma_r)
    chunk_decay: torch.Tensor  # [B,H,N] exp(gamma_C)
    T: int


def _prepare(q, k, v, g, beta, *, scale, use_qk_l2norm_in_kernel, need_output: bool) -> _Chunked:
    dt = compute_dtype(v)
    B, T, Hk, K = k.shape
    Hv = v.shape[-2]
    rep = Hv // Hk
    C = CHUNK_SIZE
    pad = (-T) % C
    N = (T + pad) // C

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [B,T,H,D] -> [B,H,N,C,D], zero-padded in time
        x = F.pad(x.to(dt), (0, 0, 0, 0, 0, pad)).transpose(1, 2)
        return x.reshape(B, x.shape[1], N, C, x.shape[-1])

    k = k.repeat_interleave(rep, dim=2) if rep > 1 else k
    if use_qk_l2norm_in_kernel:
        k = l2norm(k.to(dt))
    k = heads_first(k)
    v = heads_first(v)
    # Padded tokens have g = 0 and beta = 0: they neither decay nor write the state.
    g = F.pad(g.to(dt), (0, 0, 0, pad)).transpose(1, 2).reshape(B, Hv, N, C)
    beta = F.pad(beta.to(dt), (0, 0, 0, pad)).transpose(1, 2).reshape(B, Hv, N, C)

    gam = g.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    # decay[i, j] = exp(gamma_i - gamma_j) for j <= i; masked before exp so nothing overflows.
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    a = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower triangular system (diagonal ignored)
    w = torch.linalg.solve_triangular(a, k_beta * gam.exp()[..., None], upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(a, v * beta[..., None], upper=False, unitriangular=True)
    k_tail = k * (gam[..., -1:] - gam).exp()[..., None]
    chunk_decay = gam[..., -1].exp()

    q_dec = qk = None
    if need_output:
        q = q.repeat_interleave(rep, dim=2) if rep > 1 else q
        if use_qk_l2norm_in_kernel:
            q = l2norm(q.to(dt))
        q = heads_first(q) * (K**-0.5 if scale is None else scale)
        qk = (q @ k.transpose(-1, -2)) * decay
        q_dec = q * gam.exp()[..., None]
    return _Chunked(q_dec, qk, w, u, k_tail, chunk_decay, T)


def chunk_gated_delta_rule(
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
    cu_seqlens: torch.Tensor | VarlenLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked (C=64) gated delta rule; same arguments and results as `naive.recurrent_gated_delta_rule`.

    With `cu_seqlens` (one packed row, B = 1; offsets or a `VarlenLayout`) the state restarts at every document
    start; `initial_state` feeds the first document (when the layout says it continues) and the final state is
    the last document's (`varlen.py`).
    """
    layout = as_layout(cu_seqlens, v.shape[1])
    if layout is not None:
        q, k, v_in, g, beta = (layout.to_chunks(x) for x in (q, k, v, g, beta))
    else:
        v_in = v
    c = _prepare(q, k, v_in, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                 need_output=True)
    B, Hv, N, C, K = c.w.shape
    V = c.u.shape[-1]
    h = c.u.new_zeros(B, Hv, K, V) if initial_state is None else initial_state.to(c.u.dtype)
    resets = layout.chunk_resets if layout is not None else [False] * N
    outs = []
    for n in range(N):
        if resets[n]:  # a document starts here: nothing before it reaches it
            h = torch.zeros_like(h)
        v_new = c.u[:, :, n] - c.w[:, :, n] @ h  # the part of U the entering state does not predict
        outs.append(c.q[:, :, n] @ h + c.qk[:, :, n] @ v_new)
        h = c.chunk_decay[:, :, n, None, None] * h + c.k_tail[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, Hv, N * C, V)[:, :, : c.T].transpose(1, 2)
    if layout is not None:
        o = layout.from_chunks(o)
    return o.to(v.dtype), (h if output_final_state else None)


def state_summary(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | VarlenLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, S) with H_out = M @ H_in + S for this segment.

    One scan over chunks of X = [M | S], X_0 = [I | 0]:  X <- (exp(gamma_C) I - K~ᵀ W) X + [0 | K~ᵀ U].
    With `cu_seqlens`, X <- [0 | 0] where a document starts, so M = 0 once the entering state cannot reach the
    end (a document starts inside the segment, or the first one does not continue) and S is the last
    document's final state.
    """
    layout = as_layout(cu_seqlens, v.shape[1])
    if layout is not None:
        k, v, g, beta = (layout.to_chunks(x) for x in (k, v, g, beta))
    c = _prepare(None, k, v, g, beta, scale=None, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                 need_output=False)
    B, Hv, N, C, K = c.w.shape
    eye = torch.eye(K, dtype=c.w.dtype, device=c.w.device)
    m = eye.expand(B, Hv, K, K)
    s = c.u.new_zeros(B, Hv, K, c.u.shape[-1])
    resets = layout.chunk_resets if layout is not None else [False] * N
    for n in range(N):
        if resets[n]:
            m, s = torch.zeros_like(m), torch.zeros_like(s)
        k_tail_t = c.k_tail[:, :, n].transpose(-1, -2)
        transition = c.chunk_decay[:, :, n, None, None] * eye - k_tail_t @ c.w[:, :, n]
        m = transition @ m
        s = transition @ s + k_tail_t @ c.u[:, :, n]
    return m, s


def initial_state_grad(q, k, v, g, beta, grad_o, *, scale=None, use_qk_l2norm_in_kernel=False, cu_seqlens=None
                       ) -> torch.Tensor:
    """d sum(o * grad_o) / dH0, by autograd through the chunked op from a zero H0 (o is affine in H0)."""
    B, Hv, K, V = v.shape[0], v.shape[2], k.shape[3], v.shape[3]
    layout = as_layout(cu_seqlens, v.shape[1])
    if layout is not None and layout.chunk_resets[0]:  # the entering state reaches no output
        return torch.zeros(B, Hv, K, V, dtype=compute_dtype(v), device=v.device)
    with torch.enable_grad():
        h0 = torch.zeros(B, Hv, K, V, dtype=compute_dtype(v), device=v.device, requires_grad=True)
        o, _ = chunk_gated_delta_rule(*(x.detach() for x in (q, k, v, g, beta)), scale=scale, initial_state=h0,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=layout)
        return torch.autograd.grad(o, h0, grad_o)[0]


def split_qkv(qkv: torch.Tensor, qk_heads: int, head_k_dim: int, head_v_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, T, channels = q | k | v] -> q, k [B, T, qk_heads, K] and v [B, T, Hv, V] (views)."""
    B, T, _ = qkv.shape
    key_dim = qk_heads * head_k_dim
    q, k, v = torch.split(qkv, [key_dim, key_dim, qkv.shape[-1] - 2 * key_dim], dim=-1)
    return (q.reshape(B, T, qk_heads, head_k_dim), k.reshape(B, T, qk_heads, head_k_dim),
            v.reshape(B, T, -1, head_v_dim))


def conv_fix_from_starts(doc_start_s: torch.Tensor, kernel: int, dilation: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [n], valid [n, kernel]) of the tokens whose causal conv window reaches back past the start of their
    document (`doc_start_s`: local index of each token's document start, may be negative): tap j of token t reads
    token t - (kernel-1-j)*dilation, valid when that is >= its document's start. One host sync (nonzero)."""
    t = torch.arange(doc_start_s.numel(), device=doc_start_s.device)
    start = doc_start_s.to(torch.int64)
    halo = (kernel - 1) * dilation
    index = (t - start < halo).nonzero().flatten()
    shifts = (kernel - 1 - torch.arange(kernel, device=t.device)) * dilation
    return index, index[:, None] - shifts[None, :] >= start[index][:, None]


def causal_conv_silu(x_BsC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None, dilation: int,
                     left_context_BhC: torch.Tensor | None = None,
                     doc_start_s: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(causal depthwise conv) of x [B, s, C] -> [B, s, C] (`causal_conv`'s window rules); SiLU in the weight
    dtype, then one rounding to x's dtype, as transformers' Qwen3.5 does."""
    return F.silu(_causal_conv_CBs(x_BsC, weight_CK, bias_C, dilation, left_context_BhC, doc_start_s)).to(
        x_BsC.dtype).transpose(1, 2)


def causal_conv(x_BsC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None, dilation: int,
                left_context_BhC: torch.Tensor | None = None, doc_start_s: torch.Tensor | None = None) -> torch.Tensor:
    """The causal depthwise conv of x [B, s, C] -> [B, s, C], no activation (LFM2's gated short conv: transformers'
    `causal_conv1d_fn` with activation None): in the weight dtype, one rounding to x's dtype."""
    return _causal_conv_CBs(x_BsC, weight_CK, bias_C, dilation, left_context_BhC, doc_start_s).to(
        x_BsC.dtype).transpose(1, 2)


def _causal_conv_CBs(x_BsC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None, dilation: int,
                     left_context_BhC: torch.Tensor | None, doc_start_s: torch.Tensor | None) -> torch.Tensor:
    """The causal depthwise conv of x [B, s, C] -> [B, C, s] in the weight dtype (x cast to it, as transformers
    does); `left_context` supplies the (kernel-1)*dilation tokens before x (zeros when None).

    Packed documents (`doc_start_s` [s], the local index of each token's document start): no token of another
    document may enter a conv window. Only the first (kernel-1)*dilation tokens of each document have windows
    that reach back that far, so the conv runs as usual and those few outputs are recomputed from their own
    document's taps (`conv_fix_from_starts`): exact, and the unpacked path is unchanged.
    """
    s, channels = x_BsC.shape[1], x_BsC.shape[2]
    kernel = weight_CK.shape[-1]
    halo = (kernel - 1) * dilation
    x = x_BsC if left_context_BhC is None else torch.cat([left_context_BhC, x_BsC], dim=1)
    x = x.transpose(1, 2).to(weight_CK.dtype)
    if left_context_BhC is None:
        x = F.pad(x, (halo, 0))
    out = F.conv1d(x, weight_CK.unsqueeze(1), bias_C, dilation=dilation, groups=channels)[:, :, -s:]
    if doc_start_s is not None:
        index, valid = conv_fix_from_starts(doc_start_s, kernel, dilation)
        if index.numel():
            # x holds halo + s tokens: token t's tap j reads x[..., t + halo - (kernel-1-j)*dilation]
            taps_nK = index[:, None] + halo - (kernel - 1 - torch.arange(kernel, device=x.device)) * dilation
            x_BCnK = x[:, :, taps_nK] * valid.to(x.dtype)
            fixed_BCn = torch.einsum("bcnk,ck->bcn", x_BCnK, weight_CK)
            if bias_C is not None:
                fixed_BCn = fixed_BCn + bias_C[:, None]
            out = out.index_copy(2, index, fixed_BCn)
    return out


def split_parts(x: torch.Tensor, parts: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, ...]:
    """[B, T, channels] -> one [B, T, heads, dim] view per (heads, dim) of `parts`, in order; one heads may be -1
    (what the other parts leave)."""
    B, T, channels = x.shape
    known = sum(h * d for h, d in parts if h != -1)
    sizes = [h * d if h != -1 else channels - known for h, d in parts]
    return tuple(t.reshape(B, T, -1, d) for t, (_, d) in zip(torch.split(x, sizes, dim=-1), parts))


def conv_silu_split(x_BsC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None, dilation: int, *,
                    left_BhC: torch.Tensor | None = None, doc_start_s: torch.Tensor | None = None,
                    heads: tuple) -> tuple[torch.Tensor, ...]:
    """`causal_conv_silu`, then split: heads = (qk_heads, head_k_dim, head_v_dim), the [q | k | v] split of GDN
    (`split_qkv`), or ((heads, dim), ...) pairs, any channel groups in order (`split_parts`): the contract's
    `conv_silu_split` (views of one [B, s, C] output)."""
    y = causal_conv_silu(x_BsC, weight_CK, bias_C, dilation, left_BhC, doc_start_s)
    return split_parts(y, heads) if isinstance(heads[0], tuple) else split_qkv(y, *heads)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The GDN gates as transformers' Qwen3.5 computes them: g = -exp(A_log) * softplus(a + dt_bias) in float32
    (float64 for float64 inputs), beta = sigmoid(b) in b's dtype. a, b [..., Hv]; a_log, dt_bias [Hv]."""
    dt = compute_dtype(a)
    return -a_log.to(dt).exp() * F.softplus(a.to(dt) + dt_bias.to(dt)), b.sigmoid()


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5RMSNormGated over the last dim of x, gate [..., V], with float32 upcasts widened to
    float64 for float64 inputs."""
    dt = compute_dtype(x)
    h = x.to(dt)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(gate.to(dt))).to(x.dtype)


class EagerGDNBackend:
    """Pure-PyTorch backend: any float dtype, any device, any length; backward by autograd."""

    name = "eager"

    def check(self, q, k, v, g, beta) -> None:
        if not (v.is_floating_point() and k.is_floating_point()):
            raise ValueError(f"eager GDN needs floating-point q/k/v, got {k.dtype}/{v.dtype}")
        if v.shape[-2] % k.shape[-2]:
            raise ValueError(f"value heads ({v.shape[-2]}) must be a multiple of key heads ({k.shape[-2]})")

    def chunk_gated_delta_rule(self, q, k, v, g, beta, *, prepared=None, **kwargs):
        _no_prepared(prepared)
        return chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)

    def prepare_chunks(self, k, v, g, beta, **kwargs):
        return None  # nothing staged: each eager call computes what it needs

    def conv_silu_split(self, x_BsC, weight_CK, bias_C, dilation, *, left_BhC=None, doc_start_s=None, heads):
        return conv_silu_split(x_BsC, weight_CK, bias_C, dilation, left_BhC=left_BhC, doc_start_s=doc_start_s,
                               heads=heads)

    def prepared_from_saved(self, tensors):
        raise TypeError("the eager GDN backend stages nothing (prepare_chunks returns None)")

    def state_summary(self, k, v, g, beta, *, prepared=None, need_transition=True, **kwargs):
        _no_prepared(prepared)
        m, s = state_summary(k, v, g, beta, **kwargs)
        return (m if need_transition else None), s

    def initial_state_grad(self, q, k, v, g, beta, grad_o, *, prepared=None, **kwargs):
        _no_prepared(prepared)
        return initial_state_grad(q, k, v, g, beta, grad_o, **kwargs)

    def gates(self, a, b, a_log, dt_bias):
        return gdn_gates(a, b, a_log, dt_bias)

    def gated_rms_norm(self, x, gate, weight, eps):
        return gated_rms_norm(x, gate, weight, eps)


def _no_prepared(prepared) -> None:
    if prepared is not None:
        raise TypeError(f"the eager GDN backend takes no prepared chunks (got {type(prepared).__name__}); "
                        "they come from another backend's prepare_chunks")
