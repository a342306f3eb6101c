"""The fault trial's one-rank and silent cases at the CP entry points (2026-12-05), one 2-rank spawn: each is refused
on every rank together, naming the fix, never run silently, never a crash or a hang.

- cp_token_logprobs and cp_causal_lm_loss on a model CP was never applied to (an RL reference model left unwrapped:
  each rank's slice ran as a sequence of its own, logp 5.7e-3 off) and inside suspend_cp;
- a different temperature on each rank;
- apply_activation_checkpointing on rank 0 only (a gloo abort under Ulysses, a hang under p2p), and applied twice
  (it nested: 1.7x the step time).

Mutations seen failing: see the test's docstring.
"""

import copy

import pytest
import torch
from transformers import Qwen3_5ForCausalLM

from deltacp import (apply_activation_checkpointing, cp_causal_lm_loss, cp_token_logprobs, parallelize_cp,
                     shard_batch_for_cp, suspend_cp)
from deltacp.distributed.launch import run_distributed
from helpers import cp_mesh, long_memory_gates_, tiny_config

pytestmark = pytest.mark.fast


def _raises_on_every_rank(error, pattern, fn):
    with pytest.raises(error, match=pattern):
        fn()


def _worker(rank, world):
    mesh = cp_mesh()
    torch.manual_seed(0)
    base = long_memory_gates_(Qwen3_5ForCausalLM(tiny_config())).double()
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    batch = shard_batch_for_cp(ids, mesh)
    targets = batch.pop("target_ids")

    plain = copy.deepcopy(base)  # never parallelized
    for fn in (cp_token_logprobs, cp_causal_lm_loss):
        _raises_on_every_rank(ValueError, rf"{fn.__name__}: context parallelism is not applied to this "
                                          r"Qwen3_5ForCausalLM.*Apply parallelize_cp\(model, mesh, \.\.\.\) first",
                              lambda: fn(plain, targets, mesh, **batch, use_cache=False))

    model = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode="p2p")
    with suspend_cp(model):
        _raises_on_every_rank(ValueError, r"cp_token_logprobs: the model is inside suspend_cp",
                              lambda: cp_token_logprobs(model, targets, mesh, **batch, use_cache=False))
    logp = cp_token_logprobs(model, targets, mesh, temperature=0.7, **batch, use_cache=False)
    assert torch.isfinite(logp).all()
    mine = 0.7 if rank == 0 else 0.75  # a different temperature on rank 1
    _raises_on_every_rank(ValueError, r"cp_token_logprobs: ranks disagree on temperature \(rank 0: 0\.7, rank 1: "
                                      r"0\.75\)",
                          lambda: cp_token_logprobs(model, targets, mesh, temperature=mine, **batch, use_cache=False))

    for mode in ("ulysses", "p2p"):  # checkpointing on rank 0 only: refused at the first forward, on both ranks
        model = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode=mode)
        if rank == 0:
            apply_activation_checkpointing(model)
        _raises_on_every_rank(ValueError, r"ranks disagree on activation_checkpointing \(rank 0: \(1, 1, -1, 4\), "
                                          r"rank 1: \(0, 0, 0, 0\)\)",
                              lambda: cp_causal_lm_loss(model, targets, mesh, **batch, use_cache=False).backward())
    model = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode="p2p")
    apply_activation_checkpointing(model, policy="selective")
    _raises_on_every_rank(ValueError, r"apply_activation_checkpointing: already applied to this Qwen3_5ForCausalLM "
                                      r"\(policy='selective', every_n_layers=1, num_layers=None: 4 layers\)",
                          lambda: apply_activation_checkpointing(model))
    cp_causal_lm_loss(model, targets, mesh, **batch, use_cache=False).backward()  # the model still trains


def test_entry_point_faults_raise_on_every_rank():
    """Mutations seen failing: require_parallelized removed from the losses (rank-local sequences, no error); the
    temperature left out of the agreed values (no error); the checkpointing signature left out of the input hook's
    agreed values (rank 1 aborts in gloo, SIGABRT, at the ulysses case); the second-apply check removed (no error)."""
    run_distributed(_worker, 2, timeout_s=300, collective_timeout_s=60)
