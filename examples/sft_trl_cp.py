"""Supervised fine-tuning with TRL's SFTTrainer under deltacp context parallelism (padding-free packed rows).

    torchrun --nproc-per-node 4 examples/sft_trl_cp.py              # CPU: 4 gloo ranks, dp 2 x cp 2
    torchrun --nproc-per-node 4 examples/sft_trl_cp.py --cp 4       # dp 1 x cp 4
    torchrun --nproc-per-node 8 examples/sft_trl_cp.py --cp 4       # 8 GPUs: the same script, NCCL, bf16

Everything is made here, nothing is downloaded: a tiny random-init Qwen3.5 (3 GDN + 1 full attention layers), a
byte-level tokenizer and a small dataset of sentences. Compared with a plain SFTTrainer script, the deltacp lines are
the import of CPSFTTrainer and `cp_size=` (marked "deltacp"). The trained model is saved as a normal transformers
directory and reloaded on one device at the end; a second run into the same --out needs --overwrite.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here comes from the Hub

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402
from trl import SFTConfig  # noqa: E402

from deltacp.integrations import CPSFTTrainer, checkpointing_arguments  # deltacp  # noqa: E402
from deltacp.testing.hf import byte_tokenizer  # a tokenizer that needs no download (use your own)  # noqa: E402


def sentences(n: int, seed: int = 0) -> list[str]:
    """Short documents with learnable structure (sums, a repeated phrase) of varied lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append(" ".join(f"{a} plus {b} is {a + b}." for _ in range(rng.randint(1, 6))))
    return out


def tiny_qwen3_5(vocab_size: int) -> Qwen3_5ForCausalLM:
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=2, help="ranks per sequence (the world is dp x cp)")
    parser.add_argument("--mode", default="p2p", choices=["ulysses", "p2p", "all_gather"],
                        help="linear_attention_cp_mode (GDN layers)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="runs/sft_trl_cp")
    parser.add_argument("--overwrite", action="store_true", help="write into --out even if it holds a run")
    opts = parser.parse_args()
    if os.path.isdir(opts.out) and os.listdir(opts.out) and not opts.overwrite:
        sys.exit(f"{opts.out} holds an earlier run: pass --overwrite, or another --out")
    gpu = torch.cuda.is_available()

    tokenizer = byte_tokenizer()
    model = tiny_qwen3_5(vocab_size=len(tokenizer))
    args = SFTConfig(
        output_dir=opts.out, max_steps=opts.steps, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=3, logging_steps=5, save_strategy="no",
        eval_strategy="steps", eval_steps=opts.steps // 2, per_device_eval_batch_size=8,
        padding_free=True, max_length=None,              # packed rows: documents back to back, no padding
        **checkpointing_arguments(),                     # deltacp's per-layer activation checkpointing
        bf16=gpu, use_cpu=not gpu, report_to=[], seed=0, disable_tqdm=True)
    trainer = CPSFTTrainer(
        model=model, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"text": sentences(2000)}),
        eval_dataset=Dataset.from_dict({"text": sentences(64, seed=1)}),
        cp_size=opts.cp, linear_attention_cp_mode=opts.mode)  # deltacp
    trainer.train()
    metrics = trainer.evaluate()
    final = os.path.join(opts.out, "final")
    trainer.save_model(final)  # every rank calls it: the full weights are gathered, rank 0 writes
    if trainer.is_world_process_zero():
        print(f"dp {trainer.dp_size} x cp {trainer.cp_size}: eval_loss {metrics['eval_loss']:.4f}; saved {final}")
        reloaded = Qwen3_5ForCausalLM.from_pretrained(final, local_files_only=True)  # plain transformers, one device
        prompt = tokenizer("12 plus 30 is", return_tensors="pt")
        out = reloaded.generate(**prompt, max_new_tokens=12, do_sample=False)
        print("greedy continuation:", repr(tokenizer.decode(out[0][prompt["input_ids"].shape[1]:])))
    dist.destroy_process_group()  # torchrun started it; a process exiting with it alive can abort at exit


if __name__ == "__main__":
    main()
