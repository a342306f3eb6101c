"""run_distributed's start methods (deltacp.distributed.launch): the test suite forks its ranks from a server that
imported torch, transformers and deltacp once (conftest.py); a forked rank must still run with the caller's
environment, working directory and sys.path, be spawned instead when a variable read at import differs from the
server's, and die with a caller that is killed."""

import os
import signal
import subprocess
import sys
import time

import pytest

from deltacp.distributed import launch
from deltacp.distributed.launch import run_distributed, set_start_method

pytestmark = pytest.mark.fast


def state_worker(rank, world, caller_pid, expected, forked):
    assert os.environ.get("DELTACP_TEST_MARK") == expected["mark"], os.environ.get("DELTACP_TEST_MARK")
    assert os.getcwd() == expected["cwd"], os.getcwd()
    assert sys.path[0] == expected["path0"], sys.path[:3]
    # a forked rank is the server's child, a spawned one the caller's; the server imported the preload
    assert (os.getppid() != caller_pid) == forked, (os.getppid(), caller_pid)
    assert ("rank_preload" in sys.modules) == forked


@pytest.mark.skipif(launch._start["method"] != "forkserver", reason="conftest.py forks the ranks on CPU-only "
                                                                       "machines only")
def test_forked_ranks_run_with_the_callers_state_and_import_time_variables_spawn(monkeypatch, tmp_path):
    monkeypatch.setenv("DELTACP_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = {"mark": "set after the server started", "cwd": str(tmp_path), "path0": str(tmp_path)}
    run_distributed(state_worker, 2, os.getpid(), expected, True, timeout_s=120)
    server = os.environ.get("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_INTERPRET", "0" if server == "1" else "1")  # triton's mode is fixed at its import
    run_distributed(state_worker, 2, os.getpid(), expected, False, timeout_s=120)


def test_start_method_names_the_choices():
    with pytest.raises(ValueError, match=r"method must be one of \('spawn', 'forkserver'\), got 'fork'"):
        set_start_method("fork")


_CALLER = r"""
import os, sys, time
from deltacp.distributed.launch import run_distributed, set_start_method


def sleeper(rank, world, out):
    open(os.path.join(out, "rank%d.pid" % rank), "w").write(str(os.getpid()))
    time.sleep(600)


if __name__ == "__main__":
    set_start_method("forkserver", preload=["deltacp.distributed.launch"])
    run_distributed(sleeper, 2, sys.argv[1], timeout_s=600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_caller_takes_its_forked_ranks_with_it(tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(_CALLER)
    log = tmp_path / "caller.log"
    with open(log, "w") as err:  # a file, not a pipe: a rank that outlived the caller would keep a pipe open
        caller = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=err, stderr=err)
    try:
        deadline = time.monotonic() + 240
        while len(pids := list(tmp_path.glob("rank*.pid"))) < 2 or not all(p.read_text() for p in pids):
            assert caller.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        ranks = [int(p.read_text()) for p in pids]
        assert all(_alive(pid) for pid in ranks)
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks), f"ranks outlived the killed caller: {ranks}"
    finally:
        caller.kill()
        caller.wait()
