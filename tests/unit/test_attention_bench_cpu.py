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
    for scheme in ("ulysses", "allgather", "ring", "2d-u2", "2d-u4"):
        assert f" {scheme} " in out, out[-3000:]
