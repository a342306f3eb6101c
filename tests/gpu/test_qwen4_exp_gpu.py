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

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from deltacp import parallelize_cp, shard_batch_for_cp
from deltacp.distributed.launch import run_distributed
from helpers import flat, grads_of, rel_l2, tiny_qwen4_exp, transformers_torch_paths

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
    for packed in (False, True):
        ref = copy.deepcopy(base)
        with transformers_torch_paths(ref) as swapped:  # not FLA's GDN kernels (tf32), where the machine has them
            assert "torch_chunk_gated_delta_rule" in swapped, swapped
            if packed:
                b = cu.tolist()
                logits_ref = torch.cat([ref(input_ids=ids[:, x:y], use_cache=False).logits
                                        for x, y in zip(b[:-1], b[1:])], dim=1)
            else:
                logits_ref = ref(input_ids=ids, use_cache=False).logits
            (logits_ref * w).sum().backward()
        model = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_backend="eager",
                               full_attention_cp="all_gather")
        batch = shard_batch_for_cp(ids, mesh, cu_seqlens=cu if packed else None, model=model)
        logits = model(**{k: v for k, v in batch.items() if k != "target_ids" and v is not None},
                       use_cache=False).logits
        s = S // world
        (logits * w[:, rank * s:(rank + 1) * s]).sum().backward()
        grads = grads_of(model)
        for g in grads.values():
            dist.all_reduce(g)
        figures = {"logits": rel_l2(logits, logits_ref[:, rank * s:(rank + 1) * s]),
                   "grads": rel_l2(flat(grads), flat(grads_of(ref)))}
        if rank == 0:
            print(f"Qwen4-Exp CP{world} on CUDA ({'packed' if packed else 'row'}) vs transformers fp32: " +
                  ", ".join(f"{n} {v:.2e}" for n, v in figures.items()))
        failures += [f"{'packed' if packed else 'row'} {n} {v:.2e}" for n, v in figures.items() if not v < BOUND]
    assert not failures, failures


def test_qwen4_exp_cp2_on_cuda():
    run_distributed(worker, 2, timeout_s=600)
