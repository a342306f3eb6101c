"""Activation checkpointing of p2p layers replays the state its own forward received.

An extra grad-enabled forward without a backward (an evaluation outside no_grad) between steps must not
change the next step's gradients: the recompute looks its H_in up in its own forward's context, never in a
queue that other forwards fill.
"""

import copy

import pytest
import torch

from deltacp import all_reduce_cp_grads, cp_cross_entropy, parallelize_qwen3_5_cp, shard_batch_for_cp
from deltacp.distributed.launch import run_distributed
from deltacp.models.checkpointing import apply_activation_checkpointing
from helpers import cp_mesh, flat, grads_of, long_memory_gates_, rel_l2, tiny_config

pytestmark = pytest.mark.fast


def _grads_of_step(model, mesh, ids, cu, extra_forward_ids=None):
    model.zero_grad(set_to_none=True)
    if extra_forward_ids is not None:  # grad enabled, no backward: its graph is dropped
        model(**{k: v for k, v in shard_batch_for_cp(extra_forward_ids, mesh).items() if k != "target_ids"},
              use_cache=False)
    batch = shard_batch_for_cp(ids, mesh, cu_seqlens=cu)
    logits = model(**{k: v for k, v in batch.items() if k != "target_ids"}, use_cache=False).logits
    cp_cross_entropy(logits, batch["target_ids"], mesh).backward()
    all_reduce_cp_grads(model, mesh)
    return flat(grads_of(model))


def replay_worker(rank, world):
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    base = long_memory_gates_(Qwen3_5ForCausalLM(tiny_config()).double())
    mesh = cp_mesh()
    ids = torch.randint(0, 256, (1, 128))
    other = torch.randint(0, 256, (1, 128))
    cu = torch.tensor([0, 50, 128])
    plain = parallelize_qwen3_5_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode="p2p")
    expected = _grads_of_step(plain, mesh, ids, cu)
    ac = parallelize_qwen3_5_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode="p2p")
    apply_activation_checkpointing(ac)
    for extra in (None, other, other):
        got = _grads_of_step(ac, mesh, ids, cu, extra_forward_ids=extra)
        assert rel_l2(got, expected) < 1e-12, f"rank {rank}: AC gradients differ by {rel_l2(got, expected):.2e}"


def test_extra_forward_without_backward_leaves_gradients_exact():
    run_distributed(replay_worker, 4, timeout_s=300)
