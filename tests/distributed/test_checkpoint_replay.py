"""Activation checkpointing of p2p layers replays the state its own forward received; the selective policy keeps
each full attention's output, so backward never runs an attention forward kernel again.

An extra grad-enabled forward without a backward (an evaluation outside no_grad) between steps must not
change the next step's gradients: the recompute looks its H_in up in its own forward's context, never in a
queue that other forwards fill.

Selective (CP4, float64, packed documents, p2p GDN): for full attention by Ulysses, KV all-gather, ring (1-D),
all-gather in the 2-D layout (u = 2) and ring under the balanced layout, the gradients with policy "selective"
and "full" equal those without checkpointing (1e-12), the p2p messages are the same as without checkpointing, and
the attention forward kernels (counted below the autograd engine, by a dispatch mode around forward + backward)
run as often as without checkpointing, where full checkpointing runs them twice.
"""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deltacp import all_reduce_cp_grads, cp_cross_entropy, parallelize_qwen3_5_cp, shard_batch_for_cp
from deltacp.distributed.launch import run_distributed
from deltacp.models.checkpointing import apply_activation_checkpointing
from deltacp.train.trainer import p2p_passings
from helpers import cp_mesh, flat, grads_of, long_memory_gates_, rel_l2, tiny_config

pytestmark = pytest.mark.fast

# the attention forward kernel of the CPU (written here, not taken from deltacp's list)
CPU_ATTENTION_FORWARD = "aten._scaled_dot_product_flash_attention_for_cpu.default"


class KernelCounter(TorchDispatchMode):
    """Counts the calls of each op that reach the kernels (below autograd and below a selective checkpoint)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func)] = self.calls.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def _grads_of_step(model, mesh, ids, cu, extra_forward_ids=None, layout="contiguous"):
    model.zero_grad(set_to_none=True)
    if extra_forward_ids is not None:  # grad enabled, no backward: its graph is dropped
        model(**{k: v for k, v in shard_batch_for_cp(extra_forward_ids, mesh, sequence_layout=layout).items()
                 if k != "target_ids"}, use_cache=False)
    batch = shard_batch_for_cp(ids, mesh, cu_seqlens=cu, sequence_layout=layout)
    logits = model(**{k: v for k, v in batch.items() if k != "target_ids"}, use_cache=False).logits
    cp_cross_entropy(logits, batch["target_ids"], mesh).backward()
    all_reduce_cp_grads(model, mesh)
    return flat(grads_of(model))


SELECTIVE_CASES = [  # (full_attention_cp, ulysses_degree, sequence_layout, packed)
    ("ulysses", None, "contiguous", True),
    ("all_gather", None, "contiguous", True),
    ("ring", None, "contiguous", True),
    ("all_gather", 2, "contiguous", True),
    ("ring", None, "balanced", False),
]


def _selective_case(rank, base, mesh, ids, cu, other, attention, degree, layout):
    runs = {}
    for policy in (None, "full", "selective"):
        model = parallelize_qwen3_5_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode="p2p",
                                       full_attention_cp=attention, ulysses_degree=degree, sequence_layout=layout)
        if policy is not None:
            apply_activation_checkpointing(model, policy=policy)
        passings = p2p_passings(model)
        for p in passings:
            p.log = []
        with KernelCounter() as counter:
            grads = _grads_of_step(model, mesh, ids, cu, layout=layout)
        runs[policy] = (grads, counter.calls.get(CPU_ATTENTION_FORWARD, 0), [list(p.log) for p in passings])
        if policy == "selective":  # a step after a forward without backward: nothing that forward kept is taken
            again = _grads_of_step(model, mesh, ids, cu, extra_forward_ids=other, layout=layout)
    where = f"rank {rank}, {attention} u={degree} {layout}"
    plain, calls, logs = runs[None]
    assert calls > 0, f"{where}: no attention kernel counted"
    assert rel_l2(again, plain) < 1e-12, f"{where}: selective after an extra forward: {rel_l2(again, plain):.2e}"
    for policy in ("full", "selective"):
        grads, n, policy_logs = runs[policy]
        assert rel_l2(grads, plain) < 1e-12, f"{where}: {policy} gradients differ by {rel_l2(grads, plain):.2e}"
        assert n == (2 * calls if policy == "full" else calls), \
            f"{where}: {policy} ran {n} attention forward kernels, without checkpointing {calls}"
        assert policy_logs == logs, f"{where}: {policy} changed the p2p messages"


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
    apply_activation_checkpointing(ac, policy="full")
    for extra in (None, other, other):
        got = _grads_of_step(ac, mesh, ids, cu, extra_forward_ids=extra)
        assert rel_l2(got, expected) < 1e-12, f"rank {rank}: AC gradients differ by {rel_l2(got, expected):.2e}"
    for attention, degree, layout, packed in SELECTIVE_CASES:
        _selective_case(rank, base, mesh, ids, cu if packed else None, other, attention, degree, layout)


def test_extra_forward_without_backward_leaves_gradients_exact_and_selective_runs_attention_once():
    run_distributed(replay_worker, 4, timeout_s=300)
