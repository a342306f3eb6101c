"""Reinforcement learning with TRL's GRPOTrainer under deltacp context parallelism: a tiny model learns to answer sums.

    torchrun --nproc-per-node 2 examples/grpo_trl_cp.py              # CPU: 2 gloo ranks, dp 1 x cp 2
    torchrun --nproc-per-node 4 examples/grpo_trl_cp.py --cp 2       # dp 2 x cp 2
    torchrun --nproc-per-node 8 examples/grpo_trl_cp.py --cp 4       # 8 GPUs: the same script, NCCL, bf16

Everything is made here, nothing is downloaded: a tiny random-init Qwen3.5 (3 GDN + 1 full attention layers), a
byte-level tokenizer and prompts "a+b=" with a, b in 0..4. As usual for RL, the model first learns the format from a
few worked examples (a short SFT with CPSFTTrainer, saved and loaded back as a normal transformers directory); then
GRPO with a verifiable reward (1 for the right sum, then the end-of-text token; 0 otherwise) raises how often it is
right, printed every 5 steps with the fraction of prompts whose completions all scored alike (no signal): on 2 CPU
ranks the reward goes from about 0.24 to 0.54 in 100 steps (1 minute), the KL term (beta) keeping the tiny model
from collapsing onto one answer. Compared with a plain TRL script, the deltacp lines are the imports of the CP
trainers and `cp_size=` (marked "deltacp"). Each CP rank generates its share of the completions with the model
itself; log-probabilities and the training step run under CP.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here comes from the Hub

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PrinterCallback, Qwen3_5ForCausalLM, Qwen3_5TextConfig, TrainerCallback  # noqa: E402
from trl import GRPOConfig, SFTConfig  # noqa: E402

from deltacp.integrations import CPGRPOTrainer, CPSFTTrainer, checkpointing_arguments  # deltacp  # noqa: E402
from deltacp.testing.hf import byte_tokenizer  # a tokenizer that needs no download (use your own)  # noqa: E402


def sum_reward(prompts, completions, **kwargs) -> list[float]:
    """1 for the right sum (TRL decodes the completion without the end-of-text token, so "12" + end is "12" and
    "12" + "3" is "123"), 0 otherwise."""
    return [float(text == str(sum(map(int, re.findall(r"\d+", prompt))))) for prompt, text in zip(prompts, completions)]


def tiny_qwen3_5(tokenizer) -> Qwen3_5ForCausalLM:
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config)


class PrintRewards(TrainerCallback):
    """One line per logging step on the main process: the mean reward (the fraction of right sums)."""

    def __init__(self):
        self.rewards = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "reward" in logs:
            self.rewards.append(logs["reward"])
            print(f"GRPO step {state.global_step:4d}  reward {logs['reward']:.3f}  groups all alike "
                  f"{logs['frac_reward_zero_std']:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=2, help="ranks per sequence (the world is dp x cp)")
    parser.add_argument("--mode", default="p2p", choices=["ulysses", "p2p", "all_gather"],
                        help="linear_attention_cp_mode (GDN layers)")
    parser.add_argument("--sft-steps", type=int, default=30, help="steps of the format warm-up")
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps")
    parser.add_argument("--out", default="runs/grpo_trl_cp")
    parser.add_argument("--overwrite", action="store_true", help="write into --out even if it holds a run")
    opts = parser.parse_args()
    if os.path.isdir(opts.out) and os.listdir(opts.out) and not opts.overwrite:
        sys.exit(f"{opts.out} holds an earlier run: pass --overwrite, or another --out")
    gpu = torch.cuda.is_available()
    common = dict(bf16=gpu, use_cpu=not gpu, report_to=[], seed=0, disable_tqdm=True, save_strategy="no",
                  lr_scheduler_type="constant", **checkpointing_arguments())  # deltacp's per-layer checkpointing
    cp = dict(cp_size=opts.cp, linear_attention_cp_mode=opts.mode)  # deltacp
    tokenizer = byte_tokenizer()
    rng = random.Random(0)
    pairs = [(rng.randint(0, 4), rng.randint(0, 4)) for _ in range(4000)]

    # 1. the format: a few worked sums (packed padding-free rows, deltacp's activation checkpointing)
    sft = CPSFTTrainer(
        model=tiny_qwen3_5(tokenizer), processing_class=tokenizer, **cp,
        args=SFTConfig(output_dir=os.path.join(opts.out, "sft"), max_steps=opts.sft_steps, learning_rate=3e-3,
                       per_device_train_batch_size=16, logging_steps=opts.sft_steps, padding_free=True,
                       max_length=None, **common),
        train_dataset=Dataset.from_dict({"text": [f"{a}+{b}={a + b}" for a, b in pairs]}))
    sft.remove_callback(PrinterCallback)
    sft.train()
    warm = os.path.join(opts.out, "sft", "final")
    sft.save_model(warm)  # every rank calls it: the full weights are gathered, rank 0 writes

    # 2. GRPO from the saved model: 8 completions per prompt, the reward checks the sum
    callback = PrintRewards()
    trainer = CPGRPOTrainer(
        model=Qwen3_5ForCausalLM.from_pretrained(warm, local_files_only=True), reward_funcs=sum_reward,
        processing_class=tokenizer, callbacks=[callback], **cp,
        args=GRPOConfig(output_dir=opts.out, max_steps=opts.steps, per_device_train_batch_size=64, num_generations=16,
                        max_completion_length=3, learning_rate=1e-3, beta=0.1, logging_steps=5, **common),
        train_dataset=Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs]}))
    trainer.remove_callback(PrinterCallback)  # PrintRewards prints one short line per logging step instead
    trainer.train()
    final = os.path.join(opts.out, "final")
    trainer.save_model(final)
    if trainer.is_world_process_zero():
        first, last = callback.rewards[:2], callback.rewards[-2:]
        print(f"dp {trainer.dp_size} x cp {trainer.cp_size}: right sums {sum(first) / len(first):.3f} (first "
              f"logged GRPO steps) -> {sum(last) / len(last):.3f} (last); saved {final}")
    dist.destroy_process_group()  # torchrun started it; a process exiting with it alive can abort at exit


if __name__ == "__main__":
    main()
