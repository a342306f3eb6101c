"""Zamba2 (`Zamba2ForCausalLM`, `Zamba2Model`; transformers 5.25): its family record, Mamba2 view and the shared
attention's view.

Layers (`Zamba2Model.layers`, `layers_block_type`): "linear_attention" ones are `Zamba2MambaDecoderLayer`
(`residual + mamba(input_layernorm(x))`), "hybrid" ones `Zamba2HybridLayer`: a shared block
(`shared_transformer`, a `Zamba2AttentionDecoderLayer`) on concat(x, the input embeddings) -> a per-layer `linear`
-> added to the Mamba layer's input (`mamba_decoder`). The layers' own forwards run under CP; both mixers are made
CP: the Mamba2 mixer at `mamba` / `mamba_decoder.mamba`, the shared block's attention at `shared_transformer.self_attn`.

Mixer (`Zamba2MambaMixer`): textually Bamba's (`families/mamba2.py`): in_proj -> [z | xBC | dt] (bias under
`add_bias_linear`), a depthwise conv with bias (always: `use_conv_bias` is not read), the SSD scan with the D skip,
dt = softplus(dt_raw + dt_bias) clamped below at `time_step_min` (its `time_step_limit` = (time_step_min, inf)), B
and C per group (`mamba_ngroups`), the gated RMSNorm `Zamba2RMSNormGated` (the gate silu(z) applied BEFORE the norm,
RMS over groups of intermediate / mamba_ngroups channels, eps 1e-5), out_proj; the padding mask applied before in_proj
and after the conv (`apply_mask_to_padding_states`), as the CP layer does for every Mamba2 family.

Shared blocks: `num_mem_blocks` distinct blocks cycled over the hybrid layers (hybrid layer j runs block
j % num_mem_blocks). transformers builds one `Zamba2AttentionDecoderLayer` instance per hybrid layer and ties the
parameters of the later ones to the first of their block (`Zamba2Model._tied_weights_keys`, prefix
`layers.<i>.shared_transformer`): the instances hold the SAME Parameter objects. CP installs its forward on every
instance and reads the parameters through it at call time, so they stay one set; FSDP2 must shard each tied group as
ONE unit (`shared_blocks`, read by `models/fsdp.fully_shard_cp`), and checkpoints store a tied group once, under
its first layer's names (`checkpoint_io`: transformers' save drops the tied keys). Attention (`Zamba2Attention`):
input width 2 x hidden, GQA, head_dim 2 x hidden / heads, scaling (head_dim / 2)^-1/2, no biases, no q/k norm, the
full RoPE only under `use_mem_rope` (the model computes no position embeddings otherwise); under
`use_shared_attention_adapter` q/k/v each add a LoRA adapter of the invocation (`linear_*_adapter_list[j]`, j the
hybrid layer's rank among the hybrid layers, from the call's `layer_idx`). The MLP (`Zamba2MLP`, with its per-
invocation `gate_up_proj_adapter_list`) is per-token: transformers' own code.
"""

from __future__ import annotations

from deltacp.families.attention import PlainAttentionView
from deltacp.families.mamba2 import Mamba2View
from deltacp.families.registry import Family, register_family


class Zamba2Mamba2View(Mamba2View):
    family = "zamba2"
    groups_setting = "mamba_ngroups"
    heads_setting = "n_mamba_heads"


class Zamba2AttentionView(PlainAttentionView):
    """The shared block's attention; `for_call(layer_idx=...)` binds the invocation (its LoRA adapters)."""

    family = "zamba2"
    call_keywords = ("layer_idx",)

    def __init__(self, module, apply_rotary=None, layer_idx=None):
        super().__init__(module, apply_rotary)
        self.layer_idx = layer_idx

    def for_call(self, layer_idx=None) -> Zamba2AttentionView:
        m = self.module
        if m.config.use_shared_attention_adapter and layer_idx not in m.layer_dic:
            raise ValueError(f"Zamba2Attention called with layer_idx={layer_idx!r}: its adapters are those of the "
                             f"hybrid layers {sorted(m.layer_dic)}")
        return Zamba2AttentionView(m, self._apply_rotary, layer_idx)

    def project(self, x_BsD, position_embeddings):
        m, D = self.module, self.head_dim
        B, s, _ = x_BsD.shape
        q, k, v = m.q_proj(x_BsD), m.k_proj(x_BsD), m.v_proj(x_BsD)
        if m.config.use_shared_attention_adapter:
            j = m.layer_dic[self.layer_idx]
            q = q + m.linear_q_adapter_list[j](x_BsD)
            k = k + m.linear_k_adapter_list[j](x_BsD)
            v = v + m.linear_v_adapter_list[j](x_BsD)
        q, k, v = q.view(B, s, -1, D), k.view(B, s, -1, D), v.view(B, s, -1, D)
        if m.config.use_mem_rope:
            q, k = self.apply_rotary(q, k, position_embeddings)
        return q, k, v, None


def check_config(config) -> None:
    """transformers adds the q/k/v adapters' outputs (the attention's input width each) to k and v of the key-value
    heads' width: with GQA its own forward fails; refused here before any collective, naming the fields."""
    if config.use_shared_attention_adapter and config.num_key_value_heads != config.num_attention_heads:
        raise ValueError(f"Zamba2 with use_shared_attention_adapter=True and num_key_value_heads "
                         f"({config.num_key_value_heads}) != num_attention_heads ({config.num_attention_heads}): "
                         f"transformers adds the k / v adapters at the query width, its own forward cannot run it")


def shared_blocks(attribute: str):
    """`Family.shared_modules` for shared blocks at the hybrid layers' `attribute`: their instances grouped by the
    parameters they hold (one list per tied group, in layer order); FSDP2 shards each group as one unit, so that a
    tied parameter is one sharded parameter (Zamba's `shared_transf` too)."""

    def shared_modules(text_model) -> list[list]:
        groups: dict[int, list] = {}
        for layer in text_model.layers:
            block = getattr(layer, attribute, None)
            if block is not None:
                key = id(block.self_attn.q_proj.weight)
                groups.setdefault(key, []).append(block)
        return list(groups.values())

    return shared_modules


ZAMBA2 = register_family(Family(
    "zamba2", "transformers.models.zamba2.modeling_zamba2", causal_lm="Zamba2ForCausalLM", text_model="Zamba2Model",
    linear_mixer="Zamba2MambaMixer", attention="Zamba2Attention", norm="Zamba2RMSNorm", mlp="Zamba2MLP",
    text_config="Zamba2Config", mixer_view=Zamba2Mamba2View, attention_view=Zamba2AttentionView, fused_decoder=False,
    linear_attribute=("mamba", "mamba_decoder.mamba"), attention_attribute="shared_transformer.self_attn",
    moe_fields=None, check_config=check_config, shared_modules=shared_blocks("shared_transformer")))
