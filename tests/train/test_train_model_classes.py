"""The trainer picks any supported class from YAML (train.model.model_class): each trains at CP2 (p2p, FSDP2,
float32, packed rows) with the single-device losses and grad norms, 2 steps (AdamW's first and one with its moments),
and one family per mechanism also at dp2 x cp2 (4 ranks, the same global batch: `DP_CP`); bad class settings name
the key.
Every family: Qwen3.5 (dense: the main config), its MoE and multimodal classes, Qwen3-Next, OLMo-Hybrid, and the
Mamba2 families (eager: the main config's backend on the CPU): Bamba, Granite-4.0-H (routed experts with the aux loss,
muP multipliers), Nemotron-H (MLP / MoE blocks), Falcon-H1 (parallel mixers, multipliers); Kimi-Linear and
Bailing-Hybrid (KDA and MLA, routed experts; eager); Mamba2 (Mamba2 blocks only); Zamba2 (Mamba2 layers, shared
attention blocks with adapters); Mamba (Mamba1 blocks only; FalconMamba is the same class layout with weightless
dt / B / C norms, in the conformance and parity grids); Jamba (Mamba1 with its dt / B / C norms, a NoPE GQA layer,
routed experts); Zamba (Mamba1 heads, one shared attention block);
Qwen4-Exp (indexed attention with full_attention_cp=all_gather, a PLE layer, hyper-connections); GLM-5.3-Flash
(its conditional class with a text-only batch: KDA, MLA with the pooled indexer and a "shared" layer,
hyper-connections); MiniMax-Text-01 (lightning attention and GQA, routed experts); LaRA-mini
(GDN, sliding-window and NoPE full attention, MoE with an ungated shared expert); LFM2 and LFM3 (gated short convs;
LFM3's sliding-window and gated full attention); RecurrentGemma (the RG-LRU, local MQA, soft-capped logits)."""

from pathlib import Path

import pytest

from deltacp.train.config import ConfigError, config_from_dict, config_to_dict, load_config
from deltacp.train.parity import compare, cp_configs, reference_config, run_jobs

MAIN = Path(__file__).resolve().parents[2] / "configs" / "tiny_cp4.yaml"
STEPS = 2
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
           output_router_logits=True)
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64, patch_size=2,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
MLA = dict(num_key_value_heads=8, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
           num_experts=4, num_experts_per_token=2, moe_intermediate_size=32, num_expert_group=2, topk_group=1,
           mlp_layer_types=["dense", "sparse", "dense", "sparse"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
NOT_MLA = ["head_dim", "max_position_embeddings"]  # set from qk_rope_head_dim; aliased to model_max_length
GDN_FIELDS = ["linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim"]
CLASSES = {  # class -> (text config fields added to the main config's, removed ones, vision_config)
    "Qwen3_5MoeForCausalLM": (MOE, ["intermediate_size"], {}),
    "Qwen3NextForCausalLM": (dict(MOE, decoder_sparse_step=1), [], {}),
    "Qwen3_5ForConditionalGeneration": ({}, [], VISION),
    "Qwen3_5MoeForConditionalGeneration": (MOE, ["intermediate_size"], VISION),
    # K != V (neither a power of two), beta = 2 sigmoid(b), a post-norm attention layer, NoPE
    "OlmoHybridForCausalLM": (dict(linear_key_head_dim=12, linear_value_head_dim=24, linear_allow_neg_eigval=True,
                                   pad_token_id=0, eos_token_id=1, rope_parameters=None,
                                   layer_types=["linear_attention", "full_attention", "linear_attention",
                                                "linear_attention"]), ["head_dim"], {}),
    # Mamba2 (eager: the trainer's backend below is the main config's, eager on the CPU)
    "BambaForCausalLM": (dict(attn_layer_indices=[3], mamba_n_heads=8, mamba_d_head=16, mamba_expand=2,
                              mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=64),
                         GDN_FIELDS + ["layer_types", "head_dim"], {}),
    "GraniteMoeHybridForCausalLM": (dict(layer_types=["linear_attention", "linear_attention", "linear_attention",
                                                      "full_attention"], mamba_n_heads=8, mamba_d_head=16,
                                         mamba_expand=2, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                                         mamba_chunk_size=64, num_local_experts=4, num_experts_per_tok=2,
                                         shared_intermediate_size=64, position_embedding_type="rope",
                                         residual_multiplier=0.7, logits_scaling=1.5, output_router_logits=True),
                                    GDN_FIELDS + ["head_dim"], {}),
    "NemotronHForCausalLM": (dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                                  mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, conv_kernel=4,
                                  chunk_size=64, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1),
                             GDN_FIELDS + ["layer_types", "num_hidden_layers"], {}),
    "FalconH1ForCausalLM": (dict(mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
                                 mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=64, mamba_rms_norm=True,
                                 key_multiplier=0.7, lm_head_multiplier=0.8, ssm_in_multiplier=0.9),
                            GDN_FIELDS + ["layer_types", "head_dim"], {}),
    # Mamba2 blocks only: no attention, no MLP
    "Mamba2ForCausalLM": (dict(num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=16, conv_kernel=4,
                               chunk_size=64, pad_token_id=0),
                          GDN_FIELDS + ["layer_types", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "max_position_embeddings"], {}),
    # Mamba2 layers and hybrid layers running 2 shared attention blocks (tied, cycled: the first and third hybrid
    # layers share one) with per-invocation LoRA adapters and RoPE
    "Zamba2ForCausalLM": (dict(layers_block_type=["linear_attention", "hybrid", "hybrid", "hybrid"], n_mamba_heads=8,
                               mamba_ngroups=2, mamba_d_state=16, chunk_size=64, num_key_value_heads=8,
                               num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
                               pad_token_id=0), GDN_FIELDS + ["layer_types", "head_dim"], {}),
    # Mamba1 layers of 2 heads (x / z interleaved) and hybrid layers running the one shared NoPE attention block
    "ZambaForCausalLM": (dict(layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
                              n_mamba_heads=2, mamba_d_state=16, mamba_dt_rank=8, pad_token_id=0,
                              tie_word_embeddings=True),  # transformers ties the shared block only under it
                         GDN_FIELDS + ["layer_types", "head_dim"], {}),
    # Mamba1 blocks only (the selective scan: one head of I x N state rows, p2p)
    "MambaForCausalLM": (dict(state_size=16, expand=2, conv_kernel=4, time_step_rank=8, pad_token_id=0),
                         GDN_FIELDS + ["layer_types", "intermediate_size", "num_attention_heads",
                                       "num_key_value_heads", "max_position_embeddings", "head_dim"], {}),
    # Mamba1 layers with the dt / B / C norms, a NoPE GQA layer (attn_layer_period 4, offset 3), routed experts on
    # the odd layers (top 2 of 4, not renormalised, the aux loss)
    "JambaForCausalLM": (dict(attn_layer_period=4, attn_layer_offset=3, expert_layer_period=2, expert_layer_offset=1,
                              num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                              mamba_dt_rank=8, output_router_logits=True, pad_token_id=0),
                         GDN_FIELDS + ["layer_types", "head_dim"], {}),
    # KDA + MLA (v_head_dim != qk head dim), routed and shared experts; Bailing: the safe gate, RoPE, output gate
    "KimiLinearForCausalLM": (dict(MLA, linear_num_heads=8, linear_head_dim=16), GDN_FIELDS + NOT_MLA, {}),
    "BailingHybridForCausalLM": (dict(MLA, head_dim=16, q_lora_rank=24), GDN_FIELDS + NOT_MLA[1:], {}),
    # GDN, the indexed attention (QSA: blocks of 4, budget 24 of the 128 tokens), 2 hyper-connection streams, a PLE
    # layer (n-grams of orders 2 and 3, EOS = byte 10, the newline), routed experts
    "Qwen4ExpForCausalLM": (dict(MOE, hc_count=2, hc_lowrank=8, indexer_n_heads=8, indexer_kv_heads=1,
                                 indexer_head_dim=16, indexer_budget=24, indexer_compress_ratio=4, eos_token_id=10,
                                 layer_types=["linear_attention"] * 3 + ["indexed_attention"], ple_layer_ids=[2],
                                 ngram_vocab_size_base=64), ["intermediate_size"], {}),
    # KDA (bounded gate) + MLA with the pooled indexer (pools of 4, top 8 of the 32 pools of a 128-token row) and a
    # "shared" indexer layer reusing its selection, 2 hyper-connection streams, routed experts; text only (the
    # conditional class: a tiny vision tower, unused)
    "Glm5NextForConditionalGeneration": (
        dict(MOE, n_routed_experts=4, n_group=1, topk_group=1, num_key_value_heads=8, linear_num_heads=4,
             linear_head_dim=16, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=0,
             v_head_dim=16, index_n_heads=8, index_head_dim=16, index_kpool=4, index_topk=32, hc_mult=2,
             layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
             indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "dense", "sparse"],
             pad_token_id=0), GDN_FIELDS + ["head_dim", "num_experts", "shared_expert_intermediate_size"],
        dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=64,
             projection_intermediate_size=16, patch_size=2, temporal_patch_size=2, spatial_merge_size=2)),
    # lightning attention (fixed per-layer slopes, no conv) and GQA, the normed-input residual with its factors,
    # routed experts with the aux loss; transformers' lightning blocks of 32 (four in a 128-token row)
    "MiniMaxForCausalLM": (dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, block_size=32,
                                layer_types=["linear_attention", "full_attention", "linear_attention",
                                             "linear_attention"], linear_attn_alpha_factor=1.5,
                                full_attn_alpha_factor=1.5, mlp_alpha_factor=1.5), GDN_FIELDS, {}),
    # GDN, sliding-window attention (window 48: crosses the CP2 boundary of a 128-token row) and NoPE full attention,
    # routed experts with the ungated shared expert, tied embeddings
    "LaraMiniForCausalLM": (dict(MOE, sliding_window=48, eos_token_id=1,
                                 layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                              "full_attention"]), ["intermediate_size", "tie_word_embeddings"], {}),
    # gated short convs (kernel 3: a halo of 2) and GQA with q/k layernorms
    "Lfm2ForCausalLM": (dict(layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3, pad_token_id=0),
                        GDN_FIELDS + ["head_dim"], {}),
    # LFM3: kernel-7 convs, a sliding layer (window 48: crosses the CP2 boundary of a 128-token row) and a gated full
    # layer with proportional RoPE, sandwich norms
    "Lfm3ForCausalLM": (dict(layer_types=["conv", "sliding_attention", "full_attention", "conv"], sliding_window=48,
                             pad_token_id=0), GDN_FIELDS, {}),
    # RG-LRU (8 gate blocks of 8), conv 4 with bias, MQA local attention (window 48: crosses the CP2 boundary of a
    # 128-token row), partial RoPE, logits soft-capped at 30 (in the fused loss's kernels)
    "RecurrentGemmaForCausalLM": (dict(block_types=["recurrent", "recurrent", "attention"], num_hidden_layers=3,
                                       num_key_value_heads=1, lru_width=64, attention_window_size=48,
                                       pad_token_id=0), GDN_FIELDS + ["layer_types", "head_dim",
                                                                      "max_position_embeddings"], {}),
}
ACCELERATOR = {name: ["train.accelerator.full_attention_cp=all_gather"]  # their indexed layers' method
               for name in ("Qwen4ExpForCausalLM", "Glm5NextForConditionalGeneration")}

# at dp2 x cp2, one family per mechanism the dp groups meet (the others train at CP2 above; dp x cp itself is
# tests/train/test_dp_cp.py's): GDN with K != V; the Mamba2 mixer with the global aux loss and muP; KDA + MLA with
# experts; indexed attention with PLE and hyper-connections; the conditional class, the pooled indexer and a shared
# layer; tied shared blocks with adapters; sliding windows; the RG-LRU's global-position resets; Mamba1 with experts;
# Mamba1 heads and a tied block
DP_CP = ("OlmoHybridForCausalLM", "GraniteMoeHybridForCausalLM", "KimiLinearForCausalLM", "Qwen4ExpForCausalLM",
         "Glm5NextForConditionalGeneration", "Zamba2ForCausalLM", "LaraMiniForCausalLM", "RecurrentGemmaForCausalLM",
         "JambaForCausalLM", "ZambaForCausalLM")


def _cfg(name):
    raw = config_to_dict(load_config(MAIN, ["train.data.seq_len=128", "train.data.batch_size=2",
                                            "train.logging.progress=none", f"train.steps={STEPS}"]
                                     + ACCELERATOR.get(name, [])))
    added, removed, vision = CLASSES[name]
    model = raw["train"]["model"]
    model["config"] = {k: v for k, v in {**model["config"], **added}.items() if k not in removed}
    model.update(model_class=name, vision_config=vision)
    return config_from_dict(raw)


def test_every_model_class_trains_at_cp2(tmp_path):
    import json

    from helpers import single_device_jobs, started_in_process

    jobs = {name: _cfg(name) for name in CLASSES}
    cp_jobs = [(name, cp_configs(cfg, 2, STEPS, ["p2p"])[0][1]) for name, cfg in jobs.items()]
    path = tmp_path / "single.json"
    # the single-device jobs beside the CP2 ranks (which leave cores idle while they wait for each other)
    with started_in_process(single_device_jobs, str(path), [(name, reference_config(cfg, STEPS))
                                                         for name, cfg in jobs.items()]):
        rows = run_jobs(2, cp_jobs)
    reference = json.loads(path.read_text())
    dp_jobs = [(name, cp_configs(jobs[name], 4, STEPS, ["p2p"], cp=2)[0][1]) for name in DP_CP]
    dp_rows = run_jobs(4, dp_jobs)
    for label, got in (("cp2", rows), ("dp2xcp2", dp_rows)):
        for name in got:
            comp = compare(reference[name], got[name])
            assert comp["finite"], (label, name)
            assert comp["max_loss_rel"] < 1e-5 and comp["max_grad_norm_rel"] < 1e-4, (label, name, comp)


@pytest.mark.parametrize("overrides, pattern", [
    (["train.model.model_class=Qwen3_5ForTokenClassification"], r"train\.model\.model_class"),
    (["train.model.model_class=Qwen3_5MoeForCausalLM"],
     r"^train\.model\.config\.intermediate_size: unknown Qwen3_5MoeTextConfig field"),
    (["train.model.vision_config={depth: 1}"], r"^train\.model\.vision_config is for the multimodal classes"),
    (["train.model.model_class=Qwen3_5ForConditionalGeneration", "train.model.vision_config={dept: 1}"],
     r"^train\.model\.vision_config\.dept: unknown Qwen3_5VisionConfig field"),
])
def test_model_class_errors_name_the_key(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(MAIN, overrides)


@pytest.mark.fast
def test_default_vision_tower_is_said():
    """A multimodal class built from fields without train.model.vision_config gets transformers' default vision
    tower, which text batches never run: the trainer warns (rank 0), naming the setting and the tower's size; not with
    vision_config given, nor for a text class."""
    from deltacp.train.trainer import build_model, default_vision_tower_note

    cls = "train.model.model_class=Qwen3_5ForConditionalGeneration"
    tiny = _cfg("Qwen3_5ForConditionalGeneration")  # VISION: a one-layer tower
    model = build_model(tiny, 1)  # any vocabulary fits
    n = sum(p.numel() for name, p in model.named_parameters() if ".visual." in f".{name}")
    assert n > 0
    note = default_vision_tower_note(load_config(MAIN, [cls]), model)
    assert note is not None and "train.model.vision_config is empty" in note and f"{n:,} parameters" in note \
        and "Qwen3_5VisionConfig" in note, note
    assert default_vision_tower_note(tiny, model) is None
    assert default_vision_tower_note(load_config(MAIN, []), model) is None
