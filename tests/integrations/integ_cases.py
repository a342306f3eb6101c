"""The trainer runs the integration tests compare: one case = a trainer class, a collator layout, its arguments.

`run_case(name, cp_size=None, ...)` builds the same tiny float32 Qwen3.5 model (seeded), the same small text dataset
and byte tokenizer on every rank, and trains with the plain trainer (cp_size None: one process, the reference) or
with deltacp's CP trainer, returning the per-step log (loss, grad norm), the eval loss and, optionally, the saved
directory. Every step is logged (logging_steps=1).
"""

from __future__ import annotations

import os
import random

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# accelerate gives each CPU process (physical cores / local processes) threads when this is unset: far too many on a
# small machine whose host has many cores (torchrun sets it to 1 itself)
os.environ.setdefault("OMP_NUM_THREADS", "1")

STEPS, GA, PER_DEVICE = 3, 2, 2
TOKEN_METRICS = ("entropy", "mean_token_accuracy", "num_tokens")  # what TRL's SFTTrainer logs beside the loss
VOCAB = 264  # the byte tokenizer's 258 ids, rounded up


def texts(n: int, seed: int) -> list[str]:
    """n lines of 6..70 characters (lengths vary, so rows pad and documents cross the CP rank boundaries)."""
    rng = random.Random(seed)
    words = ["gated", "delta", "net", "context", "parallel", "rank", "state", "token", "layer", "loss", "slice", "a"]
    out = []
    for _ in range(n):
        line = ""
        target = rng.randint(6, 70)
        while len(line) < target:
            line += rng.choice(words) + " "
        out.append(line[:target].strip() or "x")
    return out


def tiny_model(family: str = "qwen3_5"):
    """The tiny float32 model of `family` ("qwen3_5", "olmo_hybrid", "bamba", "nemotron_h", "qwen4_exp" or
    "glm5_next"; float32:
    CPU float64 conv1d is slow)."""
    from transformers import Qwen3_5ForCausalLM

    from helpers import long_memory_gates_, tiny_bamba, tiny_config, tiny_nemotron_h, tiny_olmo_hybrid

    if family == "olmo_hybrid":
        return tiny_olmo_hybrid(rope=False, dtype=torch.float32, vocab_size=VOCAB, pad_token_id=256, eos_token_id=257)
    if family == "bamba":  # Mamba2 (eager)
        return tiny_bamba(torch.float32, vocab_size=VOCAB, pad_token_id=256, eos_token_id=257)
    if family == "nemotron_h":  # Mamba2 blocks beside MoE, attention and relu2 MLP blocks (eager)
        return tiny_nemotron_h(torch.float32, vocab_size=VOCAB, pad_token_id=256, eos_token_id=257)
    if family == "qwen4_exp":  # GDN, indexed attention, hyper-connections, a PLE layer (conv halo 6), routed experts
        # (the CP trainers refuse the MoE aux loss: coefficient 0)
        from helpers import tiny_qwen4_exp

        return tiny_qwen4_exp(torch.float32, vocab_size=VOCAB, pad_token_id=256, eos_token_id=257, ple_layer_ids=[2],
                              ngram_vocab_size_base=64, ple_conv_kernel_size=3, router_aux_loss_coef=0.0)
    if family == "glm5_next":  # KDA, MLA with the pooled indexer and a "shared" layer, hyper-connections, routed
        # experts (aux loss coefficient 0, as above); its conditional class with text only
        from helpers import tiny_glm5_next

        return tiny_glm5_next(torch.float32, vocab_size=VOCAB, pad_token_id=256, eos_token_id=257,
                              router_aux_loss_coef=0.0)
    torch.manual_seed(0)
    return long_memory_gates_(Qwen3_5ForCausalLM(tiny_config(vocab_size=VOCAB)))


def _tokenized(tok, lines):
    from datasets import Dataset

    eos = tok.eos_token_id
    ids = [tok(line)["input_ids"] + [eos] for line in lines]
    return Dataset.from_dict({"input_ids": ids})


def _common(out_dir: str, dp: int, extra: dict) -> dict:
    args = dict(output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=PER_DEVICE * dp,
                per_device_eval_batch_size=PER_DEVICE, gradient_accumulation_steps=GA, learning_rate=3e-3,
                warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[], seed=7, use_cpu=True,
                dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=1.0)
    return {**args, **extra}


def build(case: str, out_dir: str, *, cp_size: int | None, dp: int, cls=None, args_extra: dict | None = None,
          train_lines: list[str] | None = None, family: str = "qwen3_5", **kwargs):
    """The trainer of `case` (plain when cp_size is None). The reference runs one process at dp x the per-device
    batch, so that each optimizer step sees the same global batch as dp groups of PER_DEVICE rows. `cls` replaces
    the trainer class, `args_extra` adds training arguments, `train_lines` replaces the training texts, `family` picks
    the tiny model's family, `model` (like every other keyword, which goes to the trainer) replaces the tiny model."""
    from deltacp.testing.hf import byte_tokenizer

    tok = byte_tokenizer()
    n_train = STEPS * GA * PER_DEVICE * 2  # dp 2: exactly STEPS steps per epoch
    # eval: dp x PER_DEVICE x 4 rows at dp 2 (as many batches on every dp group); 7 at dp 1 (a short last batch)
    train_lines = texts(n_train, 0) if train_lines is None else train_lines
    eval_lines = texts(7 if dp == 1 else 8, 1)
    kind, layout = case.split("-")
    if kind == "trainer":
        from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening, Trainer, TrainingArguments

        collator = (DataCollatorForLanguageModeling(tok, mlm=False) if layout == "padded"
                    else DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True))
        args = TrainingArguments(**_common(out_dir, dp if cp_size is None else 1, args_extra or {}))
        kwargs = dict(dict(model=tiny_model(family), args=args, data_collator=collator,
                           train_dataset=_tokenized(tok, train_lines), eval_dataset=_tokenized(tok, eval_lines),
                           processing_class=tok), **kwargs)
        base = Trainer
        if cp_size is not None:
            from deltacp.integrations import CPTrainer as base
    else:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        from deltacp.integrations import checkpointing_arguments

        sft = dict(padding_free=layout == "packed", max_length=None, bf16=False, **checkpointing_arguments())
        args = SFTConfig(**_common(out_dir, dp if cp_size is None else 1, {**sft, **(args_extra or {})}))
        kwargs = dict(dict(model=tiny_model(family), args=args, train_dataset=Dataset.from_dict({"text": train_lines}),
                           eval_dataset=Dataset.from_dict({"text": eval_lines}), processing_class=tok), **kwargs)
        base = SFTTrainer
        if cp_size is not None:
            from deltacp.integrations import CPSFTTrainer as base
    if cp_size is not None:
        kwargs["cp_size"] = cp_size
    return (cls or base)(**kwargs)


def run_case(case: str, out_dir: str, *, cp_size: int | None = None, dp: int = 1, save: bool = False,
             **cp_kwargs) -> dict:
    """Train STEPS steps, evaluate; with `save`, a weights-only checkpoint at the last step and save_model."""
    if save:
        cp_kwargs["args_extra"] = dict(save_strategy="steps", save_steps=STEPS, save_only_model=True)
    import functools

    from deltacp.integrations.trainer import trainer_checkpointing

    trainer = build(case, out_dir, cp_size=cp_size, dp=dp, **cp_kwargs)
    layers = trainer.model.get_decoder().layers
    checkpointed = [isinstance(layer.forward, functools.partial) for layer in layers]  # deltacp's checkpointing
    trainer.train()
    steps = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
    # TRL's SFTTrainer also logs token metrics (the plain Trainer none)
    metrics = [{k: h[k] for k in TOKEN_METRICS if k in h} for h in trainer.state.log_history if "grad_norm" in h]
    evaluation = trainer.evaluate()
    result = dict(steps=steps, metrics=metrics, eval_loss=evaluation["eval_loss"], checkpointed=checkpointed,
                  trainer_checkpointing=trainer_checkpointing(trainer.args)[0],
                  eval_metrics={k: evaluation[f"eval_{k}"] for k in TOKEN_METRICS if f"eval_{k}" in evaluation})
    if save:
        saved = os.path.join(out_dir, "saved")
        trainer.save_model(saved)
        result["saved"] = saved
        result["checkpoint"] = os.path.join(out_dir, f"checkpoint-{STEPS}")
    return result
