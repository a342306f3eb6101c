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
act per token: transformers' own code under CP. PLE (`ple_layer_ids`): refused under CP (`refuse_ple`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from deltacp.families.qwen3_5 import GatedAttentionView, Qwen3_5GDNView, zero_centered_rms_norm
from deltacp.families.registry import Family, register_family
from deltacp.ops.precision import compute_dtype
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

    def index(self, x_BsD, position_embeddings):
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


def refuse_ple(config) -> None:
    """Per-layer n-gram embeddings under CP: refused (the n-gram ids need the previous ranks' token ids and the
    dilated conv a (kernel - 1) * ngram_size token halo; not built yet)."""
    if getattr(config, "ple_layer_ids", None):
        raise NotImplementedError(f"ple_layer_ids={list(config.ple_layer_ids)}: Qwen4-Exp's per-layer n-gram "
                                  f"embeddings (PLE) are not supported under CP yet; allowed: ple_layer_ids=[] "
                                  f"(none)")


QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


def check_qwen4_exp(text_config) -> None:
    """What deltacp refuses of a Qwen4-Exp text config under CP (before any collective): PLE layers; indexed
    attention layers without the QSA fields (transformers cannot build them either: its indexer divides None)."""
    refuse_ple(text_config)
    missing = [name for name in QSA_FIELDS if getattr(text_config, name, None) is None]
    if "indexed_attention" in (text_config.layer_types or ()) and missing:
        raise ValueError(f"Qwen4-Exp's indexed_attention layers need the QSA fields {list(QSA_FIELDS)}; "
                         f"{missing} are None (transformers' default, with which its indexer cannot be built): set "
                         f"them as the checkpoint's config does")


QWEN4_EXP = register_family(Family(
    "qwen4_exp", "transformers.models.qwen4_exp.modeling_qwen4_exp", causal_lm="Qwen4ExpForCausalLM",
    text_model="Qwen4ExpTextModel", linear_mixer="Qwen4ExpTextGatedDeltaNet", attention="Qwen4ExpTextAttention",
    norm="Qwen4ExpTextRMSNorm", mlp="Qwen4ExpTextMLP", text_config="Qwen4ExpTextConfig", mrope=True,
    mixer_view=Qwen4ExpGDNView, attention_view=Qwen4ExpIndexedAttentionView, fused_decoder=False,
    check_config=check_qwen4_exp))
