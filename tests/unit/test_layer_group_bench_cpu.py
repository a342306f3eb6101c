"""bench/layer_group.py (run on the H200 by `scripts/gpu_checks.sh layergroup`) stays runnable: its CPU smoke mode
prints the per-rank table for every configuration and the per-(CP, tokens) summary, and exits 0."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_layer_group_bench_cpu_smoke():
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}")
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "layer_group.py"), "--device", "cpu", "--cp", "4", "--global-len", "256",
         "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--qk-heads", "2", "--v-heads", "4",
         "--gdn-head-dim", "16", "--warmup", "0", "--repeat", "1", "--block", "16"],
        capture_output=True, text=True, timeout=300, env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    for config in ("contiguous 1-D", "balanced 1-D", "contiguous 2-D u=2", "balanced 2-D u=2"):
        assert f" {config} " in out, out[-3000:]
    assert "CP4 256: balanced attention slowest/mean" in out, out[-3000:]
    # --configs keeps the configurations named (the summary then lists the steps it has); --profile needs CUDA
    result = subprocess.run([*result.args, "--configs", "balanced 2-D"], capture_output=True, text=True, timeout=300,
                            env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    rows = [line for line in out.splitlines() if line.startswith("  4      256 ")]
    assert rows and all(" balanced 2-D u=2 " in line for line in rows), out[-3000:]
    assert "CP4 256: balanced 2-D u=2 (all_gather, scan)" in out, out[-3000:]
    result = subprocess.run([*result.args, "--profile"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2 and "--profile reads CUDA kernel times" in result.stderr, result.stderr[-3000:]
