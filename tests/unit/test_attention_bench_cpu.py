"""bench/attention_cp.py (run on the H200 by `scripts/gpu_checks.sh attention`) stays runnable: its CPU smoke mode
prints the per-rank table for every scheme and exits 0, and the byte model has the expected ordering."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_attention_bench_cpu_smoke():
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}")
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "attention_cp.py"), "--per-rank-cost", "--device", "cpu", "--cp", "4", "8",
         "--global-len", "256", "--hidden", "64", "--heads", "8", "--kv-heads", "2", "--head-dim", "16", "--warmup",
         "0", "--repeat", "1", "--block", "16"], capture_output=True, text=True, timeout=300, env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    for scheme in ("ulysses", "all_gather", "ring", "2d-u2", "2d-u4"):
        assert f" {scheme} " in out, out[-3000:]


def test_per_rank_steps_leave_no_reference_cycles():
    """A tensor caught in a reference cycle stays allocated until Python's cyclic collector runs, and counted into
    the peak memory of whatever row is measured next (the ring's loopback once did that: 13 GiB on the H200)."""
    import gc

    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from attention_cp import LoopbackRing

    from deltacp.parallel.attention_tiles import plan_tiles, ring_attention, tiled_attention

    S, L, q0 = 256, 64, 192
    tiles = plan_tiles(1, S, q0, L, None, 32)
    q = torch.randn(1, 4, L, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, S, 16, requires_grad=True) for _ in range(2))
    k_own, v_own = (t[:, :, q0:].detach().clone().requires_grad_() for t in (k, v))
    steps = {"all_gather": lambda: tiled_attention(q, k, v, tiles, 0.25),
             "ring": lambda: ring_attention(q, k_own, v_own, tiles, 0.25, LoopbackRing(S // L, q0 // L))}
    enabled = gc.isenabled()
    gc.disable()
    try:
        for name, step in steps.items():
            gc.collect()
            step().sum().backward()
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            caught = [tuple(o.shape) for o in gc.garbage if isinstance(o, torch.Tensor)]
            gc.set_debug(0)
            gc.garbage.clear()
            assert not caught, f"{name}: tensors kept alive only by reference cycles: {caught}"
    finally:
        gc.set_debug(0)
        if enabled:
            gc.enable()


def test_tile_and_packed_modes_print_tables_and_fail_on_their_bounds():
    """--tiles and --packed-docs (run by `scripts/gpu_checks.sh tiles`/`tiles_speed`) print their tables, and exit 1
    when their bound fails (a speed-up no run reaches)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}")
    common = ["--device", "cpu", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--warmup", "0", "--repeat",
              "1", "--tiles-cp", "2"]
    runs = {"tiles": ["--tiles", "--local-len", "32", "--block", "16", "--min-speedup", "1000"],
            "packed": ["--packed-docs", "--packed-len", "64", "--docs", "2", "16", "--max-packed-ratio", "1000"]}
    for name, extra in runs.items():
        result = subprocess.run([sys.executable, str(ROOT / "bench" / "attention_cp.py"), *extra, *common],
                                capture_output=True, text=True, timeout=300, env=env)
        out = result.stdout + result.stderr
        if name == "tiles":
            assert result.returncode == 1 and "FAILED: 32 contiguous all_gather" in out, out[-3000:]
            assert "32 balanced   ring" in out, out[-3000:]
        else:
            assert result.returncode == 0, out[-3000:]
            assert "cp rank" in out and "loop (before)" in out, out[-3000:]
    # --tiles-before: a source's own tiles timed in a child process that imports deltacp from DIR/src (this source
    # here); the bound is then checked against it
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "attention_cp.py"), *runs["tiles"], *common,
                             "--tiles-before", str(ROOT)], capture_output=True, text=True, timeout=300, env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "(vs the source before)" in out and "vs before" in out, out[-3000:]
    assert f"before: the deltacp source at {ROOT}" in out, out[-3000:]
