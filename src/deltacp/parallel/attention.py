"""Ulysses CP for a gated full attention (Qwen3.5 dense/MoE, Qwen3-Next: through the family's
`AttentionView`) over the same 1-D CP mesh.

Local projections, q/k norms and rotary (position embeddings of the rank's global positions), then
all-to-all to head shards over the whole sequence, causal attention, all-to-all back, output gate and
projection. Key/value heads that do not divide by the CP degree are repeated to the query heads first
(exact: query head j reads kv head j // groups either way).

The `attention_mask` this forward takes is None (causal over the whole row) or the model pre-hook's
`CPForwardContext`, whose `attention` describes per-document causal attention over the flattened [B * S]
stream (packed documents, or padded rows as valid + padding documents). No [S, S] mask is ever built: each
document runs through causal SDPA on its own (fused kernels on CPU and CUDA).

Shape legend: x_BsD local hidden states; q_BsHD local tokens, all heads; q_BHSD all tokens, local heads.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from deltacp.distributed.collectives import all_to_all_head_to_seq, all_to_all_seq_to_head
from deltacp.ops.gdn.naive import compute_dtype
from deltacp.parallel.documents import AttentionDocuments, CPForwardContext, refuse_unsupported
from deltacp.parallel.views import AttentionView, attention_view_of


def attention_head_layout(num_heads: int, num_kv_heads: int, cp: int) -> tuple[int, int]:
    """(query heads, kv heads) per rank, or ValueError naming the setting."""
    if num_heads % cp:
        raise ValueError(f"Ulysses full attention needs num_attention_heads ({num_heads}) divisible by the CP "
                         f"degree ({cp})")
    kv = num_kv_heads if num_kv_heads % cp == 0 else num_heads
    return num_heads // cp, kv // cp


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5RMSNorm (scale 1 + w), with its float32 upcast widened to float64 for float64."""
    dt = compute_dtype(x)
    h = x.to(dt)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(dt))).type_as(x)


def causal_document_attention(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                              docs: AttentionDocuments | None, *, scale: float, dropout_p: float) -> torch.Tensor:
    """Causal attention within each document of the flattened [B * S] stream (all of it when docs is None)."""
    gqa = k_BHSD.shape[1] != q_BHSD.shape[1]
    if docs is None:
        return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, is_causal=True, scale=scale,
                                              dropout_p=dropout_p, enable_gqa=gqa)
    if dropout_p:
        raise NotImplementedError(f"attention_dropout={dropout_p} with packed documents or padding under CP is not "
                                  f"supported (set attention_dropout=0.0, as Qwen3.5 ships)")
    # One causal SDPA per document (its fused kernels build no mask); rows of a batch are documents of the
    # flattened stream. torch's varlen flash attention could do this in one call (torch 2.11, the verified GPU
    # stack, has it without enable_gqa); it is not used until measured and verified here.
    B, H, S, D = q_BHSD.shape
    q_THD, k_THD, v_THD = (x.transpose(1, 2).reshape(B * S, x.shape[1], D) for x in (q_BHSD, k_BHSD, v_BHSD))
    bounds = docs.cu_seqlens.tolist()
    o_THD = torch.cat([
        F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1)[None] for x in (q_THD, k_THD, v_THD)),
                                       is_causal=True, scale=scale, enable_gqa=gqa)[0].transpose(0, 1)
        for a, b in zip(bounds[:-1], bounds[1:])])
    return o_THD.reshape(B, S, H, -1).transpose(1, 2)


def ulysses_attention_forward(view: AttentionView, group, hidden_states: torch.Tensor,
                              position_embeddings: tuple[torch.Tensor, torch.Tensor],
                              attention_mask: CPForwardContext | None = None, cache=None, past_key_values=None,
                              use_cache: bool | None = None, position_ids: torch.Tensor | None = None,
                              output_router_logits: bool | None = None, **unsupported):
    """position_ids: read upstream (the rotary embedding, and the model hook for document starts), not here.
    output_router_logits: passed down every decoder layer of an MoE model, honoured by transformers' recording of
    the routers' outputs; nothing to do here."""
    refuse_unsupported(type(view.module).__name__, dict(unsupported, cache=cache, past_key_values=past_key_values,
                                                       use_cache=use_cache))
    if hasattr(hidden_states, "to_local"):
        hidden_states = hidden_states.to_local()
    cp = dist.get_world_size(group)
    D = view.head_dim
    B, s, _ = hidden_states.shape
    heads, kv_heads = view.num_heads, view.num_kv_heads
    heads_local, kv_local = attention_head_layout(heads, kv_heads, cp)
    if attention_mask is not None and not isinstance(attention_mask, CPForwardContext):
        raise ValueError(f"Ulysses full attention takes None or the model hook's CPForwardContext as attention_mask, "
                         f"got {type(attention_mask).__name__}; call the model through parallelize_qwen3_5_cp, "
                         f"which builds it from the padding mask or the packed documents")
    docs = None if attention_mask is None else attention_mask.attention

    q_BsHD, gate = torch.chunk(view.q_proj(hidden_states).view(B, s, heads, 2 * D), 2, dim=-1)
    gate = gate.reshape(B, s, heads * D)
    q_BsHD = zero_centered_rms_norm(q_BsHD, *view.q_norm)
    k_BsHD = zero_centered_rms_norm(view.k_proj(hidden_states).view(B, s, kv_heads, D), *view.k_norm)
    v_BsHD = view.v_proj(hidden_states).view(B, s, kv_heads, D)
    cos, sin = position_embeddings
    q_BsHD, k_BsHD = view.apply_rotary(q_BsHD, k_BsHD, cos, sin)
    if kv_heads % cp:
        k_BsHD, v_BsHD = (x.repeat_interleave(heads // kv_heads, dim=2) for x in (k_BsHD, v_BsHD))

    # One all-to-all for q, k and v: [B, s, P, (Hq/P + 2 Hkv/P) D] -> [B, S, (Hq/P + 2 Hkv/P) D].
    packed_BsPX = torch.cat([x.reshape(B, s, cp, -1) for x in (q_BsHD, k_BsHD, v_BsHD)], dim=-1)
    full_BSX = all_to_all_seq_to_head(packed_BsPX, group)
    q_BSX, k_BSX, v_BSX = torch.split(full_BSX, [heads_local * D, kv_local * D, kv_local * D], dim=-1)
    q_BHSD, k_BHSD, v_BHSD = (x.reshape(B, s * cp, -1, D).transpose(1, 2) for x in (q_BSX, k_BSX, v_BSX))
    o_BHSD = causal_document_attention(q_BHSD, k_BHSD, v_BHSD, docs, scale=view.scaling, dropout_p=view.dropout)
    o_BSX = o_BHSD.transpose(1, 2).reshape(B, s * cp, heads_local * D)
    o_BsX = all_to_all_head_to_seq(o_BSX, group).reshape(B, s, heads * D)
    return view.o_proj(o_BsX * torch.sigmoid(gate)), None


def check_attention_module(module: nn.Module, cp: int) -> dict:
    """Validate a full attention module (through its family's view); the configuration every rank must share."""
    view = attention_view_of(module)
    attention_head_layout(view.num_heads, view.num_kv_heads, cp)
    return dict(family=view.family, num_attention_heads=view.num_heads, num_key_value_heads=view.num_kv_heads,
                head_dim=view.head_dim)


def install_ulysses_attention(module: nn.Module, group) -> nn.Module:
    """Install the Ulysses forward on the module instance (class, parameters and state_dict keys unchanged)."""
    module.forward = partial(ulysses_attention_forward, attention_view_of(module), group)
    return module
