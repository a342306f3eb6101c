"""The GDN backend contract: what a CP mode may ask of a local gated-delta-rule implementation.

Shape legend (all backends):
    q, k   [B, T, Hk, K]    query/key heads (Hk divides Hv; each key head serves Hv // Hk consecutive value heads)
    v      [B, T, Hv, V]
    g      [B, T, Hv]       log decay per token (<= 0)
    beta   [B, T, Hv]       write strength per token
    o      [B, T, Hv, V]
    state  [B, Hv, K, V]    recurrent state H (fp32, or fp64 for fp64 inputs)
    M      [B, Hv, K, K]    affine summary of a segment: H_out = M @ H_in + S
    S      [B, Hv, K, V]

A backend offers these operations; the CP modes are built from them and never see kernels, and backends
never see ranks or modes. The GDN-core operations (the op, prepare_chunks, state_summary,
initial_state_grad) take `cu_seqlens` (the conv takes document starts, `doc_start_s`): None (each row is one
sequence), or, for one packed row (B = 1), the document offsets [0, ..., T] or a prebuilt `varlen.VarlenLayout`
(what a CP step builds once and hands to every layer). The state restarts at each document start; the entering state feeds the first document
only when it continues from before the row (`VarlenLayout.first_continues`; True for plain offsets); final
states and S are the last document's; M is zero when the entering state cannot reach the end. Documents need
not align to the chunk size, and T is never a compile-time constant.

    chunk_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                           use_qk_l2norm_in_kernel, prepared, cu_seqlens) -> (o, final_state | None)  (differentiable)
        The whole local GDN, optionally from an entering state (ulysses: H_in = None; p2p and
        all_gather: H_in from the previous rank, with gradient flowing back into it).

    prepare_chunks(k, v, g, beta, *, use_qk_l2norm_in_kernel, cu_seqlens) -> prepared | None
        The "prepare" stage of p2p (docs/design.md): what the summary, the output pass and the dH_in pass of one p2p step
        would each compute from k, v, g, beta alone (Triton: gate cumsum, T = (I + A)^-1, W, U), computed
        once without autograd and passed as `prepared=` to those three calls on the same inputs. None: the
        backend stages nothing (eager). Opaque to CP modes but for `prepared.tensors_for_backward()` (what the
        dH_in pass needs, to go through save_for_backward) and `backend.prepared_from_saved(tensors)`.

    state_summary(k, v, g, beta, *, use_qk_l2norm_in_kernel, prepared, need_transition, cu_seqlens)
        -> (M | None, S)
        The affine effect of the local segment on the entering state (docs/design.md, "The math"); M is None when
        need_transition=False (the first rank, which has no entering state). p2p uses its value only;
        all_gather differentiates it (eager backend; the Triton one is forward-only and raises if
        differentiated).

    initial_state_grad(q, k, v, g, beta, grad_o, *, scale, use_qk_l2norm_in_kernel, prepared, cu_seqlens) -> dH0
        The entering state's gradient from the outputs alone, d sum(o * grad_o) / dH0 (o is affine in H0
        with a coefficient that does not depend on H0, so no H0 is needed). p2p needs it before dH_out
        arrives: dH_in = Mᵀ dH_out + dH0.

    gates(a, b, A_log, dt_bias) -> (g, beta)  (differentiable)
        The model's gates of the local tokens: a, b [B, T, Hv] (views of a projection output), A_log, dt_bias
        [Hv] (ulysses: this rank's head slice); g = -exp(A_log) softplus(a + dt_bias) in float32 (float64 for
        float64), beta = sigmoid(b) in b's dtype (`eager.gdn_gates` is the reference).

    gated_rms_norm(x, gate, weight, eps) -> y  (differentiable)
        transformers' Qwen3_5RMSNormGated over the last dim of x = o and gate = z [..., V] (z may be a strided
        view), y in x's dtype, with the eager chain's rounding points (`eager.gated_rms_norm` is the reference).

    conv_silu_split(x_BsC, weight_CK, bias_C, dilation, *, left_BhC, doc_start_s, heads) -> parts
        (differentiable w.r.t. x, weight, bias, left) The layer's causal depthwise conv + SiLU of the pre-conv
        channels x_BsC [B, s, C] (any strides), split as `split_qkv` does with heads = (qk_heads, head_k_dim,
        head_v_dim): q, k [B, s, qk_heads, K], v [B, s, Hv, V] (GDN's [q | k | v]); or, with heads = ((heads,
        dim), ...) pairs (one heads may be -1: the rest), one [B, s, heads, dim] part per pair in channel order
        (Mamba2's [x | B | C]; the Triton kernel takes three parts). left_BhC: the (kernel-1)*dilation
        tokens before x (the CP halo; None: zeros). doc_start_s: None, or int [s] the local index of each token's
        document start (may be negative); a tap reading local position p counts only if p >= doc_start_s[t].
        Numerics as transformers' eager path (conv in the weight dtype, rounded, SiLU, rounded, x's dtype out).
        Eager: `eager.causal_conv_silu` then views; Triton: one fused kernel writing q, k, v contiguous
        (`deltacp.ops.fused.conv`).

Composition and application of summaries are tiny K x K matmuls shared by all backends
(`compose_summaries`, `apply_summary`, `summary_grad` in `summary.py`). The backends by name (`get_gdn_backend`,
`GDN_BACKENDS`): `backends.py`. This module imports no backend.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

CHUNK_SIZE = 64


class GDNBackend(Protocol):
    name: str

    def check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        """Raise a clear error if these inputs are outside the backend's contract (never fall back). Which CP modes
        run on which backend is the CP layer's registry (`parallel/modes.py`), not the backend's concern."""

    def chunk_gated_delta_rule(
        self,
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
        prepared: Any = None,
        cu_seqlens: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def prepare_chunks(
        self, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
        use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Any = None,
    ) -> Any: ...

    def prepared_from_saved(self, tensors: tuple[torch.Tensor, ...]) -> Any: ...

    def state_summary(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        use_qk_l2norm_in_kernel: bool = False,
        prepared: Any = None,
        need_transition: bool = True,
        cu_seqlens: Any = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]: ...

    def initial_state_grad(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        grad_o: torch.Tensor,
        *,
        scale: float | None = None,
        use_qk_l2norm_in_kernel: bool = False,
        prepared: Any = None,
        cu_seqlens: Any = None,
    ) -> torch.Tensor: ...

    def gates(self, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> torch.Tensor: ...


    def conv_silu_split(
        self, x_BsC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None, dilation: int, *,
        left_BhC: torch.Tensor | None = None, doc_start_s: torch.Tensor | None = None,
        heads: tuple[int, int, int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
