"""The fault trial's one-rank and silent cases at the CP entry points (2026-12-05), one 2-rank spawn: each is refused
on every rank together, naming the fix, never run silently, never a crash or a hang.

- cp_token_logprobs and cp_causal_lm_loss on a model CP was never applied to (an RL reference model left unwrapped:
  each rank's slice ran as a sequence of its own, logp 5.7e-3 off) and inside suspend_cp; all_reduce_cp_grads and
  fully_shard_cp on such a model (their gradient sums assume each rank's loss is its share);
- a different temperature on each rank;
- apply_activation_checkpointing on rank 0 only (a gloo abort under Ulysses, a hang under p2p), and applied twice
  (it nested: 1.7x the step time; now the same plan again is a no-op, another plan raises).
- all_reduce_cp_grads with a gradient that some ranks lack (a parameter their tokens never reached): summed as zero
  there, not a collective on some ranks only.

Also (a second spawn): FSDP2 applied after CP passes, FSDP2 alone and shard_batch_for_cp(model=) of a plain model
are refused, and CP applied at cp = 1 keeps working.

Mutations seen failing: see each test's docstring.
"""

import copy

import pytest
import torch
from transformers import Qwen3_5ForCausalLM

from deltacp import (all_reduce_cp_grads, apply_activation_checkpointing, cp_causal_lm_loss, cp_token_logprobs,
                     fully_shard_cp, parallelize_cp, shard_batch_for_cp, suspend_cp)
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
    for fn in (all_reduce_cp_grads, fully_shard_cp):  # their sums over the mesh are right for a CP'd model only
        _raises_on_every_rank(ValueError, rf"{fn.__name__}: context parallelism is not applied",
                              lambda: fn(plain, mesh))

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
                                      r"\(policy='selective', every_n_layers=1, num_layers=None: 4 layers\), asked "
                                      r"again with policy='full', every_n_layers=1, num_layers=None",
                          lambda: apply_activation_checkpointing(model))
    forwards = [layer.forward for layer in model.model.layers]
    assert apply_activation_checkpointing(model, policy="selective") == 4  # the same plan again: nothing nested
    assert [layer.forward for layer in model.model.layers] == forwards
    cp_causal_lm_loss(model, targets, mesh, **batch, use_cache=False).backward()  # the model still trains
    _grad_sums(mesh)


def _grad_sums(mesh):
    """all_reduce_cp_grads with a gradient on one rank only (summed as zero where missing: the per-parameter
    all-reduce it replaced left the ranks in different collectives), on neither (kept None), a float32 parameter
    among float64 ones, in one bucket per dtype and in buckets of 200 bytes."""
    from deltacp.models import fsdp

    rank = torch.distributed.get_rank()
    model = parallelize_cp(Qwen3_5ForCausalLM(tiny_config()).double(), mesh, linear_attention_cp_mode="p2p")
    params = list(model.parameters())
    params[5].data = params[5].data.float()  # a float32 parameter between float64 ones: a bucket of its own
    saved = fsdp.BUCKET_BYTES
    for bucket_bytes in (saved, 200):  # one bucket per dtype run; then a bucket every 200 bytes
        fsdp.BUCKET_BYTES, expected = bucket_bytes, {}
        for i, p in enumerate(params):
            # i % 4: 0 a gradient on rank 0 only (rank 1's tokens never reached it), 1 on both, 2 on neither,
            # 3 on rank 1 only
            holders = {0: (0,), 1: (0, 1), 2: (), 3: (1,)}[i % 4]
            p.grad = torch.full_like(p, (i + 1) * (rank + 1)) if rank in holders else None
            expected[i] = None if not holders else torch.full_like(p, (i + 1) * sum(r + 1 for r in holders))
        all_reduce_cp_grads(model, mesh)
        for i, p in enumerate(params):
            if expected[i] is None:
                assert p.grad is None, (bucket_bytes, i)
            else:
                assert p.grad.dtype == p.dtype and torch.equal(p.grad, expected[i]), (bucket_bytes, i,
                                                                                      p.grad.flatten()[:3])
    fsdp.BUCKET_BYTES = saved


def test_entry_point_faults_raise_on_every_rank():
    """Mutations seen failing: require_parallelized removed from the losses (rank-local sequences, no error); the
    temperature left out of the agreed values (no error); the checkpointing signature left out of the input hook's
    agreed values (rank 1 aborts in gloo, SIGABRT, at the ulysses case); the second-apply check removed (no error);
    the same-plan no-op made to raise as well (the second selective apply raised); all_reduce_cp_grads leaving
    missing gradients out of the bucket on the ranks lacking them (a size mismatch in gloo), or giving a parameter
    with no gradient anywhere zeros."""
    run_distributed(_worker, 2, timeout_s=300, collective_timeout_s=60)


def _wrapped_worker(rank, world):
    from torch.distributed.fsdp import fully_shard

    from deltacp import fully_shard_cp, init_cp_mesh

    mesh = cp_mesh()
    torch.manual_seed(0)
    base = long_memory_gates_(Qwen3_5ForCausalLM(tiny_config())).double()
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))

    # shard_batch_for_cp(model=) of a model CP was not applied to: refused on every rank together
    _raises_on_every_rank(ValueError, r"shard_batch_for_cp: model= must be a model parallelize_cp was applied to",
                          lambda: shard_batch_for_cp(ids, mesh, model=copy.deepcopy(base)))

    batch = shard_batch_for_cp(ids, mesh)
    targets = batch.pop("target_ids")
    reference = cp_token_logprobs(parallelize_cp(copy.deepcopy(base), mesh), targets, mesh, **batch, use_cache=False)
    # FSDP2 after CP (deltacp's order) is a CP'd model; FSDP2 alone is not
    sharded = fully_shard_cp(parallelize_cp(copy.deepcopy(base), mesh), mesh)
    logp = cp_token_logprobs(sharded, targets, mesh, **batch, use_cache=False)
    torch.testing.assert_close(logp, reference, rtol=1e-12, atol=1e-12)
    only_fsdp = fully_shard(copy.deepcopy(base), mesh=mesh)  # torch's own (fully_shard_cp refuses a plain model)
    for fn in (cp_token_logprobs, cp_causal_lm_loss):
        _raises_on_every_rank(ValueError, rf"{fn.__name__}: context parallelism is not applied to this "
                                          r"FSDPQwen3_5ForCausalLM",
                              lambda: fn(only_fsdp, targets, mesh, **batch, use_cache=False))

    # CP applied with cp = 1 (dp 2 x cp 1): each rank holds whole rows, the single-device numbers
    mesh1 = init_cp_mesh(1, 2)
    one = parallelize_cp(copy.deepcopy(base), mesh1)
    whole = shard_batch_for_cp(ids, mesh1, model=one)
    target1 = whole.pop("target_ids")
    logp = cp_token_logprobs(one, target1, mesh1, **whole, use_cache=False)
    logits = base(input_ids=ids, use_cache=False).logits
    expected = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(logp[:, :-1], expected, rtol=1e-6, atol=1e-7)  # transformers' own GDN kernels
    cp_causal_lm_loss(one, target1, mesh1, **whole, use_cache=False).backward()


def test_wrapped_and_cp1_models_at_the_entry_points():
    """FSDP2 after CP passes the CP-applied check (same log-probabilities as unsharded); FSDP2 without CP and
    shard_batch_for_cp(model=) of a plain model are refused on both ranks; CP at cp = 1 keeps working. Mutation seen
    failing: require_parallelized removed from cp_token_logprobs (the FSDP2-only model ran, no error)."""
    run_distributed(_wrapped_worker, 2, timeout_s=300, collective_timeout_s=60)
