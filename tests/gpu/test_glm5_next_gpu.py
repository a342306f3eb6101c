"""GLM-5.3-Flash on CUDA under CP2 (two ranks share the GPU over gloo): its indexed attention layers then run their
CUDA path, the Triton selected attention (`ops/selected_attention.py`) on the absorbed MLA (each head's query taken
into the latent, the latent the one key and value head), where the CPU tests run the gathered kernel. The tiny model
of tests/distributed/test_glm5_next.py (pools of 3 tokens, top 3 pools: sparse past 12 tokens; a "full" and a
"shared" indexed layer) with the released latent width, kv_lora_rank 512 (the kernels' column blocks: head dims over
256), and with the tiny one, 16 (one tile), and 16 indexer heads, not 8 (with 8 and the 512 latent's draw,
deltacp's logits left transformers' from token 119 of the row on (3e-2), CP and the single device agreeing at 3e-9:
most likely pools tied at score 0 (every head's relu 0), which torch.topk orders its own way; not seen with 16), in
float32; 192 tokens in one row and in packed documents, against the
unmodified transformers model on the same GPU in float32 (its own indexer and expanded per-head K / V under the
top-k mask, eager attention; its PyTorch KDA and conv even where FLA and causal-conv1d are installed:
`helpers.transformers_torch_paths`): logits and every parameter gradient of sum(logits * w), rank-summed, within 1e-4
rel-L2 (float32 everywhere; the kernels' fp32 products are IEEE). The KDA layers run the eager recurrence: this test
is about the indexed layers' CUDA path.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from deltacp import parallelize_cp, shard_batch_for_cp
from deltacp.distributed.launch import run_distributed
from helpers import flat, grads_of, rel_l2, tiny_glm5_next, transformers_torch_paths

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the indexed attention's Triton kernels)")

S, BOUND = 192, 1e-4
LENGTHS = [40, 1, 77, 74]


def worker(rank, world):
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (1, S), generator=gen).cuda()
    w = torch.randn(1, S, 256, generator=gen).cuda()
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh_dim_names=("cp",))
    failures = []
    for latent in (512, 16):
        base = tiny_glm5_next(torch.float32, kv_lora_rank=latent, index_n_heads=16).cuda()
        for packed in (False, True):
            case = f"latent {latent}, {'packed' if packed else 'row'}"
            ref = copy.deepcopy(base)
            with transformers_torch_paths(ref) as swapped:  # not FLA's KDA kernels (tf32), where the machine has them
                assert "chunk_kimi_delta_attention" in swapped, swapped
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
                print(f"GLM-5.3-Flash CP{world} on CUDA ({case}) vs transformers fp32: " +
                      ", ".join(f"{n} {v:.2e}" for n, v in figures.items()))
            failures += [f"{case}: {n} {v:.2e}" for n, v in figures.items() if not v < BOUND]
    assert not failures, failures


def test_glm5_next_cp2_on_cuda():
    run_distributed(worker, 2, timeout_s=600)
