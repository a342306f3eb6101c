"""MiniMax-Text-01 (`MiniMaxForCausalLM`, `MiniMaxModel`; transformers 5.25, `modeling_minimax.py`): its family record,
lightning attention view and attention view.

Decoder layers (`MiniMaxDecoderLayer`): `layer.self_attn` holds either the lightning attention
(`MiniMaxLightningAttention`, `layer_types` "linear_attention") or GQA (`MiniMaxAttention`, "full_attention"), told
apart by class; `layer.mlp` is routed experts (`MiniMaxSparseMoeBlock`: softmax top-k, renormalised; per-token, left
as they are). The residual is the NORMED input: h = input_layernorm(x); x = alpha h + beta attn(h), then the same
after post_attention_layernorm with the experts (alpha, beta: `linear_attn_*` / `full_attn_*` / `mlp_*_factor`).
That is transformers' own decoder forward under CP; the decoder norm is weight * x (not the fused glue's (1 + w):
`Family.fused_decoder` off), and activation checkpointing wraps whatever the layer's forward is.
Lightning attention: qkv = act(qkv_proj(x)) (`hidden_act`), per head [q | k | v] (reshape to [heads, 3 d], then
split); no conv, no l2norm, no 1/sqrt(d), no upcast; S_t = e^{-s_h} S_{t-1} + k_t v_tᵀ, o_t = q_t S_t with the slope
s_h a buffer (`slope_rate` [H, 1, 1]: (2^{-8/H})^{h+1} (1 - l / (L - 1 + 1e-5) + 1e-5) for layer l of L); then
`norm` (RMSNorm over H d, eps 1e-6) times sigmoid(output_gate(x)), out_proj. transformers computes it in blocks of
`block_size` with intra / inter-block decays (every factor e^x with x <= 0); the same recurrence is deltacp's
scalar-decay one (`ops/ssd`, Mamba2's SSD) with k = k, q = q, x = v, g = -s_h, no value scale and no skip: M =
e^{-s_h T} per head. The view reads the buffer (what transformers' forward multiplies by, in the model's dtype).
Padded tokens: transformers zeroes q, k, v there (`apply_mask_to_padding_states`), as the CP layer does.
Attention (`MiniMaxAttention`): GQA, full RoPE, no q/k norm, no output gate; the config's `sliding_window` (every
attention layer, when set: transformers' mask and its attention call read it from the config, not the module) makes
each attention layer a sliding-window one under CP (`parallel/sliding_attention.py`: the K/V halo).
Experts: `router_jitter_noise` > 0 multiplies the hidden states by uniform noise in training, drawn per rank under CP
over its own tokens (another stream than one process's): refused (`check_minimax`).
Checkpoints (transformers' "mixtral" conversion mapping): the experts under block_sparse_moe, per expert as
experts.{e}.w1 (gate), w3 (up), w2 (down); the decay buffers are persistent (stored by save_pretrained).

Shape legend: x_BsD local hidden states; pre_BsC [q | k | v] over all heads (each H x d); o_BsHV per head.
"""

from __future__ import annotations

import torch

from deltacp.families.attention import PlainAttentionView
from deltacp.families.registry import Family, register_family
from deltacp.ops.precision import compute_dtype
from deltacp.ops.recurrence import RecurrenceInputs
from deltacp.parallel.views import HeadLayout, LinearMixerView


class LightningAttentionView(LinearMixerView):
    """MiniMax's lightning attention (`MiniMaxLightningAttention`: qkv_proj, act_fn, slope_rate, norm, output_gate,
    out_proj; num_attention_heads, head_dim) as the scalar-decay recurrence: one head of q and k per value head, no
    conv."""

    family = "minimax"
    extras = 0
    conv = None  # no conv: no halo; the activation is applied in `project`
    conv_activation = None

    @property
    def layout(self) -> HeadLayout:
        m = self.module
        H, d = m.num_attention_heads, m.head_dim
        return HeadLayout(H, H, (("key", d), ("key", d), ("value", d)), key_setting="num_attention_heads",
                          value_setting="num_attention_heads")

    @property
    def state_dims(self) -> tuple[int, int]:
        return self.module.head_dim, self.module.head_dim

    def conv_heads(self, key_heads: int) -> tuple[tuple[int, int], ...]:
        d = self.module.head_dim
        return ((key_heads, d), (key_heads, d), (-1, d))

    def project(self, x_BsD):
        m = self.module
        B, s, _ = x_BsD.shape
        H, d = m.num_attention_heads, m.head_dim
        qkv_BsH3d = m.act_fn(m.qkv_proj(x_BsD)).view(B, s, H, 3, d)  # per head [q | k | v], as transformers splits
        pre_BsC = qkv_BsH3d.transpose(2, 3).reshape(B, s, 3 * H * d)  # [q of every head | k ... | v ...]
        return pre_BsC, x_BsD.new_zeros(B, s, H, 0), x_BsD

    def slope(self, heads: slice, dtype: torch.dtype) -> torch.Tensor:
        """The decay rates s_h of value heads `heads` [h] (the module's buffer), in `dtype`."""
        return self.module.slope_rate.reshape(-1)[heads].to(dtype)

    def inputs(self, parts, extras_BnHX, heads: slice, backend) -> RecurrenceInputs:
        q, k, v = parts
        g = -self.slope(heads, compute_dtype(v)).expand(*v.shape[:3])  # [rows, n, h]: log decay per token
        return RecurrenceInputs(q, k, v, g, None, None)

    def recurrence(self, backend):
        if backend.name == "triton":  # its contract takes no value scale and no skip (v = x), one group per head
            from deltacp.ops.ssd.triton import TritonScalarDecay

            return TritonScalarDecay()
        from deltacp.ops.ssd.eager import ScalarDecay

        return ScalarDecay()

    def output(self, o_BsHV, x_BsD, backend):
        """(output, None): transformers' forward returns (output, final state); the state is the cache's, which CP
        refuses."""
        m = self.module
        B, s = o_BsHV.shape[:2]
        y = m.norm(o_BsHV.reshape(B, s, -1))
        return m.out_proj(torch.sigmoid(m.output_gate(x_BsD)) * y), None


class MiniMaxAttentionView(PlainAttentionView):
    family = "minimax"

    @property
    def sliding_window(self) -> int | None:
        """The config's window: MiniMax keeps it on the config (every attention layer slides when it is set)."""
        return getattr(self.module.config, "sliding_window", None)


def check_minimax(text_config) -> None:
    """What deltacp refuses of a MiniMax config under CP (before any collective): router jitter (each rank would draw
    its own tokens' noise, not one process's)."""
    jitter = getattr(text_config, "router_jitter_noise", 0.0) or 0.0
    if jitter > 0:
        raise NotImplementedError(f"router_jitter_noise={jitter} under CP is not supported: in training each rank "
                                  f"would draw the noise of its own tokens, not the numbers one process draws over "
                                  f"the row; allowed: 0.0, transformers' default")


MINIMAX = register_family(Family(
    "minimax", "transformers.models.minimax.modeling_minimax", causal_lm="MiniMaxForCausalLM",
    text_model="MiniMaxModel", linear_mixer="MiniMaxLightningAttention", attention="MiniMaxAttention",
    norm="MiniMaxRMSNorm", mlp="MiniMaxSparseMoeBlock", text_config="MiniMaxConfig",
    mixer_view=LightningAttentionView, attention_view=MiniMaxAttentionView, fused_decoder=False,
    linear_attribute="self_attn", attention_attribute="self_attn",
    moe_fields=("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"),
    check_config=check_minimax,
    # transformers 5.25's "mixtral" conversion mapping (minimax -> mixtral): routed experts under block_sparse_moe,
    # stored per expert as w1 (gate), w3 (up), w2 (down)
    checkpoint_renames=(("mlp", "block_sparse_moe"),), checkpoint_expert_names=("w1", "w3", "w2")))
