"""Qwen4-Exp on CUDA under CP2 (two ranks share the GPU over gloo): the indexed attention layer then runs its CUDA
path, the Triton selected attention (`ops/selected_attention.py`), where the CPU tests run the gathered kernel. The
tiny model of tests/distributed/test_qwen4_exp.py (QSA blocks of 3, top 4 blocks: sparse past 15 tokens) in float32,
192 tokens in one row and in packed documents, against the unmodified transformers model on the same GPU in float32
(its own indexer loop and SDPA, and its PyTorch GDN and conv even where FLA and causal-conv1d are installed:
`helpers.transformers_torch_paths`): logits and every parameter gradient of sum(logits * w), rank-summed, within 1e-4
rel-L2 (float32 everywhere; the kernels' fp32 products are IEEE). The GDN layers run the eager recurrence: this test
is about the indexed layer's CUDA path.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from deltacp.distributed.launch import run_distributed
from helpers import indexed_cp_vs_transformers, tiny_qwen4_exp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the indexed attention's Triton kernels)")

S, BOUND = 192, 1e-4
LENGTHS = [40, 1, 77, 74]


def worker(rank, world):
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    base = tiny_qwen4_exp(torch.float32).cuda()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (1, S), generator=gen).cuda()
    w = torch.randn(1, S, base.config.vocab_size, generator=gen).cuda()
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh_dim_names=("cp",))
    failures = []
    for case, figures in indexed_cp_vs_transformers(base, ids, w, cu, mesh, "torch_chunk_gated_delta_rule").items():
        if rank == 0:
            print(f"Qwen4-Exp CP{world} on CUDA ({case}) vs transformers fp32: " +
                  ", ".join(f"{n} {v:.2e}" for n, v in figures.items()))
        failures += [f"{case} {n} {v:.2e}" for n, v in figures.items() if not v < BOUND]
    assert not failures, failures


def test_qwen4_exp_cp2_on_cuda():
    run_distributed(worker, 2, timeout_s=600)
