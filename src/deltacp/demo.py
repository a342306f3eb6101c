"""CP parity of a small Qwen3.5 hybrid on real text, on CPU ranks over gloo (no GPU needed).

    python -m deltacp.demo --world-size 4 --seq-len 2048

Every rank builds the same model (3 GDN + 1 full attention layers) from one seed and reads the same
tokens: the bytes of Python standard library source files found on this machine. Each CP mode runs one
forward/backward on the rank's slice; the single-device transformers model runs the whole sequence.
The table gives rel-L2 = ||cp - single|| / ||single|| of logits, input (embedding) gradients, all
parameter gradients and the grad norm, with the loss of both, then a verdict line (PASS, or FAIL and exit
status 1, against AGREEMENT).
"""

from __future__ import annotations

import argparse
import copy
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from deltacp.parallel.modes import LINEAR_ATTENTION_CP_MODES

MODES = LINEAR_ATTENTION_CP_MODES
AGREEMENT = 1e-5
"""The verdict's bound on every rel-L2: transformers computes its norms, gates and GDN in float32 even for a float64
model, so CP and it agree to float32 level (observed ~5e-7; NOTES.md), not to float64 rounding."""


def stdlib_text_bytes(n: int, skip: int = 0) -> torch.Tensor:
    """n bytes of real text: Python standard library sources, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= n + skip:
            break
    return torch.tensor(list(out[skip: skip + n]), dtype=torch.long)


def tiny_hybrid_config(hidden: int = 128):
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=8, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=1 << 17, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def _global_rel(err_sq: float, ref_sq: float, group=None) -> float:
    stats = torch.tensor([err_sq, ref_sq], dtype=torch.float64)
    dist.all_reduce(stats, group=group)
    return (stats[0].sqrt() / stats[1].sqrt()).item()


def _worker(rank: int, world: int, seq_len: int, dtype_name: str, modes: list[str], results: dict) -> None:
    from transformers import Qwen3_5ForCausalLM

    from deltacp.models.gates import long_memory_gates_
    from deltacp.batching import shard_batch_for_cp
    from deltacp.models.fsdp import all_reduce_cp_grads
    from deltacp.losses import cp_cross_entropy
    from deltacp.models.parallelize import parallelize_cp

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    # Slowly decaying GDN heads, so that each rank's result depends on the state handed over to it.
    base = long_memory_gates_(Qwen3_5ForCausalLM(tiny_hybrid_config())).to(dtype)
    ids = stdlib_text_bytes(seq_len)[None]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))

    single = copy.deepcopy(base)
    embeds = single.get_input_embeddings()(ids).detach().requires_grad_()
    out = single(inputs_embeds=embeds, labels=ids, use_cache=False)
    out.loss.backward()
    ref_grads = torch.cat([p.grad.flatten() for p in single.parameters() if p.grad is not None])

    rows = []
    for mode in modes:
        model = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode=mode)
        batch = shard_batch_for_cp(ids, mesh)
        local_embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_()
        start = time.perf_counter()
        logits = model(inputs_embeds=local_embeds, position_ids=batch["position_ids"], use_cache=False).logits
        loss = cp_cross_entropy(logits, batch["target_ids"], mesh)
        loss.backward()
        all_reduce_cp_grads(model, mesh)
        seconds = time.perf_counter() - start
        s = seq_len // world
        cut = slice(rank * s, (rank + 1) * s)
        ref_logits, ref_dx = out.logits[:, cut].detach(), embeds.grad[:, cut]
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        rows.append(dict(
            mode=mode,
            logits=_global_rel((logits.detach() - ref_logits).double().pow(2).sum().item(),
                               ref_logits.double().pow(2).sum().item()),
            input_grad=_global_rel((local_embeds.grad - ref_dx).double().pow(2).sum().item(),
                                   ref_dx.double().pow(2).sum().item()),
            param_grads=((grads - ref_grads).double().norm() / ref_grads.double().norm()).item(),
            grad_norm=abs(grads.double().norm().item() / ref_grads.double().norm().item() - 1),
            loss=loss.item(), single_loss=out.loss.item(), seconds=seconds))
    if rank == 0:
        results["rows"] = rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4, help="CP ranks (CPU processes over gloo)")
    parser.add_argument("--seq-len", type=int, default=2048, help="global tokens (divisible by the world size)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args(argv)
    if args.seq_len % args.world_size:
        parser.error(f"--seq-len ({args.seq_len}) must be divisible by --world-size ({args.world_size})")

    import torch.multiprocessing as mp

    from deltacp.distributed.launch import run_distributed

    with mp.Manager() as manager:
        results = manager.dict()
        run_distributed(_worker, args.world_size, args.seq_len, args.dtype, args.modes, results, timeout_s=1800)
        rows = list(results["rows"])
    print(f"\nCP{args.world_size} vs single device: Qwen3.5 hybrid (3 GDN + 1 full attention), {args.seq_len} tokens "
          f"of Python stdlib source, {args.dtype}, CPU/gloo")
    header = f"{'mode':<11} {'logits':>9} {'input grad':>11} {'param grads':>12} {'grad norm':>10} " \
             f"{'loss cp':>9} {'loss single':>12} {'cp fwd+bwd s':>13}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['mode']:<11} {r['logits']:>9.2e} {r['input_grad']:>11.2e} {r['param_grads']:>12.2e} "
              f"{r['grad_norm']:>10.2e} {r['loss']:>9.5f} {r['single_loss']:>12.5f} {r['seconds']:>13.2f}")
    print("(rel-L2 = ||cp - single|| / ||single||; grad norm: |norm_cp / norm_single - 1|)")
    worst = max(max(r[k] for k in ("logits", "input_grad", "param_grads", "grad_norm")) for r in rows)
    if worst <= AGREEMENT:
        print(f"PASS: every mode agrees with transformers' single-device model within {AGREEMENT:.0e} (worst "
              f"{worst:.2e}; float32-level, transformers computes its norms and gates in float32)")
    else:
        print(f"FAIL: a mode differs from transformers' single-device model by {worst:.2e} > {AGREEMENT:.0e}")
        sys.exit(1)


if __name__ == "__main__":
    main()
