"""A whole hybrid (3 GDN + 1 full attention layers, float64) under sequence_layout='balanced' on gloo: the batch
cut by `shard_batch_for_cp(sequence_layout="balanced")`, the model by `parallelize_cp(sequence_layout="balanced")`,
against the single device (the same model on a one-rank mesh): each rank's logits (its two pieces, cut here
independently of deltacp), the loss, every gradient summed over ranks and the grad norm, to 1e-7 (transformers'
decoder RMSNorms compute in float32 on both sides). One spawn at CP4 (1-D and 2-D, every GDN mode and attention
method, unpacked and packed rows with documents crossing pieces); CP16 runs in `test_two_d_parity.py`'s spawn.
"""

import copy

import torch
from transformers import Qwen3_5ForCausalLM

from deltacp import all_reduce_cp_grads, cp_cross_entropy, parallelize_cp, sequence_layout_of, shard_batch_for_cp
from deltacp.distributed.launch import run_distributed
from helpers import cp_mesh, flat, grads_of, local_slice, long_memory_gates_, rel_l2, self_meshes, tiny_config

BOUND = 1e-7
S = 128  # pieces of 16 tokens at CP4
PACKED = [0, 5, 16, 50, 51, 96, 128]  # a document starts at piece 1's first token; others cross pieces and ranks

CASES = [  # (ulysses_degree, linear_attention_cp_mode, state_passing, full_attention_cp, packed)
    (None, "ulysses", "chain", "ulysses", False),
    (None, "p2p", "scan", "all_gather", True),
    (None, "p2p", "chain", "ring", False),
    (None, "all_gather", "chain", "ring", True),
    (2, "p2p", "scan", "ring", True),
    (2, "all_gather", "chain", "all_gather", False),
]


def _step(model, mesh, ids, cu, layout):
    model.zero_grad(set_to_none=True)
    batch = shard_batch_for_cp(ids, mesh, cu_seqlens=cu, sequence_layout=layout)
    targets = batch.pop("target_ids")
    logits = model(**batch, use_cache=False).logits
    loss = cp_cross_entropy(logits, targets, mesh)
    loss.backward()
    all_reduce_cp_grads(model, mesh)
    return logits.detach(), loss.detach(), flat(grads_of(model))


def balanced_model_worker(rank, world):
    torch.manual_seed(0)
    base = long_memory_gates_(Qwen3_5ForCausalLM(tiny_config()).double())  # 8 attention heads, 8 value heads
    ids = torch.randint(0, 256, (1, S))
    mesh, single = cp_mesh(), self_meshes()
    refs = {}
    for packed in (False, True):
        cu = torch.tensor(PACKED) if packed else None
        ref = parallelize_cp(copy.deepcopy(base), single, linear_attention_cp_mode="p2p")
        refs[packed] = _step(ref, single, ids, cu, "contiguous")
    failures = []
    for u, mode, passing, method, packed in CASES:
        model = parallelize_cp(copy.deepcopy(base), mesh, ulysses_degree=u, linear_attention_cp_mode=mode,
                               linear_attention_state_passing=passing, full_attention_cp=method,
                               sequence_layout="balanced")
        assert sequence_layout_of(model) == "balanced"
        logits, loss, grads = _step(model, mesh, ids, torch.tensor(PACKED) if packed else None, "balanced")
        logits_ref, loss_ref, grads_ref = refs[packed]
        figures = {"logits": rel_l2(logits, local_slice(logits_ref, rank, world, layout="balanced")),
                   "loss": abs(loss.item() / loss_ref.item() - 1), "all grads": rel_l2(grads, grads_ref),
                   "grad norm": abs(grads.norm().item() / grads_ref.norm().item() - 1)}
        failures += [f"CP{world} u={u} {mode}/{passing}+{method} {'packed' if packed else 'unpacked'} {k}: {v:.2e}"
                     for k, v in figures.items() if not v < BOUND]
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_balanced_model_parity_cp4():
    run_distributed(balanced_model_worker, 4, timeout_s=900)
