import os
import sys

# Distributed workers are spawned with the same interpreter and import the tests as modules.
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402


@pytest.fixture
def single_rank_group():
    """A one-rank gloo process group in this process (for checks that need a mesh but no peers)."""
    import torch.distributed as dist

    from deltacp.distributed.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _fork_ranks_from_a_preloaded_server():
    """Ranks of run_distributed forked from one server that imported torch, transformers and deltacp once per
    session (rank_preload.py; a spawned rank pays ~4 s of CPU in imports, and the suite starts a few hundred). On
    CPU-only machines: with a GPU the ranks stay spawned (a server whose imports initialised CUDA could not fork
    CUDA ranks, which is not tried here; the GPU tests are few)."""
    import torch

    from deltacp.distributed.launch import set_start_method

    if not torch.cuda.is_available():
        set_start_method("forkserver", preload=["rank_preload"])


_fork_ranks_from_a_preloaded_server()
