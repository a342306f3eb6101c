"""The CP forward of a linear-recurrent layer (any family, through its `LinearMixerView`): model semantics around
a CP token mixer.

Projections, gates, the output path (gated norm, output projection) are the module's own (its parameters, its order
of operations, transformers' upcasting policy for bf16), handed over by the family's view (`parallel/views.py`);
only the conv + recurrence between them is replaced by the mode's token mixer, which owns the layout and the
communication. The recurrence is the view's (`ops/recurrence.py`), computed by the layer's backend (eager PyTorch,
or Triton kernels with the same rounding points).

Shape legend: x_BsD local hidden states; pre_BsC pre-conv channels of the local tokens; extras_BsHX the per-value-
head inputs that skip the conv; o_BsHV core output of the local tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from deltacp.distributed.agree import LocalChecks, raise_together
from deltacp.distributed.collectives import StatePassing
from deltacp.ops.gdn.contract import GDNBackend
from deltacp.ops.recurrence import Recurrence
from deltacp.parallel.placement import Pieces, check_local_length
from deltacp.parallel.views import LinearMixerView
from deltacp.parallel.documents import (
    CPForwardContext,
    DocumentSegment,
    documents_from_keywords,
    fingerprints,
    refuse_unsupported,
)


@dataclass
class LinearLayerCP:
    """What a CP token mixer needs of one linear-recurrent layer on one rank."""

    view: LinearMixerView
    group: ProcessGroup
    mode: "LinearMode"  # the registry's entry (parallel/modes.py)
    backend: GDNBackend  # the kernels: the recurrence's and the conv's
    recurrence: Recurrence  # the view's recurrence over `backend`
    mixer: Callable[["LinearLayerCP", torch.Tensor, torch.Tensor, CPForwardContext], torch.Tensor]
    passing: StatePassing | None = None  # p2p: the state hops (1-D: over the CP ranks; 2-D: across groups)
    two_d: "TwoDGroups | None" = None  # the 2-D layout's process groups (parallel/two_d.py)
    channels: dict = field(default_factory=dict)  # Ulysses: this rank's conv channels, per (rank, P, device)
    balanced: bool = False  # sequence_layout='balanced': every rank holds two pieces of the row (placement.py)

    @property
    def module(self) -> nn.Module:
        return self.view.module

    @property
    def conv_weight_CK(self) -> torch.Tensor | None:
        """The depthwise kernels [C, kernel]; None for a mixer without a conv (`LinearMixerView.conv` None)."""
        conv = self.view.conv
        return None if conv is None else conv.weight.squeeze(1)

    @property
    def conv_dilation(self) -> int:
        conv = self.view.conv
        return 1 if conv is None else conv.dilation[0]

    @property
    def halo(self) -> int:
        """The pre-conv tokens of the previous piece the conv reads: (kernel-1)*dilation; 0 without a conv."""
        conv = self.view.conv
        return 0 if conv is None else (conv.kernel_size[0] - 1) * conv.dilation[0]


def linear_context(layer: LinearLayerCP, hidden_states: torch.Tensor, attention_mask, packing: dict) -> CPForwardContext:
    """The forward context of this call: the model hook's, or one built from a padding mask / packing keywords
    (a layer applied on its own, without `parallelize_cp`: then after the same input-header exchange as
    the model hook's, one small all-gather per call)."""
    if isinstance(attention_mask, CPForwardContext):
        if any(v is not None for v in packing.values()):
            raise ValueError(f"packing keywords {sorted(k for k, v in packing.items() if v is not None)} reached a "
                             f"linear-recurrent layer whose model hook already described the documents; pass them to the model "
                             f"once")
        return attention_mask
    B, s = hidden_states.shape[:2]
    docs = None
    with LocalChecks() as checks:  # then one header exchange: every rank raises together (as the model hook does)
        if attention_mask is not None and (attention_mask.ndim != 2 or attention_mask.shape != (B, s)):
            raise ValueError(f"linear attention CP takes a 2-D padding mask of the local tokens [B, s] = {(B, s)}, "
                             f"got attention_mask of shape {tuple(attention_mask.shape)}")
        docs = documents_from_keywords(s * dist.get_world_size(layer.group), **packing)
        if docs is not None and attention_mask is not None:
            raise NotImplementedError("packed documents (cu_seq_lens_q) with a padding mask: pad a packed row with "
                                      "a padding document instead (see shard_batch_for_cp)")
    raise_together(layer.group, f"{type(layer.module).__name__} under CP", checks.error, device=hidden_states.device,
                   agree=dict(batch=B, local_length=s, padding_mask=attention_mask is not None,
                              **fingerprints(packing)))
    return CPForwardContext(padding=attention_mask, documents=docs)


def document_segments(ctx: CPForwardContext, pieces: Pieces) -> list[DocumentSegment | None]:
    """This layer's view of the documents of each local piece (`placement.Pieces`: its row spans; Ulysses: the
    whole row, one piece). Nones for an unpacked row."""
    if ctx.documents is None:
        return [None] * pieces.per_member
    if ctx.documents.seq_len != pieces.row_length:
        raise ValueError(f"the packed documents cover {ctx.documents.seq_len} tokens, but this rank's "
                         f"{pieces.length} tokens are not 1/{pieces.members} of that row")
    return [ctx.documents.segment(lo, hi) for lo, hi in pieces.spans()]


def linear_forward_cp(layer: LinearLayerCP, hidden_states: torch.Tensor, attention_mask=None, cache=None,
                   cache_params=None, use_cache: bool | None = None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                   max_length_q=None, max_length_k=None, output_router_logits: bool | None = None,
                   position_embeddings=None, input_ids=None, position_ids=None, **unsupported) -> torch.Tensor:
    """The CP forward of one linear-recurrent layer on this rank's slice [B, s, hidden] of the sequence.

    attention_mask: the model hook's `CPForwardContext`, or the local 2-D padding mask, or None.
    cu_seq_lens_q/k, max_length_q/k: transformers' packing keywords with GLOBAL offsets (layer used on its own).
    output_router_logits: passed down every decoder layer of an MoE model; transformers' output recording of the
    routers honours it, this layer has nothing to do with it.
    position_embeddings: the rotary cos / sin that some decoder layers hand to whichever mixer
    they hold; a linear-recurrent mixer reads no positions (transformers' mixer ignores them too).
    input_ids: the token ids GLM-5.3-Flash's decoder layers hand to their mixer (read upstream, by the embedding;
    transformers' mixer ignores them too).
    position_ids: what MiniMax's decoder layers hand to whichever mixer they hold (read upstream: the rotary
    embedding, and the model hook for document starts; transformers' lightning attention ignores them too); a view
    that `reads_positions` takes them (the RG-LRU: its resets at position 0), [B, s] or [1, s], required.
    Inference caches (cache, cache_params, use_cache=True) and any other keyword raise.
    """
    refuse_unsupported(f"{type(layer.module).__name__}", dict(unsupported, cache=cache, cache_params=cache_params,
                                                             use_cache=use_cache))
    v = layer.view
    if hasattr(hidden_states, "to_local"):  # DTensor input: this rank's slice is its local tensor
        hidden_states = hidden_states.to_local()
    ctx = linear_context(layer, hidden_states, attention_mask,
                      dict(cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k, max_length_q=max_length_q,
                           max_length_k=max_length_k))
    if ctx.padding is not None:
        hidden_states = (hidden_states * ctx.padding[:, :, None]).to(hidden_states.dtype)
    B, s, _ = hidden_states.shape
    check_local_length(layer.balanced, s, dist.get_world_size(layer.group))
    piece = s // 2 if layer.balanced else s
    if layer.mode.needs_halo and piece < layer.halo:
        raise ValueError(f"linear_attention_cp_mode={layer.mode.name!r} needs local pieces of at least the conv halo "
                         f"((kernel-1)*dilation = {layer.halo}) tokens, got {piece} (local tokens {s}, "
                         f"sequence_layout={'balanced' if layer.balanced else 'contiguous'!r})")

    if v.reads_positions:
        if position_ids is None or position_ids.shape[-1] != s:
            got = None if position_ids is None else tuple(position_ids.shape)
            raise ValueError(f"{type(layer.module).__name__} under CP reads the position ids of its tokens [B, s] = "
                             f"{(B, s)} (GLOBAL positions), got {got}")
        pre_BsC, extras_BsHX, out = v.project(hidden_states, position_ids.expand(B, s))
    else:
        pre_BsC, extras_BsHX, out = v.project(hidden_states)
    if ctx.padding is not None:  # the mask as one more extra: it travels with its tokens through every layout
        keep = ctx.padding.to(extras_BsHX.dtype)[:, :, None, None].expand(*extras_BsHX.shape[:-1], 1)
        extras_BsHX = torch.cat([extras_BsHX, keep], dim=-1)
    o_BsHV = layer.mixer(layer, pre_BsC, extras_BsHX, ctx)
    return v.output(o_BsHV, out, layer.backend)
