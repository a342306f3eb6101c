"""`scripts/gpu_checks.sh multi` runs tests/gpu/multi_gpu_checks.py over NCCL on 2-8 GPUs. No multi-GPU machine is
at hand, so CI runs the same script over gloo on CPU ranks (torchrun, 2 ranks): the script itself stays correct and
its checks can fail (a broken check exits non-zero)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_multi_gpu_checks_script_over_gloo():
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tests" / "gpu" / "multi_gpu_checks.py"), "--device", "cpu", "--steps", "3"],
        capture_output=True, text=True, timeout=900, env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "42 passed, 0 failed" in out, out[-4000:]
