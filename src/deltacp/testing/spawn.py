"""Spawn a CPU process group over gloo and run one function on every rank, with a hard deadline.

Used by the tests and the README demo. A rank that raises fails the whole run with its traceback; a run
that outlives `timeout_s` is killed and reported as a hang instead of blocking forever.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, collective_timeout_s: float) -> None:
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
    # Skip interpreter finalisation on success: with torch 2.11 over gloo a rank aborted there ("terminate called
    # without an active exception", no Python frame left) in about 1 of 10 runs of a 2-rank job, after all its
    # work and the group's destruction were done. A failing rank still raises above and reports its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args, timeout_s: float = 600, collective_timeout_s: float = 120) -> None:
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; raise if any rank fails or it hangs."""
    ctx = mp.start_processes(_entry, args=(world_size, free_port(), fn, args, collective_timeout_s),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            raise TimeoutError(f"distributed run of {getattr(fn, '__name__', fn)} on {world_size} ranks did not "
                               f"finish in {timeout_s:.0f} s (a hang)")
