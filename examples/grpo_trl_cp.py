"""Reinforcement learning with TRL's GRPOTrainer under deltacp context parallelism: a tiny model learns to answer sums.

    torchrun --nproc-per-node 2 examples/grpo_trl_cp.py              # CPU: 2 gloo ranks, dp 1 x cp 2
    torchrun --nproc-per-node 4 examples/grpo_trl_cp.py --cp 2       # dp 2 x cp 2
    torchrun --nproc-per-node 8 examples/grpo_trl_cp.py --cp 4       # 8 GPUs: the same script, NCCL, bf16

Everything is made here, nothing is downloaded: a tiny random-init Qwen3.5 (3 GDN + 1 full attention layers), a
byte-level tokenizer and prompts "a+b=" with a, b in 0..9. The reward is verifiable: 1 for the right sum followed by
the end-of-text token, 0.2 for a number followed by it, 0.1 for a number alone. The model starts from random
weights, so the first rewards come from the format and the sums follow. Compared with a plain GRPOTrainer script, the
deltacp lines are the import of CPGRPOTrainer and `cp_size=` (marked "deltacp"). Each CP rank generates its share of
the completions with the model itself; log-probabilities and the training step run under CP.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import re
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here comes from the Hub

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from deltacp.integrations import CPGRPOTrainer  # deltacp  # noqa: E402
from deltacp.testing.hf import byte_tokenizer  # a tokenizer that needs no download (use your own)  # noqa: E402


def sum_reward(prompts, completions, completion_ids, eos_token_id: int, **kwargs) -> list[float]:
    """1.0: the right sum, then the end-of-text token; 0.2: a number, then the end; 0.1: a number alone."""
    rewards = []
    for prompt, text, ids in zip(prompts, completions, completion_ids):
        a, b = map(int, re.findall(r"\d+", prompt))
        ended = ids[-1] == eos_token_id
        if text.strip() == str(a + b) and ended:
            rewards.append(1.0)
        elif re.fullmatch(r"\d+", text.strip()):
            rewards.append(0.2 if ended else 0.1)
        else:
            rewards.append(0.0)
    return rewards


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
    """One line per logging step on the main process: the mean reward and how often the sum is right."""

    def __init__(self):
        self.rewards = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "reward" in logs:
            self.rewards.append(logs["reward"])
            print(f"step {state.global_step:4d}  reward {logs['reward']:.3f}  "
                  f"completion length {logs['completions/mean_length']:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=2, help="ranks per sequence (the world is dp x cp)")
    parser.add_argument("--mode", default="p2p", choices=["ulysses", "p2p", "all_gather"],
                        help="linear_attention_cp_mode (GDN layers)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="runs/grpo_trl_cp")
    parser.add_argument("--overwrite", action="store_true", help="write into --out even if it holds a run")
    opts = parser.parse_args()
    if os.path.isdir(opts.out) and os.listdir(opts.out) and not opts.overwrite:
        sys.exit(f"{opts.out} holds an earlier run: pass --overwrite, or another --out")
    gpu = torch.cuda.is_available()

    tokenizer = byte_tokenizer()
    model = tiny_qwen3_5(tokenizer)
    rng = random.Random(0)
    prompts = [f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=" for _ in range(4000)]
    args = GRPOConfig(
        output_dir=opts.out, max_steps=opts.steps, per_device_train_batch_size=16, num_generations=8,
        max_completion_length=4, learning_rate=5e-3, lr_scheduler_type="constant", logging_steps=5,
        save_strategy="no", bf16=gpu, use_cpu=not gpu, report_to=[], seed=0, disable_tqdm=True,
        activation_checkpointing=True)                  # deltacp's per-layer activation checkpointing
    callback = PrintRewards()
    reward = functools.partial(sum_reward, eos_token_id=tokenizer.eos_token_id)
    reward.__name__ = "sum_reward"  # the name TRL logs the reward under
    trainer = CPGRPOTrainer(
        model=model, reward_funcs=reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer, callbacks=[callback],
        cp_size=opts.cp, linear_attention_cp_mode=opts.mode)  # deltacp
    trainer.train()
    final = os.path.join(opts.out, "final")
    trainer.save_model(final)  # every rank calls it: the full weights are gathered, rank 0 writes
    if trainer.is_world_process_zero():
        first, last = callback.rewards[:2], callback.rewards[-2:]
        print(f"dp {trainer.dp_size} x cp {trainer.cp_size}: mean reward {sum(first) / len(first):.3f} (first "
              f"logged steps) -> {sum(last) / len(last):.3f} (last); saved {final}")
    dist.destroy_process_group()  # torchrun started it; a process exiting with it alive can abort at exit


if __name__ == "__main__":
    main()
