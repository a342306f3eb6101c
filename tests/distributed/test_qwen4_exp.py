"""Qwen4-Exp under CP (issue 51), beyond its conformance table (tests/conformance/tables.py, CP2 and CP4 over every
linear mode, both layouts, padded / packed / long rows): the indexed attention's selection against transformers' own
indexer in one process, CP4 in every linear mode and both layouts, PLE with EOS tokens at CP4, and CP8 once (PLE,
packed) against the unmodified transformers model and deltacp's single-device path, exact ties (one indexer head:
many blocks score 0), and the refusals.

Model: `tiny_qwen4_exp` (helpers): QSA blocks of 3 tokens, top 4 blocks, so at 64 tokens the selection is sparse past
15 tokens and a block straddles every rank boundary not at a multiple of 3 (CP4: 16 tokens a rank; left padding
shifts the blocks; packed documents start them anywhere).

Bounds: CP against the single device 1e-8 (float64); the single device and CP against transformers at float32 level
(transformers computes its norms, pooling and scores in float32 even in a float64 model).
"""

import copy

import pytest
import torch

from deltacp import parallelize_cp, suspend_cp
from deltacp.distributed.launch import run_distributed
from helpers import cp_mesh, tiny_qwen4_exp

S = 64
LENGTHS = [5, 2, 26, 31]  # packed documents starting at 0, 5, 7, 33: blocks of 3 straddle 16, 32, 48
TF_BOUND = 1e-6  # CP against the single device: harness.CP_BOUND (1e-8)


EOS_AT = [9, 15, 30, 33, 47, 62]  # EOS (id 2) tokens: PLE's n-grams restart after them (near the rank boundaries)
PLE = dict(ple_layer_ids=[1, 3], ngram_vocab_size_base=64)  # n-grams of orders 2, 3; conv kernel 4, dilation 3


def _inputs():
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 256, (2, S), generator=gen)
    packed = torch.randint(3, 256, (1, S), generator=gen)
    ids[:, EOS_AT] = 2
    packed[:, EOS_AT] = 2
    mask = torch.ones(2, S, dtype=torch.long)
    mask[0, 50:] = 0
    mask[1, :13] = 0
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    long = torch.randint(3, 256, (1, S + 16), generator=gen)  # 10 tokens a rank at CP8: the PLE conv halo fits
    long[:, EOS_AT] = 2
    return {"padded": (ids, mask, None), "packed": (packed, None, cu),
            "packed80": (long, None, torch.cat([cu, torch.tensor([S + 16])]))}


@pytest.mark.fast
@pytest.mark.parametrize("chunk", [1024, 7])
def test_selection_matches_transformers_indexer(chunk, monkeypatch):
    """select_tokens (one process) gives transformers' Qwen4ExpTextQSAIndexer mask at every valid query, for a
    left-padded row and packed documents, and the selection is sparse (fewer tokens than the causal prefix); queries
    scored in one chunk or in chunks of 7."""
    from deltacp.parallel import indexed_attention
    from deltacp.parallel.documents import cu_seqlens_from_padding
    from deltacp.parallel.indexed_attention import RowBlocks, select_tokens
    from deltacp.parallel.views import attention_view_of

    monkeypatch.setattr(indexed_attention, "QUERY_CHUNK", chunk)

    model = tiny_qwen4_exp()
    attn = model.model.layers[3].self_attn
    view = attention_view_of(attn)
    for kind in ("padded", "packed"):
        ids, mask, cu = _inputs()[kind]
        B = ids.shape[0]
        x = torch.randn(B, S, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        pos = torch.arange(S)[None].expand(B, S)
        if cu is not None:  # positions restart per document
            pos = (torch.arange(S) - torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1]))[None]
        cos, sin = model.model.rotary_emb(x, pos[None].expand(3, B, S))
        # transformers' visibility: causal within the document, valid keys only
        doc = torch.zeros(B, S, dtype=torch.long) if cu is None else torch.searchsorted(
            cu, torch.arange(S), right=True)[None]
        valid = torch.ones(B, S, dtype=torch.bool) if mask is None else mask.bool()
        seen = (torch.arange(S)[None, :, None] >= torch.arange(S)[None, None, :]) & (doc[:, :, None] == doc[:, None])
        seen = seen & valid[:, None, :]
        theirs = attn.indexer(x, (cos, sin), seen[:, None], None)[:, 0]  # [B, S, S] bool (test only)
        row_cu = cu if cu is not None else cu_seqlens_from_padding(mask)
        blocks = RowBlocks.build(row_cu, B, S, view.block_size, x.device)
        index, ok = select_tokens(view, blocks, x, (cos, sin), torch.arange(S), None).token_index()
        mine = torch.zeros(B, S, S + 1, dtype=torch.bool).scatter_(-1, torch.where(ok, index, S), True)[..., :S]
        rows = valid  # padding queries: transformers sees nothing there, deltacp a padding document
        assert torch.equal(mine[rows], theirs[rows]), kind
        late = seen.sum(-1) > view.top_blocks * view.block_size + view.block_size
        assert bool(late.any()) and bool((mine.sum(-1)[late] < seen.sum(-1)[late]).all()), kind


def _cp_run(rank, world, overrides, combos, compare_transformers, fsdp=False):
    from conformance.harness import randomize_, run_against_references

    base = randomize_(tiny_qwen4_exp(**overrides), keep=("A_log", "dt_bias"))
    run_against_references(rank, world, base, _inputs(), combos, compare_transformers, fsdp,
                           tf_bound=TF_BOUND, full_attention_cp="all_gather")


CP4_COMBOS = (("p2p", "contiguous", "padded"), ("ulysses", "balanced", "packed"), ("all_gather", "balanced", "padded"))


def test_cp4_every_mode_and_layout():
    run_distributed(_cp_run, 4, {}, CP4_COMBOS, True, timeout_s=600)


def test_ple_cp4():
    """PLE layers 1 and 3 with EOS tokens near the rank boundaries: the n-gram ids read the previous rank's ids, a
    packed document's start and a left-padded row's first valid token see EOS, the dilated conv its 9-token halo
    (balanced: 8 pieces of 10 tokens)."""
    run_distributed(_cp_run, 4, PLE, (("p2p", "contiguous", "padded"), ("ulysses", "balanced", "packed80")), True,
                    timeout_s=600)


def test_cp8_packed_with_ple():
    """CP8, a packed row of 80 tokens (10 a rank: the PLE conv's 9-token halo spans one rank boundary)."""
    run_distributed(_cp_run, 8, PLE, (("p2p", "contiguous", "packed80"),), True, timeout_s=600)


def test_fsdp_and_checkpointing_cp2():
    """Activation checkpointing (the recompute issues the indexed layer's all-reduce and all-gather and PLE's halo
    exchanges again, in the same order on every rank) and FSDP2 over the CP mesh, PLE on; against the single device
    (the model's indexer parameters take no gradient: transformers' selection is discrete)."""
    run_distributed(_cp_run, 2, PLE, (("p2p", "contiguous", "padded"),), False, True, timeout_s=600)


def test_exact_ties_cp4():
    """One indexer head: a block scores 0 wherever its only dot is negative, so many blocks tie; the stable order
    (the earlier block first) is the same on every rank and in one process."""
    run_distributed(_cp_run, 4, dict(indexer_n_heads=1), (("p2p", "contiguous", "padded"),
                                                         ("ulysses", "balanced", "packed")), False, timeout_s=600)


def _refusals(rank, world):
    mesh = cp_mesh()
    model = tiny_qwen4_exp()
    # inside suspend_cp every CP forward is set aside (the PLE layers' too): the single-device model on each rank
    cp_model = parallelize_cp(tiny_qwen4_exp(**PLE), mesh, full_attention_cp="all_gather")
    ids, mask, _ = _inputs()["padded"]
    with torch.no_grad(), suspend_cp(cp_model):
        got = cp_model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(got, tiny_qwen4_exp(**PLE)(input_ids=ids, attention_mask=mask, use_cache=False).logits.detach())
    assert all("forward" in layer.ple.__dict__ for layer in cp_model.model.layers if layer.ple is not None)
    for settings, pattern in ((dict(full_attention_cp="ulysses"), r"full_attention_cp='ulysses'.*\('all_gather',\)"),
                              (dict(full_attention_cp="ring"), r"full_attention_cp='ring'.*\('all_gather',\)")):
        with pytest.raises(ValueError, match=pattern):
            parallelize_cp(copy.deepcopy(model), mesh, **settings)


def test_refusals_on_every_rank_and_suspend_cp():
    run_distributed(_refusals, 2, timeout_s=300)


@pytest.mark.fast
def test_qsa_fields_none_refused():
    import transformers

    from deltacp.families.qwen4_exp import check_qwen4_exp

    config = transformers.Qwen4ExpTextConfig(num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"QSA fields .*indexer_budget.* are None"):
        check_qwen4_exp(config)


@pytest.mark.fast
def test_two_d_layout_refused():
    from deltacp.parallel.indexed_attention import check_indexed_attention
    from deltacp.parallel.views import attention_view_of

    view = attention_view_of(tiny_qwen4_exp().model.layers[3].self_attn)
    with pytest.raises(ValueError, match=r"ulysses_degree=2: .*1-D layout only"):
        check_indexed_attention(view, "all_gather", 2)
    assert check_indexed_attention(view, "all_gather", 1)["top_blocks"] == 4


@pytest.mark.fast
def test_gathered_attention_chunks_agree(monkeypatch):
    """The attention over the selected tokens is the same in one chunk of queries and in chunks of 7."""
    from deltacp.ops import selected_attention

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, n, h, 8, dtype=torch.float64, generator=gen) for n, h in ((20, 4), (40, 2), (40, 2)))
    index = torch.randint(0, 40, (2, 20, 9), generator=gen)
    valid = torch.rand(2, 20, 9, generator=gen) < 0.7
    valid[..., 0] = True
    one = selected_attention.gathered_attention(q, k, v, index, valid, 0.3)
    monkeypatch.setattr(selected_attention, "KV_CHUNK", 7)
    assert torch.equal(selected_attention.gathered_attention(q, k, v, index, valid, 0.3), one)


@pytest.mark.fast
def test_trainer_refuses_missing_qsa_fields():
    """A trainer YAML whose Qwen4-Exp config leaves the QSA fields at transformers' None: a ConfigError naming the
    key and the fields, before the model is built (transformers' indexer would fail dividing None)."""
    from pathlib import Path

    from deltacp.train.config import ConfigError, config_from_dict, config_to_dict, load_config
    from deltacp.train.trainer import model_config

    raw = config_to_dict(load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny_cp4.yaml",
                                     ["train.accelerator.full_attention_cp=all_gather"]))
    fields = {k: v for k, v in raw["train"]["model"]["config"].items() if k != "intermediate_size"}
    raw["train"]["model"].update(model_class="Qwen4ExpForCausalLM", config=dict(
        fields, num_experts=4, num_experts_per_tok=2, layer_types=["linear_attention"] * 3 + ["indexed_attention"]))
    with pytest.raises(ConfigError, match=r"^train\.model\.config: .*QSA fields.*indexer_budget"):
        model_config(config_from_dict(raw))
