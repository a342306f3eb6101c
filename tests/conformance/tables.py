"""The conformance tables: per family, every config field of its transformers classes that changes the forward pass
(read from transformers 5.25's configuration and modeling code), each with a value that exercises it, run by
`harness.py` (test_conformance.py). Adding a family means writing its table here.

A row's `touches`: linear (the linear-recurrent mixer), attention, rope (rotary frequencies that depend on the call's
positions), layers (the layer pattern), and the token-wise parts: mlp, moe, norm, embedding, head (transformers' own
per-token code under CP) and rotary (a rope type whose frequencies depend on nothing but its config: transformers'
rotary module computes cos / sin from the rank's positions in every mode alike). A row touching only token-wise parts
runs one of the six CP configurations at CP2 (in turn, on an input transformers runs too) and none at CP4, an
attention-only row three at CP2 (as any sequence part) and none at CP4 (`harness.combos_of`). Several token-wise
fields may share a row. `refused`:
deltacp refuses the value with an error containing that text; `ignored`: transformers' forward does not read it (the
reason given), so there is nothing to run; `elsewhere`: a field that changes no logits (a loss term), checked by
the test named.

Not rows: fields that act on generation or caches only (use_cache, bos / eos ids: caches are refused under CP),
initialisation ranges (replaced by `randomize_` and the builders' decays), output recording (output_router_logits:
the global aux loss is tests/distributed/test_model_families.py's), attention_dropout (random: deltacp refuses it
with padding, packed rows, all_gather and ring, and Ulysses draws another stream than one process; a row below
checks the refusal).
"""

from __future__ import annotations

import torch

from conformance.harness import Knob, Table
from deltacp.models.gates import long_memory_gates_
from helpers import (
    MOE_FIELDS,
    tiny_bailing_hybrid,
    tiny_bamba,
    tiny_falcon_h1,
    tiny_glm5_next,
    tiny_granite_hybrid,
    tiny_jamba,
    tiny_kimi_linear,
    tiny_minimax,
    tiny_lara_mini,
    tiny_lfm2,
    tiny_lfm2_moe,
    tiny_falcon_mamba,
    tiny_lfm3,
    tiny_mamba,
    tiny_mamba2,
    tiny_nemotron_h,
    tiny_olmo_hybrid,
    tiny_qwen4_exp,
    tiny_recurrent_gemma,
    tiny_text_fields,
    tiny_zamba,
    tiny_zamba2,
)

GDN_DECAYS = ("A_log", "dt_bias")  # the builders' slow decays, kept by randomize_


def _rope(kind: str, rotary_dims: int, **extra) -> dict:
    """rope_parameters of one type for the tiny models. 'dynamic' and 'longrope' depend on the call's largest
    position: with the original context 48 (dynamic: max_position_embeddings 48) the padded row (64 tokens) crosses it
    on the second rank only at CP2, the long row on both."""
    params = {
        "default": {},
        "linear": {"factor": 2.0},
        "dynamic": {"factor": 2.0},
        "yarn": {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0, "beta_slow": 2.0},
        "llama3": {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                   "original_max_position_embeddings": 16},
        "longrope": {"original_max_position_embeddings": 48, "factor": 4.0,
                     "short_factor": [1.0 + 0.1 * i for i in range(rotary_dims // 2)],
                     "long_factor": [2.0 + 0.3 * i for i in range(rotary_dims // 2)]},
    }[kind]
    return {"rope_type": kind, "rope_theta": 10000.0, **params, **extra}


POSITION_DEPENDENT = ("dynamic", "longrope")  # transformers updates their frequencies from the call's positions


def _rope_rows(rotary_dims: int, **extra) -> tuple[Knob, ...]:
    """One row per rope type transformers ships for a 1-D rotary (mRoPE is the multimodal class's)."""
    rows = []
    for kind in ("linear", "dynamic", "yarn", "llama3", "longrope"):
        fields = dict(rope_parameters=_rope(kind, rotary_dims, **extra))
        if kind == "dynamic":
            fields["max_position_embeddings"] = 48
        rows.append(Knob(f"rope_parameters: {kind}", fields, touches="rope" if kind in POSITION_DEPENDENT else
                         "rotary"))
    return tuple(rows)


def _transformers_model(cls_name: str, config_cls: str, **fields) -> torch.nn.Module:
    """`cls_name(config_cls(**fields))`, seeded, sdpa attention and eager experts, slow GDN decays, float64."""
    import transformers

    config = getattr(transformers, config_cls)(**fields)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return long_memory_gates_(getattr(transformers, cls_name)(config)).to(torch.float64)


def qwen3_5(**overrides):
    return _transformers_model("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", **tiny_text_fields(**overrides))


def qwen3_5_moe(**overrides):
    return _transformers_model("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig",
                               **tiny_text_fields(**{**MOE_FIELDS, **overrides}))


def qwen3_next(**overrides):
    base = dict(MOE_FIELDS, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)
    return _transformers_model("Qwen3NextForCausalLM", "Qwen3NextConfig", **tiny_text_fields(**{**base, **overrides}))


# the tiny Qwen models: attention 4 heads of 16 over 2 KV heads, partial rotary 0.25 (4 rotary dims); GDN 2 key heads
# for 4 value heads, K = V = 16, conv kernel 4; layers GDN, GDN, GDN, attention
QWEN_ROTARY = 4
QWEN_ATTENTION = (
    Knob("attention_bias: True", dict(attention_bias=True), touches="attention"),
    Knob("num_attention_heads 8, num_key_value_heads 1 (MQA), head_dim 8",
         dict(num_attention_heads=8, num_key_value_heads=1, head_dim=8), touches="attention"),
    Knob("rope_parameters: rope_theta 500, partial_rotary_factor 0.5",
         dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}),
         touches="rope"),
) + _rope_rows(QWEN_ROTARY)
QWEN_GDN = (
    Knob("linear_conv_kernel_dim: 1 (no conv halo)", dict(linear_conv_kernel_dim=1), touches="linear"),
    Knob("linear_num_key_heads 1, linear_num_value_heads 4, linear_key_head_dim 8, linear_value_head_dim 24",
         dict(linear_num_key_heads=1, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=24),
         touches="linear"),
    Knob("hidden_act: swish (SiLU)", dict(hidden_act="swish"), touches="linear mlp"),
    Knob("hidden_act: gelu", dict(hidden_act="gelu"), touches="linear mlp",
         refused="computes the conv's activation as SiLU"),
)
QWEN_COMMON = (
    Knob("layer_types: attention, GDN, GDN, attention",
         dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
         touches="layers"),
    Knob("rms_norm_eps: 1e-2", dict(rms_norm_eps=1e-2), touches="norm"),
    Knob("tie_word_embeddings: True", dict(tie_word_embeddings=True), touches="embedding head"),
    Knob("attention_dropout: 0.1 (training)", dict(attention_dropout=0.1), touches="attention",
         refused="attention_dropout"),
)

QWEN3_5 = Table("Qwen3.5", "Qwen3_5ForCausalLM", qwen3_5, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob("intermediate_size: 48", dict(intermediate_size=48), touches="mlp"),
) + QWEN_ATTENTION + QWEN_GDN + QWEN_COMMON)

QWEN3_5_MOE = Table("Qwen3.5-MoE", "Qwen3_5MoeForCausalLM", qwen3_5_moe, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob("num_experts 8, num_experts_per_tok 3, moe_intermediate_size 16, shared_expert_intermediate_size 24",
         dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=24),
         touches="moe"),
    Knob("norm_topk_prob, decoder_sparse_step, mlp_only_layers, intermediate_size",
         ignored="Qwen3_5MoeTextConfig takes them as extra attributes; the modeling code never reads them (every "
                 "layer is MoE, the router always renormalises its top-k)"),
) + QWEN_ATTENTION[:1] + _rope_rows(QWEN_ROTARY)[1:2] + QWEN_GDN[:1] + QWEN_COMMON[:2])

QWEN3_NEXT = Table("Qwen3-Next", "Qwen3NextForCausalLM", qwen3_next, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob("linear_num_key_heads 1, linear_num_value_heads 4 (fused q/k/v/z interleave, r = 4)",
         dict(linear_num_key_heads=1, linear_num_value_heads=4), touches="linear"),
    Knob("linear_num_key_heads 3, linear_num_value_heads 6 (odd key heads)",
         dict(linear_num_key_heads=3, linear_num_value_heads=6), touches="linear"),
    Knob("decoder_sparse_step 2, mlp_only_layers [], intermediate_size 48",
         dict(decoder_sparse_step=2, mlp_only_layers=[], intermediate_size=48), touches="layers mlp moe"),
    Knob("norm_topk_prob False, num_experts_per_tok 1", dict(norm_topk_prob=False, num_experts_per_tok=1),
         touches="moe"),
    Knob("num_experts: 0 (every MLP dense)", dict(num_experts=0), touches="mlp"),
) + QWEN_ATTENTION[:1] + _rope_rows(QWEN_ROTARY)[1:2] + _rope_rows(QWEN_ROTARY)[4:] + QWEN_GDN[:1] + QWEN_COMMON[:1])

# the tiny OLMo-Hybrid: attention 8 heads of 8 over 2 KV heads, full rotary (8 dims), q/k norms over the projected
# width; GDN 2 key heads for 8 value heads, K 12, V 24, beta = 2 sigmoid(b); layers GDN, attention, GDN, GDN
OLMO_HYBRID = Table("OLMo-Hybrid", "OlmoHybridForCausalLM", tiny_olmo_hybrid, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob("rope_parameters: none (NoPE)", dict(rope=False), touches="rope"),
    Knob("attention_bias True, num_key_value_heads 1", dict(attention_bias=True, num_key_value_heads=1),
         touches="attention"),
) + _rope_rows(8) + (
    Knob("linear_allow_neg_eigval: False", dict(linear_allow_neg_eigval=False), touches="linear"),
    Knob("linear_num_key_heads 3, linear_num_value_heads 6, linear_key_head_dim 8, linear_value_head_dim 16",
         dict(linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=16),
         touches="linear"),
    Knob("linear_conv_kernel_dim: 1 (no conv halo)", dict(linear_conv_kernel_dim=1), touches="linear"),
    Knob("layer_types: attention, GDN, GDN, GDN",
         dict(layer_types=["full_attention", "linear_attention", "linear_attention", "linear_attention"]),
         touches="layers"),
    Knob("rms_norm_eps 1e-2, intermediate_size 48, tie_word_embeddings",
         dict(rms_norm_eps=1e-2, intermediate_size=48, tie_word_embeddings=True), touches="norm mlp embedding head"),
    Knob("partial_rotary_factor",
         ignored="the default rope rotates the whole head dim whatever it says, and OLMo's apply_rotary_pos_emb has "
                 "no partial form for the other types (transformers fails)"),
    Knob("rms_norm_eps on the GDN output norm", ignored="the GDN o_norm keeps eps 1e-5 in transformers"),
))

MAMBA_DECAYS = ("A_log", "dt_proj.bias")  # and D, which randomize_ does not touch
SSD_DECAYS = ("A_log", "dt_bias")  # and D, which randomize_ does not touch
BIAS_WINDOW = ("padded tokens' input-projection biases enter the conv windows of the first valid tokens, as in "
               "transformers")


def _mamba2_rows(prefix: str, groups: str, conv: str, conv_bias: str, proj_bias: str, limit: str = "time_step_limit"
                 ) -> tuple[Knob, ...]:
    """The rows every Mamba2 mixer shares, under the family's config names."""
    return (
        Knob(f"{proj_bias}: True ({BIAS_WINDOW})", {proj_bias: True}, touches="linear padding"),
        Knob(f"{groups}: 1 (one B/C group for every head)", {groups: 1}, touches="linear"),
        Knob(f"{groups}: 8 (a group per head)", {groups: 8}, touches="linear"),
        Knob(f"{conv}: 1 (no conv halo)", {conv: 1}, touches="linear"),
        Knob(f"{conv_bias} False, {conv} 2, {limit} (0.05, 0.4) (dt clamped)",
             {conv_bias: False, conv: 2, limit: (0.05, 0.4)}, touches="linear"),
    )


# the tiny Bamba: Mamba2 8 heads of 8 in 2 groups, state 6, conv 4 with bias; attention 8 heads of 4 over 2 KV heads,
# RoPE on half the head dim (2 rotary dims); layers Mamba2, attention, Mamba2, Mamba2
BAMBA = Table("Bamba", "BambaForCausalLM", tiny_bamba, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
) + _mamba2_rows("bamba", "mamba_n_groups", "mamba_d_conv", "mamba_conv_bias", "mamba_proj_bias") + (
    Knob("mamba_expand 1, mamba_d_head 4", dict(mamba_expand=1, mamba_d_head=4), touches="linear"),
    Knob("attention_bias True, num_key_value_heads 1", dict(attention_bias=True, num_key_value_heads=1),
         touches="attention"),
    Knob("rope_parameters: partial_rotary_factor 1.0, rope_theta 500",
         dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0}),
         touches="rope"),
) + _rope_rows(4, partial_rotary_factor=1.0) + (  # transformers' dynamic NTK divides by rotary dims - 2
    Knob("attn_layer_indices: [0, 3]", dict(attn_layer_indices=[0, 3]), touches="layers"),
    Knob("rms_norm_eps 1e-2, intermediate_size 48, mlp_bias True",
         dict(rms_norm_eps=1e-2, intermediate_size=48, mlp_bias=True), touches="norm mlp linear"),
    Knob("tie_word_embeddings: True", dict(tie_word_embeddings=True), touches="embedding head"),
    Knob("z_loss_coefficient > 0 (a loss term: refused by cp_causal_lm_loss)",
         elsewhere="tests/unit/test_fail_fast.py::test_z_loss_is_refused_by_the_cp_losses"),
))

# the tiny Granite-4.0-H: as Bamba's mixer, RoPE on the whole head dim (4), 4 experts top 2 and the shared MLP, muP
# multipliers away from 1
GRANITE_HYBRID = Table("Granite-4.0-H", "GraniteMoeHybridForCausalLM", tiny_granite_hybrid, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
) + _mamba2_rows("granite", "mamba_n_groups", "mamba_d_conv", "mamba_conv_bias", "mamba_proj_bias")[:2] + (
    Knob("mamba_d_conv 1 (no conv halo), mamba_conv_bias False", dict(mamba_d_conv=1, mamba_conv_bias=False),
         touches="linear"),
    Knob("position_embedding_type: None (NoPE, the config default)", dict(position_embedding_type=None),
         touches="rope"),
) + _rope_rows(4) + (
    Knob("attention_multiplier 0.5, attention_bias True", dict(attention_multiplier=0.5, attention_bias=True),
         touches="attention"),
    Knob("num_local_experts 0 (dense), shared_intermediate_size 48",
         dict(num_local_experts=0, shared_intermediate_size=48), touches="mlp"),
    Knob("num_experts_per_tok 1, intermediate_size 32", dict(num_experts_per_tok=1, intermediate_size=32),
         touches="moe"),
    Knob("embedding_multiplier 0.5, residual_multiplier 1.3, logits_scaling 0.7, rms_norm_eps 1e-2",
         dict(embedding_multiplier=0.5, residual_multiplier=1.3, logits_scaling=0.7, rms_norm_eps=1e-2),
         touches="embedding head norm linear"),
    Knob("tie_word_embeddings: True", dict(tie_word_embeddings=True), touches="embedding head"),
))

# the tiny Nemotron-H: blocks Mamba2, MoE, attention, Mamba2, MLP; Mamba2 8 heads of 4 in 2 groups, state 6;
# attention 8 heads of 4 over 2 KV heads, no rotary; relu2 MLPs and experts
NEMOTRON_H = Table("Nemotron-H", "NemotronHForCausalLM", tiny_nemotron_h, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
) + _mamba2_rows("nemotron", "n_groups", "conv_kernel", "use_conv_bias", "use_bias") + (
    Knob("head_dim 8 (heads x head_dim != hidden), num_key_value_heads 1",
         dict(head_dim=8, num_key_value_heads=1), touches="attention"),
    Knob("layers_block_type: attention, Mamba2, MLP, Mamba2, MoE",
         dict(layers_block_type=["full_attention", "linear_attention", "mlp", "linear_attention", "moe"]),
         touches="layers"),
    Knob("mlp_hidden_act silu, mlp_bias True, intermediate_size 48",
         dict(mlp_hidden_act="silu", mlp_bias=True, intermediate_size=48), touches="mlp moe"),
    Knob("num_experts_per_tok 1, routed_scaling_factor 2.5, norm_topk_prob False, moe_latent_size 16, n_group 2",
         dict(num_experts_per_tok=1, routed_scaling_factor=2.5, norm_topk_prob=False, moe_latent_size=16, n_group=2,
              topk_group=1), touches="moe"),
    Knob("layer_norm_epsilon: 1e-2", dict(layer_norm_epsilon=1e-2), touches="norm linear"),
    Knob("expand, mamba_proj_bias, attention_bias, sliding_window, residual_in_fp32, tie_word_embeddings",
         ignored="NemotronHConfig stores them; the modeling code builds the mixer from mamba_num_heads x "
                 "mamba_head_dim and use_bias, its attention without biases or a window, and ties no weights"),
))

# the tiny Mamba2: 3 Mamba2 blocks (8 heads of 8 in 2 groups, state 6, conv 4 with bias); no attention, no MLP
MAMBA2 = Table("Mamba2", "Mamba2ForCausalLM", tiny_mamba2, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
) + _mamba2_rows("mamba2", "n_groups", "conv_kernel", "use_conv_bias", "use_bias") + (
    Knob("expand 1, head_dim 4", dict(expand=1, head_dim=4), touches="linear"),
    Knob("residual_in_fp32 False, layer_norm_epsilon 1e-2, tie_word_embeddings True",
         dict(residual_in_fp32=False, layer_norm_epsilon=1e-2, tie_word_embeddings=True),
         touches="norm linear embedding head"),
    Knob("hidden_act: gelu (the conv's activation)", dict(hidden_act="gelu"), touches="linear",
         refused="computes the conv's activation as SiLU"),
    Knob("chunk_size", ignored="the chunk length of transformers' torch scan: the same sums grouped otherwise "
                               "(deltacp's chunks are its own)"),
    Knob("rescale_prenorm_residual, time_step_min, time_step_max, time_step_floor, initializer_range, time_step_rank",
         ignored="initialisation only (time_step_rank: stored, never read)"),
))

# the tiny Mamba: 2 Mamba1 blocks (I = 32, state 4, dt rank 3, conv 4 with bias, in_proj / out_proj with bias); no
# attention, no MLP. A head per channel: Ulysses splits the 32 channels, x_proj's partial products summed
MAMBA_SCAN_INIT = Knob("time_step_scale, time_step_min, time_step_max, time_step_init_scheme, time_step_floor, "
                       "rescale_prenorm_residual, initializer_range", ignored="initialisation only")
MAMBA_SCANS = Knob("use_mambapy, use_associative_scan",
                   ignored="another torch scan of the same recurrence (mambapy: a package; the associative scan: "
                           "under torch.compile only)")
MAMBA_TAIL = (  # the rows Mamba and FalconMamba share after their mixer rows
    Knob("residual_in_fp32 False, layer_norm_epsilon 1e-2, tie_word_embeddings True",
         dict(residual_in_fp32=False, layer_norm_epsilon=1e-2, tie_word_embeddings=True),
         touches="norm embedding head"),
    Knob("hidden_act: gelu (the conv's activation)", dict(hidden_act="gelu"), touches="linear",
         refused="computes the conv's activation as SiLU"),
    MAMBA_SCANS, MAMBA_SCAN_INIT,
)
MAMBA = Table("Mamba", "MambaForCausalLM", tiny_mamba, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob(f"use_bias: False (in_proj / out_proj; True in the tiny model: {BIAS_WINDOW})", dict(use_bias=False),
         touches="linear padding"),
    Knob("use_conv_bias False, conv_kernel 2 (conv_kernel 1, no halo: FalconMamba's table)",
         dict(use_conv_bias=False, conv_kernel=2), touches="linear"),
    Knob("state_size 8, expand 1, time_step_rank auto (1)", dict(state_size=8, expand=1, time_step_rank="auto"),
         touches="linear"),
) + MAMBA_TAIL)

# the tiny FalconMamba: the tiny Mamba with the weightless RMSNorms on dt, B and C (eps mixer_rms_eps)
FALCON_MAMBA = Table("FalconMamba", "FalconMambaForCausalLM", tiny_falcon_mamba, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob("mixer_rms_eps 0.1, state_size 8, expand 1, time_step_rank 5",
         dict(mixer_rms_eps=0.1, state_size=8, expand=1, time_step_rank=5), touches="linear"),
    Knob("use_bias False, use_conv_bias False, conv_kernel 1 (no conv halo)",
         dict(use_bias=False, use_conv_bias=False, conv_kernel=1), touches="linear padding"),
) + MAMBA_TAIL)

# the tiny Jamba: layers Mamba1 (I = 32, state 4, dt rank 3, conv 4 with bias, in_proj / out_proj with bias, the dt /
# B / C RMSNorms with weights), NoPE attention (4 heads of 4 over 2 KV heads), Mamba1; 4 experts of 24, top 2, not
# renormalised, after both Mamba1 layers, a SwiGLU MLP after the attention. Ulysses splits the Mamba1 channels
# (x_proj's partial products summed) and the attention heads
JAMBA = Table("Jamba", "JambaForCausalLM", tiny_jamba, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob("mamba_proj_bias: False (in_proj / out_proj)", dict(mamba_proj_bias=False), touches="linear padding"),
    Knob("mamba_conv_bias False, mamba_d_conv 1 (no conv halo)", dict(mamba_conv_bias=False, mamba_d_conv=1),
         touches="linear"),
    Knob("mamba_d_state 8, mamba_expand 1, mamba_dt_rank auto (1)",
         dict(mamba_d_state=8, mamba_expand=1, mamba_dt_rank="auto"), touches="linear"),
    Knob("rms_norm_eps: 1e-1 (the dt / B / C norms and the decoder norms)", dict(rms_norm_eps=1e-1),
         touches="linear norm"),
    Knob("attn_layer_period 2, attn_layer_offset 0 (attention, Mamba1, attention)",
         dict(attn_layer_period=2, attn_layer_offset=0), touches="layers"),
    Knob("num_attention_heads 8, num_key_value_heads 1 (MQA, head dim 2)",
         dict(num_attention_heads=8, num_key_value_heads=1), touches="attention"),
    Knob("expert_layer_period 3, expert_layer_offset 1, num_experts 6, num_experts_per_tok 3, intermediate_size 20",
         dict(expert_layer_period=3, expert_layer_offset=1, num_experts=6, num_experts_per_tok=3,
              intermediate_size=20), touches="moe mlp"),
    Knob("tie_word_embeddings: True", dict(tie_word_embeddings=True), touches="embedding head"),
    Knob("hidden_act: gelu (the conv's activation)", dict(hidden_act="gelu"), touches="linear mlp moe",
         refused="computes the conv's activation as SiLU"),
    Knob("attention_dropout: 0.1 (training)", dict(attention_dropout=0.1), touches="attention",
         refused="attention_dropout"),
    Knob("router_aux_loss_coef (a loss term with output_router_logits)",
         elsewhere="tests/distributed/test_model_families.py (JambaForCausalLM's global aux loss)"),
    MAMBA_SCANS,
    Knob("use_mamba_kernels", ignored="deprecated: no effect in transformers 5.25 (the path follows what is "
                                      "installed; the torch path computes the same recurrence)"),
    Knob("initializer_range", ignored="initialisation only"),
))

# the tiny Falcon-H1: 3 layers, each Mamba2 (8 heads of 8 in 2 groups, state 6, the grouped gated RMSNorm) and
# attention (8 heads of 4 over 2 KV heads, full RoPE: 4 dims) in parallel; every muP multiplier away from 1
FALCON_H1 = Table("Falcon-H1", "FalconH1ForCausalLM", tiny_falcon_h1, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob("mamba_rms_norm False (the config default: y * silu(z)), mamba_proj_bias, projectors_bias",
         dict(mamba_rms_norm=False, mamba_proj_bias=True, projectors_bias=True), touches="linear padding"),
    Knob("mamba_norm_before_gate: False", dict(mamba_norm_before_gate=False), touches="linear"),
) + _mamba2_rows("falcon", "mamba_n_groups", "mamba_d_conv", "mamba_conv_bias", "mamba_proj_bias")[1:] + (
    Knob("ssm_multipliers, ssm_in_multiplier, ssm_out_multiplier other values",
         dict(ssm_multipliers=[0.8, 1.3, 0.7, 1.4, 0.6], ssm_in_multiplier=1.3, ssm_out_multiplier=0.6),
         touches="linear"),
    Knob("key_multiplier 1.4, attention_in_multiplier 0.8, attention_out_multiplier 1.3, attention_bias True",
         dict(key_multiplier=1.4, attention_in_multiplier=0.8, attention_out_multiplier=1.3, attention_bias=True),
         touches="attention"),
) + _rope_rows(4) + (
    Knob("lm_head_multiplier 1.3, embedding_multiplier 0.6, mlp_multipliers, mlp_bias, rms_norm_eps 1e-2",
         dict(lm_head_multiplier=1.3, embedding_multiplier=0.6, mlp_multipliers=[0.7, 1.4], mlp_bias=True,
              rms_norm_eps=1e-2), touches="head embedding mlp norm linear"),
    Knob("tie_word_embeddings: True", dict(tie_word_embeddings=True), touches="embedding head"),
))

KDA_DECAYS = ("A_log", "dt_bias")

# the tiny Kimi-Linear: KDA 8 heads of 8, conv 4; MLA 8 heads, kv_lora_rank 16, no q_lora, qk 8 + 4 (unrotated),
# v 6; layers KDA, MLA, KDA, KDA; MLPs dense, routed, dense, routed (4 experts in 2 groups, top 2, a shared expert)
KIMI_LINEAR = Table("Kimi-Linear", "KimiLinearForCausalLM", tiny_kimi_linear, (
    Knob("defaults (randomised biases, norm weights and routing bias)", touches="all"),
    Knob("linear_conv_kernel_dim: 1 (no conv halo)", dict(linear_conv_kernel_dim=1), touches="linear"),
    Knob("linear_num_heads 4, linear_head_dim 16", dict(linear_num_heads=4, linear_head_dim=16), touches="linear"),
    Knob("q_lora_rank 12, attention_bias True", dict(q_lora_rank=12, attention_bias=True), touches="attention"),
    Knob("v_head_dim 16 (above the q/k head dim)", dict(v_head_dim=16), touches="attention"),
    Knob("layer_types: MLA, KDA, KDA, MLA",
         dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
         touches="layers"),
    Knob("mlp_layer_types all routed, norm_topk_prob False, n_shared_experts 2, routed_scaling_factor 1.7",
         dict(mlp_layer_types=["sparse"] * 4, norm_topk_prob=False, n_shared_experts=2, routed_scaling_factor=1.7),
         touches="moe"),
    Knob("rms_norm_eps 1e-2, intermediate_size 48", dict(rms_norm_eps=1e-2, intermediate_size=48),
         touches="norm mlp linear"),
    Knob("tie_word_embeddings", ignored="KimiLinearForCausalLM ties no weights (_tied_weights_keys is empty)"),
    Knob("num_key_value_heads", ignored="MLA expands its latent to num_attention_heads key/value heads"),
    Knob("max_position_embeddings, rope_parameters", ignored="Kimi-Linear has no rotary"),
))

# the tiny Bailing-Hybrid: KDA 8 heads of 8 with the safe gate (bound -5); MLA 8 heads, q_lora_rank 12,
# kv_lora_rank 16, qk 8 + 4 (interleaved RoPE), v 6, YaRN with mscale, the per-head output gate; MLPs dense, routed,
# routed, dense with SwiGLU clamps
BAILING_HYBRID = Table("Bailing-Hybrid", "BailingHybridForCausalLM", tiny_bailing_hybrid, (
    Knob("defaults (randomised biases, norm weights and routing bias)", touches="all"),
    Knob("kda_safe_gate: False", dict(kda_safe_gate=False), touches="linear"),
    Knob("kda_lower_bound: -1", dict(kda_lower_bound=-1.0), touches="linear"),
    Knob("short_conv_kernel_size: 1 (no conv halo)", dict(short_conv_kernel_size=1), touches="linear"),
    Knob("head_dim (KDA) 16, num_attention_heads 4", dict(head_dim=16, num_attention_heads=4, num_key_value_heads=4),
         touches="linear attention"),
    Knob("q_lora_rank None, v_head_dim 16", dict(q_lora_rank=None, v_head_dim=16), touches="attention"),
    Knob("rope_parameters: yarn without mscale",
         dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 16}), touches="rope"),
    Knob("rope_parameters: linear", dict(rope_parameters=_rope("linear", 4)), touches="rope"),
    Knob("rope_parameters: dynamic", dict(rope_parameters=_rope("dynamic", 4), max_position_embeddings=48),
         touches="rope"),
    Knob("rope_parameters: longrope", dict(rope_parameters=_rope("longrope", 4), max_position_embeddings=64),
         touches="rope"),
    Knob("expert and shared-expert SwiGLU limits 0, norm_topk_prob False, routed_scaling_factor 1.7",
         dict(expert_swiglu_limit_list=[0, 0, 0, 0], share_expert_swiglu_limit_list=[0, 0, 0, 0],
              norm_topk_prob=False, routed_scaling_factor=1.7), touches="moe"),
    Knob("layer_types: MLA, KDA, KDA, MLA",
         dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
         touches="layers"),
    Knob("tie_word_embeddings", ignored="BailingHybridForCausalLM ties no weights (_tied_weights_keys is empty)"),
    Knob("partial_rotary_factor", ignored="the interleaved RoPE rotates the whole rope slice (transformers fails "
                                          "with a narrower cos)"),
))

# the tiny Qwen4-Exp (`tiny_qwen4_exp`): 2 hyper-connection streams; GDN 2 key heads for 4 value heads of 16;
# layers GDN, GDN, GDN, indexed attention (4 heads of 16 over 2 KV heads, partial mRoPE; QSA 8 indexer heads of 8,
# blocks of 3, budget 12: sparse past 15 tokens, blocks straddling the rank boundaries); 4 experts, top 2; its indexed
# attention runs with full_attention_cp='all_gather' only (ulysses and ring refused: test_qwen4_exp.py)
QWEN4_EXP = Table("Qwen4-Exp", "Qwen4ExpForCausalLM", tiny_qwen4_exp, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob("output_gate_type: sigmoid", dict(output_gate_type="sigmoid"), touches="linear"),
    Knob("indexer_compress_ratio 4, indexer_budget 8, indexer_n_heads 12, indexer_head_dim 4",
         dict(indexer_compress_ratio=4, indexer_budget=8, indexer_n_heads=12, indexer_head_dim=4), touches="attention"),
    Knob("layer_types: indexed, GDN, indexed, GDN",
         dict(layer_types=["indexed_attention", "linear_attention", "indexed_attention", "linear_attention"]),
         touches="layers"),
    Knob("hc_count 3, hc_lowrank 4", dict(hc_count=3, hc_lowrank=4), touches="norm"),
    Knob("attention_bias: True", dict(attention_bias=True), touches="attention"),
    Knob("ple_layer_ids [1, 3], ple_conv_kernel_size 3 (conv halo 6; ngram_vocab_size_base 64)",
         dict(ple_layer_ids=[1, 3], ple_conv_kernel_size=3, ngram_vocab_size_base=64), touches="embedding linear"),
    Knob("ple_layer_ids [2], ngram_size 2, heads_per_ngram 4, ple_embed_dim 16 (conv halo 3)",
         dict(ple_layer_ids=[2], ngram_vocab_size_base=40, ngram_size=2, heads_per_ngram=4, ple_embed_dim=16),
         touches="embedding linear"),
    Knob("attention_dropout: 0.1 (training)", dict(attention_dropout=0.1), touches="attention",
         refused="attention_dropout"),
), attention_methods=("all_gather",))

# the tiny GLM-5.3-Flash (`tiny_glm5_next`, Glm5NextForConditionalGeneration with a text-only config): 4
# hyper-connection streams; layers KDA, MLA with its indexer, MLA reusing that selection ("shared"), KDA; KDA 4 heads
# of 8, bounded gate; MLA 4 heads, NoPE, v 6; indexer 8 heads of 8, pools of 3, top 3 pools (sparse past 12 tokens,
# pools straddling the rank boundaries); MLPs dense, routed, dense, routed; full_attention_cp='all_gather' only. A
# padded row's transformers reference is its valid tokens alone (harness.transformers_reference, valid_runs)
GLM5_NEXT = Table("GLM-5.3-Flash", "Glm5NextForConditionalGeneration", tiny_glm5_next, (
    Knob("defaults (randomised biases, norm weights and routing bias)", touches="all"),
    Knob("linear_lower_bound: None (the softplus gate; the default -5 bounds g in every other row)",
         dict(linear_lower_bound=None), touches="linear"),
    Knob("linear_conv_kernel_dim: 1 (no conv halo)", dict(linear_conv_kernel_dim=1), touches="linear"),
    Knob("linear_num_heads 2, linear_head_dim 16", dict(linear_num_heads=2, linear_head_dim=16), touches="linear"),
    Knob("index_kpool 4, index_topk 8, index_n_heads 12, index_head_dim 16",
         dict(index_kpool=4, index_topk=8, index_n_heads=12, index_head_dim=16), touches="attention"),
    Knob("index_kpool 1, index_topk 5 (pools of one token, no tail)", dict(index_kpool=1, index_topk=5),
         touches="attention"),
    Knob("indexer_types: all full", dict(indexer_types=["full"] * 4), touches="attention"),
    Knob("layer_types: MLA, MLA (shared), KDA, MLA",
         dict(layer_types=["indexed_attention", "indexed_attention", "linear_attention", "indexed_attention"],
              indexer_types=["full", "shared", "full", "full"]), touches="layers"),
    Knob("q_lora_rank 8, kv_lora_rank 8, qk_nope_head_dim 12, v_head_dim 12, num_attention_heads 2, "
         "attention_bias True",
         dict(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=12, v_head_dim=12, num_attention_heads=2,
              num_key_value_heads=2, attention_bias=True), touches="attention"),
    Knob("hc_mult 2, hc_sinkhorn_iters 3, hc_eps 1e-3", dict(hc_mult=2, hc_sinkhorn_iters=3, hc_eps=1e-3),
         touches="norm"),
    Knob("mlp_layer_types all routed, n_group 2, swiglu_limit 0.05, norm_topk_prob False, n_shared_experts 2, "
         "routed_scaling_factor 1.7",
         dict(mlp_layer_types=["sparse"] * 4, n_group=2, swiglu_limit=0.05, norm_topk_prob=False,
              n_shared_experts=2, routed_scaling_factor=1.7), touches="moe mlp"),
    Knob("rms_norm_eps 1e-2, intermediate_size 48", dict(rms_norm_eps=1e-2, intermediate_size=48),
         touches="norm mlp linear"),
    Knob("tie_word_embeddings: True", dict(tie_word_embeddings=True), touches="head embedding"),
    Knob("hidden_act: gelu (the KDA conv's activation too)", dict(hidden_act="gelu"), touches="linear mlp",
         refused="hidden_act"),
    Knob("index_kpool_always_select_tail: False", dict(index_kpool_always_select_tail=False), touches="attention",
         refused="index_kpool_always_select_tail"),
    Knob("indexer_types: shared after a KDA layer",
         dict(layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
              indexer_types=["full", "full", "full", "shared"]), touches="attention", refused="indexer_types[3]"),
    Knob("attention_dropout: 0.1 (training)", dict(attention_dropout=0.1), touches="attention",
         refused="attention_dropout"),
    Knob("qk_rope_head_dim", ignored="transformers validates it to 0: the model has no positional encoding"),
    Knob("num_key_value_heads", ignored="transformers validates it equal to num_attention_heads (MLA expands its "
                                        "latent per head)"),
    Knob("max_position_embeddings, rope_parameters", ignored="GLM-5.3-Flash's text model has no rotary (NoPE)"),
), attention_methods=("all_gather",), valid_runs=True)

# the tiny MiniMax-Text-01 (`tiny_minimax`): layers lightning, attention, lightning, lightning; 8 heads of 8 in both
# mixers (attention over 2 KV heads, full RoPE); 4 experts top 2; transformers' lightning blocks of 16; residual
# factors away from 1. The lightning decays are fixed per layer and head (no parameters: nothing to keep)
MINIMAX = Table("MiniMax-Text-01", "MiniMaxForCausalLM", tiny_minimax, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob("num_attention_heads 4, num_key_value_heads 1, head_dim 16 (both mixers)",
         dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16), touches="linear attention"),
    Knob("hidden_act: gelu (the lightning q/k/v activation and the experts')", dict(hidden_act="gelu"),
         touches="linear moe"),
    Knob("block_size: 7 (transformers' partial lightning blocks)", dict(block_size=7), touches="linear"),
    Knob("layer_types: attention, lightning, lightning, attention (other slopes per layer)",
         dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
         touches="layers"),
) + _rope_rows(8)[1:2] + (
    Knob("full_attn / linear_attn / mlp alpha and beta factors: other values",
         dict(full_attn_alpha_factor=0.7, full_attn_beta_factor=1.4, linear_attn_alpha_factor=1.3,
              linear_attn_beta_factor=0.6, mlp_alpha_factor=1.2, mlp_beta_factor=0.7), touches="norm"),
    Knob("num_local_experts 8, num_experts_per_tok 1, intermediate_size 48",
         dict(num_local_experts=8, num_experts_per_tok=1, intermediate_size=48), touches="moe"),
    Knob("rms_norm_eps 1e-2, tie_word_embeddings", dict(rms_norm_eps=1e-2, tie_word_embeddings=True),
         touches="norm embedding head"),
    Knob("sliding_window: 16 (every attention layer; longer than a CP4 piece)", dict(sliding_window=16),
         touches="attention"),
    Knob("router_jitter_noise: 0.1 (training)", dict(router_jitter_noise=0.1), touches="moe",
         refused="router_jitter_noise"),
    Knob("attention_dropout: 0.1 (training)", dict(attention_dropout=0.1), touches="attention",
         refused="attention_dropout"),
    Knob("router_aux_loss_coef (a loss term with output_router_logits)",
         elsewhere="tests/distributed/test_model_families.py (MiniMaxForCausalLM's global aux loss)"),
    Knob("rms_norm_eps on the lightning attention's output norm",
         ignored="MiniMaxLightningAttention's norm keeps eps 1e-6 in transformers"),
))

# the tiny LaRA-mini (`tiny_lara_mini`): layers GDN, sliding attention (window 20, RoPE on the 8-dim heads), full
# attention (NoPE), sliding attention; attention 4 heads of 8 over 2 KV heads with per-head q/k norms; GDN 2 key heads
# for 4 value heads of 8; 4 experts top 2 with the ungated shared expert; tied embeddings. The window crosses rank
# boundaries everywhere and is longer than a piece at CP2 balanced (16 tokens) and CP4 (16 / 8): its K/V halo reaches
# back over several pieces
LARA_MINI = Table("LaRA-mini", "LaraMiniForCausalLM", tiny_lara_mini, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob("sliding_window: 5 (shorter than every piece)", dict(sliding_window=5), touches="attention"),
    Knob("sliding_window: 50 (longer than a CP2 slice; the long row's balanced pieces: 40)", dict(sliding_window=50),
         touches="attention"),
    Knob("sliding_window: 1 (a query sees itself only: no halo)", dict(sliding_window=1), touches="attention"),
    Knob("layer_types: sliding, GDN, full, sliding",
         dict(layer_types=["sliding_attention", "linear_attention", "full_attention", "sliding_attention"]),
         touches="layers"),
    Knob("num_attention_heads 8, num_key_value_heads 1, head_dim 4, attention_bias True",
         dict(num_attention_heads=8, num_key_value_heads=1, head_dim=4, attention_bias=True), touches="attention"),
) + _rope_rows(8)[1:2] + (
    Knob("rope_parameters: rope_theta 500", dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
         touches="rotary"),
    Knob("linear_conv_kernel_dim: 1 (no conv halo)", dict(linear_conv_kernel_dim=1), touches="linear"),
    Knob("linear_num_key_heads 1, linear_num_value_heads 4, linear_key_head_dim 4, linear_value_head_dim 12",
         dict(linear_num_key_heads=1, linear_num_value_heads=4, linear_key_head_dim=4, linear_value_head_dim=12),
         touches="linear"),
    Knob("hidden_act: swish (SiLU)", dict(hidden_act="swish"), touches="linear mlp moe"),
    Knob("num_experts 6, num_experts_per_tok 3, norm_topk_prob False, moe_intermediate_size 8, "
         "shared_expert_intermediate_size 12",
         dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, moe_intermediate_size=8,
              shared_expert_intermediate_size=12), touches="moe"),
    Knob("rms_norm_eps 1e-2, tie_word_embeddings False", dict(rms_norm_eps=1e-2, tie_word_embeddings=False),
         touches="norm embedding head linear"),
    Knob("hidden_act: gelu", dict(hidden_act="gelu"), touches="linear mlp",
         refused="computes the conv's activation as SiLU"),
    Knob("attention_dropout: 0.1 (training)", dict(attention_dropout=0.1), touches="attention",
         refused="attention_dropout"),
    Knob("intermediate_size, decoder_sparse_step, mlp_only_layers",
         ignored="LaraMiniConfig refuses them (AttributeError): every layer is MoE with a shared expert"),
))

# the tiny LFM2 (`tiny_lfm2`): layers conv, attention, conv, conv; gated short convs of kernel 3 over hidden 32 (the
# halo of 2 crosses every rank boundary; the packed row's documents of 1 and 3 tokens are shorter than the kernel);
# attention 4 heads of 8 over 2 KV heads with q/k layernorms, full RoPE; SwiGLU 48; untied head
LFM2_ATTENTION = (
    Knob("num_attention_heads 8, num_key_value_heads 1 (MQA; head_dim 4)",
         dict(num_attention_heads=8, num_key_value_heads=1), touches="attention"),
) + _rope_rows(8)[1:2] + (
    Knob("rope_parameters: rope_theta 500", dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
         touches="rotary"),
)
LFM2_CONV = (
    Knob("conv_bias: True (conv, in_proj and out_proj biases)", dict(conv_bias=True), touches="linear"),
    Knob("conv_L_cache: 7 (LFM3's kernel: a halo of 6)", dict(conv_L_cache=7), touches="linear"),
    Knob("conv_L_cache: 1 (no conv halo)", dict(conv_L_cache=1), touches="linear"),
)
LFM2 = Table("LFM2", "Lfm2ForCausalLM", tiny_lfm2, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
) + LFM2_CONV + LFM2_ATTENTION + (
    Knob("layer_types: attention, conv, conv, attention",
         dict(layer_types=["full_attention", "conv", "conv", "full_attention"]), touches="layers"),
    Knob("full_attn_idxs [0, 2] (layer_types None)", dict(layer_types=None, full_attn_idxs=[0, 2]),
         touches="layers"),
    Knob("block_auto_adjust_ff_dim with block_ffn_dim_multiplier 1.5, block_multiple_of 16; block_ff_dim 96",
         dict(block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.5, block_multiple_of=16, block_ff_dim=96),
         touches="mlp"),
    Knob("norm_eps 1e-2, tie_embedding (tied)", dict(norm_eps=1e-2, tie_embedding=True),
         touches="norm embedding head"),
    Knob("head_dim", ignored="Lfm2Config has no such field: head_dim is hidden_size / num_attention_heads"),
))

# the tiny LFM2-MoE (`tiny_lfm2_moe`): `tiny_lfm2`'s layers; layer 0 dense, layers 1-3 4 experts of 16, top 2, the
# sigmoid router's expert bias drawn by randomize_, renormalised, scaled 1.3
LFM2_MOE = Table("LFM2-MoE", "Lfm2MoeForCausalLM", tiny_lfm2_moe, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob("conv_bias: True, conv_L_cache 4", dict(conv_bias=True, conv_L_cache=4), touches="linear"),
    Knob("layer_types: attention, conv, attention, conv",
         dict(layer_types=["full_attention", "conv", "full_attention", "conv"]), touches="layers"),
    Knob("num_experts 6, num_experts_per_tok 3, moe_intermediate_size 8, num_dense_layers 2, intermediate_size 24",
         dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=8, num_dense_layers=2,
              intermediate_size=24), touches="moe mlp"),
    Knob("use_expert_bias False, norm_topk_prob False, routed_scaling_factor 1.0",
         dict(use_expert_bias=False, norm_topk_prob=False, routed_scaling_factor=1.0), touches="moe"),
    Knob("norm_eps 1e-2, tie_embedding (tied)", dict(norm_eps=1e-2, tie_embedding=True),
         touches="norm embedding head"),
) + LFM2_ATTENTION[:1] + (
    Knob("output_router_logits",
         ignored="Lfm2MoeForCausalLM adds no auxiliary loss: the router logits are only recorded"),
))

# the tiny LFM3 (`tiny_lfm3`): layers conv, sliding attention (window 20, default RoPE theta 1e4), full attention
# (proportional RoPE theta 1e6, half the frequencies 0), conv; gated short convs of kernel 7 (a halo of 6: the packed
# row's documents of 1 and 3 tokens are shorter); attention 4 heads of 8 over 2 KV heads, q/k norms, the g_proj gate;
# sandwich norms; SwiGLU 48; untied head. The window of 20 crosses every rank boundary and is longer than the balanced
# pieces at CP2 (16 tokens) and every piece at CP4 (16 / 8): its K/V halo reaches back over several pieces; 40 is
# longer than a CP2 slice (32)
LFM3_ROPE = {"sliding_attention": _rope("dynamic", 8),
             "full_attention": {"rope_type": "proportional", "rope_theta": 500.0, "partial_rotary_factor": 0.25}}
LFM3 = Table("LFM3", "Lfm3ForCausalLM", tiny_lfm3, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob("sliding_window: 40 (longer than a CP2 slice)", dict(sliding_window=40), touches="attention"),
    Knob("use_attention_gate False, use_sandwich_norm False", dict(use_attention_gate=False, use_sandwich_norm=False),
         touches="attention norm"),
    Knob("num_attention_heads 8, num_key_value_heads 1, head_dim 4, attention_bias True",
         dict(num_attention_heads=8, num_key_value_heads=1, head_dim=4, attention_bias=True), touches="attention"),
    Knob("conv_bias True (conv, in_proj and out_proj biases), conv_L_cache 3", dict(conv_bias=True, conv_L_cache=3),
         touches="linear"),
    Knob("layer_types None: the default pattern (5 layers: conv, conv, full, conv, sliding)",
         dict(layer_types=None, num_hidden_layers=5), touches="layers"),
    Knob("rope_parameters: sliding dynamic (max_position_embeddings 48); full proportional theta 500, "
         "partial_rotary_factor 0.25", dict(rope_parameters=LFM3_ROPE, max_position_embeddings=48), touches="rope"),
    Knob("norm_eps 1e-2, intermediate_size 24, tie_word_embeddings True",
         dict(norm_eps=1e-2, intermediate_size=24, tie_word_embeddings=True), touches="norm mlp embedding head"),
    Knob("attention_dropout: 0.1 (training)", dict(attention_dropout=0.1), touches="attention",
         refused="attention_dropout"),
    Knob("tie_embedding, block_ff_dim",
         ignored="Lfm3Config's __post_init__ skips LFM2's aliases: tie_word_embeddings and intermediate_size stay"),
))

# the tiny Zamba2: layers Mamba2, hybrid, Mamba2, hybrid, hybrid (2 shared blocks cycled: the first and last hybrid
# layers run the same tied block, each invocation its own LoRA adapters); Mamba2 8 heads of 8 in 2 groups, state 6,
# conv 4 with bias; attention 8 heads of 8 on concat(hidden, embeddings) (width 64), full RoPE (8 dims)
ZAMBA2 = Table("Zamba2", "Zamba2ForCausalLM", tiny_zamba2, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob(f"add_bias_linear: True ({BIAS_WINDOW}; the MLP's biases too)", dict(add_bias_linear=True),
         touches="linear padding mlp"),
    Knob("mamba_ngroups 1 (one B/C group for every head), mamba_d_conv 1 (no conv halo), time_step_min 0.5 (dt "
         "clamped below), mamba_expand 1, n_mamba_heads 4, mamba_d_state 4",
         dict(mamba_ngroups=1, mamba_d_conv=1, time_step_min=0.5, mamba_expand=1, n_mamba_heads=4, mamba_d_state=4),
         touches="linear"),
    Knob("num_mem_blocks 1 (one block for both hybrid layers), layers_block_type: hybrid, linear_attention, hybrid "
         "(a hybrid layer first)",
         dict(num_mem_blocks=1, num_hidden_layers=3, layers_block_type=["hybrid", "linear_attention", "hybrid"]),
         touches="attention mlp layers"),
    Knob("num_mem_blocks 3 (no block shared), use_shared_attention_adapter False, num_key_value_heads 2 (GQA), "
         "num_attention_heads 4 (head dim 16), use_mem_rope False (NoPE)",
         dict(num_mem_blocks=3, use_shared_attention_adapter=False, num_key_value_heads=2, num_attention_heads=4,
              use_mem_rope=False), touches="attention mlp"),
    Knob("use_shared_attention_adapter True with num_key_value_heads 2",
         dict(num_key_value_heads=2), refused="use_shared_attention_adapter"),
) + tuple(row for row in _rope_rows(8) if row.name.endswith(("dynamic", "yarn"))) + (
    Knob("hidden_act silu, intermediate_size 32, adapter_rank 2, rms_norm_eps 1e-2, tie_word_embeddings False",
         dict(hidden_act="silu", intermediate_size=32, adapter_rank=2, rms_norm_eps=1e-2, tie_word_embeddings=False),
         touches="mlp norm embedding head"),
    Knob("rope_parameters: linear, llama3, longrope", ignored="transformers' shared rotary code, the same under "
                                                              "CP as dynamic / yarn above (the other tables run them)"),
    Knob("use_conv_bias", ignored="Zamba2MambaMixer's conv has a bias whatever it says"),
    Knob("use_long_context", ignored="sets max_position_embeddings 16384 only (read by the position-dependent rope "
                                     "types, whose row sets it)"),
    Knob("chunk_size", ignored="the chunk length of transformers' torch scan: the same sums grouped otherwise"),
    Knob("use_mem_eff_path, use_mamba_kernels", ignored="not read by the forward (use_mamba_kernels: deprecated)"),
    Knob("time_step_max, time_step_floor, initializer_range", ignored="initialisation only"),
))

# the tiny Zamba: layers Mamba1, hybrid, Mamba1, hybrid (both hybrid layers run the ONE shared block, tied with the
# embeddings under tie_word_embeddings, the default); Mamba1 I = 32 in
# 2 heads of 16 (x / z interleaved), state 4, dt rank 3, conv 4 with bias, in_proj / out_proj with bias; attention on
# concat(hidden, embeddings) 4 heads of 8 over 2 KV heads, NoPE; gelu MLP 24. Ulysses splits the Mamba heads (CP2;
# CP4 needs n_mamba_heads 4, else refused and run through p2p)
ZAMBA = Table("Zamba", "ZambaForCausalLM", tiny_zamba, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob("mamba_conv_bias False, mamba_d_conv 1 (no conv halo), n_mamba_heads 1 (one scan over every channel)",
         dict(mamba_conv_bias=False, mamba_d_conv=1, n_mamba_heads=1), touches="linear"),
    Knob(f"mamba_proj_bias False (in_proj / out_proj; True in the tiny model: {BIAS_WINDOW}), n_mamba_heads 4, "
         "mamba_d_state 8, mamba_expand 1 (heads of 4), mamba_dt_rank auto (1)",
         dict(mamba_proj_bias=False, n_mamba_heads=4, mamba_d_state=8, mamba_expand=1, mamba_dt_rank="auto"),
         touches="linear padding"),
    Knob("layers_block_type: hybrid, linear_attention, hybrid (a hybrid layer first)",
         dict(num_hidden_layers=3, layers_block_type=["hybrid", "linear_attention", "hybrid"]), touches="layers"),
    Knob("attn_layer_period 2, attn_layer_offset 1 (layers_block_type unset: Mamba1, Mamba1, hybrid, Mamba1, "
         "hybrid), num_attention_heads 8, num_key_value_heads 1 (MQA), attention_head_dim 6",
         dict(num_hidden_layers=5, layers_block_type=None, attn_layer_period=2, attn_layer_offset=1,
              num_attention_heads=8, num_key_value_heads=1, attention_head_dim=6), touches="layers attention"),
    Knob("hidden_act silu, intermediate_size 20, rms_norm_eps 1e-1, tie_word_embeddings False (transformers then "
         "ties nothing: the shared block's instances are independent blocks, each its own parameters)",
         dict(hidden_act="silu", intermediate_size=20, rms_norm_eps=1e-1, tie_word_embeddings=False),
         touches="mlp norm embedding head"),
    Knob("hidden_mamba_act: gelu (the conv's activation)", dict(hidden_mamba_act="gelu"), touches="linear",
         refused="computes the conv's activation as SiLU"),
    Knob("attention_dropout: 0.1 (training)", dict(attention_dropout=0.1), touches="attention",
         refused="attention_dropout"),
    Knob("attention_hidden_size", ignored="must be 2 x hidden_size: the shared block reads concat(hidden, "
                                          "embeddings) (another value fails in transformers)"),
    Knob("use_associative_scan", ignored="another torch scan of the same recurrence, under torch.compile only"),
    Knob("use_mamba_kernels", ignored="deprecated: no effect in transformers 5.25"),
    Knob("max_position_embeddings, num_logits_to_keep", ignored="NoPE: no position is read; generation only"),
    Knob("time_step_min, time_step_max, time_step_floor, initializer_range", ignored="initialisation only"),
))

# the tiny RecurrentGemma (`tiny_recurrent_gemma`): layers recurrent, recurrent, attention; RG-LRU width 32 in 4 gate
# blocks of 8 (transformers' init: slow decays), conv 4 with bias (a halo of 3: the packed row's documents of 1 and 3
# tokens are shorter); attention 4 heads of 8 over 1 KV head, partial RoPE 0.5, window 20 (crosses every rank boundary,
# longer than the balanced pieces at CP2); MLP 24 with biases; logits soft-capped at 2; tied head. The padded row's
# reference is its valid tokens alone (`valid_runs`: transformers' recurrent block reads padding)
RECURRENT_GEMMA = Table("RecurrentGemma", "RecurrentGemmaForCausalLM", tiny_recurrent_gemma, (
    Knob("defaults (randomised biases and norm weights)", touches="all"),
    Knob("lru_width 48 (gate blocks of 12), conv1d_width 2 (a halo of 1), hidden_activation gelu (the block's y "
         "branch and the MLP), block_types: recurrent (no attention layer)",
         dict(lru_width=48, conv1d_width=2, hidden_activation="gelu", block_types=("recurrent",)),
         touches="linear mlp layers"),
    Knob("num_attention_heads 8, num_key_value_heads 2 (head dim 4; RG-LRU blocks of 4), attention_bias True, "
         "rope_parameters: rope_theta 500, partial_rotary_factor 0.25",
         dict(num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
              rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}),
         touches="attention linear rotary"),
    Knob("block_types: attention, recurrent (4 layers), attention_window_size 40 (longer than a CP2 slice)",
         dict(block_types=("attention", "recurrent"), num_hidden_layers=4, attention_window_size=40),
         touches="layers attention"),
    Knob("logits_soft_cap 0.5, rms_norm_eps 1e-2, intermediate_size 40, tie_word_embeddings False",
         dict(logits_soft_cap=0.5, rms_norm_eps=1e-2, intermediate_size=40, tie_word_embeddings=False),
         touches="head norm mlp embedding"),
    Knob("attention_dropout: 0.1 (training)", dict(attention_dropout=0.1), touches="attention",
         refused="attention_dropout"),
    Knob("rope_parameters: other rope types", ignored="RecurrentGemmaRotaryEmbedding raises for any type but "
                                                      "'default'"),
    Knob("head_dim", ignored="RecurrentGemmaConfig sets it to hidden_size / num_attention_heads"),
    Knob("w_init_variance_scale, final_w_init_variance_scale", ignored="initialisation only"),
), valid_runs=True)

TABLES = {t.family: t for t in (QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT, OLMO_HYBRID, BAMBA, GRANITE_HYBRID, NEMOTRON_H,
                                 FALCON_H1, KIMI_LINEAR, BAILING_HYBRID, QWEN4_EXP, GLM5_NEXT, MINIMAX,
                                 LARA_MINI, LFM2, LFM2_MOE, LFM3, MAMBA2, MAMBA, FALCON_MAMBA, JAMBA,
                                 ZAMBA2, ZAMBA, RECURRENT_GEMMA)}
DECAYS = {"Qwen3.5": GDN_DECAYS, "Qwen3.5-MoE": GDN_DECAYS, "Qwen3-Next": GDN_DECAYS, "OLMo-Hybrid": GDN_DECAYS,
          "Bamba": SSD_DECAYS, "Granite-4.0-H": SSD_DECAYS, "Nemotron-H": SSD_DECAYS, "Falcon-H1": SSD_DECAYS,
          "Kimi-Linear": KDA_DECAYS, "Bailing-Hybrid": KDA_DECAYS, "Qwen4-Exp": GDN_DECAYS,
          "GLM-5.3-Flash": KDA_DECAYS, "MiniMax-Text-01": (), "LaRA-mini": GDN_DECAYS,
          "LFM2": (), "LFM2-MoE": (), "LFM3": (), "Mamba2": SSD_DECAYS, "Mamba": MAMBA_DECAYS,
          "FalconMamba": MAMBA_DECAYS, "Jamba": MAMBA_DECAYS,
          "Zamba2": SSD_DECAYS, "Zamba": ("A_log", "dt_proj_bias"),
          "RecurrentGemma": ("recurrent_param",)}


def readme_section() -> str:
    """README's section "Config knobs covered", from the tables (`python tests/conformance/tables.py` prints it;
    test_tables.py checks that the README holds it)."""
    lines = ["### Config knobs covered: the conformance tables", "",
             "Each family's table (`tests/conformance/tables.py`, run by `tests/conformance/test_conformance.py`) "
             "holds every config",
             "field of its transformers classes that changes the forward pass, read from transformers 5.25's code, "
             "each set to a",
             "value that exercises it on a tiny model whose biases, norm weights and routing biases are drawn away "
             "from",
             "transformers' init; each row runs a padded batch (one row right-, one left-padded), a packed row and a "
             "long row at",
             "CP2 in every linear mode and full-attention method (the defaults row in both sequence layouts, a row "
             "changing a",
             "sequence part in one, the layouts by turns; a token-wise row in one of the six runs, on an input "
             "transformers",
             "runs too), and in turn at CP4, against",
             "the single device (1e-8, float64), and the single device against the unmodified transformers model "
             "(float32-level).",
             "Besides the defaults (randomised) row, the rows are:", ""]
    for family, table in TABLES.items():
        run = [k.name for k in table.knobs if k.runs and k.refused is None and not k.name.startswith("defaults")]
        line = f"- **{family}** (`{table.model_class}`): " + "; ".join(run)
        for label, names in (("Refused (checked as a refusal)", [k.name for k in table.knobs if k.refused]),
                             ("Checked elsewhere", [k.name for k in table.knobs if k.elsewhere]),
                             ("Ignored by transformers' forward", [k.name for k in table.knobs if k.ignored])):
            if names:
                line += f". {label}: " + "; ".join(names)
        lines.append(line + ".")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(readme_section(), end="")
