"""Shared timing helper: warm-up, CUDA events per iteration, median / min / p90, peak memory.

Single-process helper: where several ranks run, take the max over ranks of each iteration before the
statistics (`reduce_max_over_ranks`). First compile/autotune is excluded by the warm-up.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from collections import defaultdict
from typing import Callable

import torch


def _percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[i]


def reduce_max_over_ranks(times_ms: list[float]) -> list[float]:
    """Max over ranks of each iteration (no-op without an initialised process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return times_ms
    on_gpu = torch.cuda.is_available() and dist.get_backend() == "nccl"  # gloo reduces host tensors
    t = torch.tensor(times_ms, device="cuda" if on_gpu else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def max_over_ranks(value: float) -> float:
    """Max of a scalar over ranks (identity without a process group); NCCL reduces on the GPU, gloo on host."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def time_cuda(fn: Callable[[], object], *, warmup: int = 5, repeat: int = 20,
              setup: Callable[[], object] | None = None,
              barrier: Callable[[], object] | None = None) -> dict[str, float]:
    """Run fn warmup times, then time `repeat` calls with CUDA events (synchronised around each).

    `setup` (untimed) runs before every call, e.g. a forward before a timed backward; fn gets its result.
    `barrier` (e.g. torch.distributed.barrier) runs before each timed call, so that ranks start together.

    Returns median/min/p90 in ms and the peak allocated memory (GiB) seen during the timed calls.
    """
    call = (lambda: fn(setup())) if setup is not None else fn
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeat):
        arg = setup() if setup is not None else None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if barrier is not None:
            barrier()
        start.record()
        fn(arg) if setup is not None else fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times = reduce_max_over_ranks(times)
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "p90_ms": _percentile(times, 90),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def emit(row: dict, path: str | None = None) -> None:
    """One JSON row to stdout (and appended to `path`); with BENCH_VARIANT set (gpu_checks.sh's A/B parts: the
    launch table or switch the process runs), the row carries it as "variant"."""
    if os.environ.get("BENCH_VARIANT"):
        row = {**row, "variant": os.environ["BENCH_VARIANT"]}
    line = json.dumps(row, sort_keys=True)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


# (class, pattern over the lower-cased kernel name); the first that matches names the kernel's class
KERNEL_CLASSES: list[tuple[str, str]] = [
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("attention", r"flash|fmha|attention|sdpa|pytorch_flash|cudnn.*mha"),
    ("loss", r"cross_entropy|liger|_ce_|lce|logsumexp|nll"),
    ("selective op", r"^sel_|selective_scan"),  # deltacp's Mamba1 kernels, mamba_ssm's CUDA scan
    ("kda op", r"kda"),  # deltacp's kda_* and FLA's chunk_kda kernels
    ("ssd op", r"ssd_|scalar_decay|_chunk_scan_|_chunk_state_|_state_passing|_bmm_chunk|_chunk_cumsum"),
    ("gdn op", r"chunk|wy_|wu_fwd|o_fwd|kkt|solve_tril|state_|dqkwg|recompute_w_u|prepare_wy|l2norm|merge_16x16"
               r"|fwd_kernel_o|bwd_kernel_dqkwg|bwd_kernel_dhu|fwd_kernel_h|gated_delta|tril|head_sum|group_sum"
               r"|dv_local|gdr_|prepare_h|prepare_dh|correct_h0"),  # the last four: FlashQLA's TileLang kernels
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


def profile_step(step, top: int) -> tuple[dict[str, float], dict[str, float]]:
    """CUDA kernel time (ms) of one call of `step`, by class and by kernel name; prints the `top` kernels."""
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
