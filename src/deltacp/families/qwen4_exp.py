"""Qwen4-Exp (`Qwen4ExpForCausalLM`, `Qwen4ExpTextModel`): its family record, its GDN view and its indexed attention
(QSA) view. Facts read from transformers 5.25's `modeling_qwen4_exp.py`.

GDN (`Qwen4ExpTextGatedDeltaNet`): Qwen3.5's (in_proj_qkv [q | k | v], in_proj_z, in_proj_b, in_proj_a, conv
kernel 4 over q/k/v, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)); the gated output norm's activation is
`output_gate_type or hidden_act`, silu or sigmoid (the norm module's `activation`).
Indexed attention (`Qwen4ExpTextAttention`, every `layer_types` entry "indexed_attention"): Qwen3.5's gated attention
(q_proj -> per head [query | gate], (1 + w) q/k norms, partial mRoPE, output x sigmoid(gate), o_proj) whose boolean
mask is ANDed with `Qwen4ExpTextQSAIndexer`'s selection: index_qk_proj -> indexer_n_heads query heads and one key
head of indexer_head_dim; queries q_layernorm then RoPE at their positions; keys mean-pooled over blocks of
indexer_compress_ratio tokens (from the first visible token, in float32), k_layernorm, RoPE at the block's first
position; score = sum over heads of relu(q . k) / sqrt(indexer_head_dim); the top indexer_budget / ratio complete
blocks plus the tail. The QSA fields default to None, with which transformers cannot build the layer.
Hyper-connections (`Qwen4ExpTextGatedResidual`, hc_count streams, [B, s, hc_count * hidden]) and the routed experts
act per token: transformers' own code under CP. PLE (`Qwen4ExpTextPLELayer`, decoder layers `ple_layer_ids`):
hashed n-grams of the token ids (orders 2..ngram_size, EOS-segment aware), gated per stream, plus SiLU of a dilated
depthwise conv (kernel ple_conv_kernel_size, dilation ngram_size) over hc_count x hidden channels: its CP forward
(`ple_forward_cp`) reads the ngram_size - 1 ids and the (kernel - 1) x ngram_size conv inputs before each piece.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from deltacp.families.qwen3_5 import GatedAttentionView, Qwen3_5GDNView, zero_centered_rms_norm
from deltacp.families.registry import Family, register_family
from deltacp.ops.precision import compute_dtype
from deltacp.parallel.documents import CPForwardContext, refuse_unsupported
from deltacp.parallel.placement import Pieces
from deltacp.parallel.token_halo import dilated_conv_silu, left_context
from deltacp.parallel.views import IndexedAttentionView

OUTPUT_GATES = ("silu", "sigmoid")  # transformers validates output_gate_type or hidden_act against these


class Qwen4ExpGDNView(Qwen3_5GDNView):
    """Qwen3.5's GDN view; the output gate's activation is the norm module's (silu: the backend's gated norm)."""

    family = "qwen4_exp"

    def output(self, o_BsHV: torch.Tensor, z_BsHV: torch.Tensor, backend) -> torch.Tensor:
        norm = self.module.norm
        if norm.activation in ("silu", "swish"):
            return super().output(o_BsHV, z_BsHV, backend)
        if norm.activation != "sigmoid":
            raise NotImplementedError(f"output_gate_type={norm.activation!r} under CP: expected one of {OUTPUT_GATES}")
        # transformers' Qwen4ExpTextRMSNormGated with a sigmoid gate, float32 widened to float64 for float64
        B, s = o_BsHV.shape[:2]
        dt = compute_dtype(o_BsHV)
        h = o_BsHV.to(dt)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        h = (norm.weight * h.to(o_BsHV.dtype)) * torch.sigmoid(z_BsHV.to(dt))
        return self.module.out_proj(h.to(o_BsHV.dtype).reshape(B, s, -1))


class Qwen4ExpIndexedAttentionView(GatedAttentionView, IndexedAttentionView):
    """Qwen4-Exp's gated attention with its QSA indexer (`module.indexer`)."""

    family = "qwen4_exp"

    @property
    def block_size(self) -> int:
        return self.module.indexer.compress_ratio

    @property
    def top_blocks(self) -> int:
        return self.module.indexer.block_topk

    def _rotate(self, x_BnHD: torch.Tensor, cos, sin) -> torch.Tensor:
        return x_BnHD if cos is None else self._apply_rotary(x_BnHD, cos=cos, sin=sin, unsqueeze_dim=2)

    def index(self, x_BsD, position_embeddings, offsets_Bs=None):  # mean pooling: offsets not read
        ix = self.module.indexer
        B, s, _ = x_BsD.shape
        d = ix.index_head_dim
        q, k = torch.split(ix.index_qk_proj(x_BsD), [ix.index_n_heads * d, d], dim=-1)
        q = zero_centered_rms_norm(q.view(B, s, -1, d), ix.q_layernorm.weight, ix.q_layernorm.eps)
        cos, sin = (None, None) if position_embeddings is None else position_embeddings
        return self._rotate(q, cos, sin), k.to(compute_dtype(k))

    def block_keys(self, sums_BNX, cos_BNR, sin_BNR):
        ix = self.module.indexer
        dtype = ix.index_qk_proj.weight.dtype
        pooled = (sums_BNX / ix.compress_ratio).to(dtype)
        keys = zero_centered_rms_norm(pooled, ix.k_layernorm.weight, ix.k_layernorm.eps)
        return self._rotate(keys[:, :, None], cos_BNR, sin_BNR)[:, :, 0]

    def block_scores(self, iq_BsHd, keys_BNd):
        dt = compute_dtype(iq_BsHd)
        dots = torch.einsum("bshd,bnd->bshn", iq_BsHd.to(dt), keys_BNd.to(dt))
        return F.relu(dots).sum(dim=2) / math.sqrt(iq_BsHd.shape[-1])


def ngram_ids(module, ids_BhL: torch.Tensor, source_ok: torch.Tensor) -> torch.Tensor:
    """[B, L, heads] hashed n-gram ids of the last L tokens of `ids_BhL` (h = ngram_size - 1 tokens of left context
    first), as transformers' `Qwen4ExpTextNGramEmbedding` hashes them: shift j of token t is the token j back, or
    EOS where an EOS lies in between or the token j back is not of t's document (`source_ok` [B, L, h + 1], shift
    j's validity; the document start and the row start act as EOS); orders 2..ngram_size, splitmix multipliers,
    XOR, modulo each head's prime, plus its offset."""
    h = module.ngram_size - 1
    eos = module.eos_token_id
    L = ids_BhL.shape[1] - h
    is_eos = ids_BhL == eos
    shifted = [ids_BhL[:, h:]]
    for j in range(1, h + 1):
        src = ids_BhL[:, h - j: h - j + L]
        between = torch.stack([is_eos[:, h - i: h - i + L] for i in range(1, j + 1)], dim=-1).any(-1)
        shifted.append(torch.where(source_ok[..., j] & ~between, src, torch.full_like(src, eos)))
    blocks = []
    for ngram in range(2, module.ngram_size + 1):
        lo = (ngram - 2) * module.heads_per_ngram
        mixed = shifted[0] * module.layer_multipliers[0]
        for position in range(1, ngram):
            mixed = torch.bitwise_xor(mixed, shifted[position] * module.layer_multipliers[position])
        sizes = module.ngram_heads_vocab_sizes[lo: lo + module.heads_per_ngram]
        blocks.append(torch.remainder(mixed[..., None], sizes) + module.ngram_heads_offsets[lo: lo + module.heads_per_ngram])
    return torch.cat(blocks, dim=-1)


def ple_forward_cp(group, balanced: bool, module, hidden_states: torch.Tensor, input_ids: torch.Tensor, cache=None,
                   conv_mask=None, output_router_logits: bool | None = None, **unsupported) -> torch.Tensor:
    """`Qwen4ExpTextPLELayer` on this rank's tokens: the n-gram ids read the ngram_size - 1 token ids before each
    piece and the dilated conv its (kernel - 1) * ngram_size pre-conv tokens (`parallel/token_halo.py`: the conv
    halo exchange), a packed document's start seeing EOS and zeros as the row's start does; the rest per token as
    transformers computes it. conv_mask: the model hook's `CPForwardContext` (padding: padded tokens' gated values
    zeroed, as transformers does; documents). output_router_logits: for the routers, nothing here. A cache raises."""
    refuse_unsupported(type(module).__name__, dict(unsupported, cache=cache))
    ctx = conv_mask if isinstance(conv_mask, CPForwardContext) else CPForwardContext(padding=conv_mask)
    emb_module = module.ple_embedding
    B, s = input_ids.shape
    P, r = dist.get_world_size(group), dist.get_rank(group)
    pieces = Pieces(r, P, balanced, s)
    h = emb_module.ngram_size - 1
    segments = [None if ctx.documents is None else ctx.documents.segment(lo, hi) for lo, hi in pieces.spans()]
    # 1. the n-gram ids: each piece's h ids before it (one halo exchange of the ids, EOS before the row)
    ids = input_ids.long()
    ids_per_slot = left_context(ids[..., None], h, group, pieces)
    n_ids = []
    for slot, (lo, hi) in enumerate(pieces.spans()):
        local = torch.arange(hi - lo, device=ids.device)
        start = torch.zeros_like(local) - lo if segments[slot] is None else segments[slot].doc_starts(
            ids.device).long()
        ok = (local[:, None] - torch.arange(h + 1, device=ids.device)) >= start[:, None]  # [n, h + 1]
        n_ids.append(ngram_ids(emb_module, ids_per_slot[slot][..., 0], ok[None].expand(B, -1, -1)))
    embeddings = emb_module.ngram_embedding(torch.cat(n_ids, dim=1)).flatten(-2)
    # 2. transformers' per-token part (Qwen4ExpTextPLELayer.forward)
    hc, H = module.hc_count, module.hidden_size
    key_normed = module.norm_key(module.key_proj(embeddings)).unflatten(-1, (hc, H))
    value = module.value_proj(embeddings)
    query_normed = module.norm_query(hidden_states).unflatten(-1, (hc, H))
    gate = (key_normed * query_normed).sum(dim=-1, keepdim=True) / math.sqrt(H)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated_value = torch.sigmoid(gate) * value.unsqueeze(-2)
    gated_value_normed = module.norm_conv(gated_value.flatten(-2))
    gated_value = gated_value.flatten(-2)
    if ctx.padding is not None:
        keep = ctx.padding[:, :, None]
        gated_value, gated_value_normed = ((x * keep).to(x.dtype) for x in (gated_value, gated_value_normed))
    # 3. the dilated conv over the row (its halo from the previous piece's holder)
    conv = module.conv1d
    starts = [None if seg is None else seg.doc_starts(hidden_states.device) for seg in segments]
    return gated_value + dilated_conv_silu(gated_value_normed, conv.weight[:, 0], conv.dilation[0], group, pieces,
                                           starts)


def check_ple(module) -> dict:
    """What every rank must share of a PLE layer, and its halo (ids: ngram_size - 1; the conv: (kernel - 1) x
    dilation); raises for what is not supported."""
    conv = module.conv1d
    if conv.bias is not None or conv.stride[0] != 1 or conv.groups != conv.in_channels:
        raise ValueError("Qwen4-Exp's PLE conv under CP must be depthwise, stride 1, without bias")
    return dict(ngram_size=module.ple_embedding.ngram_size,
                token_halo=max((conv.kernel_size[0] - 1) * conv.dilation[0], module.ple_embedding.ngram_size - 1))


def install_ple(layers, group, balanced: bool) -> list:
    """The CP forward on every decoder layer's `ple` (module instance; class, parameters, state_dict unchanged);
    returns the modules."""
    modules = [layer.ple for layer in layers if getattr(layer, "ple", None) is not None]
    for m in modules:
        m.forward = partial(ple_forward_cp, group, balanced, m)
    return modules


def ngram_shards(ple, config) -> list[tuple[str, int]]:
    """The stored pieces of a PLE layer's n-gram embedding: `split_ngram_parts` row shards as transformers' conversion
    mapping writes them (torch.chunk: ceil(rows / parts) rows each, the last smaller, fewer shards when they run
    out) and concatenates them on load."""
    rows, parts = ple.ple_embedding.ngram_embedding.num_embeddings, config.split_ngram_parts
    size = -(-rows // parts)
    return [(f"ple.ple_embedding.ngram_embedding.shard_{i}.weight", min(size, rows - i * size))
            for i in range(parts) if i * size < rows]


QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


def check_qwen4_exp(text_config) -> None:
    """What deltacp refuses of a Qwen4-Exp text config under CP (before any collective): indexed attention layers
    without the QSA fields (transformers cannot build them either: its indexer divides None)."""
    missing = [name for name in QSA_FIELDS if getattr(text_config, name, None) is None]
    if "indexed_attention" in (text_config.layer_types or ()) and missing:
        raise ValueError(f"Qwen4-Exp's indexed_attention layers need the QSA fields {list(QSA_FIELDS)}; "
                         f"{missing} are None (transformers' default, with which its indexer cannot be built): set "
                         f"them as the checkpoint's config does")


QWEN4_EXP = register_family(Family(
    "qwen4_exp", "transformers.models.qwen4_exp.modeling_qwen4_exp", causal_lm="Qwen4ExpForCausalLM",
    text_model="Qwen4ExpTextModel", linear_mixer="Qwen4ExpTextGatedDeltaNet", attention="Qwen4ExpTextAttention",
    norm="Qwen4ExpTextRMSNorm", mlp="Qwen4ExpTextMLP", text_config="Qwen4ExpTextConfig", mrope=True,
    conditional="Qwen4ExpForConditionalGeneration", multimodal_model="Qwen4ExpModel", multimodal_config="Qwen4ExpConfig",
    vision_config="Qwen4ExpVisionConfig",
    mixer_view=Qwen4ExpGDNView, attention_view=Qwen4ExpIndexedAttentionView, fused_decoder=False,
    check_config=check_qwen4_exp, token_layers=("ple", check_ple, install_ple),
    checkpoint_row_pieces=(("ple.ple_embedding.ngram_embedding.weight", ngram_shards),)))
