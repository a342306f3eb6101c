"""The whole training step at cp = 1, deltacp against the strongest public stacks, in one process.

    python bench/step.py --size 2B --lengths 16384 65536 --ac full selective          # the table
    python bench/step.py --size 9B --layers 8 --lengths 65536 --ac full selective
    python bench/step.py --size 2B --lengths 131072 --ac full selective
    python bench/step.py --size 2B --lengths 65536 --profile                           # + CUDA kernel time by class

One step = forward + backward of the mean next-token loss over one row + a fused AdamW step, bf16 parameters,
gradients and optimizer states, the released Qwen3.5 text shape (`deltacp.models.presets`, vocabulary 248,320),
randomly initialised with one seed so that every stack holds the same weights and trains on the same row (their
step-0 losses are printed and must agree). Stacks (`--stacks`):

- liger: the strongest public stack. transformers' Qwen3_5ForCausalLM with SDPA attention and the GDN kernels
  transformers picks when flash-linear-attention is installed (its chunked GDN op and fused gated RMSNorm; FLA
  0.6.0's Hopper backward guard is BYPASSED, since it refuses to run otherwise), liger-kernel's own Qwen3.5 patch
  `apply_liger_kernel_to_qwen3_5(model=model)` with its defaults (its RMSNorm on the decoder norms and the final
  norm, its SwiGLU MLP, its fused linear cross-entropy in the model's forward: `model(ids, labels=ids).loss`, no
  logits), and `gradient_checkpointing_enable()` (every decoder layer, full). The patch is applied to the instance
  the way transformers' Trainer applies liger (`use_liger_kernel`), after the model is built; the module-level
  classes it also replaces are restored, so the other stacks' models are transformers' own.
- flce: the same without liger's patch but its fused linear cross-entropy on the text model's last hidden state.
- deltacp: `parallelize_cp` (p2p, Triton GDN backend), `apply_activation_checkpointing(policy=...)` for each `--ac`
  policy (none | full | selective; one row each; the public stacks always checkpoint every layer in full),
  `cp_causal_lm_loss`.

Times are CUDA events around whole steps, median of --repeat after --warmup; peak is the allocator's maximum
over the timed steps. --profile records one more step of each stack with torch.profiler and sums CUDA kernel
time by class (`KERNEL_CLASSES`, first match wins; names printed with --profile-top). A stack whose packages are
not installed (FLA, liger-kernel) is refused with a message: the comparison is meaningless without it. The last
lines compare the speed-ups with the targets (`TARGETS`: deltacp over the liger stack at 64K tokens, full
checkpointing on both sides, and selective at no more peak memory than the liger stack's).
Exit status 1 when a step-0 loss differs from the first stack's by more than --loss-tol (relative) or deltacp runs
out of memory (a public stack that does not fit is reported as OOM); a missed target is reported, not a failure.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_shapes import build_model  # noqa: E402  (the released shape, seeded, bf16, SDPA)
from timing import KERNEL_CLASSES, emit, profile_step, time_cuda  # noqa: E402

IGNORE_INDEX = -100
PUBLIC_STACKS = ("liger", "flce")
# (size, layers or None, tokens) -> (deltacp full / liger, deltacp selective / liger): the done-when speed-ups
# of the whole step over the liger stack (selective at no more peak memory than the liger stack's)
TARGETS = {("2B", None, 65536): (1.35, 1.45), ("9B", 8, 65536): (1.25, None)}

def shifted_targets(ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets of one row, the last ignored (the loss both stacks compute)."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)


def flce_stack(model, ids):
    """transformers + FLA kernels + liger-kernel fused linear CE + gradient checkpointing; returns (loss_fn, opt)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lce = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
    targets = shifted_targets(ids).flatten()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

    def loss_fn():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        return lce(model.lm_head.weight, hidden.flatten(0, 1), targets)

    return loss_fn, opt


def liger_stack(model, ids):
    """transformers + FLA kernels + liger-kernel's Qwen3.5 patch (RMSNorm, SwiGLU, fused linear CE in the forward) +
    gradient checkpointing; returns (loss_fn, opt)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    from liger_kernel.transformers import apply_liger_kernel_to_qwen3_5

    before = dict(vars(modeling))
    try:
        apply_liger_kernel_to_qwen3_5(model=model)  # rms_norm, swiglu, fused_linear_cross_entropy: its defaults
    finally:  # the patch also swaps module-level classes (RMSNorm, MLP); models built later stay transformers' own
        for name, value in before.items():
            if vars(modeling).get(name) is not value:
                setattr(modeling, name, value)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

    def loss_fn():
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    return loss_fn, opt


def deltacp_stack(model, ids, mesh, backend: str, policy: str):
    from deltacp import parallelize_qwen3_5_cp, shard_batch_for_cp
    from deltacp.losses import cp_causal_lm_loss
    from deltacp.models.checkpointing import apply_activation_checkpointing

    model = parallelize_qwen3_5_cp(model, mesh, linear_attention_cp_mode="p2p", linear_attention_backend=backend)
    if policy != "none":
        apply_activation_checkpointing(model, policy=policy)
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


def free():
    gc.collect()
    torch.cuda.empty_cache()


def run_stack(name: str, args, ids, mesh, device) -> dict:
    """One stack's row: name is a public stack or deltacp/<policy>."""
    model = build_model(args.size, args.layers, device)
    if name == "liger":
        loss_fn, opt = liger_stack(model, ids)
    elif name == "flce":
        loss_fn, opt = flce_stack(model, ids)
    else:
        loss_fn, opt = deltacp_stack(model, ids, mesh, args.backend, name.split("/")[1])
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


def check_public_stacks(stacks) -> str:
    """The public stacks' packages (exit with a message naming what is missing); returns the GDN kernels' label."""
    from fla_ref import load_fla

    loaded = load_fla(bypass_hopper_guard=True)
    if not loaded:
        sys.exit("bench/step.py: the public stacks need flash-linear-attention (pip install flash-linear-attention); "
                 "run with --stacks deltacp to time deltacp alone")
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        sys.exit("bench/step.py: the public stacks need liger-kernel (pip install liger-kernel); run with --stacks "
                 "deltacp to time deltacp alone")
    if "liger" in stacks and not hasattr(liger, "apply_liger_kernel_to_qwen3_5"):
        sys.exit("bench/step.py: this liger-kernel has no apply_liger_kernel_to_qwen3_5 (added in 0.8.1; it patches "
                 "the decoder RMSNorms with its offset-1 RMSNorm, the MLPs with its SwiGLU and the causal-LM forward "
                 "with its fused linear cross-entropy): install liger-kernel >= 0.8.1 or run --stacks flce deltacp")
    return loaded[0]


def ratio_text(base: dict | None, row: dict | None) -> str:
    """base's time / row's time (row's speed-up over base)."""
    if not base or not row or base.get("oom") or row.get("oom"):
        return "-"
    return f"{base['median_ms'] / row['median_ms']:.3f}"


def report(args, rows: list[dict], names: list[str], device_name: str) -> list[str]:
    """The table, the profile, the comparison with the targets; returns the failures (losses, stacks)."""
    failed = []
    ac = ", ".join(n.split("/")[1] for n in names if n.startswith("deltacp/"))
    print(f"\nTraining step at cp = 1, Qwen3.5-{args.size}"
          f"{'' if args.layers is None else f' ({args.layers} layers)'}, bf16, fused AdamW; public stacks with "
          f"gradient checkpointing (full), deltacp with activation checkpointing {ac or '-'}; on "
          f"{device_name}; median of {args.repeat} steps after {args.warmup}")
    print(f"{'tokens':>7} {'stack':<18} {'ms':>9} {'tokens/s':>9} {'x liger':>8} {'x flce':>7} {'peak GiB':>9} "
          f"{'loss0':>9}")
    by = {(r["tokens"], r["stack"]): r for r in rows}
    for length in args.lengths:
        first = next((by[(length, n)] for n in names if not by[(length, n)].get("oom")), None)
        for n in names:
            r = by[(length, n)]
            if r.get("oom") or first is None:
                print(f"{length:>7} {n:<18} {'OOM':>9}")
                continue
            print(f"{length:>7} {n:<18} {r['median_ms']:>9.1f} {r['tokens_per_s']:>9.0f} "
                  f"{ratio_text(by.get((length, 'liger')), r):>8} {ratio_text(by.get((length, 'flce')), r):>7} "
                  f"{r['peak_gib']:>9.2f} {r['loss0']:>9.5f}")
            rel = abs(r["loss0"] - first["loss0"]) / abs(first["loss0"])
            if rel > args.loss_tol:
                failed.append(f"step-0 losses differ at {length}: {n} {r['loss0']} vs {first['stack']} "
                              f"{first['loss0']} (rel {rel:.2e})")
    if args.profile:
        classes = [c for c, _ in KERNEL_CLASSES] + ["other"]
        print(f"\nCUDA kernel time by class, one step (ms)\n{'tokens':>7} {'stack':<18} "
              + " ".join(f"{c:>11}" for c in classes) + f" {'total':>9}")
        for r in rows:
            if "profile_ms" in r:
                prof = r["profile_ms"]
                print(f"{r['tokens']:>7} {r['stack']:<18} " + " ".join(f"{prof.get(c, 0.0):>11.1f}" for c in classes)
                      + f" {sum(prof.values()):>9.1f}")
    print()
    for line in target_lines(args, by):
        print(line)
    return failed


def target_lines(args, by: dict) -> list[str]:
    """One line per length that has a target (`TARGETS`): deltacp's speed-ups over the liger stack against them."""
    lines = []
    for length in args.lengths:
        target = TARGETS.get((args.size, args.layers, length))
        if target is None:
            continue
        liger = by.get((length, "liger"))
        if not liger or liger.get("oom"):
            lines.append(f"targets at {args.size} {length}: the liger stack did not run; nothing to compare")
            continue
        parts = []
        for policy, goal in zip(("full", "selective"), target):
            row = by.get((length, f"deltacp/{policy}"))
            if goal is None or not row or row.get("oom"):
                continue
            speed = liger["median_ms"] / row["median_ms"]
            text = f"{policy} {speed:.3f}x (target {goal}x: {'met' if speed >= goal else 'NOT met'})"
            if policy == "selective":
                text += (f", peak {row['peak_gib']:.2f} vs liger {liger['peak_gib']:.2f} GiB "
                         f"({'met' if row['peak_gib'] <= liger['peak_gib'] else 'NOT met'})")
            parts.append(text)
        lines.append(f"targets at {args.size}{'' if args.layers is None else f' ({args.layers} layers)'} {length}: "
                     f"deltacp over the liger stack: " + ("; ".join(parts) or "no deltacp row with a target"))
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2B")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--stacks", nargs="+", default=["liger", "flce", "deltacp"],
                        choices=["liger", "flce", "deltacp"])
    parser.add_argument("--ac", nargs="+", default=["full", "selective"], choices=["none", "full", "selective"],
                        help="deltacp's activation checkpointing policies, one row each")
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
    names = [n for n in args.stacks if n in PUBLIC_STACKS] + (
        [f"deltacp/{p}" for p in args.ac] if "deltacp" in args.stacks else [])
    if any(n in PUBLIC_STACKS for n in names):
        label = check_public_stacks(args.stacks)
        print(f"public stacks: transformers + {label} + gradient checkpointing; liger: + liger-kernel's Qwen3.5 patch "
              f"(RMSNorm, SwiGLU, fused linear CE); flce: + liger-kernel's fused linear CE only")
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
        for name in names:
            try:
                row = run_stack(name, args, ids, mesh, device)
            except torch.OutOfMemoryError:  # a public stack that does not fit is reported, deltacp's fails the run
                row = dict(bench="step", stack=name, size=args.size, tokens=length, oom=True)
                if name not in PUBLIC_STACKS:
                    failed.append(f"{name} OOM at {length}")
                free()
            rows.append(row)
            emit(row, args.json)
    dist.destroy_process_group()
    failed = report(args, rows, names, torch.cuda.get_device_name(0)) + failed
    if failed:
        print("FAILED: " + "; ".join(failed))
        sys.exit(1)


def build_vocab_size(size: str) -> int:
    from deltacp.models.presets import qwen3_5_preset

    return qwen3_5_preset(size)["vocab_size"]


if __name__ == "__main__":
    main()
