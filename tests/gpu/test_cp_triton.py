"""CP layer parity with the Triton backend, 2 and 4 ranks sharing one GPU (gloo, staged through host).

NCCL refuses two ranks on one device, so these ranks talk over gloo; the collectives layer stages CUDA
tensors through host memory there. The same code runs over NCCL with one GPU per rank.

Per world size and mode (ulysses, p2p), on a bf16 GDN layer with K = V = 128:
- CP triton vs the single-device eager layer in fp32 (the higher-precision reference): bf16 bounds;
- CP triton vs the single-device triton layer (same kernels, one rank): summation-order differences only;
- 20 consecutive forward/backward runs: finite, no memory growth.
Figures are printed by rank 0 (run pytest with -s to see them).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from deltacp import LinearAttentionContextParallel
from deltacp.distributed.launch import run_distributed
from helpers import flat, grads_of, local_slice, long_memory_gates_, rel_l2, summed_over_ranks, tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton backend)")

BF16_BOUND = 2e-2  # bf16 inputs and projections against an fp32 layer
SAME_KERNEL_BOUND = 1e-2  # CP vs one rank, both triton bf16


def _config():
    return tiny_config(hidden_size=512, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                       linear_value_head_dim=128)


def _run(module, x, d_out, cu=None):
    x = x.clone().requires_grad_()
    out = module(x) if cu is None else module(x, cu_seq_lens_q=cu)
    (out.float() * d_out).sum().backward()
    return out.detach().float(), x.grad.float()


def _mesh(group):
    return DeviceMesh.from_group(group, "cuda", mesh_dim_names=("cp",))


def cp_triton_worker(rank, world, seq, cu=None, layout="contiguous"):
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    base = long_memory_gates_(Qwen3_5GatedDeltaNet(_config(), 0)).cuda()
    x = torch.randn(1, seq, 512, device="cuda")
    d_out = torch.randn(1, seq, 512, device="cuda")
    self_group = None
    for r in range(world):
        group = dist.new_group([r])
        if r == rank:
            self_group = group
    failures, rows = [], []
    cases = [("ulysses", "chain"), ("p2p", "chain")] + ([("p2p", "scan")] if layout == "balanced" else [])
    for mode, passing in cases:
        ref32 = LinearAttentionContextParallel(mode=mode, backend="eager").apply(copy.deepcopy(base).float(),
                                                                                _mesh(self_group))
        out32, dx32 = _run(ref32, x, d_out, cu)
        g32 = grads_of(ref32)
        ref16 = LinearAttentionContextParallel(mode=mode, backend="triton").apply(
            copy.deepcopy(base).bfloat16(), _mesh(self_group))
        out16, dx16 = _run(ref16, x.bfloat16(), d_out, cu)
        g16 = grads_of(ref16)
        cp = LinearAttentionContextParallel(mode=mode, backend="triton", state_passing=passing,
                                            sequence_layout=layout).apply(copy.deepcopy(base).bfloat16(),
                                                                          _mesh(dist.group.WORLD))
        xl, dl = local_slice(x, rank, world, layout=layout).bfloat16(), local_slice(d_out, rank, world, layout=layout)
        out, dx = _run(cp, xl, dl, cu)
        grads = summed_over_ranks({n: g.float() for n, g in grads_of(cp).items()})
        norm = flat(grads).norm().item()
        figures = {
            "output vs fp32": rel_l2(out, local_slice(out32, rank, world, layout=layout)),
            "input grad vs fp32": rel_l2(dx, local_slice(dx32, rank, world, layout=layout)),
            "param grads vs fp32": rel_l2(flat(grads), flat(g32)),
            "grad norm vs fp32": abs(norm / flat(g32).norm().item() - 1),
            "output vs 1-rank triton": rel_l2(out, local_slice(out16, rank, world, layout=layout)),
            "input grad vs 1-rank triton": rel_l2(dx, local_slice(dx16, rank, world, layout=layout)),
            "param grads vs 1-rank triton": rel_l2(flat(grads), flat({n: g.float() for n, g in g16.items()})),
        }
        worst_param = max(grads, key=lambda n: rel_l2(grads[n], g32[n]))
        figures[f"worst param ({worst_param}) vs fp32"] = rel_l2(grads[worst_param], g32[worst_param])
        for name, value in figures.items():
            bound = SAME_KERNEL_BOUND if "1-rank" in name else (5e-2 if "worst" in name else BF16_BOUND)
            if not value < bound:
                failures.append(f"CP{world} {layout} {mode}/{passing} {name}: {value:.3e} >= {bound:.0e}")
        # 20 consecutive steps: finite, and no memory growth after the first ones.
        memory = []
        for _ in range(20):
            cp.zero_grad(set_to_none=True)
            out, dx = _run(cp, xl, dl, cu)
            if not (torch.isfinite(out).all() and torch.isfinite(dx).all()):
                failures.append(f"CP{world} {layout} {mode}/{passing}: non-finite values in repeated runs")
                break
            torch.cuda.synchronize()
            memory.append(torch.cuda.memory_allocated())
        if memory[-1] > memory[2]:
            failures.append(f"CP{world} {layout} {mode}/{passing}: allocated memory grew from {memory[2]} to "
                            f"{memory[-1]} bytes")
        rows.append((f"{mode}/{passing}", figures))
    if rank == 0:
        for mode, figures in rows:
            docs = "" if cu is None else f", {cu.numel() - 1} packed documents"
            print(f"\nCP{world} {mode}+triton, {layout} layout, 1x{seq} tokens{docs}, Hk/Hv 2/4, K=V=128:")
            for name, value in figures.items():
                print(f"  {name:<45} {value:.3e}")
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_layer_parity_triton_on_one_gpu(world):
    run_distributed(cp_triton_worker, world, 4096, timeout_s=600)


# Packed documents: boundaries inside ranks, on a rank boundary (2048 at CP2/CP4), lengths 1 and 3, a document
# crossing every rank boundary of CP4 but the middle one.
PACKED_CU = torch.tensor([0, 1, 4, 700, 2048, 2049, 3000, 4096])


@pytest.mark.parametrize("world", [2, 4])
def test_cp_layer_parity_triton_packed_on_one_gpu(world):
    run_distributed(cp_triton_worker, world, 4096, PACKED_CU, timeout_s=600)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_cp_layer_parity_triton_balanced_on_one_gpu(world, packed):
    """sequence_layout='balanced': every piece through the Triton kernels (two calls of each op per rank), the p2p
    chain through 2P pieces and the scan over them."""
    run_distributed(cp_triton_worker, world, 4096, PACKED_CU if packed else None, "balanced", timeout_s=600)
