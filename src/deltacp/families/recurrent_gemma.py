"""RecurrentGemma / Griffin (`RecurrentGemmaForCausalLM`, `RecurrentGemmaModel`; transformers 5.25,
google/recurrentgemma-2b): its family record, the recurrent block's CP forward, the RG-LRU's view and the local
attention's view.

Decoder layers (`RecurrentGemmaDecoderLayer`): `temporal_pre_norm`, the temporal block (`layer.temporal_block`: the
recurrent block where `config.layers_block_type` says "linear_attention", from `block_types` cycled, else the local
attention), the residual, `channel_pre_norm`, the MLP (`mlp_block`: down(gelu_tanh(gate x) * up x), biases,
intermediate_size / 2), the residual; norms `RecurrentGemmaRMSNorm` ((1 + w) in float32, cast back); the final norm
`final_norm`. The text model multiplies the embeddings by its `normalizer` buffer, sqrt(hidden_size) ROUNDED TO
bfloat16 (then cast to the hidden states' dtype: 50.5 for hidden 2560, not 50.596), and the causal LM soft-caps its
logits: cap * tanh(logits / cap), cap `logits_soft_cap` (30): transformers' own forwards under CP. The CP losses that
replace the head (`cp_causal_lm_loss`, `cp_token_logprobs`) cap the logits in their kernels instead
(`Family.logit_softcap`, `ops/lm_head/kernels.soft_capped`); `model(...).logits` with `cp_cross_entropy` is exact.

Recurrent block (`RecurrentGemmaRecurrentBlock`): y = gelu_tanh(linear_y x); x = conv_1d(linear_x x) (depthwise,
kernel `conv1d_width`, WITH bias, NO activation); h = rg_lru(x, position_ids); out = linear_out(h * y). Under CP its
forward is deltacp's (`Family.token_layers`): the conv reads the kernel - 1 values of linear_x x before each local
piece by the conv halo exchange (`parallel/token_halo.windowed_conv`; a packed document's window sees no token of
another, zeros before the row), then the RG-LRU runs as the family's linear mixer in the configured mode.
RG-LRU (`RecurrentGemmaRglru`, `temporal_block.rg_lru`): per head (num_attention_heads blocks of lru_width / heads
channels) the block-diagonal gates i = sigmoid(x W_x + b_x), r = sigmoid(x W_a + b_a); log a = -8 r
softplus(recurrent_param); the input x i sqrt(1 - a^2) (transformers' `SqrtBoundDerivative`: the gradient of the sqrt
clipped) in x's dtype; h_t = a_t h_{t-1} + that, accumulated in float32 (float64 here for float64): one state per
channel, a diagonal M (`ops/selective/diagonal.py`). The recurrence RESETS where position_ids == 0 (a = 0, the
multiplier 1): under CP every rank reads the GLOBAL position ids the model hook hands it (a reset on a rank's local
positions would cut the state at every rank boundary); the block also resets at every document start (packed rows)
and at a padded row's first valid token, whose conv window sees zeros before it: a padded row runs as its valid
tokens alone. The gates are per head, so Ulysses splits the RG-LRU's heads (num_attention_heads divisible by the
degree). transformers keeps the conv and recurrent states on module attributes (`conv1d_state`,
`rg_lru.recurrent_states`), not in a Cache: the CP forwards never read or write them (use_cache=True and a cache
raise).

Attention (`RecurrentGemmaAttention`): MQA / GQA (`num_key_value_heads`), q/k/v without bias unless `attention_bias`,
o_proj WITH bias, head_dim hidden / heads, scaling head_dim^-1/2, partial RoPE (`partial_rotary_factor` 0.5, the
module's own `rotary_emb` of the call's position ids: the view forms it from the global position ids), a local window
of `attention_window_size` (2048) tokens: the K/V halo in every full-attention method (`parallel/sliding_attention.py`).

Checkpoints: the modules' names (no conversion mapping); the head is tied to the embedding (`tie_word_embeddings`).

Backends: eager only (no RG-LRU kernel): `linear_attention_backend="triton"` raises in `parallelize_cp`'s checks,
before any collective.

Shape legend: x_BsD local hidden states; x_BsC the block's conv channels (lru_width); x_RnHK the RG-LRU's input
per head [rows, n, heads, channels per head]; reset_BsH1 one reset flag per token and head.
"""

from __future__ import annotations

import importlib
import logging
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from deltacp.families.attention import PlainAttentionView
from deltacp.families.registry import Family, register_family
from deltacp.ops.recurrence import RecurrenceInputs
from deltacp.parallel.documents import CPForwardContext, refuse_unsupported
from deltacp.parallel.placement import Pieces
from deltacp.parallel.token_halo import windowed_conv
from deltacp.parallel.views import HeadLayout, LinearMixerView

logger = logging.getLogger(__name__)

HEADS = "num_attention_heads (the RG-LRU's gate blocks)"


class RglruView(LinearMixerView):
    """The RG-LRU (recurrent_param, input_gate_weight / _bias, recurrent_gate_weight / _bias; num_attention_heads,
    block_width) as a diagonal recurrence: one head per gate block, K = block_width state rows of V = 1. Its input is
    the recurrent block's conv output (no conv of its own); the reset flags (position id 0) travel as its one extra."""

    family = "recurrent_gemma"
    extras = 1  # the reset flag
    conv = None  # the block's conv runs before (its CP forward, with the halo)
    conv_activation = None
    reads_positions = True

    @property
    def layout(self) -> HeadLayout:
        m = self.module
        return HeadLayout(m.num_attention_heads, m.num_attention_heads, (("value", m.block_width),),
                          key_setting=HEADS, value_setting=HEADS)

    @property
    def state_dims(self) -> tuple[int, int]:
        return self.module.block_width, 1

    def conv_heads(self, key_heads: int) -> tuple[tuple[int, int], ...]:
        return ((key_heads, self.module.block_width),)

    def project(self, x_BsC, position_ids_Bs):
        B, s, _ = x_BsC.shape
        reset_BsH1 = (position_ids_Bs == 0).to(x_BsC.dtype)[:, :, None, None]
        return x_BsC, reset_BsH1.expand(B, s, self.module.num_attention_heads, 1), x_BsC.dtype

    def inputs(self, parts, extras_BnHX, heads: slice, backend) -> RecurrenceInputs:
        """(a, b): the decays (0 at a reset) and the normalised inputs, in transformers' order of operations."""
        m = self.module
        (x,) = parts  # [rows, n, h, block_width]
        reset = extras_BnHX[..., :1] > 0.5  # [rows, n, h, 1]
        x_hTK = x.flatten(0, 1).transpose(0, 1)  # per head, every token: transformers' baddbmm (one rounding)

        def gate(weight, bias):
            return torch.baddbmm(bias[heads, None, :], x_hTK, weight[heads]).transpose(0, 1).reshape(x.shape)

        gate_x, gate_a = gate(m.input_gate_weight, m.input_gate_bias), gate(m.recurrent_gate_weight,
                                                                             m.recurrent_gate_bias)
        log_a = -8.0 * torch.sigmoid(gate_a) * F.softplus(m.recurrent_param.view(m.num_attention_heads, -1)[heads])
        a, a_square = torch.exp(log_a), torch.exp(2 * log_a)
        sqrt_bound = importlib.import_module(type(m).__module__).SqrtBoundDerivative  # its clipped gradient
        multiplier = sqrt_bound.apply(1 - a_square)
        multiplier = reset + ~reset * multiplier
        b = x * torch.sigmoid(gate_x) * multiplier.type(x.dtype)
        return RecurrenceInputs(a * ~reset, b)

    def recurrence(self, backend):
        self.eager_only("the RG-LRU scan (RecurrentGemma)", backend)
        from deltacp.ops.selective.diagonal import DiagonalScan

        return DiagonalScan()

    def output(self, o_BsHV, out, backend):
        B, s = o_BsHV.shape[:2]
        return o_BsHV.reshape(B, s, -1).to(out)


def reset_positions(ctx: CPForwardContext, position_ids, pieces: Pieces, B: int, s: int) -> torch.Tensor:
    """[B, s] the position ids the RG-LRU reads: the model hook's GLOBAL ones, 0 also at every document start of
    the forward (packed rows; a padded row's valid run and its padding: `ctx.attention`), where the recurrence
    restarts as transformers' does on that document alone."""
    positions = position_ids.expand(B, s)
    if ctx.attention is None:
        return positions
    starts = ctx.attention.starts(B, pieces.row_length, pieces.spans()).to(positions.device)
    first = starts == pieces.row_index().to(positions.device)[None]
    return torch.where(first, torch.zeros_like(positions), positions)


def recurrent_block_forward_cp(group, balanced: bool, module, input_states: torch.Tensor, position_ids=None,
                               attention_mask=None, use_cache: bool | None = None, cache=None, **unsupported):
    """`RecurrentGemmaRecurrentBlock.forward` on this rank's tokens [B, s, hidden] -> (output, None).
    attention_mask: the model hook's `CPForwardContext`; position_ids: the hook's global position ids. The conv's
    halo comes from the holders of the tokens before each piece; padded tokens' conv inputs are zeroed (a padded row
    runs as its valid tokens alone). use_cache=True, a cache and any other keyword raise: the block never touches
    transformers' state attributes under CP."""
    refuse_unsupported(type(module).__name__, dict(unsupported, cache=cache, use_cache=use_cache))
    if not isinstance(attention_mask, CPForwardContext) or position_ids is None:
        raise ValueError(f"{type(module).__name__} under CP runs inside the model: call the model made CP by "
                         f"parallelize_cp (its input hook hands every layer the forward's context and the GLOBAL "
                         f"position ids the RG-LRU resets on)")
    ctx = attention_mask
    B, s, _ = input_states.shape
    pieces = Pieces(dist.get_rank(group), dist.get_world_size(group), balanced, s)
    y_BsC = module.act_fn(module.linear_y(input_states))
    x_BsC = module.linear_x(input_states)
    if ctx.padding is not None:
        x_BsC = x_BsC * ctx.padding[:, :, None].to(x_BsC.dtype)
    starts = [None if ctx.documents is None else ctx.documents.segment(lo, hi).doc_starts(x_BsC.device)
              for lo, hi in pieces.spans()]
    conv = module.conv_1d
    x_BsC = windowed_conv(x_BsC, conv.weight[:, 0], conv.bias, conv.dilation[0], group, pieces, starts)
    h_BsC = module.rg_lru(x_BsC, position_ids=reset_positions(ctx, position_ids, pieces, B, s), attention_mask=ctx)
    return module.linear_out(h_BsC * y_BsC), None


def is_recurrent_block(module) -> bool:
    return type(module).__name__ == "RecurrentGemmaRecurrentBlock"


def check_recurrent_block(module) -> dict:
    """What every rank must share of a recurrent block, and its conv halo (kernel - 1); {} for the attention the
    same attribute holds in attention layers. Raises for a conv deltacp does not run."""
    if not is_recurrent_block(module):
        return {}
    conv = module.conv_1d
    k = conv.kernel_size[0]
    if conv.stride[0] != 1 or conv.groups != conv.in_channels or conv.dilation[0] != 1 or conv.padding[0] != k - 1:
        raise ValueError(f"{type(module).__name__}'s conv_1d under CP must be causal and depthwise, stride 1, "
                         f"dilation 1")
    return dict(kernel=k, bias=conv.bias is not None, token_halo=k - 1)


def install_recurrent_block(layers, group, balanced: bool) -> list:
    """The CP forward on every recurrent block (module instance; class, parameters, state_dict unchanged)."""
    modules = [layer.temporal_block for layer in layers if is_recurrent_block(layer.temporal_block)]
    for m in modules:
        m.forward = partial(recurrent_block_forward_cp, group, balanced, m)
    return modules


class RecurrentGemmaAttentionView(PlainAttentionView):
    """GQA with o_proj's bias, the module's own partial rotary formed from the call's global position ids, and its
    window (`sliding_window`: the config's attention_window_size)."""

    family = "recurrent_gemma"

    def positions(self, position_embeddings, position_ids):
        return position_ids

    def project(self, x_BsD, position_ids):
        return super().project(x_BsD, self.module.rotary_emb(x_BsD, position_ids))


RECURRENT_GEMMA = register_family(Family(
    "recurrent_gemma", "transformers.models.recurrent_gemma.modeling_recurrent_gemma",
    causal_lm="RecurrentGemmaForCausalLM", text_model="RecurrentGemmaModel", linear_mixer="RecurrentGemmaRglru",
    attention="RecurrentGemmaAttention", norm="RecurrentGemmaRMSNorm", mlp="RecurrentGemmaMlp",
    text_config="RecurrentGemmaConfig", mixer_view=RglruView, attention_view=RecurrentGemmaAttentionView,
    fused_decoder=False, linear_attribute="temporal_block.rg_lru", attention_attribute="temporal_block",
    moe_fields=None, token_layers=("temporal_block", check_recurrent_block, install_recurrent_block),
    logit_softcap="logits_soft_cap"))
