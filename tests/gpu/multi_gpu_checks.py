"""Multi-GPU checks over NCCL, one GPU per rank (`scripts/gpu_checks.sh multi`; torchrun, 2-8 GPUs):

    torchrun --standalone --nproc-per-node 4 tests/gpu/multi_gpu_checks.py --steps 20

- layer parity: a GDN layer in every mode (eager float64; triton bf16 for ulysses/p2p) against the same layer
  on a one-rank mesh of this rank, unpacked and on a packed row;
- model parity: the 3-linear + 1-full hybrid in float64, every mode, FSDP2 on, logits, loss and gradients against
  the one-rank computation, unpacked and packed;
- full attention past the head count: a Qwen3_5Attention layer with full_attention_cp all_gather / ring at Ulysses
  degree 1 and every 2-D degree the world size allows (eager float64; bf16 flash tiles on CUDA), unpacked and
  packed; the model in the 2-D layouts (ulysses_degree 1 and every u < world dividing it; p2p / all_gather with
  ring / all_gather) and under sequence_layout='balanced' (p2p chain and scan, 1-D and 2-D);
- training: `--steps` consecutive steps per mode (and for the ring / 2-D layouts) with and without activation
  checkpointing, FSDP2 on, a packed row each step: finite, no growth of allocated memory after the first steps,
  and identical losses with and without checkpointing (a ring recompute re-sends its blocks on every rank).
Every check prints one row; the script exits 1 if any failed. A hang ends in the process-group timeout
(`--timeout-s`), so nothing waits forever. `--device cpu` runs the same over gloo (to check the script itself).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from helpers import (flat, full_tensors, grads_of, local_slice, long_memory_gates_, rel_l2,  # noqa: E402
                     summed_over_ranks, tiny_config)

MODES = ("ulysses", "p2p", "all_gather")
PACKED = [0, 1, 4, 37, 100, 101, 180, 256]  # boundaries inside ranks, lengths 1 and 3, on rank boundaries of CP2


def _self_mesh(device_type: str) -> DeviceMesh:
    mine = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r])
        if r == dist.get_rank():
            mine = group
    return DeviceMesh.from_group(mine, device_type, mesh_dim_names=("cp",))


def _sum_grads(module) -> torch.Tensor:
    return flat(full_tensors({n: p.grad for n, p in module.named_parameters() if p.grad is not None}))


def _layer_figures(cp, ref, out, out_ref, xl, xr, rank: int, world: int) -> dict[str, float]:
    """rel-L2 of a CP'd layer's output, input gradient and rank-summed parameter gradients against the
    single-device layer `ref` (its output out_ref and input xr)."""
    grads = summed_over_ranks({n: g.double() for n, g in grads_of(cp).items()})
    return {"output": rel_l2(out, local_slice(out_ref, rank, world)),
            "input grad": rel_l2(xl.grad, local_slice(xr.grad, rank, world)),
            "param grads": rel_l2(flat(grads), flat(grads_of(ref)))}


def layer_checks(device, mesh, self_mesh, rows):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from deltacp import LinearAttentionContextParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    S = 256
    for backend, dtype, bound in (("eager", torch.float64, 1e-8), ("triton", torch.bfloat16, 2e-2)):
        if backend == "triton" and device.type != "cuda":
            continue
        config = tiny_config() if backend == "eager" else tiny_config(
            hidden_size=512, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
            linear_value_head_dim=128)
        base = long_memory_gates_(Qwen3_5GatedDeltaNet(config, 0)).to(device)
        hidden = config.hidden_size
        x = torch.randn(1, S, hidden, device=device, dtype=torch.float64)
        d_out = torch.randn(1, S, hidden, device=device, dtype=torch.float64)
        for mode in MODES:
            if backend == "triton" and mode == "all_gather":
                continue
            for cu in (None, torch.tensor(PACKED)):
                kw = {} if cu is None else {"cu_seq_lens_q": cu}
                # the reference: eager float64 on this rank alone
                ref = LinearAttentionContextParallel(mode=mode, backend="eager").apply(
                    copy.deepcopy(base).double(), self_mesh)
                xr = x.clone().requires_grad_()
                out_ref = ref(xr, **kw)
                (out_ref * d_out).sum().backward()
                cp = LinearAttentionContextParallel(mode=mode, backend=backend).apply(
                    copy.deepcopy(base).to(dtype), mesh)
                xl = local_slice(x, rank, world).to(dtype).requires_grad_()
                out = cp(xl, **kw)
                (out.double() * local_slice(d_out, rank, world)).sum().backward()
                figures = _layer_figures(cp, ref, out, out_ref, xl, xr, rank, world)
                label = f"layer {mode}+{backend} {'packed' if cu is not None else 'unpacked'}"
                rows.append((label, max(figures.values()), bound))


def two_d_degrees(world: int) -> list[int]:
    """Ulysses degrees of the 2-D layout at this world size (1: groups of one rank)."""
    return [u for u in (1, 2, 4) if u < world and world % u == 0]


def two_d_layouts(world: int) -> list[dict]:
    layouts = []
    for u in two_d_degrees(world):
        layouts += [dict(ulysses_degree=u, linear_attention_cp_mode="p2p", full_attention_cp="ring"),
                    dict(ulysses_degree=u, linear_attention_cp_mode="all_gather", full_attention_cp="all_gather")]
    return layouts


def balanced_layouts(world: int) -> list[dict]:
    """sequence_layout='balanced' (rank r: pieces r and 2P - 1 - r): 1-D p2p with the scan (ring attention) and
    with the chain (all_gather attention), and a 2-D layout."""
    layouts = [dict(ulysses_degree=1, linear_attention_cp_mode="p2p", full_attention_cp="ring",
                    linear_attention_state_passing="scan", sequence_layout="balanced"),
               dict(ulysses_degree=1, linear_attention_cp_mode="p2p", full_attention_cp="all_gather",
                    sequence_layout="balanced")]
    if two_d_degrees(world)[-1] > 1:
        layouts.append(dict(ulysses_degree=two_d_degrees(world)[-1], linear_attention_cp_mode="p2p",
                            full_attention_cp="ring", linear_attention_state_passing="scan",
                            sequence_layout="balanced"))
    return layouts


def _layout_label(kw: dict) -> str:
    extra = "".join(f" {kw[k]}" for k in ("linear_attention_state_passing", "sequence_layout") if k in kw)
    return f"u={kw['ulysses_degree']} {kw['linear_attention_cp_mode']}+{kw['full_attention_cp']}{extra}"


def attention_checks(device, mesh, self_mesh, rows):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5TextRotaryEmbedding

    from deltacp.parallel.attention import attention_cp_plan, install_kv_cp_attention
    from deltacp.parallel.documents import AttentionDocuments, CPForwardContext

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    S = 256
    for dtype, bound in ((torch.float64, 1e-8), (torch.bfloat16, 2e-2)):
        if dtype == torch.bfloat16 and device.type != "cuda":
            continue
        config = tiny_config() if dtype == torch.float64 else tiny_config(hidden_size=512, head_dim=128)
        base = Qwen3_5Attention(config, 3).to(device)
        rotary = Qwen3_5TextRotaryEmbedding(config).to(device)
        x = torch.randn(1, S, config.hidden_size, device=device, dtype=torch.float64)
        d_out = torch.randn_like(x)
        cos, sin = rotary(x, torch.arange(S, device=device)[None, None].expand(3, 1, -1))
        for cu in (None, torch.tensor(PACKED)):
            ctx = None if cu is None else CPForwardContext(attention=AttentionDocuments.build(cu))
            ref = install_kv_cp_attention(copy.deepcopy(base).double(), attention_cp_plan(self_mesh, "all_gather", 1))
            xr = x.clone().requires_grad_()
            out_ref, _ = ref(xr, (cos.double(), sin.double()), ctx)
            (out_ref * d_out).sum().backward()
            for method in ("all_gather", "ring"):
                for u in two_d_degrees(world):
                    cp = install_kv_cp_attention(copy.deepcopy(base).to(dtype), attention_cp_plan(mesh, method, u))
                    xl = local_slice(x, rank, world).to(dtype).requires_grad_()
                    out, _ = cp(xl, (local_slice(cos, rank, world).to(dtype), local_slice(sin, rank, world).to(dtype)),
                                ctx)
                    (out.double() * local_slice(d_out, rank, world)).sum().backward()
                    figures = _layer_figures(cp, ref, out, out_ref, xl, xr, rank, world)
                    label = (f"attention {method} u={u} {str(dtype)[6:]} {'packed' if cu is not None else 'unpacked'}")
                    rows.append((label, max(figures.values()), bound))


def model_checks(device, mesh, self_mesh, rows):
    from transformers import Qwen3_5ForCausalLM

    from deltacp import cp_cross_entropy, fully_shard_qwen3_5, parallelize_qwen3_5_cp, shard_batch_for_cp

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = long_memory_gates_(Qwen3_5ForCausalLM(tiny_config()).double()).to(device)
    ids = torch.randint(0, 256, (1, 256), device=device)
    layouts = [dict(linear_attention_cp_mode=mode) for mode in MODES] + two_d_layouts(world) + balanced_layouts(world)
    for kw in layouts:
        mode = kw["linear_attention_cp_mode"] if len(kw) == 1 else _layout_label(kw)
        layout = kw.get("sequence_layout", "contiguous")
        for cu in (None, torch.tensor(PACKED)):
            results = []
            for m, fsdp in ((self_mesh, False), (mesh, True)):
                model = parallelize_qwen3_5_cp(copy.deepcopy(base), m, **(kw if fsdp else dict(
                    linear_attention_cp_mode=kw["linear_attention_cp_mode"])))
                if fsdp:
                    fully_shard_qwen3_5(model, m)
                batch = shard_batch_for_cp(ids, m, cu_seqlens=cu, sequence_layout=layout if fsdp else "contiguous")
                logits = model(**{k: v for k, v in batch.items() if k != "target_ids"}, use_cache=False).logits
                loss = cp_cross_entropy(logits, batch["target_ids"], m)
                loss.backward()
                results.append((logits.detach(), loss.detach(), _sum_grads(model)))
            (logits_ref, loss_ref, g_ref), (logits, loss, g) = results
            label = f"model {mode} fsdp {'packed' if cu is not None else 'unpacked'}"
            worst = max(rel_l2(logits, local_slice(logits_ref, rank, world, layout=layout)),
                        abs(loss / loss_ref - 1).item(),
                        rel_l2(g, g_ref))
            rows.append((label, worst, 1e-7))


def training_checks(device, mesh, steps, rows):
    from transformers import Qwen3_5ForCausalLM

    from deltacp import cp_cross_entropy, fully_shard_qwen3_5, parallelize_qwen3_5_cp, shard_batch_for_cp
    from deltacp.models.checkpointing import apply_activation_checkpointing

    torch.manual_seed(0)
    base = long_memory_gates_(Qwen3_5ForCausalLM(tiny_config())).to(device)
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 256, (1, 512), generator=data),
                torch.tensor([0] + sorted(torch.randperm(510, generator=data)[:6].add(1).tolist()) + [512]))
               for _ in range(steps)]
    world = dist.get_world_size()
    layouts = [dict(linear_attention_cp_mode=mode) for mode in MODES] + [
        dict(linear_attention_cp_mode="p2p", full_attention_cp="ring"), two_d_layouts(world)[-1],
        balanced_layouts(world)[0]]
    for kw in layouts:
        mode = kw["linear_attention_cp_mode"] if len(kw) == 1 else (
            _layout_label(kw) if "ulysses_degree" in kw else f"p2p+{kw['full_attention_cp']}")
        layout = kw.get("sequence_layout", "contiguous")
        losses = {}
        for ac in (False, True):
            model = parallelize_qwen3_5_cp(copy.deepcopy(base), mesh, **kw)
            if ac:
                apply_activation_checkpointing(model)
            fully_shard_qwen3_5(model, mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            memory, run = [], []
            for ids, cu in batches:
                batch = shard_batch_for_cp(ids.to(device), mesh, cu_seqlens=cu, sequence_layout=layout)
                logits = model(**{k: v for k, v in batch.items() if k != "target_ids"}, use_cache=False).logits
                loss = cp_cross_entropy(logits, batch["target_ids"], mesh)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                run.append(loss.item())
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    memory.append(torch.cuda.memory_allocated())
            losses[ac] = run
            finite = all(torch.isfinite(torch.tensor(run)))
            grew = bool(memory) and memory[-1] > memory[min(2, len(memory) - 1)]
            rows.append((f"train {mode} {steps} steps AC={'full' if ac else 'none'} finite, no memory growth",
                         0.0 if finite and not grew else 1.0, 0.5))
        diff = max(abs(a / b - 1) for a, b in zip(losses[True], losses[False]))
        rows.append((f"train {mode}: AC full vs none, max loss rel diff", diff, 1e-6))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--timeout-s", type=float, default=120)
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=args.timeout_s))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    self_mesh = _self_mesh(device.type)
    rows = []
    try:
        layer_checks(device, mesh, self_mesh, rows)
        attention_checks(device, mesh, self_mesh, rows)
        model_checks(device, mesh, self_mesh, rows)
        training_checks(device, mesh, args.steps, rows)
    finally:
        worst = torch.tensor([value for _, value, _ in rows], dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the worst rank's figure per check
        failed = 0
        if rank == 0:
            print(f"\nCP{world} over {dist.get_backend()} ({device.type})")
            print(f"{'check':<70} {'worst':>10} {'bound':>8}  verdict")
            for (label, _, bound), value in zip(rows, worst.tolist()):
                ok = value < bound
                failed += not ok
                print(f"{label:<70} {value:>10.2e} {bound:>8.0e}  {'ok' if ok else 'FAILED'}")
            print(f"{len(rows) - failed} passed, {failed} failed")
        verdict = torch.tensor([failed], device=device)
        dist.broadcast(verdict, 0)
        dist.destroy_process_group()
    sys.exit(1 if verdict.item() else 0)


if __name__ == "__main__":
    main()
