"""Triton backend of the GDN contract (`deltacp.ops.gdn.contract.GDNBackend`).

Importing this package imports no Triton: the kernels load on first use. Kernels never see a process group.
    indexing.py  chunk size BT, per-chunk vs token tensors, packed chunk/document tables, row load/store
    wy.py        A, T = (I + A)^-1 (16x16 diagonal inverses, block merge), W, U per chunk, and the WY backward
    chunk_h.py   chunk-to-chunk state recurrence, forward and backward (also used for the summary [M | S])
    chunk_o.py   per-chunk outputs, dVn_local, dq/dk/dW/dg
    l2norm.py    q/k l2 normalisation (fp32 inside, input dtype out), forward and backward
    heads.py     GVA head sum of dq/dk (value heads onto their key head)
    launch.py    fixed launch configurations per kernel
    chunk.py     `_fwd`/`_bwd` compositions, autograd Functions, public ops
    contract_check.py  `check_triton_contract` (device, dtypes, head dims, head ratio, Triton version)
    version.py         the Triton versions accepted (verified on a GPU, the range) and the installed one
    selfcheck.py       first-use self-check of a Triton version not verified on a GPU, against eager (cached)
The model glue around the op (gates, gated RMSNorm) is `deltacp.ops.fused` (gates.py, gated_norm.py).
The layer's conv + SiLU + q/k/v split (`conv_silu_split`) is the fused kernel of `deltacp.ops.fused.conv`.

Every operation takes `cu_seqlens` (None, document offsets of one packed row, or a `varlen.VarlenLayout`): the
row is laid out chunk-aligned outside the kernels, and the state kernels restart at each document's first chunk.
"""

from __future__ import annotations

import torch

from deltacp.ops.fused import check_device
from deltacp.ops.gdn.triton.contract_check import check_triton_contract


class TritonGDNBackend:
    name = "triton"

    def check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        check_triton_contract(q, k, v, g, beta)

    def chunk_gated_delta_rule(self, q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, prepared=None, cu_seqlens=None):
        from deltacp.ops.gdn.triton.chunk import chunk_gated_delta_rule

        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, prepared=prepared,
                                      cu_seqlens=cu_seqlens)

    def prepare_chunks(self, k, v, g, beta, *, use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        from deltacp.ops.gdn.triton.chunk import prepare_chunks

        return prepare_chunks(k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)

    def state_summary(self, k, v, g, beta, *, use_qk_l2norm_in_kernel=False, prepared=None, need_transition=True,
                      cu_seqlens=None):
        from deltacp.ops.gdn.triton.chunk import state_summary

        return state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, prepared=prepared,
                             need_transition=need_transition, cu_seqlens=cu_seqlens)

    def initial_state_grad(self, q, k, v, g, beta, grad_o, *, scale=None, use_qk_l2norm_in_kernel=False,
                           prepared=None, cu_seqlens=None):
        from deltacp.ops.gdn.triton.chunk import initial_state_grad

        return initial_state_grad(q, k, v, g, beta, grad_o, scale=scale,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, prepared=prepared,
                                  cu_seqlens=cu_seqlens)

    def gates(self, a, b, a_log, dt_bias):
        check_device("a", a)
        from deltacp.ops.fused.gates import gdn_gates

        return gdn_gates(a, b, a_log, dt_bias)

    def gated_rms_norm(self, x, gate, weight, eps):
        check_device("o", x)
        from deltacp.ops.fused.gated_norm import gated_rms_norm

        return gated_rms_norm(x, gate, weight, eps)

    def conv_silu_split(self, x_BsC, weight_CK, bias_C, dilation, *, left_BhC=None, doc_start_s=None, heads):
        check_device("qkv", x_BsC)  # the first kernel of a GDN layer: the device error before any launch
        from deltacp.ops.fused.conv import conv_silu_split

        B, s, C = x_BsC.shape
        if isinstance(heads[0], tuple):  # ((heads, dim), ...) channel groups in order, one heads may be -1
            parts = heads
        else:  # (qk_heads, head_k_dim, head_v_dim): GDN's [q | k | v]
            qk_heads, head_k_dim, head_v_dim = heads
            parts = ((qk_heads, head_k_dim), (qk_heads, head_k_dim), (-1, head_v_dim))
        if not 1 <= len(parts) <= 3:
            raise NotImplementedError(f"the fused conv splits its channels in one to three parts; got {len(parts)}")
        known = sum(h * d for h, d in parts if h != -1)
        split = tuple(h * d if h != -1 else C - known for h, d in parts)
        outs = conv_silu_split(x_BsC, weight_CK, bias_C, dilation, left_BhC=left_BhC, doc_start_s=doc_start_s,
                               split=split + (0,) * (3 - len(split)))  # Mamba1's one part: [x | - | -]
        return tuple(t.view(B, s, -1, d) for t, (_, d) in zip(outs, parts))

    def prepared_from_saved(self, tensors):
        from deltacp.ops.gdn.triton.chunk import PreparedChunks

        return PreparedChunks.from_saved(tensors)


__all__ = ["TritonGDNBackend", "check_triton_contract"]
