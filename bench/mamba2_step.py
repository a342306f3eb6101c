"""The whole training step of a Mamba2 hybrid at cp = 1: deltacp against transformers with the public Mamba2 kernels,
in one process.

    python bench/mamba2_step.py --lengths 16384 65536 --profile

The model: NemotronHForCausalLM at Nemotron-H-8B's layer shapes (transformers' NemotronHConfig defaults: hidden 4096,
Mamba2 mixers of 128 heads of 64 in 8 groups with state 128, attention 32 heads over 8 KV heads of 128, relu2 MLP
21504, vocabulary 131,072), cut to --blocks blocks in the pattern Mamba2, MLP, ... with one attention block
(default 8: 3 Mamba2, 1 attention, 4 MLP), bf16, seeded so both stacks hold the same weights and train on the same
row (their step-0 losses are printed and must agree). One step = forward + backward of the mean next-token loss +
a fused AdamW step; every decoder block checkpointed in full on both sides.

- public: transformers' model with SDPA, mamba_ssm's Triton SSD (`mamba_chunk_scan_combined`, through transformers'
  kernel resolution, from the staged copy in .whl/mamba_ssm_triton: the package root's CUDA-extension import is
  bypassed), PyTorch's conv1d (causal_conv1d's CUDA extension is not installed, so transformers' fused
  split-conv-scan path, which needs it, is switched to transformers' own fall-back: it returns None and the layer
  runs conv, scan and norm separately), liger-kernel's fused linear cross-entropy on the last hidden state,
  `gradient_checkpointing_enable()`.
- deltacp: `parallelize_cp` (p2p, Triton backend: the fused conv and the Triton scalar-decay recurrence),
  `apply_activation_checkpointing(policy="full")`, `cp_causal_lm_loss`.

--profile adds CUDA kernel time by class (bench/timing.py KERNEL_CLASSES) of one step of each stack. Exit status 1
when deltacp fails (out of memory included) or the step-0 losses differ by more than --loss-tol.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_shapes import build_bf16  # noqa: E402
from step import flce_stack, free, make_step  # noqa: E402
from timing import emit, profile_step, time_cuda  # noqa: E402


def build(blocks: int, device):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    pattern = ["linear_attention", "mlp"] * (blocks // 2)
    pattern[len(pattern) // 2 + (len(pattern) // 2) % 2] = "full_attention"  # one attention block, mid-stack
    return build_bf16(NemotronHForCausalLM, NemotronHConfig(layers_block_type=pattern, max_position_embeddings=1 << 20),
                      device)


def public_stack(model, ids):
    import transformers.models.nemotron_h.modeling_nemotron_h as modeling

    # mamba_ssm's fused split-conv-scan needs causal_conv1d's CUDA extension: transformers' own fall-back instead,
    # which returns None (the layer then runs its conv, mamba_ssm's scan and its norm one after the other)
    modeling.mamba2_split_conv1d_scan_combined = lambda *args, **kwargs: None
    return flce_stack(model, ids)  # liger's fused linear CE on the last hidden state, gradient checkpointing


def deltacp_stack(model, ids, mesh):
    from deltacp import apply_activation_checkpointing, cp_causal_lm_loss, parallelize_cp, shard_batch_for_cp

    model = parallelize_cp(model, mesh, linear_attention_cp_mode="p2p", linear_attention_backend="triton")
    apply_activation_checkpointing(model, policy="full")
    batch = shard_batch_for_cp(ids, mesh, model=model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

    def loss_fn():
        return cp_causal_lm_loss(model, batch["target_ids"], mesh, input_ids=batch["input_ids"],
                                 position_ids=batch["position_ids"], use_cache=False)

    return loss_fn, opt


def scan_kernel_of() -> str:
    import transformers.models.nemotron_h.modeling_nemotron_h as modeling

    loaded = "mamba_ssm" in sys.modules
    return (f"mamba_ssm {sys.modules['mamba_ssm'].__version__} (Triton SSD)" if loaded
            else f"transformers' torch scan ({modeling.__name__})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--stacks", nargs="+", default=["public", "deltacp"], choices=["public", "deltacp"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-top", type=int, default=12)
    ap.add_argument("--loss-tol", type=float, default=2e-3)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/mamba2_step.py needs a CUDA GPU")
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29700 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh_dim_names=("cp",))
    device = torch.device("cuda", 0)
    rows, failed = [], []
    for length in args.lengths:
        for name in args.stacks:
            model = build(args.blocks, device)
            ids = torch.randint(0, model.config.vocab_size, (1, length), device=device,
                                generator=torch.Generator(device).manual_seed(1))
            try:
                loss_fn, opt = public_stack(model, ids) if name == "public" else deltacp_stack(model, ids, mesh)
                step = make_step(loss_fn, opt)
                loss0 = float(step().detach())
                stats = time_cuda(step, warmup=args.warmup, repeat=args.repeat)
                row = dict(bench="mamba2_step", stack=name, blocks=args.blocks, tokens=length, loss0=loss0, **stats,
                           tokens_per_s=length / (stats["median_ms"] / 1e3))
                if name == "public":
                    row["scan"] = scan_kernel_of()
                if args.profile:
                    print(f"  {name} {length} tokens: top kernels of one profiled step", flush=True)
                    row["profile_ms"], _ = profile_step(step, args.profile_top)
                del loss_fn, opt, step
            except torch.OutOfMemoryError:
                row = dict(bench="mamba2_step", stack=name, blocks=args.blocks, tokens=length, oom=True)
                if name == "deltacp":
                    failed.append(f"deltacp OOM at {length}")
            del model
            free()
            rows.append(row)
            emit(row, args.json)
    dist.destroy_process_group()
    print(f"\nNemotron-H-8B layer shapes, {args.blocks} blocks, bf16, full checkpointing, "
          f"{torch.cuda.get_device_name(0)}; public scan: {next((r['scan'] for r in rows if 'scan' in r), '-')}")
    print(f"{'tokens':>7} {'stack':>8} {'ms':>9} {'peak GiB':>9} {'loss0':>9} {'speed-up':>9}")
    for length in args.lengths:
        by = {r["stack"]: r for r in rows if r["tokens"] == length}
        base = by.get("public")
        for name, r in by.items():
            if r.get("oom"):
                print(f"{length:>7} {name:>8} {'OOM':>9}")
                continue
            up = f"{base['median_ms'] / r['median_ms']:.2f}x" if base and not base.get("oom") else "-"
            print(f"{length:>7} {name:>8} {r['median_ms']:>9.1f} {r['peak_gib']:>9.2f} {r['loss0']:>9.4f} {up:>9}")
            if "profile_ms" in r:
                print("        " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["profile_ms"].items(),
                                                                               key=lambda kv: -kv[1])))
        if base and "deltacp" in by and not base.get("oom") and not by["deltacp"].get("oom"):
            a, b = base["loss0"], by["deltacp"]["loss0"]
            if abs(a - b) > args.loss_tol * abs(a):
                failed.append(f"step-0 losses differ at {length}: public {a:.5f}, deltacp {b:.5f}")
    if failed:
        print("FAILED: " + "; ".join(failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
