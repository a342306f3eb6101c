"""The p2p + Triton path on CPU: the real kernels under TRITON_INTERPRET=1, on 4 gloo ranks (a first, two middle
and a last rank), against the single-device eager layer.

What it covers that the GPU tests cover only on a GPU: p2p's Triton stages (one `prepare_chunks` shared by the
summary, the output pass and the backward's dH_in pass; S alone on rank 0; M and S on the middle ranks; the
prepared tensors carried through save_for_backward). fp32 inputs, so the kernels compute in fp32 end to end and
the bound is fp32's. The capability check (CUDA, bf16, head dim 128) is bypassed here on purpose: it has its own
tests, and the kernels themselves are generic in those.
"""

import copy
import importlib.util

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from deltacp import LinearAttentionContextParallel
from deltacp.distributed.launch import run_distributed
from helpers import cp_mesh, flat, grads_of, local_slice, long_memory_gates_, rel_l2, self_meshes, summed_grads, \
    tiny_config

WORLD, SEQ = 4, 256  # 64 tokens (one chunk) per rank


def p2p_triton_interpreter_worker(rank, world):
    from deltacp.ops.gdn.triton import TritonGDNBackend

    TritonGDNBackend.check = lambda self, *args, **kwargs: None  # CPU tensors, fp32, head dim 32 (see above)
    torch.manual_seed(3)
    config = tiny_config(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                         linear_value_head_dim=32)
    base = long_memory_gates_(Qwen3_5GatedDeltaNet(config, 0))
    x, d_out = torch.randn(1, SEQ, 64), torch.randn(1, SEQ, 64)

    def run(module, x_in, d_in):
        x_in = x_in.clone().requires_grad_()
        out = module(x_in)
        (out * d_in).sum().backward()
        return out.detach(), x_in.grad

    ref = LinearAttentionContextParallel(mode="p2p", backend="eager").apply(copy.deepcopy(base), self_meshes())
    out_ref, dx_ref = run(ref, x, d_out)
    cp = LinearAttentionContextParallel(mode="p2p", backend="triton").apply(copy.deepcopy(base), cp_mesh())
    out, dx = run(cp, local_slice(x, rank, world), local_slice(d_out, rank, world))
    grads, grads_ref = summed_grads(cp), grads_of(ref)
    errs = {"output": rel_l2(out, local_slice(out_ref, rank, world)),
            "input grad": rel_l2(dx, local_slice(dx_ref, rank, world)),
            "param grads": rel_l2(flat(grads), flat(grads_ref))}
    errs.update({f"grad {n}": rel_l2(grads[n], grads_ref[n]) for n in grads_ref})
    failures = [f"{name}: {e:.3e}" for name, e in errs.items() if not e < 1e-4]
    assert not failures, f"rank {rank} p2p+triton (interpreter) vs single-device eager:\n" + "\n".join(failures)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (the README test "
                                                                       "command installs it)")
def test_p2p_triton_stages_under_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned ranks
    run_distributed(p2p_triton_interpreter_worker, WORLD, timeout_s=600)
