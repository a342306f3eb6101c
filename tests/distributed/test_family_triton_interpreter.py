"""The other recurrences' mixers on the Triton backend on CPU: a Mamba2 mixer (the fused conv over [x | B | C] with its
three channel groups, the scalar-decay recurrence) and a KDA mixer (the fused conv over [q | k | v], the KDA
kernels), the real kernels under TRITON_INTERPRET=1, on 2 gloo ranks, in p2p and Ulysses (the modes with a Triton
path; all_gather runs on eager only), against the single-device eager mixer.

What it covers that the GPU tests cover only on a GPU: each view's Triton wiring (Mamba2: v = dt x rounded to the
input dtype; KDA: the per-channel gate and beta handed to the kernels) and each Triton recurrence in the modes
(p2p's summary and dh_in passes, Ulysses' head slices, Mamba2's groups repeated). fp32 inputs, so the kernels
compute in fp32 (products in tf32x3, about fp32) and the bound is fp32's.
"""

import copy
import importlib.util

import pytest
import torch

from deltacp import LinearAttentionContextParallel
from deltacp.distributed.launch import run_distributed
from helpers import cp_mesh, flat, grads_of, local_slice, rel_l2, self_meshes, summed_grads

WORLD, SEQ, HIDDEN = 2, 160, 32  # 80 tokens per rank: two chunks, the second partial
MODES = ("p2p", "ulysses")


def _mamba2():
    """A Bamba mixer with the Triton contract's smallest dims (state 16, head dim 16), 4 heads in 2 groups, slowly
    decaying heads so the state crosses the rank boundary."""
    import transformers
    from transformers.models.bamba.modeling_bamba import BambaMixer

    config = transformers.BambaConfig(hidden_size=HIDDEN, mamba_n_heads=4, mamba_d_head=16, mamba_expand=2,
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


def _kda():
    """Kimi-Linear's KDA mixer of `tiny_kimi_linear` with 4 heads of 16 (the Triton contract's smallest head dim),
    its slowly decaying per-channel gates."""
    from helpers import tiny_kimi_linear

    model = tiny_kimi_linear(torch.float32, linear_num_heads=4, linear_head_dim=16)
    return copy.deepcopy(model.model.layers[0].self_attn)


MIXERS = {"mamba2 (Bamba)": _mamba2, "kda (Kimi-Linear)": _kda}


def family_triton_interpreter_worker(rank, world):
    def run(module, x_in, d_in):
        x_in = x_in.clone().requires_grad_()
        out = module(x_in)
        (out * d_in).sum().backward()
        return out.detach(), x_in.grad

    failures = []
    for name, build in MIXERS.items():
        base = build()
        x, d_out = torch.randn(1, SEQ, HIDDEN), torch.randn(1, SEQ, HIDDEN)
        ref = LinearAttentionContextParallel(mode="p2p", backend="eager").apply(copy.deepcopy(base), self_meshes())
        out_ref, dx_ref = run(ref, x, d_out)
        grads_ref = grads_of(ref)
        for mode in MODES:
            cp = LinearAttentionContextParallel(mode=mode, backend="triton").apply(copy.deepcopy(base), cp_mesh())
            out, dx = run(cp, local_slice(x, rank, world), local_slice(d_out, rank, world))
            grads = summed_grads(cp)
            errs = {"output": rel_l2(out, local_slice(out_ref, rank, world)),
                    "input grad": rel_l2(dx, local_slice(dx_ref, rank, world)),
                    "param grads": rel_l2(flat(grads), flat(grads_ref))}
            errs.update({f"grad {n}": rel_l2(grads[n], grads_ref[n]) for n in grads_ref})
            failures += [f"{name} {mode} {k}: {e:.3e}" for k, e in errs.items() if not e < 1e-4]
            if rank == 0:
                print(f"{name} {mode}: worst {max(errs.values()):.1e}")
    assert not failures, f"rank {rank} triton (interpreter) vs single-device eager:\n" + "\n".join(failures)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (the README test "
                                                                       "command installs it)")
def test_family_mixers_on_triton_under_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned ranks
    run_distributed(family_triton_interpreter_worker, WORLD, timeout_s=600)
