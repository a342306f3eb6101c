"""Fail-fast cases that need several ranks: every rank raises the documented error, nobody hangs."""

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen3_5ForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from deltacp import LinearAttentionContextParallel, parallelize_qwen3_5_cp
from deltacp.distributed.launch import run_distributed
from helpers import cp_mesh, tiny_config

pytestmark = pytest.mark.fast


def _expect(error, pattern, fn):
    with pytest.raises(error, match=pattern):
        fn()


def fail_fast_worker(rank, world):
    mesh = cp_mesh()
    # Ulysses needs value heads divisible by the CP degree (6 heads at CP4).
    gdn6 = Qwen3_5GatedDeltaNet(tiny_config(linear_num_key_heads=3, linear_num_value_heads=6), 0)
    _expect(ValueError, r"linear_num_value_heads \(6\) divisible by the CP degree \(4\)",
            lambda: LinearAttentionContextParallel(mode="ulysses").apply(copy.deepcopy(gdn6), mesh))
    LinearAttentionContextParallel(mode="p2p").apply(copy.deepcopy(gdn6), mesh)  # p2p keeps all heads: fine
    _expect(ValueError, r"num_attention_heads \(6\) divisible by the CP degree \(4\)",
            lambda: parallelize_qwen3_5_cp(Qwen3_5ForCausalLM(tiny_config(num_attention_heads=6)), mesh))

    # Local sequence shorter than the conv halo (kernel 4 -> 3 tokens): raised before the halo exchange.
    gdn = LinearAttentionContextParallel(mode="p2p").apply(Qwen3_5GatedDeltaNet(tiny_config(), 0), mesh)
    _expect(ValueError, r"at least the conv halo .* = 3\) tokens, got 2", lambda: gdn(torch.randn(1, 2, 64)))

    # tp > 1 in the mesh.
    tp_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("tp", "cp"))
    _expect(ValueError, r"tp=2 is not supported with linear attention CP",
            lambda: parallelize_qwen3_5_cp(Qwen3_5ForCausalLM(tiny_config()), tp_mesh))

    # Ranks that disagree on the configuration all raise (rank 0 asks for p2p, the others for ulysses) ...
    mode = "p2p" if rank == 0 else "ulysses"
    _expect(ValueError, r"parallelize_cp: ranks disagree on linear_attention_cp_mode \(rank 0: 'p2p', ranks \[1, 2, 3\]: "
                        r"'ulysses'\)",
            lambda: parallelize_qwen3_5_cp(Qwen3_5ForCausalLM(tiny_config()), mesh,
                                           linear_attention_cp_mode=mode))
    # ... and so do ranks with different model shapes.
    heads = 8 if rank < world - 1 else 4
    _expect(ValueError, r"ranks disagree on num_v_heads \(ranks \[0, 1, 2\]: 8, rank 3: 4\)",
            lambda: LinearAttentionContextParallel(mode="p2p").apply(
                Qwen3_5GatedDeltaNet(tiny_config(linear_num_value_heads=heads), 0), mesh))
    # The group is still usable afterwards: a correct apply and forward go through.
    model = parallelize_qwen3_5_cp(Qwen3_5ForCausalLM(tiny_config()), mesh, linear_attention_cp_mode="p2p")
    model(input_ids=torch.randint(0, 256, (1, 16)), use_cache=False)

    # DTensor input (sequence-sharded over the CP mesh) is taken by its local tensor.
    from torch.distributed.tensor import DTensor, Shard

    torch.manual_seed(5)
    x_local = torch.randn(1, 32, 64)
    for mode in ("ulysses", "p2p", "all_gather"):
        layer = LinearAttentionContextParallel(mode=mode).apply(Qwen3_5GatedDeltaNet(tiny_config(), 0), mesh)
        from_dtensor = layer(DTensor.from_local(x_local, mesh, [Shard(1)]))
        assert torch.equal(from_dtensor, layer(x_local)), mode


def test_fail_fast_cp4():
    run_distributed(fail_fast_worker, 4, timeout_s=300)


def one_rank_fails_worker(rank, world, failing_rank):
    """A check that fails on one rank only: every rank raises, within the collective timeout's fraction."""
    import time

    mesh = cp_mesh()
    # the failing rank's model has 5 attention heads (not divisible by the CP degree); the others are fine
    heads = 5 if rank == failing_rank else 8
    model = Qwen3_5ForCausalLM(tiny_config(num_attention_heads=heads, num_key_value_heads=1))
    start = time.monotonic()
    if rank == failing_rank:
        _expect(ValueError, r"num_attention_heads \(5\) divisible by the CP degree",
                lambda: parallelize_qwen3_5_cp(model, mesh))
    else:
        _expect(RuntimeError, rf"checks failed on rank\(s\) \[{failing_rank}\].*num_attention_heads \(5\)",
                lambda: parallelize_qwen3_5_cp(model, mesh))
    elapsed = time.monotonic() - start
    assert elapsed < 20, f"rank {rank} took {elapsed:.1f} s to raise (the others waited?)"
    # the same for the single-layer style
    heads = 5 if rank == failing_rank else 8
    gdn = Qwen3_5GatedDeltaNet(tiny_config(linear_num_key_heads=1, linear_num_value_heads=heads), 0)
    error = ValueError if rank == failing_rank else RuntimeError
    _expect(error, "divisible by the CP degree", lambda: LinearAttentionContextParallel(mode="ulysses").apply(gdn, mesh))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_check_failing_on_one_rank_raises_on_all(world):
    # collective timeout 120 s: a rank left waiting in the exchange would fail the 20 s bound above
    run_distributed(one_rank_fails_worker, world, world - 1, timeout_s=300)


def keywords_worker(rank, world):
    """Every keyword a CP'd forward receives is honoured or refused, naming it."""
    mesh = cp_mesh()
    model = parallelize_qwen3_5_cp(Qwen3_5ForCausalLM(tiny_config()), mesh, linear_attention_cp_mode="p2p")
    ids = torch.randint(0, 256, (1, 16))
    _expect(NotImplementedError, r"does not support the keyword\(s\) \[('cache'|'cache_params'|'past_key_values'), 'use_cache'\]",
            lambda: model(input_ids=ids))  # use_cache defaults to True: an inference cache
    _expect(NotImplementedError, r"\['output_attentions'\]",
            lambda: model(input_ids=ids, use_cache=False, output_attentions=True))
    _expect(NotImplementedError, r"\['made_up_keyword'\]",
            lambda: model(input_ids=ids, use_cache=False, made_up_keyword=1))
    _expect(ValueError, "labels under CP", lambda: model(input_ids=ids, labels=ids, use_cache=False))
    _expect(ValueError, "logits_to_keep", lambda: model(input_ids=ids, logits_to_keep=1, use_cache=False))
    S = 16 * world
    _expect(ValueError, r"cu_seq_lens_q ends at 16, the number of tokens this rank was given: under CP the model takes "
                        r"this rank's slice of the row \(16 tokens here, so a row of 16 x cp 2 = 32 tokens\)",
            lambda: model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 5, 16]), use_cache=False))
    _expect(ValueError, r"cu_seq_lens_q .* must start at 0 and end at the row length 32",
            lambda: model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 5, 20]), use_cache=False))
    _expect(ValueError, "strictly increasing",
            lambda: model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 5, 5, S]), use_cache=False))
    _expect(ValueError, r"max_length_q=3 does not match the longest document of cu_seq_lens_q \(" + str(S - 5) + r"\)",
            lambda: model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 5, S]), max_length_q=3, use_cache=False))
    _expect(ValueError, "cu_seq_lens_k must equal cu_seq_lens_q",
            lambda: model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 5, S]), cu_seq_lens_k=torch.tensor([0, 6, S]),
                          use_cache=False))
    # ranks that received different batches (here: different document offsets) all raise
    cut = 5 if rank == 0 else 6
    _expect(ValueError, r"ranks disagree on cu_seq_lens_q \(rank 0: \(1, 3, .*\), rank 1: \(1, 3, .*\)\)",
            lambda: model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, cut, S]), use_cache=False))
    # a malformed mask on one rank only: that rank raises its error, the others raise too (nobody waits)
    bad = torch.ones(1, 15 if rank == 0 else 16, dtype=torch.long)
    _expect(ValueError if rank == 0 else RuntimeError,
            r"local 2-D padding mask \[B, s\] = \(1, 16\), got \(1, 15\)" if rank == 0 else
            r"checks failed on rank\(s\) \[0\] \(rank 0: ValueError: under CP, attention_mask must be the local",
            lambda: model(input_ids=ids, attention_mask=bad, use_cache=False))
    # max_length_q differing on one rank
    _expect(ValueError if rank == 1 else RuntimeError,
            r"does not match the longest document|checks failed on rank\(s\) \[1\].*does not match the longest",
            lambda: model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 5, S]), max_length_q=S - 5 + rank,
                          use_cache=False))
    # a padding mask with a hole cannot be expressed as documents: refused
    mask = torch.ones(1, 16, dtype=torch.long)
    if rank == 0:
        mask[0, 3] = 0
    _expect(NotImplementedError, "padding between valid tokens",
            lambda: model(input_ids=ids, attention_mask=mask, use_cache=False))
    # a GDN layer applied on its own refuses unknown keywords too
    gdn = LinearAttentionContextParallel(mode="ulysses").apply(Qwen3_5GatedDeltaNet(tiny_config(), 0), mesh)
    _expect(NotImplementedError, r"\['seq_idx'\]", lambda: gdn(torch.randn(1, 16, 64), seq_idx=torch.zeros(1, 16)))
    # ... and exchanges an input header too: different offsets or a malformed mask on one rank raise everywhere
    p2p = LinearAttentionContextParallel(mode="p2p").apply(Qwen3_5GatedDeltaNet(tiny_config(), 0), mesh)
    _expect(ValueError, "ranks disagree on cu_seq_lens_q",
            lambda: p2p(torch.randn(1, 16, 64), cu_seq_lens_q=torch.tensor([0, cut, S])))
    _expect(ValueError if rank == 0 else RuntimeError,
            r"2-D padding mask of the local tokens" if rank == 0 else r"checks failed on rank\(s\) \[0\]",
            lambda: p2p(torch.randn(1, 16, 64), attention_mask=bad))


def test_unhonoured_keywords_raise_cp2():
    run_distributed(keywords_worker, 2, timeout_s=300)
