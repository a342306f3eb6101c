"""Granite-4.0-H (`GraniteMoeHybridForCausalLM`, `GraniteMoeHybridModel`; transformers 5.25): its family record,
Mamba2 view and attention view.

Layers (`GraniteMoeHybridDecoderLayer`): either `layer.mamba` (`GraniteMoeHybridMambaLayer`, Bamba's mixer:
`families/mamba2.py`) or `layer.self_attn` (`GraniteMoeHybridAttention`: GQA, no q/k norm, no gate, scaling =
`attention_multiplier`, RoPE only with `position_embedding_type="rope"`), pre-norm, then routed experts
(`block_sparse_moe`, when `num_local_experts` > 0) plus the always-on `shared_mlp`. The muP multipliers (embedding,
residual, logits) are the layers' and the model's own forwards, which CP keeps. The auxiliary loss
(`load_balancing_loss_func` x `router_aux_loss_coef` with `output_router_logits`) is made global over the CP group
(`models/moe.py`), read from `num_local_experts`.
"""

from __future__ import annotations

from deltacp.families.attention import PlainAttentionView
from deltacp.families.mamba2 import Mamba2View
from deltacp.families.registry import Family, register_family


class GraniteHybridMamba2View(Mamba2View):
    family = "granitemoehybrid"


class GraniteHybridAttentionView(PlainAttentionView):
    family = "granitemoehybrid"


GRANITE_HYBRID = register_family(Family(
    "granitemoehybrid", "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
    causal_lm="GraniteMoeHybridForCausalLM", text_model="GraniteMoeHybridModel", linear_mixer="GraniteMoeHybridMambaLayer",
    attention="GraniteMoeHybridAttention", norm="GraniteMoeHybridRMSNorm", mlp="GraniteMoeHybridMLP",
    text_config="GraniteMoeHybridConfig", mixer_view=GraniteHybridMamba2View,
    attention_view=GraniteHybridAttentionView, fused_decoder=False, linear_attribute="mamba",
    moe_fields=("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"),
    moe_router=("block_sparse_moe", "router"), logit_scale=("logits_scaling", "div"),
    # transformers 5.25's "granitemoe" conversion mapping: the released names of the experts and the router
    checkpoint_renames=(("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"),
                        ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight"),
                        ("block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight"))))
