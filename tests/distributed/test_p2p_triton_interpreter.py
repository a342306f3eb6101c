"""The p2p + Triton path on CPU: the real kernels under TRITON_INTERPRET=1, on 4 gloo ranks (a first, two middle
and a last rank), against the single-device eager layer.

What it covers that the GPU tests cover only on a GPU: p2p's Triton stages (one `prepare_chunks` shared by the
summary, the output pass and the backward's dH_in pass; S alone on rank 0; M and S on the middle ranks; the
prepared tensors carried through save_for_backward). fp32 inputs, so the kernels compute in fp32 end to end and
the bound is fp32's. The capability check (CUDA, bf16, head dim 128) is bypassed here on purpose: it has its own
tests, and the kernels themselves are generic in those.

The same spawn runs the other recurrences' mixers on the Triton backend: a Mamba2 mixer (the fused conv over
[x | B | C] with its three channel groups, the scalar-decay recurrence) and a KDA mixer (the fused conv over
[q | k | v], the KDA kernels), in p2p and Ulysses (the modes with a Triton path; all_gather runs on eager only),
against the single-device eager mixer: each view's Triton wiring (Mamba2: x, dt and D handed to the kernels; KDA:
the per-channel gate and beta handed to the kernels) and each Triton recurrence in the modes (p2p's summary and
dh_in passes, Ulysses' head slices, Mamba2's groups repeated); fp32, so the bound is fp32's. A Mamba1 mixer (the
selective scan: x, dt after softplus, A, B, C, D and the gate z handed to its kernels) runs in p2p only: its Ulysses
rows (the same op on fewer channels after an all-reduce that knows no backend) cost 32 s here, and the eager parity
tests run Mamba1 under Ulysses.
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
FAMILY_SEQ, HIDDEN = 320, 32  # the other mixers: 80 tokens per rank, two chunks, the second partial
MODES = ("p2p", "ulysses")


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


def _mamba1():
    """A Mamba1 mixer (the selective scan: a head per channel) with I = 32 channels (one channel block of the
    kernels), N = 4, slowly decaying so the state crosses the rank boundary, a non-zero D."""
    import transformers
    from transformers.models.mamba.modeling_mamba import MambaMixer

    config = transformers.MambaConfig(hidden_size=HIDDEN, state_size=4, expand=1, conv_kernel=4, time_step_rank=4,
                                      num_hidden_layers=1)
    torch.manual_seed(6)
    mixer = MambaMixer(config, 0)
    with torch.no_grad():
        mixer.A_log.uniform_(-4, -2)
        mixer.D.uniform_(0.5, 1.5)
    return mixer


MIXERS = {"mamba2 (Bamba)": _mamba2, "kda (Kimi-Linear)": _kda, "selective scan (Mamba)": _mamba1}
# Mamba1 under Ulysses is the same Triton op on a rank's channels (16 here, any count in the op's own interpreter
# tests) after x_proj's all-reduce, which is backend-free (the eager parity tests run it); running it here took 34 s
# of the suite's time (the whole row per rank): p2p only
MIXER_MODES = {"selective scan (Mamba)": ("p2p",)}


def family_mixers_worker(rank, world):
    def run(module, x_in, d_in):
        x_in = x_in.clone().requires_grad_()
        out = module(x_in)
        (out * d_in).sum().backward()
        return out.detach(), x_in.grad

    failures = []
    for name, build in MIXERS.items():
        base = build()
        x, d_out = torch.randn(1, FAMILY_SEQ, HIDDEN), torch.randn(1, FAMILY_SEQ, HIDDEN)
        ref = LinearAttentionContextParallel(mode="p2p", backend="eager").apply(copy.deepcopy(base), self_meshes())
        out_ref, dx_ref = run(ref, x, d_out)
        grads_ref = grads_of(ref)
        for mode in MIXER_MODES.get(name, MODES):
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


def interpreter_worker(rank, world):
    import triton_interpreter

    triton_interpreter.patch()
    p2p_triton_interpreter_worker(rank, world)
    family_mixers_worker(rank, world)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (the README test "
                                                                       "command installs it)")
def test_p2p_triton_stages_under_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned ranks
    run_distributed(interpreter_worker, WORLD, timeout_s=600)
