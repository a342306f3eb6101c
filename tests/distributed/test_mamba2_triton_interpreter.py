"""A Mamba2 mixer on the Triton backend on CPU: the real kernels (the fused conv over [x | B | C] with its three
channel groups, the scalar-decay recurrence) under TRITON_INTERPRET=1, on 2 gloo ranks, in p2p and Ulysses, against
the single-device eager mixer.

What it covers that the GPU tests cover only on a GPU: the Mamba2 view's Triton wiring (v = dt x rounded to the
input dtype, the conv kernel's group split, `TritonScalarDecay` in the modes: p2p's summary and dh_in passes, the
all-gathered summaries, Ulysses' head slices with groups repeated). fp32 inputs, so the kernels compute in fp32
(products in tf32x3, about fp32) and the bound is fp32's.
"""

import copy
import importlib.util

import pytest
import torch

from deltacp import LinearAttentionContextParallel
from deltacp.distributed.launch import run_distributed
from helpers import cp_mesh, flat, grads_of, local_slice, rel_l2, self_meshes, summed_grads

WORLD, SEQ = 2, 160  # 80 tokens per rank: two chunks, the second partial
MODES = ("p2p", "ulysses")  # the modes with a Triton path (all_gather runs on eager only)


def _mixer():
    """A Bamba mixer with the Triton contract's smallest dims (state 16, head dim 16), 4 heads in 2 groups, slowly
    decaying heads so the state crosses the rank boundary."""
    import transformers
    from transformers.models.bamba.modeling_bamba import BambaMixer

    config = transformers.BambaConfig(hidden_size=32, mamba_n_heads=4, mamba_d_head=16, mamba_expand=2,
                                      mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=64,
                                      num_hidden_layers=1, attn_layer_indices=[])
    torch.manual_seed(5)
    mixer = BambaMixer(config, 0)
    with torch.no_grad():
        mixer.A_log.uniform_(-4, -2)
        mixer.dt_bias.uniform_(-1, 1)
        mixer.D.uniform_(0.5, 1.5)
        mixer.norm.weight.uniform_(0.5, 1.5)
    return mixer


def mamba2_triton_interpreter_worker(rank, world):
    base = _mixer()
    x, d_out = torch.randn(1, SEQ, 32), torch.randn(1, SEQ, 32)

    def run(module, x_in, d_in):
        x_in = x_in.clone().requires_grad_()
        out = module(x_in)
        (out * d_in).sum().backward()
        return out.detach(), x_in.grad

    ref = LinearAttentionContextParallel(mode="p2p", backend="eager").apply(copy.deepcopy(base), self_meshes())
    out_ref, dx_ref = run(ref, x, d_out)
    grads_ref = grads_of(ref)
    failures = []
    for mode in MODES:
        cp = LinearAttentionContextParallel(mode=mode, backend="triton").apply(copy.deepcopy(base), cp_mesh())
        out, dx = run(cp, local_slice(x, rank, world), local_slice(d_out, rank, world))
        grads = summed_grads(cp)
        errs = {"output": rel_l2(out, local_slice(out_ref, rank, world)),
                "input grad": rel_l2(dx, local_slice(dx_ref, rank, world)),
                "param grads": rel_l2(flat(grads), flat(grads_ref))}
        errs.update({f"grad {n}": rel_l2(grads[n], grads_ref[n]) for n in grads_ref})
        failures += [f"{mode} {name}: {e:.3e}" for name, e in errs.items() if not e < 1e-4]
        if rank == 0:
            print(f"{mode}: worst {max(errs.values()):.1e}")
    assert not failures, f"rank {rank} Mamba2 triton (interpreter) vs single-device eager:\n" + "\n".join(failures)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (the README test "
                                                                       "command installs it)")
def test_mamba2_triton_under_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned ranks
    run_distributed(mamba2_triton_interpreter_worker, WORLD, timeout_s=600)
