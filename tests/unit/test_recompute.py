"""Selective activation checkpointing (`deltacp.ops.recompute`, `models/checkpointing.py`), in one process.

- the store of kept outputs: outside a selective checkpoint it only computes; a recompute that asks for another
  call than its forward kept, a second recompute, and a kept output modified in place in between all raise;
- on a tiny model at cp = 1 (float64, one gloo rank), every full attention method: the SDPA path (Ulysses) has its
  kernel's outputs saved by torch's selective checkpoint (one save per attention layer, nothing in the store), the
  tiled and ring paths keep their merged outputs in the store (one entry per attention layer, no per-tile save),
  and the gradients equal those without checkpointing bitwise. (CP4 over gloo: tests/distributed/
  test_checkpoint_replay.py.)
- `apply_activation_checkpointing`: policy and num_layers checked, num_layers checkpoints the first n layers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import deltacp.ops.recompute as recompute
from deltacp.models.checkpointing import apply_activation_checkpointing
from helpers import DownProjProducts, cp_mesh, rel_l2, tiny_config

pytestmark = pytest.mark.fast


class _Twice(torch.autograd.Function):
    """y = 2 x through a kept call (its backward needs nothing kept)."""

    calls = 0

    @staticmethod
    def forward(ctx, x, name):
        def compute():
            _Twice.calls += 1
            return (x * 2,)

        return recompute.keep_outputs(name, compute)[0]

    @staticmethod
    def backward(ctx, dy):
        return dy * 2, None


def test_keep_outputs_outside_a_checkpoint_computes():
    _Twice.calls = 0
    x = torch.randn(3, requires_grad=True)
    _Twice.apply(x, "a").sum().backward()
    assert _Twice.calls == 1 and torch.equal(x.grad, torch.full((3,), 2.0))


def test_selective_checkpoint_runs_a_kept_call_once_and_refuses_a_changed_recompute():
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    _Twice.calls = 0
    y = checkpoint(lambda t: _Twice.apply(t, "a").sin(), x, use_reentrant=False,
                   context_fn=recompute.selective_contexts)
    y.sum().backward()
    assert _Twice.calls == 1
    torch.testing.assert_close(x.grad, 2 * torch.cos(2 * x.detach()), rtol=0, atol=0)

    names = iter(["a", "b"])  # the recompute asks for another call than the forward kept
    y = checkpoint(lambda t: _Twice.apply(t, next(names)).sin(), x, use_reentrant=False,
                   context_fn=recompute.selective_contexts)
    with pytest.raises(RuntimeError, match="same kept calls in the same order"):
        y.sum().backward()

    kept = []

    def modify_kept(t):
        out = _Twice.apply(t, "a")
        kept.append(out)
        return out.sin()

    y = checkpoint(modify_kept, x, use_reentrant=False, context_fn=recompute.selective_contexts)
    with torch.no_grad():
        kept[0].add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()


def _tiny_model():
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    config = tiny_config(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2)
    return Qwen3_5ForCausalLM(config).double()


def _step_grads(model, mesh, ids):
    from deltacp import cp_causal_lm_loss, shard_batch_for_cp

    batch = shard_batch_for_cp(ids, mesh)
    cp_causal_lm_loss(model, batch.pop("target_ids"), mesh, **batch, use_cache=False).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("attention", ["ulysses", "all_gather", "ring"])
def test_selective_keeps_each_attention_once(single_rank_group, monkeypatch, attention):
    from deltacp import parallelize_cp

    mesh = cp_mesh()
    base, ids = _tiny_model(), torch.randint(0, 256, (1, 48))
    plain = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode="p2p", full_attention_cp=attention)
    expected = _step_grads(plain, mesh, ids)

    saves, takes = [], []
    policy, take = recompute.sac_policy, recompute.KeptOutputs.take

    def spy_policy(ctx, func, *args, **kwargs):
        decision = policy(ctx, func, *args, **kwargs)
        if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            saves.append(str(func))
        return decision

    def spy_take(self, name):
        takes.append(name)
        return take(self, name)

    monkeypatch.setattr(recompute, "sac_policy", spy_policy)
    monkeypatch.setattr(recompute.KeptOutputs, "take", spy_take)
    model = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode="p2p", full_attention_cp=attention)
    assert apply_activation_checkpointing(model, policy="selective") == 4
    got = _step_grads(model, mesh, ids)
    assert rel_l2(got, expected) == 0.0
    if attention == "ulysses":
        assert saves == ["aten._scaled_dot_product_flash_attention_for_cpu.default"] * 2 and takes == []
    else:
        assert saves == [] and takes == [f"{'ring' if attention == 'ring' else 'tiled'} attention"] * 2


def test_apply_activation_checkpointing_arguments(single_rank_group):
    from deltacp import parallelize_cp

    model = parallelize_cp(_tiny_model(), cp_mesh(), linear_attention_cp_mode="p2p")
    with pytest.raises(ValueError, match=r"policy='partial' is not an activation checkpointing policy; expected "
                                         r"one of \['full', 'selective'\]"):
        apply_activation_checkpointing(model, policy="partial")
    with pytest.raises(ValueError, match="num_layers=-1"):
        apply_activation_checkpointing(model, num_layers=-1)
    layers = list(model.model.layers)
    assert apply_activation_checkpointing(model, policy="full", num_layers=3) == 3
    assert ["forward" in layer.__dict__ and hasattr(layer.forward, "func") for layer in layers] == \
        [True, True, True, False]


def _grads_and_backward_down_products(model, ids):
    from deltacp import cp_causal_lm_loss, shard_batch_for_cp

    mesh = cp_mesh()
    batch = shard_batch_for_cp(ids, mesh)
    loss = cp_causal_lm_loss(model, batch.pop("target_ids"), mesh, **batch, use_cache=False)
    counter = DownProjProducts(model)
    with counter:
        loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), counter.count


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_skips_the_down_projection_exactly(single_rank_group, monkeypatch, policy):
    """The recompute of a checkpointed layer does not run its MLP's down_proj product: torch's early stop ends it
    at the last saved tensor, the product's input, saved before the product runs (what `train/memory.py`'s FLOPs
    model assumes); the gradients are bitwise those without checkpointing. With early stop off, or with an op after
    the MLP that saves a tensor, the product runs in the recompute and the gradients stay bitwise."""
    from torch.utils.checkpoint import set_checkpoint_early_stop
    from transformers import Qwen3_5ForCausalLM

    from deltacp import parallelize_cp

    torch.manual_seed(0)
    base = Qwen3_5ForCausalLM(tiny_config(intermediate_size=96)).double()
    ids = torch.randint(0, 256, (1, 40))
    mesh = cp_mesh()

    def cp_model():
        return parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode="p2p")

    expected, none = _grads_and_backward_down_products(cp_model(), ids)
    assert none == 0

    model = cp_model()
    apply_activation_checkpointing(model, policy=policy)
    got, skipped = _grads_and_backward_down_products(model, ids)
    assert skipped == 0 and torch.equal(got, expected)

    # an op after the layer that saves its output (sin saves its input), inside the checkpoint: the recompute goes
    # on past the MLP, whose output it needs
    model, reference = cp_model(), cp_model()
    for m in (model, reference):
        for layer in m.model.layers:
            layer.forward = lambda *a, f=layer.forward, **k: torch.sin(f(*a, **k))
    expected_saving, _ = _grads_and_backward_down_products(reference, ids)
    apply_activation_checkpointing(model, policy=policy)
    got, recomputed = _grads_and_backward_down_products(model, ids)
    assert torch.equal(got, expected_saving) and recomputed == 4

    model = cp_model()
    apply_activation_checkpointing(model, policy=policy)
    with set_checkpoint_early_stop(False):
        got, recomputed = _grads_and_backward_down_products(model, ids)
    assert recomputed == 4 and torch.equal(got, expected)
