"""GLM-5.3-Flash under CP (issue 52), beyond its conformance table (tests/conformance/tables.py, CP2 and CP4 over
every linear mode, both layouts, padded / packed / long rows, against transformers and the single device): the
pooled indexer's selection against transformers' own indexer in one process, CP4 in every linear mode and both
layouts, CP8 once (packed), against the unmodified transformers model and deltacp's single-device path (the
"shared" indexer layer's selection handed on in each), exact ties, FSDP2 and activation checkpointing, the global
aux loss, load / save in the released names, images, the text model alone, bf16, and the refusals.

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
from helpers import cp_mesh, full_tensors, rel_l2, self_meshes, tiny_glm5_next

S = 64
LENGTHS = [5, 2, 26, 31]  # packed documents starting at 0, 5, 7, 33: pools of 3 straddle 16, 32, 48
TF_BOUND = 1e-6  # CP against the single device: harness.CP_BOUND (1e-8)


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
        late = valid & (torch.arange(S)[None] >= 40)  # at least 27 tokens visible: every row's document and run
        assert bool((mine.sum(-1)[late] <= 11).all()), kind  # 3 pools of 3 and a tail of at most 2


def _cp_run(rank, world, overrides, combos, compare_transformers, fsdp=False, policy="full"):
    from conformance.harness import randomize_, run_against_references

    base = randomize_(tiny_glm5_next(**overrides), keep=("A_log", "dt_bias"))
    run_against_references(rank, world, base, _inputs(), combos, compare_transformers, fsdp, valid_runs=True,
                           tf_bound=TF_BOUND, checkpoint_policy=policy, full_attention_cp="all_gather")


CP4_COMBOS = (("p2p", "contiguous", "padded"), ("ulysses", "balanced", "packed"), ("all_gather", "balanced", "padded"),
              ("all_gather", "contiguous", "packed"))


def test_cp4_every_mode_and_layout():
    run_distributed(_cp_run, 4, {}, CP4_COMBOS, True, timeout_s=600)


def test_cp8_packed():
    """CP8, a packed row of 80 tokens (10 a rank: pools of 3 straddle most rank boundaries)."""
    run_distributed(_cp_run, 8, {}, (("p2p", "contiguous", "packed80"),), True, timeout_s=600)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_fsdp_and_checkpointing_cp2(policy):
    """Activation checkpointing (the recompute runs the indexed layer's collectives again, in the same order on every
    rank, and hands the "shared" layer the recomputed selection) and FSDP2 over the CP mesh; against the single
    device (the indexer's parameters take no gradient: transformers' selection is discrete)."""
    run_distributed(_cp_run, 2, {}, (("p2p", "contiguous", "padded"), ("all_gather", "balanced", "packed")), False,
                    True, policy, timeout_s=600)


def test_exact_ties_cp4():
    """One indexer head: a pool scores 0 wherever its only dot is negative, so many pools tie; the stable order
    (the earlier pool first) is the same on every rank and in one process (transformers' topk breaks such ties its
    own way: not compared)."""
    run_distributed(_cp_run, 4, dict(index_n_heads=1), (("p2p", "contiguous", "padded"),
                                                        ("ulysses", "balanced", "packed")), False, timeout_s=600)


def _aux_loss(rank, world):
    """output_router_logits=True: the routed layers' auxiliary loss is the single-device one on every rank (global
    statistics), and the single device's is transformers'."""
    from deltacp import shard_batch_for_cp

    single, mesh = self_meshes(), cp_mesh()
    base = tiny_glm5_next()
    ids = _inputs()["padded"][0]
    theirs = base(input_ids=ids, use_cache=False, output_router_logits=True).aux_loss
    values = []
    for m in (single, mesh):
        model = parallelize_cp(copy.deepcopy(base), m, full_attention_cp="all_gather")
        batch = shard_batch_for_cp(ids, m, model=model)
        batch.pop("target_ids")
        values.append(model(**batch, use_cache=False, output_router_logits=True).aux_loss.detach())
    assert abs(values[0] / theirs - 1) < 1e-6 and abs(values[1] / values[0] - 1) < 1e-12, (theirs, values)


def test_aux_loss_cp2():
    run_distributed(_aux_loss, 2, timeout_s=300)


def _refusals(rank, world):
    from deltacp import suspend_cp

    mesh = cp_mesh()
    cp_model = parallelize_cp(tiny_glm5_next(), mesh, full_attention_cp="all_gather")
    ids = _inputs()["packed"][0]
    # inside suspend_cp every CP forward is set aside: the single-device model on each rank
    with torch.no_grad(), suspend_cp(cp_model):
        got = cp_model(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, tiny_glm5_next()(input_ids=ids, use_cache=False).logits.detach())
    with pytest.raises(NotImplementedError, match=r"does not support \['pixel_values_videos', 'video_grid_thw'\]"):
        cp_model(input_ids=ids[:, :S // world], pixel_values_videos=torch.zeros(4, 24, dtype=torch.float64),
                 video_grid_thw=torch.tensor([[1, 2, 2]]), use_cache=False)
    for settings, pattern in ((dict(full_attention_cp="ulysses"), r"full_attention_cp='ulysses'.*\('all_gather',\)"),
                              (dict(full_attention_cp="ring"), r"full_attention_cp='ring'.*\('all_gather',\)")):
        with pytest.raises(ValueError, match=pattern):
            parallelize_cp(tiny_glm5_next(), mesh, **settings)
    with pytest.raises(ValueError, match=r"indexer_types\[3\]='shared'.*layer 2: 'linear_attention'"):
        parallelize_cp(tiny_glm5_next(indexer_types=["full", "full", "full", "shared"],
                                      layer_types=["linear_attention", "indexed_attention", "linear_attention",
                                                   "indexed_attention"]), mesh, full_attention_cp="all_gather")


def test_refusals_on_every_rank_and_suspend_cp():
    run_distributed(_refusals, 2, timeout_s=300)


@pytest.mark.fast
def test_config_refusals():
    """check_glm5_next: a shared layer first, after another shared layer, or after a KDA layer; an unknown
    indexer type; index_kpool_always_select_tail False."""
    import transformers

    from deltacp.families.glm5_next import check_glm5_next
    from helpers import GLM5_NEXT_FIELDS

    def config(**overrides):
        return transformers.Glm5NextTextConfig(**{**GLM5_NEXT_FIELDS, **overrides})

    check_glm5_next(config())
    attention = ["indexed_attention"] * 4
    for types, pattern in ((["shared", "full", "full", "full"], r"indexer_types\[0\]='shared'.*layer 0 has no previous layer"),
                           (["full", "shared", "shared", "full"], r"indexer_types\[2\]='shared'.*'shared'\)"),
                           (["full", "full", "sparse", "full"], r"indexer_types\[2\]='sparse': allowed values")):
        with pytest.raises(ValueError, match=pattern):
            check_glm5_next(config(layer_types=attention, indexer_types=types))
    with pytest.raises(NotImplementedError, match=r"index_kpool_always_select_tail=False .* allowed: True"):
        check_glm5_next(config(index_kpool_always_select_tail=False))


@pytest.mark.fast
def test_bounded_and_softplus_forget_gates_match_transformers():
    """The KDA view's g (float64 here) is transformers' Glm5NextTextForgetGate (float32 in any model) for
    linear_lower_bound -5 and None, per slice of heads."""
    from deltacp.parallel.views import mixer_view_of

    for bound in (-5.0, None):
        mixer = tiny_glm5_next(linear_lower_bound=bound).model.language_model.layers[0].self_attn
        view = mixer_view_of(mixer)
        x = torch.randn(2, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        theirs = mixer.forget_gate(x)
        assert theirs.dtype == torch.float32
        f = view.forget_projection(x).view(2, 7, 4, 8)
        mine = torch.cat([view.forget_gate(f[:, :, 2 * h:2 * h + 2], slice(2 * h, 2 * h + 2)) for h in range(2)], 2)
        assert mine.dtype == torch.float64 and rel_l2(mine, theirs.double()) < 1e-6, bound


def _load_save(rank, world, path, out):
    """load_pretrained (FSDP2 over the CP mesh) of a checkpoint transformers wrote: every tensor equals
    from_pretrained's, the logits of this rank's slice its logits; save_pretrained writes what transformers wrote
    (names and shapes) and reloads to the same tensors."""
    import transformers

    from deltacp import load_pretrained, save_pretrained, shard_batch_for_cp
    from deltacp.checkpoint_io.hf_format import read_index
    from helpers import local_slice

    mesh = cp_mesh()
    cls = transformers.Glm5NextForConditionalGeneration
    model = load_pretrained(path, mesh, dtype=torch.float32, model_class=cls.__name__, linear_attention_cp_mode="p2p",
                            full_attention_cp="all_gather")
    ref = cls.from_pretrained(path, dtype=torch.float32).eval()
    ref.config.get_text_config()._attn_implementation = "eager"
    mine = full_tensors(model.state_dict())
    theirs = ref.state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[n], theirs[n]) for n in theirs)
    ids = _inputs()["packed"][0]
    batch = shard_batch_for_cp(ids, mesh, model=model)
    with torch.no_grad():
        got = model(**{k: v for k, v in batch.items() if k != "target_ids"}, use_cache=False).logits
        want = ref(input_ids=ids, use_cache=False).logits
    assert rel_l2(got, local_slice(want, rank, world)) < 2e-6
    save_pretrained(model, out, max_shard_size="40KB", block_bytes=512)
    if rank == 0:
        stored = {k: t.shape for k, t in read_index(path).items() if ".layers.45." not in k}
        assert {k: t.shape for k, t in read_index(out).items()} == stored
        again = cls.from_pretrained(out).state_dict()
        assert all(torch.equal(again[n], theirs[n]) for n in theirs)


def test_load_and_save_pretrained_cp2(tmp_path):
    """A checkpoint as transformers' save_pretrained writes it (bf16, several files: the conversion mapping's names,
    experts per expert, the conv as q/k/v_conv1d, the hyper-connections as hc_*), plus a multi-token-prediction
    layer's tensor (`layers.45.`, as the released checkpoint holds: ignored on load, as transformers ignores it),
    loaded and saved at CP2 (the save holds what transformers wrote, the MTP tensor not)."""
    import json

    from safetensors.torch import save_file

    path = tmp_path / "theirs"
    tiny_glm5_next(torch.float32).to(torch.bfloat16).save_pretrained(path, max_shard_size="60KB")
    original = json.loads((path / "model.safetensors.index.json").read_text())
    mtp = "model.language_model.layers.45.eh_proj.weight"
    save_file({mtp: torch.zeros(32, 64, dtype=torch.bfloat16)}, str(path / "mtp.safetensors"))
    extended = dict(original, weight_map=dict(original["weight_map"], **{mtp: "mtp.safetensors"}))
    (path / "model.safetensors.index.json").write_text(json.dumps(extended))
    run_distributed(_load_save, 2, path, tmp_path / "ours", timeout_s=300)


def _images(rank, world):
    """Two images in row 0 whose tokens cross rank boundaries (CP2: 32; CP4: 16, 32, 48): the vision tower on every
    image, each rank's image features placed on its tokens; NoPE, so no positions are formed. This rank's logits, the
    loss and the rank-summed gradients (the vision tower's too) against deltacp's single device (1e-8) and the single
    device against transformers' own forward with the images."""
    import torch.nn.functional as F

    from conformance.harness import randomize_
    from deltacp import all_reduce_cp_grads, cp_cross_entropy, shard_batch_for_cp
    from helpers import IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_END_ID, VISION_START_ID, flat, grads_of, image_batch

    base = randomize_(tiny_glm5_next(image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
                                     image_start_token_id=VISION_START_ID, image_end_token_id=VISION_END_ID),
                      keep=("A_log", "dt_bias"))
    ids, _, pixel_values, grid = image_batch(2, S, starts=(14, 30), seed=1)
    images = dict(pixel_values=pixel_values, image_grid_thw=grid)
    results = []
    for mesh in (self_meshes(), cp_mesh()):
        model = parallelize_cp(copy.deepcopy(base), mesh, full_attention_cp="all_gather")
        batch = shard_batch_for_cp(ids, mesh, model=model)
        logits = model(input_ids=batch["input_ids"], **images, use_cache=False).logits
        loss = cp_cross_entropy(logits, batch["target_ids"], mesh)
        loss.backward()
        all_reduce_cp_grads(model, mesh)
        results.append((logits.detach(), loss.detach(), flat(grads_of(model))))
    (logits_1, loss_1, grads_1), (logits, loss, grads) = results
    tf = copy.deepcopy(base)
    theirs = tf(input_ids=ids, **images, use_cache=False).logits
    loss_tf = F.cross_entropy(theirs[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss_tf.backward()
    s = S // world
    assert rel_l2(logits, logits_1[:, rank * s:(rank + 1) * s]) < 1e-8 and abs(loss / loss_1 - 1) < 1e-8
    assert rel_l2(grads, grads_1) < 1e-8
    assert rel_l2(logits_1, theirs) < 1e-6 and abs(loss_1 / loss_tf - 1) < 1e-6
    assert rel_l2(grads_1, flat(grads_of(tf))) < 1e-4


@pytest.mark.parametrize("world", [2, 4])
def test_images(world):
    run_distributed(_images, world, timeout_s=300)


def _text_model(rank, world):
    """`Glm5NextTextModel` on its own under CP (the balanced layout): this rank's last hidden states are transformers'
    text model's at its tokens."""
    from deltacp import shard_batch_for_cp
    from helpers import local_slice

    text = copy.deepcopy(tiny_glm5_next().model.language_model)
    ids = _inputs()["padded"][0]
    with torch.no_grad():
        theirs = text(input_ids=ids, use_cache=False).last_hidden_state
        model = parallelize_cp(text, cp_mesh(), full_attention_cp="all_gather", sequence_layout="balanced")
        batch = shard_batch_for_cp(ids, cp_mesh(), model=model)
        mine = model(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
    assert rel_l2(mine, local_slice(theirs, rank, world, layout="balanced")) < 1e-6


def test_text_model_cp2():
    run_distributed(_text_model, 2, timeout_s=300)


BF16_U = 2.0 ** -8  # bf16's unit roundoff


def _bf16(rank, world):
    """bf16 with transformers' float32 modules (the conv, dt_bias, A_log: `_keep_in_fp32_modules_strict`, as
    from_pretrained keeps them): CP runs (the conv rounds to float32, g stays float32, the pooling in float32) and
    its logits are the single device's (1e-2) and transformers' at bf16 level (3e-2; measured: CP bitwise the single
    device, 6e-3 from transformers). Then 3 SGD steps (lr 0.05) in bf16 at CP and on deltacp's single device from
    the same weights. The 3 steps move the weights about one bf16 ulp (4.3e-3 rel-L2); the rank-summed gradients
    differ from the single device's by bf16 rounding (u = 2^-8 of the update), which moves a weight whose exact update
    lands near a rounding midpoint by one ulp: the losses of every step agree within u relative and the weights'
    gap is a small part of their movement, bounded at a quarter (measured 2026-12-06 on the VM: losses 0 / 1.5e-5 /
    1.0e-4 apart, weights 1.6e-4: 0.04 of the 4.3e-3 moved). Mutation: the CP run's gradients not summed over the ranks
    (all_reduce_cp_grads dropped): weights 3.4e-3 / 2.8e-3 apart on ranks 0 / 1 (0.8 / 0.65 of the movement); the
    losses stayed within u (2.3e-3 at step 3)."""
    from deltacp import shard_batch_for_cp
    from helpers import local_slice

    base = tiny_glm5_next(torch.float32).to(torch.bfloat16)
    for layer in base.model.language_model.layers:
        if hasattr(layer.self_attn, "conv1d"):
            layer.self_attn.conv1d.float()
            gate = layer.self_attn.forget_gate
            gate.dt_bias.data, gate.A_log.data = gate.dt_bias.data.float(), gate.A_log.data.float()
    ids = _inputs()["packed"][0]
    with torch.no_grad():
        theirs = base(input_ids=ids, use_cache=False).logits.float()
        got = []
        for mesh in (self_meshes(), cp_mesh()):
            model = parallelize_cp(copy.deepcopy(base), mesh, full_attention_cp="all_gather")
            batch = shard_batch_for_cp(ids, mesh, model=model)
            got.append(model(input_ids=batch["input_ids"], use_cache=False).logits.float())
    assert got[1].shape[1] == S // world
    assert rel_l2(got[1], local_slice(got[0], rank, world)) < 1e-2 and rel_l2(got[0], theirs) < 3e-2
    # training in bf16: 3 SGD steps at CP2 and on deltacp's single device from the same weights
    from deltacp import all_reduce_cp_grads, cp_cross_entropy
    from helpers import flat

    runs = []
    for mesh in (self_meshes(), cp_mesh()):
        model = parallelize_cp(copy.deepcopy(base), mesh, full_attention_cp="all_gather")
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        batch = shard_batch_for_cp(ids, mesh, model=model)
        losses = []
        for _ in range(3):
            loss = cp_cross_entropy(model(input_ids=batch["input_ids"], use_cache=False).logits, batch["target_ids"],
                                    mesh)
            loss.backward()
            all_reduce_cp_grads(model, mesh)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, flat({n: p.detach().float() for n, p in model.named_parameters()})))
    (losses_1, weights_1), (losses, weights) = runs
    moved = rel_l2(weights_1, flat({n: p.float() for n, p in base.named_parameters()}))
    drift = rel_l2(weights, weights_1)
    print(f"bf16 training CP{world} vs single device: losses {losses} / {losses_1}, weights {drift:.1e} (moved "
          f"{moved:.1e})")
    assert all(abs(a / b - 1) < BF16_U for a, b in zip(losses, losses_1)), (losses, losses_1)
    assert drift < moved / 4, (drift, moved)


def test_bf16_cp2():
    run_distributed(_bf16, 2, timeout_s=300)
