"""Zamba (`ZambaForCausalLM`, `ZambaModel`; transformers 5.25, Zyphra/Zamba-7B-v1): its family record, the Mamba1
view of its multi-head mixer and the shared attention's view.

Layers (`ZambaModel.layers`, `layers_block_type`): "linear_attention" ones are `ZambaMambaDecoderLayer`
(`residual + mamba(input_layernorm(x))`), "hybrid" ones `ZambaHybridLayer`: ONE shared block (`shared_transf`, a
`ZambaAttentionDecoderLayer`: RMSNorm over 2 x hidden -> attention -> `pre_ff_layernorm` -> gelu MLP, no inner
residual) on concat(x, the input embeddings) -> a per-layer `linear` -> added to the input of the layer's Mamba
decoder (`mamba_decoder`: x + mamba(input_layernorm(x + that)), the residual without it). The layers' own forwards
run under CP; the mixers at `mamba` / `mamba_decoder.mamba` and the shared block's attention at
`shared_transf.self_attn` are made CP.

Mixer (`ZambaMambaMixer`): `n_mamba_heads` independent Mamba1 scans (`families/mamba.py`'s recurrence, the selective
scan of `ops/selective/eager.py`). in_proj H -> 2I (bias under `mamba_proj_bias`) split INTERLEAVED: channel 2i is x_i,
channel 2i + 1 is z_i (transformers views it as [I, 2]); a depthwise conv over x (kernel `mamba_d_conv`, bias under
`mamba_conv_bias`, `hidden_mamba_act` SiLU); x's channels are head-major, head h owning [h P, (h + 1) P) (P =
I / heads); per head: x_proj_weight[h] P -> [dt (`mamba_dt_rank`) | B (`mamba_d_state`) | C] (no bias),
dt = softplus(dt_proj_weight[h] dt + dt_proj_bias[h]) (no clamp), A = -exp(A_log[h]) [P, N], D[h] [P], the scan with
the D skip and the silu(z) gate; the heads' outputs concatenated -> out_proj (bias under `mamba_proj_bias`). The
padding mask is applied before in_proj and after the conv, as the CP layer does (`parallel/shard.py`).

Shared block: transformers builds one `ZambaAttentionDecoderLayer` per hybrid layer and ties them all to the first
(`ZambaModel._tied_weights_keys`): the instances hold the SAME parameters, and each invocation runs the block afresh.
As Zamba2's (`families/zamba2.py`): CP installs its forward on every instance and reads the parameters at call time,
FSDP2 shards the tied group as ONE unit (`shared_blocks`), and checkpoints store it once, under the first hybrid
layer's names. Attention (`ZambaAttention`): input width `attention_hidden_size` (2 x hidden), GQA, head_dim
`attention_head_dim` (2 x hidden / heads), scaling (head_dim / 2)^-1/2, no biases, NoPE (the model computes no
position embeddings); its `layer_idx` keyword picks the invocation's KV-cache slot only (caches are refused under CP:
read and nothing to do). The MLP (`ZambaMLP`) is per-token: transformers' own code.

CP: a Mamba head's x_proj reads only its own P channels, so the heads are independent: the view declares
`n_mamba_heads` contract heads of P x N state rows (V = 1, M diagonal; B and C per head), and Ulysses and the 2-D
layout split them over ranks (CP degrees dividing `n_mamba_heads`; others are refused naming it). The conv halo is
kernel - 1 tokens of x. The gate z travels as the heads' extras (P per token per head). On Triton each head is one
scan of the kernels (they take one group of B and C: `ops/selective/triton/scan.py` runs one per group).

Shape legend: x_BsD local hidden states; pre_BsC pre-conv x [B, s, I]; extras_BsHX z [B, s, heads, P].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltacp.families.attention import PlainAttentionView
from deltacp.families.mamba import MambaView
from deltacp.families.registry import Family, register_family
from deltacp.families.zamba2 import shared_blocks
from deltacp.ops.precision import compute_dtype
from deltacp.ops.recurrence import RecurrenceInputs
from deltacp.parallel.views import HeadLayout


class ZambaMambaView(MambaView):
    """A `ZambaMambaMixer`: heads of P = `mamba_head_dim` channels with their own x_proj / dt_proj / A_log / D rows
    (`x_proj_weight` [heads, rank + 2N, P], `dt_proj_weight` [heads, P, rank], `dt_proj_bias` [heads, P])."""

    family = "zamba"
    reads_every_head = False  # a head's x_proj reads its own channels only

    @property
    def extras(self) -> int:
        return self.module.mamba_head_dim  # z per head

    @property
    def layout(self) -> HeadLayout:
        m = self.module
        return HeadLayout(m.n_mamba_heads, m.n_mamba_heads, (("value", m.mamba_head_dim),),
                          key_setting="n_mamba_heads", value_setting="n_mamba_heads")

    @property
    def state_dims(self) -> tuple[int, int]:
        m = self.module
        return m.mamba_head_dim * m.ssm_state_size, 1

    def conv_heads(self, key_heads: int) -> tuple[tuple[int, int], ...]:
        return ((-1, self.module.mamba_head_dim),)

    def project(self, x_BsD):
        m = self.module
        xz = m.in_proj(x_BsD)
        return xz[..., 0::2], xz[..., 1::2].unflatten(-1, (m.n_mamba_heads, -1)), x_BsD.dtype

    def inputs(self, parts, extras_BnHX, heads: slice, backend) -> RecurrenceInputs:
        m = self.module
        (x,) = parts  # [rows, n, heads here, P]
        rows = x.shape[0]
        dt, b, c = torch.einsum("rnhp,hkp->rnhk", x, m.x_proj_weight[heads]).split(
            [m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)
        dt = torch.einsum("rnhk,hpk->rnhp", dt, m.dt_proj_weight[heads])
        dt = F.softplus(dt + m.dt_proj_bias[heads].to(dt.dtype)).flatten(2)
        cd = compute_dtype(x)
        a = -m.A_log[heads].to(cd).exp().flatten(0, 1)
        d = m.D[heads].to(cd).flatten()
        return RecurrenceInputs(x.flatten(2), dt, a.expand(rows, *a.shape), b, c, d.expand(rows, -1),
                                extras_BnHX.flatten(2))


class ZambaAttentionView(PlainAttentionView):
    """The shared block's attention (NoPE); `layer_idx` (the invocation's KV-cache slot) read and dropped."""

    family = "zamba"
    call_keywords = ("layer_idx",)

    def for_call(self, layer_idx=None) -> ZambaAttentionView:
        return self


ZAMBA = register_family(Family(
    "zamba", "transformers.models.zamba.modeling_zamba", causal_lm="ZambaForCausalLM", text_model="ZambaModel",
    linear_mixer="ZambaMambaMixer", attention="ZambaAttention", norm="ZambaRMSNorm", mlp="ZambaMLP",
    text_config="ZambaConfig", mixer_view=ZambaMambaView, attention_view=ZambaAttentionView, fused_decoder=False,
    linear_attribute=("mamba", "mamba_decoder.mamba"), attention_attribute="shared_transf.self_attn",
    moe_fields=None, shared_modules=shared_blocks("shared_transf")))
