"""GLM-5.3-Flash under CP (issue 52), beyond its conformance table (tests/conformance/tables.py, CP2 and CP4 over
every linear mode, both layouts, padded / packed / long rows): the pooled indexer's selection against transformers'
own indexer in one process, CP4 in every linear mode and both layouts, CP8 once (packed), against the unmodified
transformers model and deltacp's single-device path, the "shared" indexer layer's selection handed on, and the
refusals.

Model: `tiny_glm5_next` (helpers): layers KDA / MLA with its indexer / MLA reusing that selection ("shared") / KDA;
pools of 3 tokens, top 3 pools, so at 64 tokens the selection is sparse past 12 tokens and a pool straddles every
rank boundary not at a multiple of 3 (CP4: 16 tokens a rank; left padding shifts the pools; packed documents start
them anywhere).

Bounds: CP against the single device 1e-8 (float64); the single device and CP against transformers at float32 level
(transformers computes its norms, gates, pooling weights and scores in float32 even in a float64 model). A padded
row's transformers reference is its valid tokens alone (`harness.transformers_reference(valid_runs=True)`: its
float64 eager softmax turns a fully masked padded query into NaN, which reaches every token).
"""

import copy

import pytest
import torch

from deltacp import parallelize_cp
from deltacp.distributed.launch import run_distributed
from helpers import cp_mesh, rel_l2, self_meshes, tiny_glm5_next

S = 64
LENGTHS = [5, 2, 26, 31]  # packed documents starting at 0, 5, 7, 33: pools of 3 straddle 16, 32, 48
CP_BOUND, TF_BOUND = 1e-8, 1e-6


def _inputs():
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 256, (2, S), generator=gen)
    packed = torch.randint(3, 256, (1, S), generator=gen)
    mask = torch.ones(2, S, dtype=torch.long)
    mask[0, 50:] = 0
    mask[1, :13] = 0
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    long = torch.randint(3, 256, (1, S + 16), generator=gen)  # 10 tokens a rank at CP8
    return {"padded": (ids, mask, None), "packed": (packed, None, cu),
            "packed80": (long, None, torch.cat([cu, torch.tensor([S + 16])]))}


def _their_tokens(attn, x, mask):
    """[B, S, S] bool: the tokens transformers' indexer selects for each query (x: the layer's input)."""
    B = x.shape[0]
    topk = attn.indexer(x, attn.q_a_layernorm(attn.q_a_proj(x)), mask, None).long()
    picked = torch.zeros(B, S, S + 1, dtype=torch.bool)
    return picked.scatter_(-1, torch.where(topk >= 0, topk, S), True)[..., :S]


@pytest.mark.fast
@pytest.mark.parametrize("chunk", [1024, 7])
def test_selection_matches_transformers_indexer(chunk, monkeypatch):
    """select_tokens (one process) gives transformers' Glm5NextTextIndexer selection at every valid query, for a
    left- and right-padded batch and packed documents (transformers' indexer run on each document alone), and the
    selection is sparse (fewer tokens than the causal prefix); queries scored in one chunk or in chunks of 7."""
    from deltacp.parallel import indexed_attention
    from deltacp.parallel.documents import cu_seqlens_from_padding
    from deltacp.parallel.indexed_attention import RowBlocks, select_tokens
    from deltacp.parallel.views import attention_view_of

    monkeypatch.setattr(indexed_attention, "QUERY_CHUNK", chunk)
    attn = tiny_glm5_next().model.language_model.layers[1].self_attn
    view = attention_view_of(attn)
    for kind in ("padded", "packed"):
        ids, mask, cu = _inputs()[kind]
        B = ids.shape[0]
        x = torch.randn(B, S, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        valid = torch.ones(B, S, dtype=torch.bool) if mask is None else mask.bool()
        if cu is None:
            theirs = _their_tokens(attn, x, valid)
        else:  # per document: its tokens' selection, shifted to row positions
            theirs = torch.zeros(B, S, S, dtype=torch.bool)
            for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
                n = hi - lo
                part = attn.indexer(x[:, lo:hi], attn.q_a_layernorm(attn.q_a_proj(x[:, lo:hi])),
                                    torch.ones(B, n, dtype=torch.bool), None).long()
                picked = torch.zeros(B, n, n + 1, dtype=torch.bool).scatter_(-1, torch.where(part >= 0, part, n), True)
                theirs[:, lo:hi, lo:hi] = picked[..., :n]
        row_cu = cu if cu is not None else cu_seqlens_from_padding(mask)
        blocks = RowBlocks.build(row_cu, B, S, view.block_size, x.device)
        index, ok = select_tokens(view, blocks, x, None, torch.arange(S), None).token_index()
        mine = torch.zeros(B, S, S + 1, dtype=torch.bool).scatter_(-1, torch.where(ok, index, S), True)[..., :S]
        assert torch.equal(mine[valid], theirs[valid]), kind
        seen = mine.sum(-1)
        causal = torch.arange(1, S + 1)[None].expand(B, S)
        late = valid & (causal - (0 if cu is None else 0) > 20)
        assert bool((seen[late] < 16).all()), kind  # at most 3 pools of 3 and a tail of 2, plus itself


def _cp_run(rank, world, overrides, combos, compare_transformers, fsdp=False):
    """fsdp: activation checkpointing, then FSDP2 over the CP mesh, on the CP'd model (deltacp's order)."""
    from conformance.harness import _rank_positions, cp_step, randomize_, transformers_reference

    from deltacp import apply_activation_checkpointing, fully_shard_cp

    single, mesh = self_meshes(), cp_mesh()
    base = randomize_(tiny_glm5_next(**overrides), keep=("A_log", "dt_bias"))
    inputs = _inputs()
    failures = []
    refs = {}
    for mode, layout, kind in combos:
        ids, m, cu = inputs[kind]
        if kind not in refs:
            one = parallelize_cp(copy.deepcopy(base), single, linear_attention_cp_mode="p2p",
                                 full_attention_cp="all_gather")
            refs[kind] = (cp_step(one, single, ids, m, cu),
                          transformers_reference(base, single, ids, m, cu, True) if compare_transformers else None)
        (logits_1, loss_1, grads_1), theirs = refs[kind]
        model = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode=mode, sequence_layout=layout,
                               full_attention_cp="all_gather")
        if fsdp:
            apply_activation_checkpointing(model)
            fully_shard_cp(model, mesh)
        logits, loss, grads = cp_step(model, mesh, ids, m, cu, sharded=fsdp)
        mine = _rank_positions(model, mesh, ids, cu)
        kept = mine < ids.shape[1]
        valid = (torch.ones(ids.shape, dtype=torch.bool) if m is None else m.bool())[:, mine[kept]]
        checks = {"logits": rel_l2(logits[:, kept], logits_1[:, mine[kept]]), "loss": abs(loss / loss_1 - 1).item(),
                  "grads": rel_l2(grads, grads_1)}
        failures += [f"CP{world} {mode} {layout} {kind}: {k} {v:.2e}" for k, v in checks.items() if not v < CP_BOUND]
        if theirs is not None:
            tf = {"logits vs transformers": rel_l2(logits[:, kept][valid], theirs[0][:, mine[kept]][valid]),
                  "loss vs transformers": abs(loss / theirs[1] - 1).item(),
                  "grads vs transformers": rel_l2(grads, theirs[2])}
            failures += [f"CP{world} {mode} {layout} {kind}: {k} {v:.2e}" for k, v in tf.items()
                         if not v < (100 * TF_BOUND if k.startswith("grads") else TF_BOUND)]
        if rank == 0:
            print(f"CP{world} {mode} {layout} {kind}: " + ", ".join(f"{k} {v:.1e}" for k, v in checks.items()))
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


CP4_COMBOS = (("p2p", "contiguous", "padded"), ("ulysses", "balanced", "packed"), ("all_gather", "balanced", "padded"),
              ("all_gather", "contiguous", "packed"))


def test_cp2_against_transformers():
    run_distributed(_cp_run, 2, {}, (("p2p", "balanced", "padded"), ("ulysses", "contiguous", "packed")), True,
                    timeout_s=600)


def test_cp4_every_mode_and_layout():
    run_distributed(_cp_run, 4, {}, CP4_COMBOS, True, timeout_s=600)


def test_cp8_packed():
    """CP8, a packed row of 80 tokens (10 a rank: pools of 3 straddle most rank boundaries)."""
    run_distributed(_cp_run, 8, {}, (("p2p", "contiguous", "packed80"),), True, timeout_s=600)
