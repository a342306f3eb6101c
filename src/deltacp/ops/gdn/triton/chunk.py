"""Chunked gated delta rule on Triton: `_fwd`/`_bwd` compositions, thin autograd Functions, public ops.

Shapes: q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; states [B, Hv, K, V] fp32;
summary M [B, Hv, K, K], S [B, Hv, K, V] fp32. Value head j reads key head j // (Hv // Hk).

Stages (forward): gate cumsum -> wy_fwd (A, T = (I+A)^-1, W, U) -> state_fwd (per-chunk H, Vn) -> o_fwd.
Backward keeps T from the forward, recomputes W, U, H and Vn, then dv_local -> state_bwd (dH per chunk, dVn,
dH0) -> dqkwg -> wy_bwd.
The l2 norm of q/k (own autograd Function and kernels, l2norm.py) and the padding of T to a multiple of 64 stay
outside the core Function: padded tokens have k = v = q = 0, beta = 0, g = 0, which leave the state unchanged.
Packed documents (`cu_seqlens`, one row): the kernels read q, k, v, beta, dO and write o, dq, dk, dv, dbeta in the
packed row itself, through the chunk table (`layout.chunk_table`: each chunk's first token and token count, a
document's last chunk partial, indexing.py); the per-chunk tensors between kernels (gate cumsum, T, W, U, Vn, H, ...)
keep 64 rows per chunk, i.e. the chunk-aligned layout, so every chunk computes what the zero-padded document
would. Only g ([T, Hv], 1/128 of v's bytes) is re-laid out (`VarlenLayout.to_chunks`, its gradient back with
`from_chunks`). The state kernels run one program per document (`layout.doc_table`), so the state restarts at
each document start by construction (chunk_h.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltacp.ops.gdn.triton.chunk_h import state_bwd, state_fwd
from deltacp.ops.gdn.triton.chunk_o import dqkwg, dv_local, o_fwd
from deltacp.ops.gdn.triton.heads import group_sum
from deltacp.ops.gdn.triton.indexing import BT
from deltacp.ops.gdn.triton.l2norm import l2norm
from deltacp.ops.gdn.triton.wy import wu_fwd, wy_bwd, wy_fwd, wy_inverse
from deltacp.ops.gdn.varlen import VarlenLayout, as_layout


def chunk_cumsum(g: torch.Tensor) -> torch.Tensor:
    B, T, H = g.shape
    return g.float().view(B, T // BT, BT, H).cumsum(2).view(B, T, H)


def chunk_rev_cumsum(dg: torch.Tensor) -> torch.Tensor:
    """Backward of chunk_cumsum: suffix sums within each chunk."""
    B, T, H = dg.shape
    x = dg.view(B, T // BT, BT, H)
    return (x.sum(2, keepdim=True) - x.cumsum(2) + x).view(B, T, H)


@dataclass
class PreparedChunks:
    """The part of the forward that neither the entering state nor autograd touches, built once per p2p step
    and shared by its stages (summary, output pass, dH_in pass) instead of each rebuilding the WY form.

    Computed without autograd from the (l2-normalised, padded) k and the padded v, g, beta; for packed documents
    k is the packed row and the rest per chunk (Tp = layout.padded; the calls that use it take the same
    cu_seqlens). The output pass consumes W and U (sets them to None); gc and T stay for the dH_in pass and are the
    tensors the output pass's backward saves anyway (no extra memory)."""

    k: torch.Tensor | None  # normalised k (the summary's recurrences read it), dropped after the summary
    gc: torch.Tensor  # [B, Tp, Hv] chunk-local gate cumsum, fp32
    ai: torch.Tensor  # [B, Tp, Hv, 64] T = (I + A)^-1, fp32
    w: torch.Tensor | None  # [B, Tp, Hv, K] in the input dtype
    u: torch.Tensor | None  # [B, Tp, Hv, V]

    def tensors_for_backward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gc, self.ai

    @classmethod
    def from_saved(cls, tensors) -> PreparedChunks:
        gc, ai = tensors
        return cls(None, gc, ai, None, None)

    def check_matches(self, v: torch.Tensor, rows: int) -> None:
        """v: the value input; rows: the per-chunk rows its layout has (Tp)."""
        B, _, Hv = v.shape[:3]
        if self.ai.shape[:3] != (B, rows, Hv) or self.ai.device != v.device:
            raise ValueError(f"prepared chunks of shape {tuple(self.ai.shape[:3])} on {self.ai.device} do not "
                             f"belong to inputs of shape {(B, rows, Hv)} on {v.device}")


@dataclass(frozen=True)
class PackedRow:
    """What the kernels need of a packed row (`varlen.VarlenLayout`): the chunk table (per-chunk kernels), the
    document table (state kernels) and whether the entering state feeds document 0."""

    chunks: torch.Tensor  # [Tp / 64, 2] int32: first token, token count
    docs: torch.Tensor  # [N + 1, 2] int32: first token, first chunk
    first_continues: bool

    @classmethod
    def of(cls, layout: VarlenLayout | None, device) -> PackedRow | None:
        if layout is None:
            return None
        return cls(layout.chunk_table(device), layout.doc_table(device), layout.first_continues)


def _chunk_kw(packed: PackedRow | None) -> dict:
    """Keywords of the per-chunk kernels' launchers."""
    return {} if packed is None else {"chunks": packed.chunks}


def _state_kw(packed: PackedRow | None) -> dict:
    """Keywords of the state kernels' launchers."""
    if packed is None:
        return {}
    return {"chunks": packed.chunks, "docs": packed.docs, "first_continues": packed.first_continues}


def chunk_gdn_fwd(q, k, v, g, beta, scale, h0, output_final_state, prepared: PreparedChunks | None = None,
                  packed: PackedRow | None = None):
    """-> o, final state, and what the backward keeps: the chunk-local gate cumsum gc and T = (I + A)^-1.

    g is per chunk (Tp rows); q, k, v, beta have the same rows, or the packed row's (`packed`)."""
    ck = _chunk_kw(packed)
    if prepared is None:
        gc = chunk_cumsum(g)
        ai, w, u = wy_fwd(k, v, beta, gc, **ck)
    else:
        prepared.check_matches(v, g.shape[1])
        gc, ai, w, u = prepared.gc, prepared.ai, prepared.w, prepared.u
        if w is None:  # already consumed by another output pass
            w, u = wu_fwd(k, v, beta, gc, ai, **ck)
        prepared.w = prepared.u = None
    h, vn, ht = state_fwd(k, w, u, gc, h0, output_final_state=output_final_state, **_state_kw(packed))
    o = o_fwd(q, k, vn, h, gc, scale, **ck)
    return o, ht, gc, ai


def chunk_gdn_bwd(q, k, v, gc, beta, ai, scale, h0, do, dht, packed: PackedRow | None = None):
    """W, U (from the kept T), H and Vn are recomputed: keeping them would cost 3x the memory of q, k, v.
    dg comes back per chunk (as g went in), the other gradients with the rows of their inputs."""
    Hk = k.shape[2]
    V = v.shape[3]
    ck, sk = _chunk_kw(packed), _state_kw(packed)
    w, u = wu_fwd(k, v, beta, gc, ai, **ck)
    h, vn, _ = state_fwd(k, w, u, gc, h0, **sk)
    # dVn travels between kernels in the input dtype (it enters bf16 products anyway); dW stays fp32 (in bf16
    # the worst gradient rel-L2 at 8K is 7.2e-3 instead of 4.0e-3: NOTES.md). dq, dk, dv leave in the input
    # dtype; under GVA the kernels write dq, dk per value head in fp32, rounded once after the head sum (heads.py).
    lo = v.dtype
    out_qk = q.dtype if Hk == v.shape[2] else torch.float32
    dvl = dv_local(q, k, gc, do, scale, out_dtype=lo, **ck)
    dh, dvn, dh0 = state_bwd(q, k, w, gc, do, dvl, dht, scale=scale, V=V, need_dh0=h0 is not None, dvn_dtype=lo,
                             **sk)
    dq, dk, dw, dg1 = dqkwg(q, k, vn, h, dh, do, dvn, gc, scale, dq_dtype=out_qk, **ck)
    dk, dv, dbeta, dg2 = wy_bwd(k, v, beta, gc, ai, dw, dvn, dk, dk_dtype=out_qk, dv_dtype=v.dtype, **ck)
    dg = chunk_rev_cumsum(dg1 + dg2)
    if Hk != v.shape[2]:
        dq, dk = group_sum(dq, v.shape[2] // Hk, q.dtype), group_sum(dk, v.shape[2] // Hk, k.dtype)
    return dq, dk, dv, dg, dbeta, dh0


class ChunkGDNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, h0, output_final_state, prepared=None, packed=None):
        o, ht, gc, ai = chunk_gdn_fwd(q, k, v, g, beta, scale, h0, output_final_state, prepared, packed)
        # T (fp32, [B, T, Hv, 64]) is kept: recomputing it (the 16x16 inverses and their merge) costs more
        # than reading it back, and the backward then rebuilds W, U exactly as the forward did.
        ctx.save_for_backward(q, k, v, gc, beta, ai, h0)
        ctx.scale = scale
        ctx.g_dtype = g.dtype
        ctx.packed = packed  # chunk and document tables (no gradient), or None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gc, beta, ai, h0 = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = chunk_gdn_bwd(q, k, v, gc, beta, ai, ctx.scale, h0, do.contiguous(),
                                                   None if dht is None else dht.contiguous().float(), ctx.packed)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(ctx.g_dtype), dbeta.to(beta.dtype), None,
                None if dh0 is None else dh0.to(h0.dtype), None, None, None)


# Product precision of the summary's fp32 state recurrence and W. tf32 truncates operands, a bias that adds
# up over the chunk product; the default "tf32x3" (three tf32 products, about fp32) keeps M near fp32 where
# "tf32" does not (NOTES.md).
# DELTACP_SUMMARY_DOT_PRECISION overrides it (for measuring one against the other).
SUMMARY_DOT_PRECISION = os.environ.get("DELTACP_SUMMARY_DOT_PRECISION", "tf32x3")
if SUMMARY_DOT_PRECISION not in ("tf32", "tf32x3", "ieee"):
    raise ValueError(f"DELTACP_SUMMARY_DOT_PRECISION={SUMMARY_DOT_PRECISION!r}; expected tf32, tf32x3 or ieee")


def _summary_transition_w(k, v, beta, gc, ai, **ck):
    """W in fp32 with SUMMARY_DOT_PRECISION products, for M: M is a product of per-chunk factors (I - K~^T W)
    that cancel strongly; bf16 W costs ~2e-2 rel-L2 on M at 8K tokens."""
    w, _ = wu_fwd(k, v, beta, gc, ai, w_dtype=torch.float32, dot_precision=SUMMARY_DOT_PRECISION, need_u=False, **ck)
    return w


def state_summary_fwd(k, v, g, beta, prepared: PreparedChunks | None = None, need_transition: bool = True,
                      any_reset: bool = False, packed: PackedRow | None = None):
    """(M or None, S) of padded, normalised inputs (g per chunk; with `packed`, k, v, beta the packed row). S is
    the final state from a zero entering state, by the output pass's own bf16 recurrence (and the same W, U);
    M = the final state from I with values 0, an fp32 recurrence of width K with SUMMARY_DOT_PRECISION products.
    packed/any_reset: S restarts at each document; once any chunk resets (a document starts inside the row, or
    the first does not continue), the entering state reaches nothing after it and M is exactly 0 (returned as
    zeros without running its recurrence)."""
    ck = _chunk_kw(packed)
    if prepared is None:
        prepared = prepare_chunks_fwd(k, v, g, beta, **ck)
    w, u = prepared.w, prepared.u
    if w is None:  # an output pass consumed them already
        w, u = wu_fwd(k, v, beta, prepared.gc, prepared.ai, **ck)
    _, _, s = state_fwd(k, w, u, prepared.gc, None, store_h=False, store_vn=False, output_final_state=True,
                        **_state_kw(packed))
    if not need_transition:
        return None, s
    B, _, Hv, _ = v.shape
    K = k.shape[3]
    if any_reset:
        return torch.zeros(B, Hv, K, K, device=k.device, dtype=torch.float32), s
    w32 = _summary_transition_w(k, v, beta, prepared.gc, prepared.ai, **ck)
    eye = torch.eye(K, device=k.device, dtype=torch.float32).expand(B, Hv, K, K).contiguous()
    _, _, m = state_fwd(k, w32, None, prepared.gc, eye, store_h=False, store_vn=False, output_final_state=True,
                        fp32_dot=True, dot_precision=SUMMARY_DOT_PRECISION, **_state_kw(packed))
    return m, s


def prepare_chunks_fwd(k, v, g, beta, chunks: torch.Tensor | None = None) -> PreparedChunks:
    gc = chunk_cumsum(g.float())
    ai = wy_inverse(k, beta, gc, v.shape[2], chunks=chunks)
    w, u = wu_fwd(k, v, beta, gc, ai, chunks=chunks)
    return PreparedChunks(k, gc, ai, w, u)


def _pad_t(x: torch.Tensor, pad: int) -> torch.Tensor:
    if pad == 0:
        return x.contiguous()
    widths = [0, 0] * (x.dim() - 2) + [0, pad]
    return F.pad(x, widths).contiguous()


def _to_layout(layout: VarlenLayout | None, T: int, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Token tensors for the kernels: [B, T, ...] end-padded to a multiple of 64 (layout None), or the packed row
    as it is (the kernels read it through the chunk table; differentiable either way)."""
    if layout is None:
        pad = (-T) % BT
        return [_pad_t(x, pad) for x in xs]
    for x in xs:
        if x.shape[0] != 1 or x.shape[1] != layout.total:
            raise ValueError(f"packed documents need one row of {layout.total} tokens (B = 1), got a tensor of "
                             f"shape {tuple(x.shape)}")
    return [x.contiguous() for x in xs]


def _gates_per_chunk(layout: VarlenLayout | None, T: int, g: torch.Tensor) -> torch.Tensor:
    """g [B, T, Hv] -> fp32 [B, Tp, Hv], 64 rows per chunk (a zero tail per document): the gate cumsum and the
    kernels read it per chunk (differentiable)."""
    g = g.float()
    return _to_layout(None, T, g)[0] if layout is None else layout.to_chunks(g)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, prepared: PreparedChunks | None = None, cu_seqlens=None):
    """o [B, T, Hv, V] (dtype of v), final state [B, Hv, K, V] fp32 or None.

    prepared: from `prepare_chunks` on the same k, v, g, beta (and cu_seqlens): its T, W, U are used instead of
    rebuilt (W, U are consumed).
    cu_seqlens: None, or for one packed row (B = 1) document offsets [0, ..., T] or a `VarlenLayout`: the state
    restarts at each document; initial_state feeds the first one only if the layout says it continues (else its
    gradient is 0); the final state is the last document's."""
    T, K = q.shape[1], q.shape[3]
    layout = as_layout(cu_seqlens, T)
    if scale is None:
        scale = K ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k, v, beta = _to_layout(layout, T, q, k, v, beta)
    g = _gates_per_chunk(layout, T, g)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, ht = ChunkGDNFunction.apply(q, k, v, g, beta, float(scale), h0, output_final_state, prepared,
                                   PackedRow.of(layout, q.device))
    if o.shape[1] != T:
        o = o[:, :T]
    return o, ht


@torch.no_grad()
def prepare_chunks(k, v, g, beta, *, use_qk_l2norm_in_kernel=False, cu_seqlens=None) -> PreparedChunks:
    """The stage before the summary: normalised k, gate cumsum, T = (I + A)^-1, W, U (no autograd); with
    cu_seqlens k stays the packed row and the rest is per chunk (per-chunk work: no resets needed here)."""
    T = k.shape[1]
    layout = as_layout(cu_seqlens, T)
    if use_qk_l2norm_in_kernel:
        k = l2norm(k)
    k, v, beta = _to_layout(layout, T, k, v, beta)
    return prepare_chunks_fwd(k, v, _gates_per_chunk(layout, T, g), beta, **_chunk_kw(PackedRow.of(layout, k.device)))


def state_summary(k, v, g, beta, *, use_qk_l2norm_in_kernel=False, prepared: PreparedChunks | None = None,
                  need_transition=True, cu_seqlens=None):
    """(M [B, Hv, K, K] or None, S [B, Hv, K, V]), fp32: H_out = M @ H_in + S over this segment. Forward only.

    need_transition=False: M is not computed (the first rank has no H_in). prepared: from `prepare_chunks`
    on the same inputs (its normalised k is then used and released). cu_seqlens: packed documents (S is the last
    document's final state; M = 0 once a chunk resets, i.e. whenever the entering state cannot reach the end).
    p2p needs no gradient through the summary (the local GDN backward with dH_out gives it, see
    parallel/p2p.py), so this backend has none: differentiating it raises instead of returning a silent zero.
    (Summary forms measured, with and without a backward: NOTES.md.)"""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (k, v, g, beta)):
        raise RuntimeError("the Triton GDN backend's state_summary has no backward; call it under torch.no_grad() "
                           "or on detached inputs (backend='eager' differentiates it)")
    T = v.shape[1]
    layout = as_layout(cu_seqlens, T)
    with torch.no_grad():
        if prepared is None:
            prepared = prepare_chunks(k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                      cu_seqlens=layout)
        kn = prepared.k
        if kn is None:
            raise ValueError("prepared chunks already used by a summary (their normalised k was released)")
        prepared.k = None
        v, beta = _to_layout(layout, T, v, beta)
        prepared.check_matches(v, T + (-T) % BT if layout is None else layout.padded)
        return state_summary_fwd(kn, v, None, beta, prepared=prepared, need_transition=need_transition,
                                 any_reset=layout is not None and layout.any_reset,
                                 packed=PackedRow.of(layout, v.device))


@torch.no_grad()
def initial_state_grad(q, k, v, g, beta, grad_o, *, scale=None, use_qk_l2norm_in_kernel=False,
                       prepared: PreparedChunks | None = None, cu_seqlens=None):
    """d sum(o * grad_o) / dH0 [B, Hv, K, V] fp32: W (from the WY form), dVn_local, then the state backward
    with nothing stored but dH0 (the rest of the backward needs dH_out, which p2p does not have yet).
    prepared: its gc and T are used instead of rebuilt (only W is computed). cu_seqlens: packed documents (the
    gradient reaches the entering state through the first document only, and not at all when it does not
    continue: zeros then, nothing run)."""
    T, K, V = q.shape[1], q.shape[3], v.shape[3]
    layout = as_layout(cu_seqlens, T)
    if layout is not None and layout.chunk_resets[0]:
        return torch.zeros(v.shape[0], v.shape[2], K, V, device=v.device, dtype=torch.float32)
    if scale is None:
        scale = K ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k, v, beta, do = _to_layout(layout, T, q, k, v, beta, grad_o)
    packed = PackedRow.of(layout, q.device)
    ck = _chunk_kw(packed)
    if prepared is None:
        gc = chunk_cumsum(_gates_per_chunk(layout, T, g))
        _, w, _ = wy_fwd(k, v, beta, gc, need_u=False, **ck)
    else:
        prepared.check_matches(v, T + (-T) % BT if layout is None else layout.padded)
        gc = prepared.gc
        w, _ = wu_fwd(k, v, beta, gc, prepared.ai, need_u=False, **ck)
    dvl = dv_local(q, k, gc, do, scale, out_dtype=v.dtype, **ck)
    _, _, dh0 = state_bwd(q, k, w, gc, do, dvl, None, scale=scale, V=V, need_dh0=True, store=False,
                          **_state_kw(packed))
    return dh0
