"""Loading a transformers checkpoint under CP + FSDP2 (`deltacp.load_pretrained`): peak memory and load time.

    python bench/load.py --ranks 4 --size 0.8B                       # CPU: 4 gloo ranks, peak RSS growth per rank
    python bench/load.py --gpu --size 27B --dtype bfloat16 float32   # one GPU, FSDP over one rank: peak device memory
    python bench/load.py --gpu --size 0.8B --layers 8 --check        # + weights and logits against from_pretrained
    python bench/load.py --arithmetic                                # parameter bytes per rank, 27B and the MoE sizes

The checkpoint is --ckpt, or a synthetic one written once (reused afterwards; --cleanup deletes it) under --workdir
(default: the first of $TMPDIR, /tmp and /dev/shm with room for it): the released Qwen3.5 dense shape `--size` (deltacp.models.presets,
vocabulary 248,320; --layers cuts it), bf16, `Qwen3_5ForCausalLM` names, safetensors files of at most 4 GB with
their index, each tensor filled by tiling one seeded random block (values do not matter to memory or time).

CPU (--ranks P): P spawned gloo ranks each load it with `load_pretrained(dtype=--dtype)` (FSDP2 over the P ranks);
per rank the peak RSS growth over the load (the kernel's high-water mark, reset at the start:
deltacp.testing.memory.PeakRSS) as bytes and as a multiple of the checkpoint's bytes, and the load time (max over
ranks). A float32 load of a bf16 checkpoint holds 2/P of its bytes per rank; a whole float32 copy per rank is 2.0x.

GPU (--gpu): one process, a one-rank NCCL group, FSDP2 over that rank: peak allocated device memory during the
load (torch.cuda.max_memory_allocated after a reset) against the parameters' bytes, and the time. --check compares
every parameter (exactly) and the logits of one 512-token row (float32, TF32 off; rel-L2) with
`from_pretrained(dtype=float32)` on the same GPU, and exits 1 when they differ.

--arithmetic: the parameter count of 27B and of the MoE sizes (35B-A3B, 122B-A10B, 397B-A17B, text model) built on
the meta device, and the bf16 bytes each rank holds at load on 8 and 64 GPUs: whole (what every rank held before
load_pretrained) and under FSDP2 (dim 0 of every tensor sharded, the largest shard).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import emit  # noqa: E402

GiB = 2**30
FILE_BYTES = 4 * 10**9
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# The MoE sizes' text models (Qwen3_5MoeTextConfig fields beyond the shared ones of deltacp.models.presets): as quoted
# in public third-party code (THUDM/slime scripts/models/qwen3.5-{35B-A3B,397B-A17B}.sh; 122B-A10B: hidden 3072, 48
# layers, 256 experts, GDN heads 16 / 64 as in tests/gpu/test_family_gdn_shapes_gpu.py), not read from config.json.
MOE_SIZES = {
    "35B-A3B": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                    linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512),
    "122B-A10B": dict(hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2,
                      linear_num_key_heads=16, linear_num_value_heads=64, num_experts=256, num_experts_per_tok=8,
                      moe_intermediate_size=1024, shared_expert_intermediate_size=1024),
    "397B-A17B": dict(hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2,
                      linear_num_key_heads=16, linear_num_value_heads=64, num_experts=512, num_experts_per_tok=10,
                      moe_intermediate_size=1024, shared_expert_intermediate_size=1024),
}


def dense_config(size: str, layers: int | None):
    from transformers import Qwen3_5TextConfig

    from deltacp.models.presets import qwen3_5_preset

    fields = qwen3_5_preset(size)
    if layers is not None:
        fields.update(num_hidden_layers=layers, layer_types=fields["layer_types"][:layers])
    return Qwen3_5TextConfig(**fields)


def moe_config(size: str):
    from transformers import Qwen3_5MoeTextConfig

    from deltacp.models.presets import qwen3_5_preset

    base = {k: v for k, v in qwen3_5_preset("27B").items()
            if k in ("vocab_size", "head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                     "max_position_embeddings", "rms_norm_eps", "rope_parameters")}
    fields = dict(base, **MOE_SIZES[size], tie_word_embeddings=False)
    layers = fields["num_hidden_layers"]
    fields["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return Qwen3_5MoeTextConfig(**fields)


def meta_model(config, cls_name: str = "Qwen3_5ForCausalLM"):
    import transformers

    with torch.device("meta"):
        return getattr(transformers, cls_name)(config)


def synthetic_checkpoint(config, given: str | None, name: str) -> Path:
    """A bf16 checkpoint of `config` (Qwen3_5ForCausalLM) named `name` under --workdir or the first of $TMPDIR, /tmp,
    /dev/shm with room for it, written once (see the module doc)."""
    from safetensors.torch import save_file

    from deltacp.checkpoint_io.hf_format import INDEX_NAME, model_tensors

    tensors = model_tensors(meta_model(config))
    need = sum(t.numel() for _, t in tensors) * 2
    candidates = [Path(given)] if given else [Path(d) / "deltacp-load-bench" for d in
                                              (os.environ.get("TMPDIR"), "/tmp", "/dev/shm") if d and os.path.isdir(d)]
    for workdir in candidates:
        if (workdir / name / "done").is_file():
            return workdir / name
    for workdir in candidates:
        workdir.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(workdir).free > need * 1.02 + GiB:
            break
    else:
        raise SystemExit(f"bench/load.py: the {need / GiB:.1f} GiB checkpoint fits in none of "
                         f"{[str(c) for c in candidates]}: pass --workdir")
    path = workdir / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    block = (torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    groups, size = [[]], 0
    for name_, t in tensors:
        nbytes = t.numel() * 2
        if groups[-1] and size + nbytes > FILE_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name_, t.shape))
        size += nbytes
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        data = {}
        for key, shape in group:
            n = math.prod(shape)
            data[key] = block.repeat(-(-n // block.numel()))[:n].view(shape)
            weight_map[key] = file
        save_file(data, str(path / file), metadata={"format": "pt"})
        del data
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": need}, "weight_map": weight_map}))
    config.architectures = ["Qwen3_5ForCausalLM"]
    config.dtype = torch.bfloat16
    config.save_pretrained(path)
    (path / "done").write_text("")
    return path


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


# -- CPU ranks -----------------------------------------------------------------------------------------------------
def cpu_worker(rank: int, world: int, path: str, dtype: str, nbytes: int, json_path: str | None) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from deltacp import load_pretrained
    from deltacp.testing.memory import PeakRSS

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    dist.barrier()
    start = time.perf_counter()
    with PeakRSS() as peak:
        model = load_pretrained(path, mesh, dtype=DTYPES[dtype])
    seconds = time.perf_counter() - start
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    rows = [None] * world
    dist.all_gather_object(rows, dict(rank=rank, growth=peak.growth, exact=peak.exact, held=held, seconds=seconds))
    if rank == 0:
        for r in rows:
            print(f"rank {r['rank']}: peak RSS growth {r['growth'] / 2**20:9.1f} MiB = {r['growth'] / nbytes:.3f}x "
                  f"of the checkpoint; parameters held {r['held'] / 2**20:9.1f} MiB = {r['held'] / nbytes:.3f}x; "
                  f"{r['seconds']:.2f} s{'' if r['exact'] else ' (peak not reset: an upper bound)'}")
        worst = max(r["growth"] for r in rows)
        print(f"checkpoint {nbytes / GiB:.2f} GiB bf16, {world} ranks, load as {dtype}: worst peak RSS growth "
              f"{worst / nbytes:.3f}x of the checkpoint's bytes, load {max(r['seconds'] for r in rows):.2f} s")
        emit(dict(bench="load", device="cpu", ranks=world, dtype=dtype, ckpt_bytes=nbytes,
                  peak_rss_growth=[r["growth"] for r in rows], held=[r["held"] for r in rows],
                  seconds=max(r["seconds"] for r in rows)), json_path)


# -- one GPU -------------------------------------------------------------------------------------------------------
def gpu_run(path: Path, dtypes: list[str], check: bool, json_path: str | None) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from deltacp import load_pretrained
    from deltacp.distributed.launch import free_port

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))
    failed = 0
    try:
        for dtype in dtypes:
            gc.collect()  # the previous dtype's model (FSDP2 modules hold reference cycles): freed before measuring
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            start = time.perf_counter()
            model = load_pretrained(path, mesh, dtype=DTYPES[dtype])
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
            peak = torch.cuda.max_memory_allocated() - base
            print(f"{path.name} as {dtype} on {torch.cuda.get_device_name()}: peak allocated {peak / GiB:.2f} GiB, "
                  f"parameters {held / GiB:.2f} GiB (peak - parameters {(peak - held) / 2**20:.0f} MiB), "
                  f"{seconds:.1f} s ({checkpoint_bytes(path) / GiB / seconds:.2f} GiB/s of checkpoint)")
            row = dict(bench="load", device=torch.cuda.get_device_name(), dtype=dtype, ckpt=path.name,
                       ckpt_bytes=checkpoint_bytes(path), peak_allocated=peak, params=held, seconds=seconds)
            if check:
                row.update(compare(model, path, dtype))
                failed += not row["ok"]
            emit(row, json_path)
            del model
    finally:
        dist.destroy_process_group()
    return failed


def compare(model, path: Path, dtype: str) -> dict:
    """Every parameter against from_pretrained's (exact), the logits of one row (rel-L2, bound 1e-4 in float32)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).cuda().eval()
    ref_state = ref.state_dict()
    differ = [n for n, p in model.state_dict().items() if not torch.equal(p.full_tensor(), ref_state[n])]
    ids = torch.randint(0, ref.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits.double()
        want = ref(input_ids=ids, use_cache=False).logits.double()
    rel = ((got - want).norm() / want.norm()).item()
    bound = 1e-4 if dtype == "float32" else 2e-2
    ok = not differ and rel < bound
    print(f"  check against from_pretrained: {len(differ)} parameter(s) differ{' e.g. ' + differ[0] if differ else ''}"
          f"; logits rel-L2 {rel:.2e} (bound {bound:.0e}): {'ok' if ok else 'FAILED'}")
    return dict(params_differ=len(differ), logits_rel_l2=rel, ok=ok)


# -- arithmetic ----------------------------------------------------------------------------------------------------
def arithmetic(json_path: str | None) -> None:
    from deltacp.checkpoint_io.hf_format import model_tensors

    print(f"{'model':>12} {'params':>9} {'bf16 GB':>8} | {'whole/rank':>10} | {'FSDP2, 8 GPUs':>14} | "
          f"{'FSDP2, 64 GPUs':>14} | largest tensor")
    cases = [("27B", meta_model(dense_config("27B", None)))]
    cases += [(size, meta_model(moe_config(size), "Qwen3_5MoeForCausalLM")) for size in MOE_SIZES]
    for size, model in cases:
        tensors = model_tensors(model)
        n = sum(t.numel() for _, t in tensors)
        per_rank = {}
        for ranks in (8, 64):
            per_rank[ranks] = sum(math.ceil(t.shape[0] / ranks) * math.prod(t.shape[1:]) if t.ndim else 1
                                  for _, t in tensors) * 2
        big_name, big = max(tensors, key=lambda kv: kv[1].numel())
        print(f"{size:>12} {n / 1e9:8.2f}B {n * 2 / 1e9:8.1f} | {n * 2 / 1e9:8.1f} GB | {per_rank[8] / 1e9:11.2f} GB | "
              f"{per_rank[64] / 1e9:11.2f} GB | {big_name.split('layers.0.')[-1]} {tuple(big.shape)} "
              f"{big.numel() * 2 / 1e9:.2f} GB")
        emit(dict(bench="load_arithmetic", model=size, params=n, bf16_bytes=n * 2, fsdp8=per_rank[8],
                  fsdp64=per_rank[64]), json_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4, help="CPU gloo ranks (without --gpu)")
    parser.add_argument("--gpu", action="store_true", help="one GPU, FSDP over one rank")
    parser.add_argument("--size", default="0.8B", help="a released dense size (deltacp.models.presets)")
    parser.add_argument("--layers", type=int, default=None, help="cut the model to this many decoder layers")
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=list(DTYPES), help="load dtype(s)")
    parser.add_argument("--ckpt", default=None, help="an existing checkpoint directory instead of a synthetic one")
    parser.add_argument("--workdir", default=None, help="where the synthetic checkpoint is written")
    parser.add_argument("--cleanup", action="store_true", help="delete the synthetic checkpoint afterwards")
    parser.add_argument("--check", action="store_true", help="GPU: compare with from_pretrained; exit 1 on a mismatch")
    parser.add_argument("--arithmetic", action="store_true", help="parameter bytes per rank, no loading")
    parser.add_argument("--json", default=None, help="append JSON rows to this file")
    args = parser.parse_args()
    if args.arithmetic:
        arithmetic(args.json)
        return
    if args.ckpt is not None:
        path = Path(args.ckpt)
    else:
        name = f"qwen3_5-{args.size}" + (f"-{args.layers}layers" if args.layers else "")
        start = time.perf_counter()
        path = synthetic_checkpoint(dense_config(args.size, args.layers), args.workdir, name)
        print(f"checkpoint {path} ({checkpoint_bytes(path) / GiB:.2f} GiB bf16; ready in "
              f"{time.perf_counter() - start:.1f} s)")
    try:
        if args.gpu:
            failed = gpu_run(path, args.dtype, args.check, args.json)
        else:
            from deltacp.distributed.launch import run_distributed

            for dtype in args.dtype:
                run_distributed(cpu_worker, args.ranks, str(path), dtype, checkpoint_bytes(path), args.json,
                                timeout_s=1800)
            failed = 0
    finally:
        if args.cleanup and args.ckpt is None:
            shutil.rmtree(path, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
