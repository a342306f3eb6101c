"""A successful rank ends without interpreter finalisation (`launch.exit_after_success`): over gloo a rank aborted
there now and then ("terminate called without an active exception", exit status 1) after all its work was done,
spawned and under torchrun alike. What it must keep: exit status 0, and every line already printed or logged."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_exit_after_success_flushes_and_returns_zero(tmp_path):
    log = tmp_path / "rank.log"
    code = ("import logging, sys\n"
            "from deltacp.distributed.launch import exit_after_success\n"
            f"logging.basicConfig(filename={str(log)!r}, level=logging.INFO)\n"
            "logging.getLogger('x').info('logged before the exit')\n"
            "sys.stdout.write('printed without a newline')\n"
            "import atexit; atexit.register(lambda: print('FINALISED'))\n"
            "exit_after_success()\n"
            "print('after the exit')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as in a rank
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "printed without a newline", done.stdout  # flushed; no finalisation, nothing after
    assert "logged before the exit" in log.read_text()


def test_torchrun_ranks_of_a_training_run_exit_zero(tmp_path):
    """`torchrun -m deltacp.train` (2 gloo ranks, CP2, 2 steps): both ranks exit 0 and the last step line is out."""
    config = ROOT / "configs" / "tiny_cp4.yaml"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "deltacp.train", "--config", str(config), "--set", "train.accelerator.cp=2",
           "--set", "train.steps=2", "--set", "train.data.seq_len=128"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2/2" in done.stdout + done.stderr, (done.stdout[-2000:], done.stderr[-2000:])
