"""The whole training step at cp = 1, deltacp against the strongest public stack, in one process.

    python bench/step.py --size 2B --lengths 16384 32768 65536          # the table
    python bench/step.py --size 9B --layers 8 --lengths 16384 65536
    python bench/step.py --size 2B --lengths 16384 --profile             # + CUDA kernel time by class

One step = forward + backward of the mean next-token loss over one row + a fused AdamW step, bf16 parameters,
gradients and optimizer states, full activation checkpointing (every decoder layer), the released Qwen3.5 text
shape (`deltacp.models.presets`, vocabulary 248,320), randomly initialised with one seed so that both stacks
hold the same weights and train on the same row (their step-0 losses are printed and must agree).

- public: transformers' Qwen3_5ForCausalLM with SDPA attention and the GDN kernels transformers picks when
  flash-linear-attention is installed (its chunked GDN op and its fused gated RMSNorm; FLA 0.6.0's Hopper
  backward guard is BYPASSED, since it refuses to run otherwise), `gradient_checkpointing_enable()`, and
  liger-kernel's fused linear cross-entropy on the text model's last hidden state (no logits).
- deltacp: `parallelize_cp` (p2p, Triton GDN backend), `apply_activation_checkpointing`, `cp_causal_lm_loss`.

Times are CUDA events around whole steps, median of --repeat after --warmup; peak is the allocator's maximum
over the timed steps. --profile records one more step of each stack with torch.profiler and sums CUDA kernel
time by class (`KERNEL_CLASSES`, first match wins; names printed with --profile-top). A stack that is not
installed (FLA or liger-kernel missing) is refused with a message: the comparison is meaningless without it.
Exit status 1 when the losses disagree by more than --loss-tol (relative) or a stack fails.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
from collections import defaultdict

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_shapes import build_model  # noqa: E402  (the released shape, seeded, bf16, SDPA)
from timing import emit, time_cuda  # noqa: E402

IGNORE_INDEX = -100

# (class, pattern over the lower-cased kernel name); the first that matches names the kernel's class
KERNEL_CLASSES: list[tuple[str, str]] = [
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("attention", r"flash|fmha|attention|sdpa|pytorch_flash|cudnn.*mha"),
    ("loss", r"cross_entropy|liger|_ce_|lce|logsumexp|nll"),
    ("gdn op", r"chunk|wy_|wu_fwd|o_fwd|kkt|solve_tril|state_|dqkwg|recompute_w_u|prepare_wy|l2norm|merge_16x16"
               r"|fwd_kernel_o|bwd_kernel_dqkwg|bwd_kernel_dhu|fwd_kernel_h|gated_delta|tril|head_sum|group_sum"
               r"|dv_local"),
    ("conv", r"conv|depthwise"),
    ("norm", r"norm"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|sm90_|sm80_|matmul|splitk"),
    ("copy/cast", r"direct_copy|copy_kernel|catarray|cat_batched|transpose"),
    ("elementwise", r"elementwise|vectorized|reduce|index|scatter|gather|fill|silu|sigmoid|softplus|exp|mul|add"
                    r"|where|sum|mean|pow|rsqrt|act|swiglu|rotary|embedding"),
]


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, pattern in KERNEL_CLASSES:
        if re.search(pattern, low):
            return cls
    return "other"


def shifted_targets(ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets of one row, the last ignored (the loss both stacks compute)."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)


def public_stack(model, ids):
    """transformers + FLA kernels + liger-kernel fused linear CE + gradient checkpointing; returns step()."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lce = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
    targets = shifted_targets(ids).flatten()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

    def loss_fn():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        return lce(model.lm_head.weight, hidden.flatten(0, 1), targets)

    return loss_fn, opt


def deltacp_stack(model, ids, mesh, backend: str):
    from deltacp import parallelize_qwen3_5_cp, shard_batch_for_cp
    from deltacp.models.loss import cp_causal_lm_loss
    from deltacp.models.checkpointing import apply_activation_checkpointing

    model = parallelize_qwen3_5_cp(model, mesh, linear_attention_cp_mode="p2p", linear_attention_gdn_backend=backend)
    apply_activation_checkpointing(model)
    batch = shard_batch_for_cp(ids, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

    def loss_fn():
        return cp_causal_lm_loss(model, batch["target_ids"], mesh, input_ids=batch["input_ids"],
                                 position_ids=batch["position_ids"], use_cache=False)

    return loss_fn, opt


def make_step(loss_fn, opt):
    def step():
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def profile_step(step, top: int) -> dict[str, float]:
    """CUDA kernel time (ms) of one step by class; prints the `top` kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_class: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.time_range.elapsed_us()
            by_class[kernel_class(e.name)] += us / 1e3
            by_name[e.name] += us / 1e3
    for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {ms:9.2f} ms  [{kernel_class(name)}]  {name[:140]}")
    return dict(by_class), dict(by_name)


def free():
    gc.collect()
    torch.cuda.empty_cache()


def run_stack(name: str, args, ids, mesh, device) -> dict:
    model = build_model(args.size, args.layers, device)
    if name == "public":
        loss_fn, opt = public_stack(model, ids)
    else:
        loss_fn, opt = deltacp_stack(model, ids, mesh, args.backend)
    step = make_step(loss_fn, opt)
    loss0 = float(step().detach())  # step 0: the loss of the initial weights (then the weights move)
    stats = time_cuda(step, warmup=args.warmup, repeat=args.repeat)
    row = dict(bench="step", stack=name, size=args.size, layers=model.config.num_hidden_layers, tokens=ids.shape[1],
               loss0=loss0, tokens_per_s=ids.shape[1] / (stats["median_ms"] / 1e3), **stats)
    if args.profile and (args.profile_at is None or ids.shape[1] in args.profile_at):
        print(f"  {name} {ids.shape[1]} tokens: top kernels of one profiled step")
        row["profile_ms"], row["profile_kernels_ms"] = profile_step(step, args.profile_top)
    del model, opt, loss_fn, step
    free()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2B")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--stacks", nargs="+", default=["public", "deltacp"], choices=["public", "deltacp"])
    parser.add_argument("--backend", default="triton", choices=["triton", "eager"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="CUDA kernel time by class of one step per stack")
    parser.add_argument("--profile-top", type=int, default=12)
    parser.add_argument("--profile-at", type=int, nargs="+", default=None, help="profile these lengths only")
    parser.add_argument("--loss-tol", type=float, default=1e-3, help="relative step-0 loss difference allowed")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/step.py needs a CUDA GPU")
    if "public" in args.stacks:
        from fla_ref import load_fla

        loaded = load_fla(bypass_hopper_guard=True)
        if not loaded:
            sys.exit("bench/step.py: the public stack needs flash-linear-attention (pip install "
                     "flash-linear-attention); run with --stacks deltacp to time deltacp alone")
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            sys.exit("bench/step.py: the public stack needs liger-kernel (pip install liger-kernel); run with "
                     "--stacks deltacp to time deltacp alone")
        print(f"public stack: transformers + {loaded[0]} + liger-kernel fused linear CE + gradient checkpointing")
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh_dim_names=("cp",))
    device = torch.device("cuda", 0)
    vocab = build_vocab_size(args.size)
    rows, failed = [], []
    for length in args.lengths:
        ids = torch.randint(0, vocab, (1, length), device=device, generator=torch.Generator(device).manual_seed(1))
        for name in args.stacks:
            try:
                row = run_stack(name, args, ids, mesh, device)
            except torch.OutOfMemoryError:
                row = dict(bench="step", stack=name, size=args.size, tokens=length, oom=True)
                failed.append(f"{name} OOM at {length}")
                free()
            rows.append(row)
            emit(row, args.json)
    dist.destroy_process_group()

    print(f"\nTraining step at cp = 1, Qwen3.5-{args.size}"
          f"{'' if args.layers is None else f' ({args.layers} layers)'}, bf16, fused AdamW, full activation "
          f"checkpointing, on {torch.cuda.get_device_name(0)}; median of {args.repeat} steps after {args.warmup}")
    print(f"{'tokens':>7} {'public ms':>10} {'deltacp ms':>11} {'deltacp/public tok/s':>21} "
          f"{'peak GiB pub / dcp':>19} {'loss0 pub / dcp':>22}")
    by = {(r["tokens"], r["stack"]): r for r in rows}
    for length in args.lengths:
        p, d = by.get((length, "public")), by.get((length, "deltacp"))
        ms = lambda r: "not run" if r is None else "OOM" if r.get("oom") else f"{r['median_ms']:.1f}"  # noqa: E731
        gib = lambda r: "-" if r is None or r.get("oom") else f"{r['peak_gib']:.1f}"  # noqa: E731
        l0 = lambda r: "-" if r is None or r.get("oom") else f"{r['loss0']:.5f}"  # noqa: E731
        ratio = "-"
        if p and d and not p.get("oom") and not d.get("oom"):
            ratio = f"{p['median_ms'] / d['median_ms']:.3f}"
            rel = abs(p["loss0"] - d["loss0"]) / abs(p["loss0"])
            if rel > args.loss_tol:
                failed.append(f"step-0 losses differ at {length}: {p['loss0']} vs {d['loss0']} (rel {rel:.2e})")
        print(f"{length:>7} {ms(p):>10} {ms(d):>11} {ratio:>21} {gib(p) + ' / ' + gib(d):>19} "
              f"{l0(p) + ' / ' + l0(d):>22}")
    if args.profile:
        classes = [c for c, _ in KERNEL_CLASSES] + ["other"]
        print(f"\nCUDA kernel time by class, one step (ms)\n{'tokens':>7} {'stack':<8} "
              + " ".join(f"{c:>11}" for c in classes) + f" {'total':>9}")
        for r in rows:
            if "profile_ms" in r:
                prof = r["profile_ms"]
                print(f"{r['tokens']:>7} {r['stack']:<8} " + " ".join(f"{prof.get(c, 0.0):>11.1f}" for c in classes)
                      + f" {sum(prof.values()):>9.1f}")
    if failed:
        print("FAILED: " + "; ".join(failed))
        sys.exit(1)


def build_vocab_size(size: str) -> int:
    from deltacp.models.presets import qwen3_5_preset

    return qwen3_5_preset(size)["vocab_size"]


if __name__ == "__main__":
    main()
