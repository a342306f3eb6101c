"""The GRPO runs the integration tests compare: one case = a GRPOConfig, CP keywords, and the world it runs at.

`run_case(name, out_dir, model_dir, cp_size=None)` trains STEPS optimizer steps with TRL's GRPOTrainer (cp_size None:
the reference, at this process's world) or deltacp's CPGRPOTrainer, on the tiny Qwen3.5 saved in `model_dir`
(`save_tiny_model`), and returns every logged step (loss, grad norm, kl, clip ratios, entropy, rewards, completion
lengths, ...) and the saved weights' directory. Both trainers see the same completions: `fixed_completions`, a
`rollout_func` (TRL's own hook) that derives each completion from its prompt, the row's place in the global
generation batch (`accelerator.process_index` x the rows a process scores: the same place for a plain process and
for a CP rank's share), the step and the mode, so no random stream of either trainer is involved.
"""

from __future__ import annotations

import hashlib
import os
import random

import torch

from helpers import float64_upcasts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16

STEPS = 3
VOCAB = 264  # the byte tokenizer's 258 ids, rounded up
MAX_COMPLETION = 8
SKIPPED_KEYS = ("step_time", "learning_rate", "epoch", "step")  # timing, and what both set alike

# name -> (GRPOConfig fields, CPGRPOTrainer keywords); the plain trainer ignores the second
CASES = {
    # CP2 against one process
    "grpo": (dict(loss_type="grpo", beta=0.1, importance_sampling_level="token", gradient_accumulation_steps=2,
                  steps_per_generation=4, top_entropy_quantile=0.8),
             dict(linear_attention_cp_mode="p2p", sequence_layout="contiguous", padding_free=True)),
    "bnpo": (dict(loss_type="bnpo", beta=0.0, importance_sampling_level="sequence", gradient_accumulation_steps=1,
                  steps_per_generation=2, entropy_coef=0.05),
             dict(linear_attention_cp_mode="ulysses", sequence_layout="balanced", padding_free=False, fsdp=False)),
    # dp2 x cp2 against TRL at dp 2 (two processes)
    "dr_grpo": (dict(loss_type="dr_grpo", beta=0.05, importance_sampling_level="sequence",
                     gradient_accumulation_steps=2, steps_per_generation=2, num_iterations=2,
                     mask_truncated_completions=True, sync_ref_model=True, ref_model_sync_steps=2,
                     ref_model_mixup_alpha=0.5),
                dict(linear_attention_cp_mode="all_gather", sequence_layout="contiguous", padding_free=True)),
    "dapo": (dict(loss_type="dapo", beta=0.1, importance_sampling_level="token", gradient_accumulation_steps=2,
                  steps_per_generation=4),
             dict(linear_attention_cp_mode="p2p", sequence_layout="balanced", padding_free=False)),
}
SAVED = ("dapo",)  # the cases whose final weights are compared
# Falcon-H1 (Mamba2 and attention in parallel in every layer, its muP multipliers, its lm_head_multiplier reaching the
# fused log-probabilities through the hidden states): the "grpo" case on that model
CASES["grpo-falcon_h1"] = (CASES["grpo"][0], dict(CASES["grpo"][1], sequence_layout="balanced"))
# Qwen4-Exp (GDN, indexed attention (all_gather), hyper-connections, a PLE layer, routed experts with the aux loss
# coefficient 0, eager experts; the indexer's budget 6: the top 2 blocks of 3, so GRPO's rows of up to 12 tokens are
# sparse): the "bnpo" case on that model (padded rows)
CASES["bnpo-qwen4_exp"] = (CASES["bnpo"][0], dict(CASES["bnpo"][1], full_attention_cp="all_gather"))
# GLM-5.3-Flash (KDA, MLA with the pooled indexer (all_gather) and a "shared" layer, hyper-connections, routed experts
# with the aux loss coefficient 0; pools of 3, the top one chosen, so GRPO's rows of up to 12 tokens are sparse): "bnpo"
CASES["bnpo-glm5_next"] = (CASES["bnpo"][0], dict(CASES["bnpo"][1], full_attention_cp="all_gather"))
MODEL_DIRS = {"grpo-falcon_h1": "model-falcon_h1", "bnpo-qwen4_exp": "model-qwen4_exp",
              "bnpo-glm5_next": "model-glm5_next"}  # the other cases train the
# tiny Qwen3.5 of `model`


def save_tiny_model(path: str, family: str = "qwen3_5") -> None:
    """A tiny float32 model (Qwen3.5: 3 GDN + 1 full attention layers; "falcon_h1": `tiny_falcon_h1`; "qwen4_exp":
    `tiny_qwen4_exp` with a PLE layer; "glm5_next": `tiny_glm5_next`, one pool of 3 chosen), seeded, and the
    byte tokenizer, saved for every run (TRL builds the reference model from the policy's directory)."""
    from transformers import Qwen3_5ForCausalLM

    from deltacp.testing.hf import byte_tokenizer
    from helpers import long_memory_gates_, tiny_config, tiny_falcon_h1

    tok = byte_tokenizer()
    torch.manual_seed(0)
    if family == "falcon_h1":
        model = tiny_falcon_h1(torch.float32, vocab_size=VOCAB, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
    elif family == "glm5_next":  # Glm5NextForConditionalGeneration (no causal LM class): TRL's loader takes the
        # config's architectures[0]
        from helpers import tiny_glm5_next

        model = tiny_glm5_next(torch.float32, vocab_size=VOCAB, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, router_aux_loss_coef=0.0, index_topk=3)
    elif family == "qwen4_exp":
        from helpers import tiny_qwen4_exp

        model = tiny_qwen4_exp(torch.float32, vocab_size=VOCAB, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, ple_layer_ids=[2], ngram_vocab_size_base=64,
                               ple_conv_kernel_size=3, router_aux_loss_coef=0.0, indexer_budget=6)
    else:
        config = tiny_config(vocab_size=VOCAB, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        model = long_memory_gates_(Qwen3_5ForCausalLM(config))
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)


def prompts(n: int) -> list[str]:
    return [f"{a}+{b}=" for a in range(10) for b in range(10)][:n]


def fixed_completions(prompts: list[str], trainer) -> dict:
    """TRL's rollout_func contract: prompt ids, completion ids (1 to MAX_COMPLETION tokens, half of them ending in
    the end-of-text token, the others truncated), no sampling log-probabilities."""
    tok = trainer.processing_class
    first = trainer.accelerator.process_index * len(prompts)
    mode = "train" if trainer.model.training else "eval"
    completions = []
    for i, prompt in enumerate(prompts):
        key = f"{prompt}|{first + i}|{trainer.state.global_step}|{mode}".encode()
        rng = random.Random(int(hashlib.sha256(key).hexdigest()[:12], 16))
        ids = [rng.choice(b"0123456789") if rng.random() < 0.5 else rng.randrange(256)
               for _ in range(rng.randint(1, MAX_COMPLETION))]
        if rng.random() < 0.5:
            ids[-1] = tok.eos_token_id
        completions.append(ids)
    return dict(prompt_ids=[tok(p)["input_ids"] for p in prompts], completion_ids=completions, logprobs=None)


def digits_reward(completion_ids, **kwargs) -> list[float]:
    """The fraction of digits in a completion, plus 0.5 for ending in the end-of-text token (256)."""
    return [sum(48 <= t < 58 for t in ids) / len(ids) + 0.5 * (ids[-1] == 256) for ids in completion_ids]


def build(case: str, out_dir: str, model_dir: str, *, cp_size: int | None, dtype=torch.float32, cls=None,
          config_extra: dict | None = None, **kwargs):
    """The trainer of `case` (TRL's when cp_size is None). `cls` replaces the trainer class, `config_extra` adds
    GRPOConfig fields, other keywords go to the trainer."""
    from datasets import Dataset
    import transformers
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    fields, cp_kwargs = CASES[case]
    config = dict(output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=MAX_COMPLETION, learning_rate=1e-2, epsilon=0.05, warmup_steps=0,
                  logging_steps=1, save_strategy="no", report_to=[], seed=7, use_cpu=True, bf16=False,
                  dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=1.0, per_device_eval_batch_size=4)
    config.update(fields)
    config.update(config_extra or {})
    # Qwen4-Exp's and GLM's routed experts run eager (grouped_mm has no float64 kernel); GLM's attention eager (sdpa
    # gives NaN at padded queries, which select nothing)
    extra = {}
    if model_dir.endswith((MODEL_DIRS["bnpo-qwen4_exp"], MODEL_DIRS["bnpo-glm5_next"])):
        extra["experts_implementation"] = "eager"
    if model_dir.endswith(MODEL_DIRS["bnpo-glm5_next"]):
        extra["attn_implementation"] = "eager"
    # the saved config's architecture, as TRL's own loader takes it (GLM-5.3-Flash has no causal-LM class)
    architecture = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True).architectures[0]
    model = getattr(transformers, architecture).from_pretrained(model_dir, dtype=dtype, local_files_only=True, **extra)
    if model_dir.endswith(MODEL_DIRS["bnpo-glm5_next"]):  # its KDA conv is kept in float32 by from_pretrained, which
        model = model.to(dtype)  # transformers' own conv then refuses beside float64 inputs
    kwargs.update(model=model, reward_funcs=digits_reward, args=GRPOConfig(**config),
                  train_dataset=Dataset.from_dict({"prompt": prompts(48)}),
                  processing_class=AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    kwargs.setdefault("rollout_func", fixed_completions)
    if cp_size is None:
        return (cls or GRPOTrainer)(**kwargs)
    from deltacp.integrations import CPGRPOTrainer

    return (cls or CPGRPOTrainer)(**kwargs, cp_size=cp_size, **cp_kwargs)


def run_case(case: str, out_dir: str, model_dir: str, *, cp_size: int | None = None, save: bool = False,
             evaluate: bool = False, **kwargs) -> dict:
    """Train STEPS steps in float64 (transformers' and TRL's float32 upcasts widened alike for the reference and for
    CP: `float64_upcasts`); every logged step's numbers; with `save`, the saved model's directory; with `evaluate`,
    the evaluation's metrics on a small prompt set."""
    if evaluate:
        from datasets import Dataset

        kwargs["eval_dataset"] = Dataset.from_dict({"prompt": prompts(100)[60:68]})
    import trl.kernels.chunked_logprob

    with float64_upcasts(factories_in=[trl.kernels.chunked_logprob]):
        trainer = build(case, out_dir, model_dir, cp_size=cp_size, dtype=torch.float64, **kwargs)
        trainer.train()
        steps = [{k: v for k, v in h.items() if k not in SKIPPED_KEYS} for h in trainer.state.log_history
                 if "grad_norm" in h]
        result = dict(steps=steps)
        if evaluate:
            result["eval"] = trainer.evaluate()
        if save:
            result["saved"] = os.path.join(out_dir, "saved")
            trainer.save_model(result["saved"])
    return result
