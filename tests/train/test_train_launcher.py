"""Stopping the launcher stops the ranks: `python -m deltacp.train --spawn 2` gets SIGINT (Ctrl-C: the whole
process group), SIGTERM or SIGKILL; afterwards no rank process is left and no checkpoint is written.

The three launchers run at once (each start costs ~10 s of interpreter and model start-up per process)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from deltacp.train.checkpoint import complete_checkpoints

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "configs" / "tiny_cp4.yaml"


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, _ppid, pgrp = stat[stat.rfind(")") + 2:].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            pids.append(int(entry))
    return pids


def _launch(ckpt: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "deltacp.train", "--config", str(MAIN), "--spawn", "2",
           "--set", "train.accelerator.cp=2", "--set", "train.steps=100000", "--set", "train.data.seq_len=64",
           "--set", f"train.checkpoint.dir={ckpt}", "--set", "train.checkpoint.interval=1",
           "--set", "train.checkpoint.keep=0", "--set", "train.logging.progress=none"]
    # Its own session: the launcher's pid is the process group id of it and its ranks.
    return subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _listing(ckpt: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))


def test_signals_to_the_launcher_stop_every_rank(tmp_path):
    cases = {"SIGINT": "group", "SIGTERM": "launcher", "SIGKILL": "launcher"}
    runs = {name: (_launch(tmp_path / name), tmp_path / name) for name in cases}
    try:
        deadline = time.monotonic() + 240
        pending = dict(runs)
        while pending:  # signal each launcher once its run has saved its first checkpoint (the ranks are training)
            for name, (proc, ckpt) in list(pending.items()):
                if proc.poll() is not None:
                    err = proc.communicate()[1]
                    raise AssertionError(f"{name}: the launcher ended early:\n{err[err.find('Traceback'):][-6000:]}")
                if complete_checkpoints(ckpt):
                    members = group_members(proc.pid)
                    assert len(members) >= 3, f"{name}: launcher and 2 ranks expected, found pids {members}"
                    sig = getattr(signal, name)
                    (os.killpg if cases[name] == "group" else os.kill)(proc.pid, sig)
                    del pending[name]
            assert time.monotonic() < deadline, f"no checkpoint from {sorted(pending)} in time"
            time.sleep(0.2)
        outputs = {name: proc.communicate(timeout=60) for name, (proc, _) in runs.items()}
        for name, (proc, ckpt) in runs.items():
            gone = time.monotonic() + 10
            while group_members(proc.pid) and time.monotonic() < gone:
                time.sleep(0.2)
            assert not group_members(proc.pid), f"{name}: processes outlived the launcher: {group_members(proc.pid)}"
        listings = {name: _listing(ckpt) for name, (_, ckpt) in runs.items()}
        time.sleep(2)
        for name, (proc, ckpt) in runs.items():
            assert _listing(ckpt) == listings[name], f"{name}: files written after the launcher stopped"
        for name in ("SIGINT", "SIGTERM"):
            rc, err = runs[name][0].returncode, outputs[name][1]
            assert rc == 128 + getattr(signal, name), f"{name}: exit code {rc}\n{err[-2000:]}"
            assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
            lines = err.strip().splitlines()
            assert lines[-1].startswith(f"deltacp.train: stopped by {name}: terminated the 2 ranks"), lines[-3:]
            assert not any(line.startswith("deltacp.train: rank") for line in lines), lines
        assert runs["SIGKILL"][0].returncode == -signal.SIGKILL
    finally:
        for proc, _ in runs.values():
            for pid in group_members(proc.pid):
                os.kill(pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
