"""GLM-5.3-Flash (`Glm5NextForConditionalGeneration` with a text-only config, `Glm5NextTextModel`; transformers 5.25,
`modeling_glm5_next.py`): its family record, its KDA view and its indexed attention (MLA + pooled indexer) view.

There is no causal-LM class: the conditional-generation class takes flat text-only configs. Under CP its text path
runs, and images as for Qwen3.5's multimodal classes (`models/multimodal.py`: the vision tower on every image, each
rank's features placed on its tokens; no positions to form: the language model is NoPE); videos are refused by name.
Decoder layers (`Glm5NextTextDecoderLayer`): `layer.self_attn` holds KDA (`Glm5NextTextLinearAttention`,
`layer_types` "linear_attention") or MLA with the indexer (`Glm5NextTextAttention`, "indexed_attention"), told apart
by class; the residual is 4 Sinkhorn hyper-connection streams (`attn_hc`, `ffn_hc`: per token, transformers' own
code under CP), the model's head their mean. Every decoder layer returns the selection its attention handed on.
KDA (`families/kda.py`, Kimi-Linear's forget gate): q_proj, k_proj, v_proj, one conv over [q | k | v] created in
float32 (the conv rounds to float32, as transformers' does); the forget gate low-rank f_b_proj(f_a_proj(x)), x = f +
dt_bias in float32 (the compute dtype: float64 for float64), and with `linear_lower_bound` lb (the default, -5):
g = lb sigmoid(exp(A_log) x), else g = -exp(A_log) softplus(x) (transformers' softplus); g stays in that dtype (not
cast back, unlike Bailing's); beta = sigmoid(b_proj); the output gate low-rank g_b_proj(g_a_proj(x)), sigmoid.
MLA (`families/mla.py`): q_lora (q_a_proj -> q_a_layernorm -> q_b_proj), the latent -> kv_b_proj, NoPE (the
config's qk_rope_head_dim must be 0: no rotary anywhere), no output gate, scaling qk_head_dim^-1/2. The mask is the
indexer's selection only (`Glm5NextTextIndexer`, no gradient): q = wq_b(q_a_layernorm(q_a_proj(x))), index_n_heads
x index_head_dim; k = LayerNorm(wk(x)); blocks of index_kpool tokens from the document's first token, each block's
key the softmax-weighted mean of its tokens' keys, per channel, with logits x index_kpool_compress_gate^T +
index_kpool_compress_ape[offset in the block] (`pooling = "softmax"`); score = sum over heads of weights_proj(x)_h
H^-1/2 relu(q_h . key d^-1/2); the top index_topk / index_kpool complete blocks plus the tail (always: with
`index_kpool_always_select_tail` False transformers' query of an incomplete first block reads nothing, which
deltacp refuses). `indexer_types` "shared" layers run no indexer: they read the selection the previous decoder
layer hands on (`reuses_selection`), which must be a "full" indexed attention layer (transformers raises otherwise
at the forward; deltacp refuses the config first).
Checkpoints (transformers' "glm5_next" conversion mapping): the forget gate's tensors stored under self_attn, the
hyper-connections as hc_attn_* / hc_ffn_*, the conv as q/k/v_conv1d, the experts per expert; MTP layers
(`layers.45.*`) are ignored on load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltacp.families.kimi_linear import KimiLinearKDAView
from deltacp.families.mla import LatentAttentionView, rms_norm
from deltacp.families.registry import Family, register_family
from deltacp.ops.precision import compute_dtype
from deltacp.parallel.views import IndexedAttentionView

INDEXER_TYPES = ("full", "shared")


class Glm5NextKDAView(KimiLinearKDAView):
    """Kimi-Linear's KDA view with GLM's bounded forget gate (`linear_lower_bound`)."""

    family = "glm5_next"

    def forget_gate(self, f_BsHD, heads: slice):
        gate = self.module.forget_gate
        bound = gate.safe_gate_lower_bound
        if bound is None:
            return super().forget_gate(f_BsHD, heads)
        dt = compute_dtype(f_BsHD)
        x = f_BsHD.to(dt) + gate.dt_bias.to(dt).view(gate.num_heads, gate.head_dim)[heads]
        return bound * torch.sigmoid(gate.A_log.to(dt)[heads].exp()[:, None] * x)


class Glm5NextIndexedAttentionView(LatentAttentionView, IndexedAttentionView):
    """GLM's MLA whose selection its pooled indexer (`module.indexer`) makes, or the previous decoder layer's
    (a "shared" layer: `module.indexer` is None)."""

    family = "glm5_next"
    pooling = "softmax"

    @property
    def block_size(self) -> int:
        return self.module.config.index_kpool

    @property
    def top_blocks(self) -> int:
        return self.module.config.index_topk // self.module.config.index_kpool

    @property
    def reuses_selection(self) -> bool:
        return self.module.indexer is None

    def project(self, x_BsD, position_embeddings):
        """MLA in its absorbed form: each head's query taken into the latent space (q_nope W_uk[h], W_uk the key rows
        of kv_b_proj), the normed latent as the one key and value head, so that what crosses ranks is the latent
        (kv_lora_rank per token: 512, against 64 x (256 + 256) for the expanded K and V) and `output` applies the
        value rows W_uv[h]. The same products as transformers' q . (W_uk c) and p . (W_uv c), summed in another
        order; NoPE (no rope slice)."""
        m = self.module
        B, s, _ = x_BsD.shape
        H, nope = m.num_heads, m.qk_nope_head_dim
        q = m.q_b_proj(rms_norm(m.q_a_proj(x_BsD), m.q_a_layernorm)).view(B, s, H, m.qk_head_dim)
        latent = rms_norm(m.kv_a_proj_with_mqa(x_BsD), m.kv_a_layernorm).view(B, s, 1, m.kv_lora_rank)
        w_uk = m.kv_b_proj.weight.view(H, nope + m.v_head_dim, m.kv_lora_rank)[:, :nope]
        return torch.einsum("bshn,hnl->bshl", q, w_uk), latent, latent, None

    def output(self, o_BsX, out):
        m = self.module
        B, s, _ = o_BsX.shape
        H, nope = m.num_heads, m.qk_nope_head_dim
        w_uv = m.kv_b_proj.weight.view(H, nope + m.v_head_dim, m.kv_lora_rank)[:, nope:]
        o = torch.einsum("bshl,hvl->bshv", o_BsX.view(B, s, H, m.kv_lora_rank), w_uv)
        return m.o_proj(o.reshape(B, s, H * m.v_head_dim))

    def index(self, x_BsD, position_embeddings, offsets_Bs):
        """iq [B, s, H, d + 1]: each index head's query and (last) its weight weights_proj(x) H^-1/2; terms [gate
        logits + position embedding within the block | LayerNorm(wk(x))] (d each)."""
        m, ix = self.module, self.module.indexer
        B, s, _ = x_BsD.shape
        dt = compute_dtype(x_BsD)
        q = ix.wq_b(rms_norm(m.q_a_proj(x_BsD), m.q_a_layernorm)).view(B, s, ix.n_heads, ix.head_dim)
        weights = ix.weights_proj(x_BsD.to(ix.weights_proj.weight.dtype)).to(dt) * ix.n_heads ** -0.5
        k = ix.k_norm(ix.wk(x_BsD))
        ape = ix.index_kpool_compress_ape.to(dt)[offsets_Bs.clamp_min(0)]
        logits = F.linear(x_BsD, ix.index_kpool_compress_gate).to(dt) + ape
        return torch.cat([q.to(dt), weights[..., None]], dim=-1), torch.cat([logits, k.to(dt)], dim=-1)

    def block_keys(self, sums_BNX, cos_BNR, sin_BNR):
        weighted, total = sums_BNX.chunk(2, dim=-1)
        return weighted / total

    def block_scores(self, iq, keys_BNd):
        d = keys_BNd.shape[-1]
        q, w = iq[..., :d], iq[..., d]
        dots = torch.einsum("bshd,bnd->bshn", q, keys_BNd.to(q.dtype)) * d ** -0.5
        return torch.einsum("bsh,bshn->bsn", w, F.relu(dots))

    def outputs(self, o_BsD, selection):
        """transformers' (output, attention weights, the selection when the next layer is "shared")."""
        return o_BsD, None, selection if self.module.next_skip_topk else None


def check_glm5_next(text_config) -> None:
    """What deltacp refuses of a GLM-5.3-Flash text config under CP (before any collective): a "shared" indexer
    layer whose previous decoder layer is not a "full" indexed attention layer (transformers raises at its forward),
    an indexer_types value other than "full" / "shared", and index_kpool_always_select_tail False."""
    types, kinds = list(text_config.indexer_types or ()), list(text_config.layer_types or ())
    for i, kind in enumerate(kinds):
        if kind != "indexed_attention" or i >= len(types):
            continue
        if types[i] not in INDEXER_TYPES:
            raise ValueError(f"indexer_types[{i}]={types[i]!r}: allowed values {INDEXER_TYPES}")
        if types[i] == "shared" and not (i > 0 and kinds[i - 1] == "indexed_attention" and types[i - 1] == "full"):
            got = f"layer {i - 1}: {kinds[i - 1]!r}, {types[i - 1]!r}" if i else "layer 0 has no previous layer"
            raise ValueError(f"indexer_types[{i}]='shared': a shared indexer layer reads the selection of the previous "
                             f"decoder layer, which must be an indexed_attention layer with indexer_types 'full' "
                             f"({got}); transformers' forward raises there too")
    if not text_config.index_kpool_always_select_tail and "indexed_attention" in kinds:
        raise NotImplementedError("index_kpool_always_select_tail=False under CP is not supported (a query reads "
                                  "no token of its own incomplete pool, and before its first complete pool none at "
                                  "all); allowed: True, transformers' default")


GLM5_NEXT = register_family(Family(
    "glm5_next", "transformers.models.glm5_next.modeling_glm5_next", causal_lm=None,
    text_model="Glm5NextTextModel", linear_mixer="Glm5NextTextLinearAttention", attention="Glm5NextTextAttention",
    norm="Glm5NextTextRMSNorm", mlp="Glm5NextTextMLP", text_config="Glm5NextTextConfig",
    conditional="Glm5NextForConditionalGeneration", multimodal_model="Glm5NextModel",
    multimodal_config="Glm5NextConfig", vision_config="Glm5NextVisionConfig",
    mixer_view=Glm5NextKDAView, attention_view=Glm5NextIndexedAttentionView, fused_decoder=False,
    linear_attribute="self_attn", attention_attribute="self_attn",
    moe_fields=("n_routed_experts", "num_experts_per_tok", "router_aux_loss_coef"),
    check_config=check_glm5_next,
    # transformers 5.25's "glm5_next" conversion mapping (the released names; experts per expert, as for every MoE
    # family): the forget gate's tensors directly under self_attn, the hyper-connections' tensors as hc_*, the conv
    # stored as one weight per q, k, v
    checkpoint_renames=(("self_attn.forget_gate", "self_attn"),
                        ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"),
                        ("attn_hc.scale", "hc_attn_scale"), ("ffn_hc.fn", "hc_ffn_fn"),
                        ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale")),
    checkpoint_row_pieces=(("self_attn.conv1d.weight", (("self_attn.q_conv1d.weight", "qkv_dim"),
                                                        ("self_attn.k_conv1d.weight", "qkv_dim"),
                                                        ("self_attn.v_conv1d.weight", "qkv_dim"))),)))
