"""Inputs that would train on something else than the user meant: each is refused on every rank (or padded so that
the numbers stay right), never run silently, never left to a collective mismatch or a hang. One 2-rank spawn.

Cases (the fault trial of 2026-12-04): a short packed row under p2p padded up to the conv-halo minimum (the loss and
gradients of the unpadded row on one device); parallelize_cp on a model already wrapped by fully_shard / DDP;
ranks given different labels, masks or positions; a batch cut for the other sequence layout without position ids
(in test_sequence_layout_batch.py, with the layout checks); parallelize_cp called twice on one rank; a packed
batch of two rows given straight to the model; a meta tensor on one rank.

Mutations seen failing: shard_batch_for_cp without the minimum in its padding rule (the p2p forward raises on every
rank: "needs local pieces of at least the conv halo"); refuse_wrapped removed (parallelize_cp goes through on the
FSDP-wrapped model); labels left out of the batch fingerprint (no error); the already-parallelized check back inside
the exchange (rank 1 times out in its forward); the B = 1 check removed from the input hook (rank 0 raises an
internal shape, rank 1 a gloo error); the meta-device checks removed (rank 1: gloo's "Connection closed").
"""

import copy

import pytest
import torch
from transformers import Qwen3_5ForCausalLM

from deltacp import cp_causal_lm_loss, parallelize_cp, row_cut_of, shard_batch_for_cp
from deltacp.distributed.launch import run_distributed
from helpers import cp_mesh, flat, grads_of, long_memory_gates_, self_meshes, summed_grads, tiny_config

pytestmark = pytest.mark.fast


def _expect(error, pattern, fn):
    with pytest.raises(error, match=pattern):
        fn()


def _loss_and_grads(cp_model, mesh, row, cu, **cut):
    batch = shard_batch_for_cp(row, mesh, cu_seqlens=cu, **cut)
    target_ids = batch.pop("target_ids")
    cp_model.zero_grad(set_to_none=True)
    loss = cp_causal_lm_loss(cp_model, target_ids, mesh, **batch, use_cache=False)
    loss.backward()
    return loss.detach(), batch


def _short_rows(rank, world, mesh, base):
    """A packed row shorter than the p2p minimum (2 x cp pieces of 3 tokens under 'balanced'): padded with an
    ignored padding document up to it; the same loss and gradients as the unpadded row on one device."""
    model = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode="p2p", sequence_layout="balanced")
    cut = row_cut_of(model)
    assert (cut.sequence_layout, cut.min_piece_length, cut.min_row_length(world)) == ("balanced", 3, 3 * 2 * world)
    row = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 2, 5])
    loss, batch = _loss_and_grads(model, mesh, row, cu, pad_to_multiple_of=2 * world, model=model)
    assert batch["input_ids"].shape[1] == 2 * 3  # two pieces of 3 tokens
    assert batch["cu_seq_lens_q"].tolist() == [0, 2, 5, 3 * 2 * world]
    grads = summed_grads(model)
    one = self_meshes()
    single = parallelize_cp(copy.deepcopy(base), one, linear_attention_cp_mode="p2p")
    ref_loss, _ = _loss_and_grads(single, one, row, cu)
    assert abs(loss.item() - ref_loss.item()) <= 1e-12 * abs(ref_loss.item())
    ref = flat(grads_of(single))
    # 1e-8: the decoder's RMSNorms are transformers code computing in float32 (their weights' gradients ~3e-8 rel)
    assert ((flat(grads) - ref).norm() / ref.norm()).item() < 1e-8
    # without pad_to_multiple_of, or an unpacked row: a clear error naming the minimum (before any forward)
    _expect(ValueError, r"every one of the 4 pieces of the row needs at least 3: a row of 8 tokens is shorter than "
                        r"12; pass pad_to_multiple_of",
            lambda: shard_batch_for_cp(torch.randint(0, 256, (1, 8)), mesh, cu_seqlens=torch.tensor([0, 3, 8]),
                                       model=model))
    _expect(ValueError, r"shorter than 12; pad the rows \(with an attention_mask\)",
            lambda: shard_batch_for_cp(torch.randint(0, 256, (1, 8)), mesh, model=model))
    _expect(ValueError, r"sequence_layout='contiguous', but the model was parallelized with sequence_layout='balanced'",
            lambda: shard_batch_for_cp(row, mesh, model=model, sequence_layout="contiguous"))
    _expect(ValueError, r"model= must be a model parallelize_cp was applied to",
            lambda: shard_batch_for_cp(row, mesh, model=base))


def _wrapped_models(rank, world, mesh, base):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    sharded = fully_shard(copy.deepcopy(base), mesh=mesh)
    _expect(ValueError, r"already sharded by torch's fully_shard \(FSDP2.*1 / cp of the single-device gradient.*"
                        r"fully_shard_cp", lambda: parallelize_cp(sharded, mesh))
    _expect(ValueError, r"wrapped in DistributedDataParallel", lambda: parallelize_cp(
        DistributedDataParallel(copy.deepcopy(base)), mesh))
    # only one rank's model wrapped: that rank names it, the other stops too
    one = self_meshes()  # collective: every rank
    model = fully_shard(copy.deepcopy(base), mesh=one) if rank == 1 else copy.deepcopy(base)
    _expect(ValueError if rank == 1 else RuntimeError, r"fully_shard", lambda: parallelize_cp(model, mesh))


def _ranks_disagree(rank, world, mesh):
    row = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    labels, mask = row.clone(), torch.ones_like(row)
    if rank == 1:
        labels[0, 5] = -100
    _expect(ValueError, r"ranks disagree on labels", lambda: shard_batch_for_cp(row, mesh, labels=labels))
    if rank == 1:
        mask[1, 14:] = 0
    _expect(ValueError, r"ranks disagree on attention_mask", lambda: shard_batch_for_cp(row, mesh, attention_mask=mask))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3] * 2]) if rank == 0 else torch.tensor([[0, 1, 2, 0] * 4])
    _expect(ValueError, r"ranks disagree on (position_ids|document_offsets)",
            lambda: shard_batch_for_cp(row[:1], mesh, position_ids=positions))
    types = torch.zeros_like(row)
    types[0, 3] = rank
    _expect(ValueError, r"ranks disagree on mm_token_type_ids",
            lambda: shard_batch_for_cp(row, mesh, mm_token_type_ids=types))


def _twice_on_one_rank(rank, world, mesh, base):
    model = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode="p2p")
    if rank == 0:  # raised at once, before any exchange rank 1 never joins
        _expect(ValueError, "already parallelized", lambda: parallelize_cp(model, mesh))
    model(input_ids=torch.randint(0, 256, (1, 8)), use_cache=False)  # both ranks go on together


def _model_inputs(rank, world, mesh, base):
    model = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode="p2p")
    two_rows = torch.randint(0, 256, (2, 8))
    _expect(ValueError, r"packed documents .* need one row \(B = 1\) under CP, got a batch of 2 rows of 8 tokens",
            lambda: model(input_ids=two_rows, cu_seq_lens_q=torch.tensor([0, 5, 16]), use_cache=False))
    # a meta tensor on rank 0: rank 0 names it, rank 1 names rank 0's error (no gloo error)
    ids = torch.randint(0, 256, (1, 16), device="meta" if rank == 0 else "cpu")
    pattern = r"input_ids is on the meta device"
    _expect(ValueError if rank == 0 else RuntimeError, (r"" if rank == 0 else r"failed on rank\(s\) \[0\].*") + pattern,
            lambda: shard_batch_for_cp(ids, mesh))
    _expect(ValueError if rank == 0 else RuntimeError, r"model's input is on the meta device",
            lambda: model(input_ids=ids[:, :8], use_cache=False))
    model(input_ids=torch.randint(0, 256, (1, 8)), use_cache=False)  # the group is still usable


def worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mesh = cp_mesh()
    torch.manual_seed(0)
    base = long_memory_gates_(Qwen3_5ForCausalLM(tiny_config())).double()
    _short_rows(rank, world, mesh, base)
    _wrapped_models(rank, world, mesh, base)
    _ranks_disagree(rank, world, mesh)
    _twice_on_one_rank(rank, world, mesh, base)
    _model_inputs(rank, world, mesh, base)


def test_no_silent_wrong_answers_cp2():
    run_distributed(worker, 2, timeout_s=300, collective_timeout_s=60)
