"""A GDN layer whose halo group is one rank holding the whole row (cp = 1, or the 2-D layout with every rank in one
Ulysses group) runs its conv without the halo exchange: no all-to-all and no zero gradient over the whole input in
backward, with logits and gradients bitwise those of the exchange (whose halo is zeros there)."""

from __future__ import annotations

import copy

import pytest
import torch

import deltacp.parallel.conv as conv
from helpers import cp_mesh, tiny_config

pytestmark = pytest.mark.fast


def _run(model, ids):
    from deltacp import cp_causal_lm_loss, shard_batch_for_cp

    mesh = cp_mesh()
    batch = shard_batch_for_cp(ids, mesh)
    loss = cp_causal_lm_loss(model, batch.pop("target_ids"), mesh, **batch, use_cache=False)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("mode", ["p2p", "all_gather"])
def test_one_rank_halo_group_skips_the_exchange_bitwise(single_rank_group, monkeypatch, mode):
    from transformers import Qwen3_5ForCausalLM

    from deltacp import parallelize_cp

    torch.manual_seed(0)
    base = Qwen3_5ForCausalLM(tiny_config()).double()
    ids = torch.randint(0, 256, (1, 40))
    exchanges = []
    exchange = conv.conv_halo_exchange
    monkeypatch.setattr(conv, "conv_halo_exchange", lambda *a: exchanges.append(1) or exchange(*a))
    got = _run(parallelize_cp(copy.deepcopy(base), cp_mesh(), linear_attention_cp_mode=mode), ids)
    assert exchanges == []

    monkeypatch.setattr(conv, "whole_row_here", lambda group, pieces: False)  # as before: the exchange runs
    expected = _run(parallelize_cp(copy.deepcopy(base), cp_mesh(), linear_attention_cp_mode=mode), ids)
    assert len(exchanges) == 3  # one per GDN layer
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
