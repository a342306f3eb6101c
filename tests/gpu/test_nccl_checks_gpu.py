"""The raise-together exchange over NCCL with inputs still on the host (one GPU, a one-rank NCCL group)."""

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")


@pytest.fixture
def nccl_group():
    from deltacp.distributed.launch import free_port

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_shard_batch_with_host_tensors_under_nccl(nccl_group):
    from deltacp import init_cp_mesh, shard_batch_for_cp

    mesh = init_cp_mesh(cp=1)
    ids = torch.arange(16)[None]  # a batch still on the host, as a DataLoader yields it
    batch = shard_batch_for_cp(ids, mesh, cu_seqlens=torch.tensor([0, 5, 16]))
    assert batch["input_ids"].device.type == "cpu" and batch["cu_seq_lens_q"].tolist() == [0, 5, 16]
    with pytest.raises(ValueError, match=r"shard_batch_for_cp: cu_seqlens .* must start at 0 and end at the row"):
        shard_batch_for_cp(ids, mesh, cu_seqlens=torch.tensor([0, 5, 15]))
    batch = shard_batch_for_cp(ids.cuda(), mesh)  # and on the GPU
    assert batch["input_ids"].is_cuda
