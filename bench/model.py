"""Whole FSDP+CP model step (forward, backward, AdamW step) per mode, activation checkpointing off and full.

Qwen3.5 hybrid (layers L,L,L,F repeated; hidden 2048, GDN QK/V heads 16/32, K = V = 128; full attention
16 heads / 2 KV heads of 128), bf16 parameters with fp32 gradient reduction (FSDP2 mixed precision),
local sequence 16K per rank by default.

    python bench/model.py --layers 4 8 --local-len 16384                 # a 1-rank CP job on one GPU
    torchrun --nproc-per-node 8 bench/model.py --layers 4 8 --local-len 16384 --modes ulysses p2p

Timing: warm-up 5 steps, 20 timed (barrier + synchronize around each), max over ranks, median/min/p90;
tokens/s over the global batch; peak allocated memory (max over ranks). Prints a table; --json appends rows.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import emit, max_over_ranks, time_cuda  # noqa: E402


def model_config(layers: int, vocab: int):
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4), num_attention_heads=16,
        num_key_value_heads=2, head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        max_position_embeddings=1 << 20, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def bench_step(args, layers: int, mode: str, checkpointing: bool, mesh, device) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import Qwen3_5ForCausalLM

    from deltacp import cp_cross_entropy, fully_shard_qwen3_5, parallelize_qwen3_5_cp, shard_batch_for_cp
    from deltacp.models.gates import long_memory_gates_
    from deltacp.models.checkpointing import apply_activation_checkpointing

    # what an earlier configuration left allocated would count in this one's peak: free it, and report it
    gc.collect()
    torch.cuda.empty_cache()
    start_gib = max_over_ranks(torch.cuda.memory_allocated() / 2**30)
    torch.manual_seed(0)
    with torch.device(device):
        model = long_memory_gates_(Qwen3_5ForCausalLM(model_config(layers, args.vocab)))
    model = parallelize_qwen3_5_cp(model, mesh, linear_attention_cp_mode=mode,
                                   linear_attention_backend=args.backend)
    if checkpointing:
        apply_activation_checkpointing(model, policy="full")
    fully_shard_qwen3_5(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                    reduce_dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    world = dist.get_world_size()
    ids = torch.randint(0, args.vocab, (1, args.local_len * world), device=device,
                        generator=torch.Generator(device).manual_seed(1))
    batch = shard_batch_for_cp(ids, mesh)

    def step():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        cp_cross_entropy(logits, batch["target_ids"], mesh).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    stats = time_cuda(step, warmup=args.warmup, repeat=args.repeat, barrier=dist.barrier)
    peak = max_over_ranks(stats["peak_gib"])
    del model, optimizer, step
    gc.collect()  # FSDP modules hold reference cycles: without a collection their memory outlives the step
    torch.cuda.empty_cache()
    return dict(bench="model", layers=layers, mode=mode, backend=args.backend, checkpointing=checkpointing, cp=world,
                local_len=args.local_len, global_len=args.local_len * world, **stats, peak_gib_max=peak, start_gib=start_gib,
                tokens_per_s=args.local_len * world / (stats["median_ms"] / 1e3))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8], help="multiples of 4 (L,L,L,F blocks)")
    parser.add_argument("--modes", nargs="+", default=["ulysses", "p2p"], choices=["ulysses", "p2p", "all_gather"])
    parser.add_argument("--backend", default="triton", choices=["eager", "triton"])
    parser.add_argument("--checkpointing", nargs="+", default=["off", "full"], choices=["off", "full"])
    parser.add_argument("--local-len", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/model.py needs a CUDA GPU")
    if any(n % 4 for n in args.layers):
        parser.error("--layers must be multiples of 4 (blocks of 3 GDN + 1 full attention layers)")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 1000))
    world, local_rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    shared_gpu = world > torch.cuda.device_count()
    torch.cuda.set_device(0 if shared_gpu else local_rank)
    dist.init_process_group("gloo" if shared_gpu else "nccl")
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh_dim_names=("cp",))
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    try:
        for layers in args.layers:
            for checkpointing in args.checkpointing:
                for mode in args.modes:
                    row = bench_step(args, layers, mode, checkpointing == "full", mesh, device)
                    rows.append(row)
                    if dist.get_rank() == 0 and args.json:
                        emit(row, args.json)
    finally:
        if dist.get_rank() == 0:
            print(f"\nFSDP+CP{world} model step (fwd+bwd+AdamW), local {args.local_len} tokens, backend {args.backend}")
            print(f"{'layers':>6} {'AC':>4} {'mode':<8} {'median ms':>10} {'min ms':>8} {'p90 ms':>8} {'tokens/s':>10} "
                  f"{'peak GiB':>9} {'start GiB':>9}")
            for r in rows:
                print(f"{r['layers']:>6} {'full' if r['checkpointing'] else 'off':>4} {r['mode']:<8} "
                      f"{r['median_ms']:>10.1f} {r['min_ms']:>8.1f} {r['p90_ms']:>8.1f} {r['tokens_per_s']:>10.0f} "
                      f"{r['peak_gib_max']:>9.2f} {r['start_gib']:>9.2f}")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
