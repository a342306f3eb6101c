"""CP layer parity on gloo: GDN in every mode and Ulysses full attention, against the single device.

One spawn per world size runs every check (spawning is the expensive part). Each rank builds the same
global tensors and modules from one seed, computes the single-device reference itself, and compares its
own output and input-gradient slices plus the rank-summed parameter gradients:
- tight bounds (fp64 1e-8, fp32 1e-4) against deltacp's own single-device computation (same code on a
  one-rank mesh), as docs/design.md ("Precision policy") explains;
- float32-accuracy bounds of deltacp's single-device computation against the transformers module.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5Attention,
    Qwen3_5GatedDeltaNet,
    Qwen3_5TextRotaryEmbedding,
)

from deltacp import LinearAttentionContextParallel
from deltacp.parallel.attention import install_ulysses_attention
from deltacp.distributed.launch import run_distributed
from helpers import long_memory_gates_, cp_mesh, flat, grads_of, local_slice, rel_l2, self_meshes, summed_grads, tiny_config

MODES = ("ulysses", "p2p", "all_gather")
TIGHT = {torch.float64: 1e-8, torch.float32: 1e-4}
SEQ = 320  # local 160/80/40 tokens at CP2/4/8: partial chunks everywhere


def _run_gdn(module, x, d_out, mask=None):
    x = x.clone().requires_grad_()
    out = module(x, attention_mask=mask)
    (out * d_out).sum().backward()
    return out.detach(), x.grad


def _check(name, value, bound, failures):
    if not value < bound:
        failures.append(f"{name}: {value:.3e} >= {bound:.0e}")


def gdn_layer_parity(rank, world, dtype, failures):
    torch.manual_seed(1)
    base = Qwen3_5GatedDeltaNet(tiny_config(), 0).to(dtype)
    long_memory_gates_(base)
    x = torch.randn(2, SEQ, 64, dtype=dtype)
    d_out = torch.randn(2, SEQ, 64, dtype=dtype)
    single_mesh = self_meshes()
    for mode in MODES:
        ref = LinearAttentionContextParallel(mode=mode).apply(copy.deepcopy(base), single_mesh)
        out_ref, dx_ref = _run_gdn(ref, x, d_out)
        cp = LinearAttentionContextParallel(mode=mode).apply(copy.deepcopy(base), cp_mesh())
        out, dx = _run_gdn(cp, local_slice(x, rank, world), local_slice(d_out, rank, world))
        grads, grads_ref = summed_grads(cp), grads_of(ref)
        tag = f"CP{world} {mode} {dtype}"
        bound = TIGHT[dtype]
        _check(f"{tag} output", rel_l2(out, local_slice(out_ref, rank, world)), bound, failures)
        _check(f"{tag} input grad", rel_l2(dx, local_slice(dx_ref, rank, world)), bound, failures)
        for name in grads_ref:
            _check(f"{tag} grad {name}", rel_l2(grads[name], grads_ref[name]), bound, failures)
        norm, norm_ref = flat(grads).norm().item(), flat(grads_ref).norm().item()
        _check(f"{tag} grad norm", abs(norm - norm_ref) / norm_ref, bound, failures)
        if dtype == torch.float64 and mode == "p2p":
            # deltacp's single-device computation against transformers' own module (float32-accurate)
            tf = copy.deepcopy(base)
            out_tf, dx_tf = _run_gdn(tf, x, d_out)
            _check(f"{tag} single vs transformers output", rel_l2(out_ref, out_tf), 1e-5, failures)
            _check(f"{tag} single vs transformers input grad", rel_l2(dx_ref, dx_tf), 1e-5, failures)
            _check(f"{tag} single vs transformers all param grads", rel_l2(flat(grads_ref), flat(grads_of(tf))),
                   1e-4, failures)


def attention_layer_parity(rank, world, dtype, failures):
    torch.manual_seed(2)
    config = tiny_config()  # 8 query heads, 2 KV heads: KV heads fewer than CP4/CP8
    base = Qwen3_5Attention(config, 3).to(dtype)
    with torch.no_grad():
        base.q_norm.weight.normal_(0, 0.1)
        base.k_norm.weight.normal_(0, 0.1)
    rotary = Qwen3_5TextRotaryEmbedding(config)
    x = torch.randn(2, SEQ, 64, dtype=dtype)
    d_out = torch.randn(2, SEQ, 64, dtype=dtype)
    positions = torch.arange(SEQ).expand(2, SEQ)
    cos, sin = rotary(x, positions[None].expand(3, -1, -1))

    def run_full(module):
        xr = x.clone().requires_grad_()
        out_ref, _ = module(xr, (cos, sin), None)
        (out_ref * d_out).sum().backward()
        return out_ref.detach(), xr.grad

    ref = install_ulysses_attention(copy.deepcopy(base), self_meshes().get_group())
    out_ref, dx_ref = run_full(ref)

    cp = install_ulysses_attention(copy.deepcopy(base), cp_mesh().get_group())
    xl = local_slice(x, rank, world).clone().requires_grad_()
    out, _ = cp(xl, (local_slice(cos, rank, world), local_slice(sin, rank, world)), None)
    (out * local_slice(d_out, rank, world)).sum().backward()
    grads, grads_ref = summed_grads(cp), grads_of(ref)
    tag = f"CP{world} attention {dtype}"
    bound = TIGHT[dtype]
    _check(f"{tag} output", rel_l2(out, local_slice(out_ref, rank, world)), bound, failures)
    _check(f"{tag} input grad", rel_l2(xl.grad, local_slice(dx_ref, rank, world)), bound, failures)
    for name in grads_ref:
        _check(f"{tag} grad {name}", rel_l2(grads[name], grads_ref[name]), bound, failures)
    if dtype == torch.float64:
        tf = copy.deepcopy(base)
        out_tf, dx_tf = run_full(tf)
        _check(f"{tag} single vs transformers output", rel_l2(out_ref, out_tf), 1e-5, failures)
        _check(f"{tag} single vs transformers input grad", rel_l2(dx_ref, dx_tf), 1e-5, failures)
        _check(f"{tag} single vs transformers all param grads", rel_l2(flat(grads_ref), flat(grads_of(tf))), 1e-4,
               failures)


def layer_parity_worker(rank, world):
    failures = []
    for dtype in (torch.float64, torch.float32):
        gdn_layer_parity(rank, world, dtype, failures)
        attention_layer_parity(rank, world, dtype, failures)
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.fast), 4, 8])
def test_layer_parity(world):
    run_distributed(layer_parity_worker, world, timeout_s=900)
