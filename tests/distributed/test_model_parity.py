"""Whole Qwen3.5 hybrid (3 linear + 1 full layers) and padded batches under CP on gloo.

- model: CP4 in every mode, with and without FSDP2 on the same mesh: logits, loss and every gradient
  against deltacp's single-device computation (and that against transformers, float32-accurate);
- padding: B=2, global 2048 tokens, valid length 1777: padding outputs exactly zero, valid outputs and
  gradients match the single device, in every mode.
"""

import copy
from functools import partial

import pytest
import torch
from transformers import Qwen3_5ForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from deltacp import (
    LinearAttentionContextParallel,
    all_reduce_cp_grads,
    cp_cross_entropy,
    fully_shard_qwen3_5,
    parallelize_qwen3_5_cp,
    shard_batch_for_cp,
)
from deltacp.distributed.launch import run_distributed
from helpers import (computed_once, cp_mesh, flat, full_tensors, grads_of, local_slice, long_memory_gates_, rel_l2,
                     self_meshes, summed_over_ranks, tiny_config)

MODES = ("ulysses", "p2p", "all_gather")


def _step(model, mesh, ids, mask):
    batch = shard_batch_for_cp(ids, mesh, attention_mask=mask)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   attention_mask=batch["attention_mask"], use_cache=False).logits
    loss = cp_cross_entropy(logits, batch["target_ids"], mesh)
    loss.backward()
    return logits.detach(), loss.detach()


def model_parity_worker(rank, world):
    torch.manual_seed(0)
    base = long_memory_gates_(Qwen3_5ForCausalLM(tiny_config()).double())
    B, S = 2, 256
    ids = torch.randint(0, 256, (B, S))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 201:] = 0
    failures = []

    single_mesh = self_meshes()
    mesh = cp_mesh()

    def transformers_reference():
        tf = copy.deepcopy(base)
        out_tf = tf(input_ids=ids, attention_mask=mask, labels=torch.where(mask.bool(), ids, -100), use_cache=False)
        out_tf.loss.backward()
        return out_tf.logits.detach(), out_tf.loss.detach(), grads_of(tf)

    def reference(mode):
        ref = parallelize_qwen3_5_cp(copy.deepcopy(base), single_mesh, linear_attention_cp_mode=mode)
        logits_ref, loss_ref = _step(ref, single_mesh, ids, mask)
        return logits_ref, loss_ref, grads_of(ref)

    (logits_tf, loss_tf, grads_tf), *refs = computed_once(transformers_reference,
                                                          *(partial(reference, mode) for mode in MODES))
    refs = dict(zip(MODES, refs))
    for mode in MODES:
        logits_ref, loss_ref, grads_ref = refs[mode]
        if mode == "ulysses":
            # logits at padded positions are not defined (transformers lets a padded query attend to the row's
            # valid keys, deltacp to the padding only); every valid position, the loss and the gradients match
            valid = mask.bool()
            if (rel_l2(logits_ref[valid], logits_tf[valid]) > 1e-6
                    or abs(loss_ref - loss_tf) > 1e-6 * loss_ref):
                failures.append(f"single vs transformers logits/loss "
                                f"{rel_l2(logits_ref[valid], logits_tf[valid]):.2e}")
            if rel_l2(flat(grads_ref), flat(grads_tf)) > 1e-4:
                failures.append(f"single vs transformers grads {rel_l2(flat(grads_ref), flat(grads_tf)):.2e}")
        for fsdp in (False, True):
            cp = parallelize_qwen3_5_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode=mode)
            if fsdp:
                fully_shard_qwen3_5(cp, mesh)
            logits, loss = _step(cp, mesh, ids, mask)
            if fsdp:
                grads = full_tensors({n: p.grad for n, p in cp.named_parameters()})
            else:
                all_reduce_cp_grads(cp, mesh)
                grads = grads_of(cp)
            tag = f"CP{world} {mode} fsdp={fsdp}"
            checks = {
                "logits": rel_l2(logits, local_slice(logits_ref, rank, world)),
                "loss": abs(loss.item() - loss_ref.item()) / loss_ref.item(),
                "all grads": rel_l2(flat(grads), flat(grads_ref)),
                "grad norm": abs(flat(grads).norm().item() / flat(grads_ref).norm().item() - 1),
            }
            failures += [f"{tag} {k}: {v:.2e}" for k, v in checks.items() if not v < 1e-7]
            # Per parameter a little looser: the decoder's own RMSNorms are transformers' code, which
            # computes in float32 even in a float64 model (docs/design.md, "Precision policy"), so their weight gradients
            # carry float32 rounding of float64-level differences in their inputs.
            per_param = {n: rel_l2(grads[n], grads_ref[n]) for n in grads_ref}
            failures += [f"{tag} grad {n}: {v:.2e}" for n, v in per_param.items() if not v < 1e-6]
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


@pytest.mark.fast
def test_model_parity_cp4_with_and_without_fsdp():
    run_distributed(model_parity_worker, 4, timeout_s=900)


def padding_worker(rank, world):
    torch.manual_seed(3)
    config = tiny_config(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4)
    base = long_memory_gates_(Qwen3_5GatedDeltaNet(config, 0).double())
    B, S, valid = 2, 2048, 1777
    x = torch.randn(B, S, 32, dtype=torch.float64)
    d_out = torch.randn(B, S, 32, dtype=torch.float64)
    mask = torch.zeros(B, S, dtype=torch.long)
    mask[:,:valid] = 1
    failures = []
    single_mesh = self_meshes()

    def reference(mode):
        ref = LinearAttentionContextParallel(mode=mode).apply(copy.deepcopy(base), single_mesh)
        xr = x.clone().requires_grad_()
        out_ref = ref(xr, attention_mask=mask)
        (out_ref * d_out).sum().backward()
        return out_ref.detach(), xr.grad, flat(grads_of(ref))

    refs = dict(zip(MODES, computed_once(*(partial(reference, mode) for mode in MODES))))
    for mode in MODES:
        out_ref, dx_ref, g_ref = refs[mode]
        cp = LinearAttentionContextParallel(mode=mode).apply(copy.deepcopy(base), cp_mesh())
        xl = local_slice(x, rank, world).clone().requires_grad_()
        out = cp(xl, attention_mask=local_slice(mask, rank, world))
        (out * local_slice(d_out, rank, world)).sum().backward()
        pad = local_slice(mask, rank, world) == 0
        if pad.any() and out[pad].abs().max().item() != 0.0:
            failures.append(f"{mode}: padding outputs are not exactly zero")
        valid_local = ~pad
        if rel_l2(out[valid_local], local_slice(out_ref, rank, world)[valid_local]) > 1e-8:
            failures.append(f"{mode}: valid outputs differ")
        if rel_l2(xl.grad, local_slice(dx_ref, rank, world)) > 1e-8:
            failures.append(f"{mode}: input gradients differ")
        grads = summed_over_ranks(grads_of(cp))
        if rel_l2(flat(grads), g_ref) > 1e-8:
            failures.append(f"{mode}: parameter gradients differ")
    assert not failures, f"rank {rank}: " + "; ".join(failures)


def test_padding_and_partial_chunks_cp4():
    run_distributed(padding_worker, 4, timeout_s=900)
