"""The CPU launcher: spawn a process group over gloo and run one function on every rank, with a hard deadline.

    from deltacp import run_distributed
    run_distributed(main, 4)          # main(rank, world_size) on 4 CPU ranks; torchrun is the launcher on GPUs

What the README's snippet, `python -m deltacp.demo`, `python -m deltacp.train --spawn N` and the tests launch
with. A rank that raises fails the
whole run with its traceback; a run that outlives `timeout_s` is killed and reported as a hang instead of
blocking forever. No rank outlives the process that spawned it:

- if run_distributed is left by any exception (a failed rank, a timeout, KeyboardInterrupt, or an
  exception raised by a signal handler of the caller), every rank still alive gets SIGTERM, then SIGKILL
  after `stop_grace_s`, before the exception propagates;
- every rank asks the kernel for SIGKILL when its parent dies (Linux prctl PR_SET_PDEATHSIG; elsewhere a
  thread that watches the parent pid), so even a SIGKILLed parent takes its ranks with it;
- ranks ignore SIGINT: a Ctrl-C in a terminal reaches the whole process group, and the parent alone decides
  (it stops the ranks as above), so the ranks print nothing of their own.

Ranks start as fresh interpreters ("spawn", the default) or, after `set_start_method("forkserver", preload)`, are
forked from one server process that imported the `preload` modules once (the test suite does this: a rank then
starts in milliseconds instead of seconds of imports). Either way a rank runs with the caller's environment, working
directory and sys.path as they are at the call, and dies with the caller (a forked rank by watching the caller, who
is not its parent, through a pidfd). The preloaded modules saw the server's environment, though: a call made while
a variable read at import (IMPORT_TIME_ENV: TRITON_INTERPRET picks Triton's interpreter when triton is imported)
differs from the server's spawns its ranks instead.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1
START_METHODS = ("spawn", "forkserver")
IMPORT_TIME_ENV = ("TRITON_INTERPRET",)
_start: dict = {"method": "spawn", "server_env": {}}


def _import_time_env() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in IMPORT_TIME_ENV}


def set_start_method(method: str, preload: tuple[str, ...] | list[str] = ()) -> None:
    """How run_distributed starts its ranks from now on in this process: "spawn" (a fresh interpreter per rank,
    the default) or "forkserver" (forked from one server that imports the modules in `preload` once, at its
    first use, with the IMPORT_TIME_ENV variables as they are now)."""
    if method not in START_METHODS:
        raise ValueError(f"set_start_method: method must be one of {START_METHODS}, got {method!r}")
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(list(preload))
    _start.update(method=method, server_env=_import_time_env())


def _ensure_server() -> None:
    """Start the forkserver unless it runs, with this process's sys.path for its preload imports (a fresh
    interpreter; Python 3.11's server does not apply the sys.path multiprocessing hands it)."""
    from multiprocessing import forkserver

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def start_method() -> str:
    """How a process started now starts: "spawn", or "forkserver" (the server then running) unless a variable read
    at import (IMPORT_TIME_ENV) differs from the server's, where it is "spawn"."""
    method = _start["method"]
    if method == "forkserver" and _import_time_env() != _start["server_env"]:
        method = "spawn"  # the server's modules were imported under other values of these variables
    if method == "forkserver":
        _ensure_server()
    return method


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent(parent_pid: int) -> None:
    """Make this process die (SIGKILL) when `parent_pid`, its parent, dies; exit now if it already has."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            armed = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent_pid:  # the parent died before the request above
        os._exit(1)
    if not armed:
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, name="deltacp-parent-watch", daemon=True).start()


def die_with_caller(caller_pid: int) -> None:
    """Make this process exit when `caller_pid`, which is not its parent, ends (a rank forked by the server, whose
    parent is the server); exit now if it already has. A thread waits on a pidfd of the caller (Linux >= 5.3: it
    also sees a caller that ended but was not reaped yet); elsewhere it polls the pid every 0.5 s."""
    try:
        fd = os.pidfd_open(caller_pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the caller has ended
        else:
            while True:
                try:
                    os.kill(caller_pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="deltacp-caller-watch", daemon=True).start()


def stop_processes(processes, grace_s: float = STOP_GRACE_S) -> int:
    """SIGTERM every live process, wait up to grace_s for all, then SIGKILL the rest; returns how many were
    killed with SIGKILL."""
    live = [p for p in processes if p is not None and p.is_alive()]
    for proc in live:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for proc in live:
        proc.join(max(0.0, deadline - time.monotonic()))
    stubborn = [p for p in live if p.is_alive()]
    for proc in stubborn:
        proc.kill()
    for proc in stubborn:
        proc.join(5)
    return len(stubborn)


def _entry(rank: int, world_size: int, port: int, fn, args, collective_timeout_s: float, parent_pid: int,
           caller_state: dict[str, str] | None) -> None:
    if caller_state is None:  # spawned: a child of the caller, with its environment
        die_with_parent(parent_pid)
    else:  # forked by the server, with the server's state
        die_with_parent(os.getppid())
        # The server outlives the caller while a rank lives (each rank holds the pipe whose closing tells the
        # server its caller ended), so the rank watches the caller itself.
        die_with_caller(parent_pid)
        os.environ.clear()  # (multiprocessing gives it the caller's sys.path and working directory)
        os.environ.update(caller_state)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops the ranks
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    faulthandler.enable()  # a hard crash (SIGSEGV/SIGABRT) prints every thread's Python stack
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=collective_timeout_s))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    exit_after_success()


def exit_after_success() -> None:
    """End a rank whose work succeeded without interpreter finalisation: over gloo a rank aborted there
    ("terminate called without an active exception", no Python frame left, exit status 1) in some runs of 2-rank
    jobs, spawned and under torchrun alike (how often: NOTES.md, Operational facts), after all its work and the
    group's destruction were done. Logs and the standard streams are flushed first; a failing rank never gets
    here and reports its traceback as usual."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args, timeout_s: float = 600, collective_timeout_s: float = 120,
                    stop_grace_s: float = STOP_GRACE_S) -> None:
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; raise if any rank fails or it hangs.

    Whatever ends the wait (a failure, the timeout, KeyboardInterrupt, an exception from a signal handler),
    the ranks still alive are stopped (SIGTERM, SIGKILL after stop_grace_s) before it propagates."""
    started_before = {p.pid for p in multiprocessing.active_children()}
    ctx = None
    try:
        method = start_method()
        caller_state = dict(os.environ) if method == "forkserver" else None
        ctx = mp.start_processes(_entry, args=(world_size, free_port(), fn, args, collective_timeout_s, os.getpid(),
                                               caller_state), nprocs=world_size, join=False, start_method=method)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed run of {getattr(fn, '__name__', fn)} on {world_size} ranks did not "
                                   f"finish in {timeout_s:.0f} s (a hang)")
    except BaseException:
        if ctx is not None:
            ranks = ctx.processes
        else:  # interrupted while starting them: the ranks started so far
            ranks = [p for p in multiprocessing.active_children() if p.pid not in started_before]
        stop_processes(ranks, stop_grace_s)
        raise
