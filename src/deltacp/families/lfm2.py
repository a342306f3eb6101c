"""LFM2, LFM2-MoE and LFM3 (`Lfm2ForCausalLM`, `Lfm2Model`; `Lfm2MoeForCausalLM`, `Lfm2MoeModel`; `Lfm3ForCausalLM`,
`Lfm3Model`; transformers 5.25, `modeling_lfm2.py`, `modeling_lfm2_moe.py`, `modeling_lfm3.py`): their family records,
the gated short conv's CP forward and the attention views.

Decoder layers (`Lfm2DecoderLayer`): `layer_types` "conv" (`layer.conv`, the gated short conv) or "full_attention"
(`layer.self_attn`); pre-norm with `operator_norm` and `ffn_norm` (`Lfm2RMSNorm`: weight x (x in its dtype), not the
fused glue's (1 + w)); `feed_forward` the SwiGLU w2(silu(w1 x) w3 x) or, in LFM2-MoE from layer `num_dense_layers` on,
routed experts (`Lfm2MoeSparseMoeBlock`: sigmoid router scores, top-k chosen on scores + `expert_bias` when
`use_expert_bias`, the chosen scores renormalised when `norm_topk_prob`, times `routed_scaling_factor`; no auxiliary
loss in the causal LM: per-token, transformers' code under CP); the final norm is `embedding_norm`. LFM2-MoE's rotary
module is `pos_emb` (LFM2's `rotary_emb`).
Gated short conv (`Lfm2ShortConv`, `Lfm2MoeShortConv`): padded tokens' inputs zeroed
(`apply_mask_to_padding_states`, the model's "conv" mask: the 2-D padding mask, None when all ones); in_proj
H -> 3H chunked [B | C | x]; y = C * conv(B * x) with a depthwise causal conv of kernel `conv_L_cache` (bias
`conv_bias`, dilation 1, NO activation), then out_proj. It has no state beyond its window: under CP it is a per-token
layer with a window (`Family.token_layers`), whose kernel - 1 tokens of B * x before each piece come by the conv halo
exchange (`parallel/token_halo.windowed_conv`) in every linear mode; a packed document's window sees no token of
another. Every backend runs it with the eager conv (the fused Triton conv computes SiLU); the install logs it.
Attention (`Lfm2Attention`): GQA, q_proj / k_proj / v_proj, per-head `q_layernorm` / `k_layernorm` (transformers'
modules, called as they are), RoPE (`apply_rotary_pos_emb`), `out_proj`; no dropout (transformers passes 0.0).
Checkpoints: LFM2's names are the modules'; LFM2-MoE's (transformers' "lfm2_moe" conversion mapping) store the routed
experts per expert as `feed_forward.experts.{e}.w1` (gate), `w3` (up), `w2` (down).

LFM3 (`Lfm3DecoderLayer`): LFM2's layer with sandwich norms (`post_operator_norm`, `post_ffn_norm`: RMSNorms of the
operator's and the MLP's outputs before each residual add; nn.Identity when `use_sandwich_norm` is False: transformers'
per-token code under CP), the same gated short conv (`Lfm3ShortConv`, kernel `conv_L_cache` 7 by default) and a third
layer type. The default `layer_types`: "full_attention" when i % 4 == 2, "sliding_attention" when i % 4 == 0 and
i > 0, "conv" otherwise. Attention (`Lfm3Attention`, Qwen3's): q_proj / k_proj / v_proj / o_proj (bias
`attention_bias`), per-head `q_norm` / `k_norm` (`Lfm3RMSNorm`, called as they are), GQA, RoPE by OLMo's
`apply_rotary_pos_emb` (cos / sin in float32, one rounding back), then each head's output times sigmoid(`g_proj`(x))
(x the layer's input, `g_proj` H -> heads without bias; absent when `use_attention_gate` is False), then o_proj. The
rotary differs per layer type: `Lfm3RotaryEmbedding` computes one (cos, sin) per attention type from the call's
position ids ("sliding_attention": default RoPE, theta 1e4; "full_attention": "proportional", theta 1e6 with
partial_rotary_factor 0.5: the first head_dim / 4 frequencies rotate, the rest are 0, i.e. cos 1 and sin 0) and the
text model hands each decoder layer its type's pair. Under CP the model hook gives every rank its global position ids,
so transformers' own rotary code computes both pairs exactly; the view applies the pair it is given. The
"sliding_attention" layers (window `sliding_window`, 256 in the release) run the K/V halo in every full-attention
method (`parallel/sliding_attention.py`), the "full_attention" layers the configured method. Checkpoints (transformers'
"lfm3" conversion mapping): the gate is stored as `self_attn.gate_proj` (`Family.checkpoint_renames`). Lfm3Config
ignores LFM2's `tie_embedding` and `block_ff_dim` aliases (its __post_init__ skips LFM2's).

Shape legend: x_BsD local hidden states; Bx_BsD the conv's input B * x of the local tokens; gate_BsH one gate logit
per attention head.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.distributed as dist

from deltacp.families.registry import Family, register_family
from deltacp.parallel.documents import CPForwardContext, refuse_unsupported
from deltacp.parallel.placement import Pieces
from deltacp.parallel.token_halo import windowed_conv
from deltacp.parallel.views import AttentionView

logger = logging.getLogger(__name__)


def short_conv_forward_cp(group, balanced: bool, module, hidden_states: torch.Tensor, cache=None,
                          attention_mask=None, output_router_logits: bool | None = None,
                          **unsupported) -> torch.Tensor:
    """`Lfm2ShortConv.forward` on this rank's tokens [B, s, H]: the conv reads the kernel - 1 values of B * x before
    each local piece from their holder (zeros before the row; a packed document's start sees zeros as the row's
    does). attention_mask: the model hook's `CPForwardContext` (padding: the inputs of padded tokens zeroed, as
    transformers does; documents), or a local 2-D padding mask [B, s] of an unpacked row. output_router_logits: for
    LFM2-MoE's routers, nothing here. A cache and any other keyword raise."""
    refuse_unsupported(type(module).__name__, dict(unsupported, cache=cache))
    ctx = attention_mask if isinstance(attention_mask, CPForwardContext) else CPForwardContext(padding=attention_mask)
    if ctx.padding is not None:
        hidden_states = (hidden_states * ctx.padding[:, :, None]).to(hidden_states.dtype)
    B, s, _ = hidden_states.shape
    pieces = Pieces(dist.get_rank(group), dist.get_world_size(group), balanced, s)
    b_BsD, c_BsD, x_BsD = module.in_proj(hidden_states).chunk(3, dim=-1)
    starts = [None if ctx.documents is None else ctx.documents.segment(lo, hi).doc_starts(hidden_states.device)
              for lo, hi in pieces.spans()]
    conv = module.conv
    y_BsD = c_BsD * windowed_conv(b_BsD * x_BsD, conv.weight[:, 0], conv.bias, conv.dilation[0], group, pieces,
                                  starts)
    return module.out_proj(y_BsD)


def check_short_conv(module) -> dict:
    """What every rank must share of a gated short conv, and its halo (kernel - 1); raises for what is not
    supported."""
    conv = module.conv
    if conv.stride[0] != 1 or conv.groups != conv.in_channels or conv.dilation[0] != 1:
        raise ValueError(f"{type(module).__name__}'s conv under CP must be depthwise, stride 1, dilation 1")
    return dict(kernel=conv.kernel_size[0], bias=conv.bias is not None, token_halo=conv.kernel_size[0] - 1)


def install_short_conv(layers, group, balanced: bool) -> list:
    """The CP forward on every decoder layer's `conv` (module instance; class, parameters, state_dict unchanged);
    returns the modules."""
    modules = [layer.conv for layer in layers if getattr(layer, "conv", None) is not None]
    for m in modules:
        m.forward = partial(short_conv_forward_cp, group, balanced, m)
    if modules:
        logger.info("The gated short convs run deltacp's eager conv (no activation) in every backend: the fused "
                    "Triton conv computes SiLU")
    return modules


class Lfm2AttentionView(AttentionView):
    """GQA with per-head q / k norms (the module's own, at `norms`: LFM2's `q_layernorm` / `k_layernorm`), RoPE,
    `out_proj`."""

    family = "lfm2"
    norms = ("q_layernorm", "k_layernorm")

    @property
    def dropout(self) -> float:
        return 0.0  # transformers' Lfm2Attention passes dropout=0.0 (it has no attention_dropout)

    def project(self, x_BsD, position_embeddings):
        m, D = self.module, self.head_dim
        B, s, _ = x_BsD.shape
        q_norm, k_norm = (getattr(m, name) for name in self.norms)
        q = q_norm(m.q_proj(x_BsD).view(B, s, -1, D))
        k = k_norm(m.k_proj(x_BsD).view(B, s, -1, D))
        v = m.v_proj(x_BsD).view(B, s, -1, D)
        q, k = self.apply_rotary(q, k, position_embeddings)
        return q, k, v, self.gate_logits(x_BsD)

    def gate_logits(self, x_BsD):
        """What `output` reads besides the attention output (LFM2: nothing)."""
        return None

    def output(self, o_BsX, out):
        return self.module.out_proj(o_BsX)


class Lfm3AttentionView(Lfm2AttentionView):
    """Qwen3's GQA with per-head `q_norm` / `k_norm`, then the per-head sigmoid output gate `g_proj` of the layer's
    input and `o_proj`; a sliding window on the "sliding_attention" layers (the module's `sliding_window`, None on the
    "full_attention" ones: the view's default reads it); the rotary of the layer's type is the (cos, sin) the text
    model hands the layer. Dropout: transformers' `attention_dropout` in training (AttentionView's)."""

    family = "lfm3"
    norms = ("q_norm", "k_norm")
    dropout = AttentionView.dropout

    def gate_logits(self, x_BsD):
        g_proj = self.module.g_proj  # None when use_attention_gate is False
        return None if g_proj is None else g_proj(x_BsD)

    def output(self, o_BsX, gate_BsH):
        if gate_BsH is not None:  # transformers: attn_output [B, s, heads, D] * sigmoid(g_proj(x)).unsqueeze(-1)
            o_BsX = (o_BsX.unflatten(2, (gate_BsH.shape[-1], -1)) * torch.sigmoid(gate_BsH)[..., None]).flatten(2)
        return self.module.o_proj(o_BsX)


SHORT_CONV = ("conv", check_short_conv, install_short_conv)

LFM2 = register_family(Family(
    "lfm2", "transformers.models.lfm2.modeling_lfm2", causal_lm="Lfm2ForCausalLM", text_model="Lfm2Model",
    linear_mixer=None, attention="Lfm2Attention", norm="Lfm2RMSNorm", mlp="Lfm2MLP", text_config="Lfm2Config",
    attention_view=Lfm2AttentionView, fused_decoder=False, moe_fields=None, token_layers=SHORT_CONV))

LFM2_MOE = register_family(Family(
    "lfm2_moe", "transformers.models.lfm2_moe.modeling_lfm2_moe", causal_lm="Lfm2MoeForCausalLM",
    text_model="Lfm2MoeModel", linear_mixer=None, attention="Lfm2MoeAttention", norm="Lfm2MoeRMSNorm",
    mlp="Lfm2MoeMLP", text_config="Lfm2MoeConfig", attention_view=Lfm2AttentionView, fused_decoder=False,
    moe_fields=None, token_layers=SHORT_CONV,
    # transformers 5.25's "lfm2_moe" conversion mapping: routed experts stored per expert as w1 (gate), w3, w2
    checkpoint_expert_names=("w1", "w3", "w2")))

LFM3 = register_family(Family(
    "lfm3", "transformers.models.lfm3.modeling_lfm3", causal_lm="Lfm3ForCausalLM", text_model="Lfm3Model",
    linear_mixer=None, attention="Lfm3Attention", norm="Lfm3RMSNorm", mlp="Lfm3MLP", text_config="Lfm3Config",
    attention_view=Lfm3AttentionView, fused_decoder=False, moe_fields=None, token_layers=SHORT_CONV,
    # transformers 5.25's "lfm3" conversion mapping: the output gate stored as self_attn.gate_proj
    checkpoint_renames=(("self_attn.g_proj", "self_attn.gate_proj"),)))
