"""sequence_layout='balanced' around the layers (one 4-rank gloo spawn): `shard_batch_for_cp` and
`shard_collated_batch` cut every per-token field into the rank's two pieces at CP4 and CP2 (the dp x cp mesh's cp
groups), checked against `helpers.local_slice` and targets written here from the whole row; the row length rules;
and the model's input hook at CP2: default position ids at the rank's row positions, and a batch cut with another
layout than the model's refused on every rank, naming sequence_layout; the multimodal hook's mRoPE positions and
embeddings are the rank's pieces of the whole row's; an odd local length refused with one message by the hooks and
by each layer applied on its own; the trainer (train.accelerator.sequence_layout=balanced, dp2
x cp2) cuts its batches with the model's layout (a step passes the hook's check). The layers themselves are not
checked here (a pre-hook after deltacp's captures what they would receive and stops the forward; the trainer step
runs them without checking values): their parity under 'balanced' is tested with them.

Mutations seen failing: the hook's gathered row left in rank order (a balanced cut refused); the two pieces
concatenated in the other order; the multimodal hook picking the contiguous slice; the trainer cutting contiguous.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen3_5ForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5GatedDeltaNet

from deltacp import FullAttentionContextParallel, LinearAttentionContextParallel, parallelize_cp, shard_batch_for_cp
from deltacp.distributed.launch import run_distributed
from deltacp.integrations.batch import shard_collated_batch
from deltacp.models.adapters import adapter_for
from helpers import image_batch, local_slice, self_meshes, tiny_config, tiny_family_model

pytestmark = pytest.mark.fast

IGNORE = -100


def _targets(ids: torch.Tensor, mask: torch.Tensor | None = None, lengths=None) -> torch.Tensor:
    """The whole row's targets, token by token: the next token, unless it is padding, or this token ends its
    document (or the row)."""
    B, S = ids.shape
    ends = set()
    if lengths is not None:
        at = 0
        for n in lengths:
            at += n
            ends.add(at - 1)
    out = torch.full_like(ids, IGNORE)
    for b in range(B):
        for j in range(S - 1):
            if j not in ends and (mask is None or mask[b, j + 1]):
                out[b, j] = ids[b, j + 1]
    return out


def _doc_positions(lengths) -> torch.Tensor:
    return torch.tensor([[p for n in lengths for p in range(n)]])


def _expect(error, pattern, fn):
    with pytest.raises(error, match=pattern):
        fn()


def _check_cuts(mesh, cp: int, r: int) -> None:
    """shard_batch_for_cp under 'balanced' at CP `cp`, this rank being `r` of its cp group."""
    g = torch.Generator().manual_seed(cp)
    S, h = 8 * cp, 4  # 2 cp pieces of h tokens
    ids = torch.randint(0, 256, (2, S), generator=g)
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, S - 5:] = 0  # right padding on the second row
    out = shard_batch_for_cp(ids, mesh, attention_mask=mask, sequence_layout="balanced")
    expected = dict(input_ids=local_slice(ids, r, cp, layout="balanced"),
                    position_ids=local_slice(torch.arange(S).expand(2, S), r, cp, layout="balanced"),
                    target_ids=local_slice(_targets(ids, mask), r, cp, layout="balanced"),
                    attention_mask=local_slice(mask, r, cp, layout="balanced"))
    assert set(out) == set(expected) | {"cp_sequence_layout"} and out["cp_sequence_layout"] == "balanced"
    for key, value in expected.items():
        assert torch.equal(out[key], value), (cp, r, key, out[key], value)
    # the targets were shifted over the whole row: the last token of the rank's first piece (row position
    # (r + 1) h - 1) targets the first token of piece r + 1, which another rank holds
    assert torch.equal(out["target_ids"][0, h - 1], ids[0, (r + 1) * h])
    assert out["target_ids"][0, -1].item() == (IGNORE if r == 0 else ids[0, (2 * cp - r) * h].item())

    # packed documents: the same cut of per-document positions and targets; the offsets stay global
    lengths = [3, 2 * h + 1, 1, S - 3 - (2 * h + 1) - 1]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = ids[:1]
    for how in ("cu_seqlens", "position_ids", "cu_seq_lens_q"):
        given = (dict(cu_seqlens=cu) if how == "cu_seqlens" else dict(position_ids=_doc_positions(lengths))
                 if how == "position_ids" else dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths)))
        out = shard_batch_for_cp(packed, mesh, sequence_layout="balanced", **given)
        assert torch.equal(out["input_ids"], local_slice(packed, r, cp, layout="balanced")), how
        assert torch.equal(out["position_ids"], local_slice(_doc_positions(lengths), r, cp, layout="balanced")), how
        assert torch.equal(out["target_ids"], local_slice(_targets(packed, lengths=lengths), r, cp,
                                                          layout="balanced")), how
        assert torch.equal(out["cu_seq_lens_q"].long(), cu) and torch.equal(out["cu_seq_lens_k"].long(), cu), how
        assert out["max_length_q"] == out["max_length_k"] == max(lengths), how

    # a packed row padded to a multiple of 2 cp: one padding document, its targets ignored
    short = ids[:1, : S - 3]
    lengths = [5, S - 3 - 5]
    cu = torch.tensor([0, 5, S - 3])
    out = shard_batch_for_cp(short, mesh, cu_seqlens=cu, pad_to_multiple_of=2 * cp, pad_token_id=7,
                             sequence_layout="balanced")
    row = torch.cat([short, torch.full((1, 3), 7)], dim=1)
    assert torch.equal(out["input_ids"], local_slice(row, r, cp, layout="balanced"))
    assert torch.equal(out["cu_seq_lens_q"].long(), torch.tensor([0, 5, S - 3, S]))
    real = (torch.arange(S) < S - 3).long()[None]  # the padding document's tokens are never targets
    assert torch.equal(out["target_ids"], local_slice(_targets(row, real, lengths + [3]), r, cp, layout="balanced"))
    assert torch.equal(out["position_ids"], local_slice(_doc_positions(lengths + [3]), r, cp, layout="balanced"))

    # multimodal token types are cut the same way (no position ids: the multimodal hook forms them)
    types = torch.randint(0, 2, (2, S), generator=g)
    out = shard_batch_for_cp(ids, mesh, mm_token_type_ids=types, sequence_layout="balanced")
    assert torch.equal(out["mm_token_type_ids"], local_slice(types, r, cp, layout="balanced"))
    assert torch.equal(out["input_ids"], local_slice(ids, r, cp, layout="balanced")) and "position_ids" not in out

    # the row length must divide by 2 cp; pad_to_multiple_of must be a multiple of 2 cp
    odd = ids[:, : S - cp]  # divisible by cp, not by 2 cp
    _expect(ValueError, rf"sequence_layout='balanced' cuts the row into 2 x cp = {2 * cp} equal pieces: the global "
                        rf"sequence length \({S - cp}\) must be divisible by {2 * cp}; pad the rows",
            lambda: shard_batch_for_cp(odd, mesh, sequence_layout="balanced"))
    _expect(ValueError, rf"pass pad_to_multiple_of=2\*cp \({2 * cp}\) to append a padding document",
            lambda: shard_batch_for_cp(odd[:1], mesh, cu_seqlens=torch.tensor([0, 3, S - cp]),
                                       sequence_layout="balanced"))
    _expect(ValueError, rf"pad_to_multiple_of={cp} is not a multiple of {2 * cp}: pass pad_to_multiple_of=2\*cp",
            lambda: shard_batch_for_cp(ids[:1], mesh, cu_seqlens=torch.tensor([0, 3, S]), pad_to_multiple_of=cp,
                                       sequence_layout="balanced"))
    shard_batch_for_cp(odd, mesh)  # contiguous: fine
    _expect(ValueError, r"shard_batch_for_cp: sequence_layout='zigzag' is not supported; expected one of",
            lambda: shard_batch_for_cp(ids, mesh, sequence_layout="zigzag"))
    # ranks asked for different layouts all raise
    mine = "balanced" if r == 0 else "contiguous"
    _expect(ValueError, r"shard_batch_for_cp: ranks disagree on sequence_layout_balanced",
            lambda: shard_batch_for_cp(ids, mesh, sequence_layout=mine))

    # the integration's collated batches: padded columns to a multiple of 2 cp, then the same cut
    labels = ids.masked_fill(mask == 0, IGNORE)
    cut = shard_collated_batch(dict(input_ids=odd, attention_mask=mask[:, : S - cp], labels=labels[:, : S - cp]),
                               mesh, sequence_layout="balanced")
    padded_ids = torch.cat([odd, torch.zeros(2, cp, dtype=odd.dtype)], dim=1)
    padded_mask = torch.cat([mask[:, : S - cp], torch.zeros(2, cp, dtype=mask.dtype)], dim=1)
    assert torch.equal(cut["input_ids"], local_slice(padded_ids, r, cp, layout="balanced"))
    assert torch.equal(cut["attention_mask"], local_slice(padded_mask, r, cp, layout="balanced"))
    assert torch.equal(cut["target_ids"], local_slice(_targets(padded_ids, padded_mask), r, cp, layout="balanced"))


class _Stop(Exception):
    pass


def _captured(model, **kwargs) -> dict:
    """What the text model's layers would receive: deltacp's hooks run, then the forward stops."""
    seen = {}

    def capture(module, args, kw):
        seen.update(kw)
        raise _Stop

    handle = adapter_for(model).text.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        model(**kwargs, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen


def _check_hook(mesh, cp: int, r: int) -> None:
    """The model's input hook at CP `cp` under both layouts."""
    torch.manual_seed(0)
    models = {layout: parallelize_cp(Qwen3_5ForCausalLM(tiny_config()), mesh, linear_attention_cp_mode="p2p",
                                     sequence_layout=layout) for layout in ("balanced", "contiguous")}
    balanced = models["balanced"]
    S = 16 * cp
    ids = torch.randint(0, 256, (1, S))
    lengths = [5, 2 * S // 3 - 5, S - 2 * S // 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    # default position ids: the row positions of the rank's tokens (per document with packing keywords)
    seen = _captured(balanced, input_ids=local_slice(ids, r, cp, layout="balanced"))
    assert torch.equal(seen["position_ids"], local_slice(torch.arange(S)[None], r, cp, layout="balanced"))
    seen = _captured(balanced, input_ids=local_slice(ids, r, cp, layout="balanced"), cu_seq_lens_q=cu)
    assert torch.equal(seen["position_ids"], local_slice(_doc_positions(lengths), r, cp, layout="balanced"))
    # a balanced cut's batch goes through, with or without the offsets; its documents are the row's
    for given in (dict(cu_seqlens=cu), dict(position_ids=_doc_positions(lengths))):
        batch = shard_batch_for_cp(ids, mesh, sequence_layout="balanced", **given)
        for keys in (("input_ids", "position_ids"), ("input_ids", "position_ids", "cu_seq_lens_q")):
            seen = _captured(balanced, **{k: batch[k] for k in keys})
            context = seen["attention_mask"]["linear_attention"]
            assert torch.equal(context.documents.cu_seqlens, cu), (given, keys)
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    two = torch.randint(0, 256, (2, S))
    batch = shard_batch_for_cp(two, mesh, attention_mask=mask, sequence_layout="balanced")
    _captured(balanced, input_ids=batch["input_ids"], position_ids=batch["position_ids"],
              attention_mask=batch["attention_mask"])

    # a batch cut with the other layout: every rank raises, naming the model's layout
    for model_layout, cut_layout in (("balanced", "contiguous"), ("contiguous", "balanced")):
        model = models[model_layout]
        named = rf"not in row order for sequence_layout='{model_layout}'.*shard_batch_for_cp\(\.\.\., model=model\) " \
                rf"\(or sequence_layout='{model_layout}'\)"
        tagged = rf"the batch was cut with sequence_layout='{cut_layout}' \(shard_batch_for_cp\), but the model holds " \
                 rf"each rank's tokens as sequence_layout='{model_layout}'"
        plain = shard_batch_for_cp(ids, mesh, sequence_layout=cut_layout)
        _expect(ValueError, named, lambda: _captured(model, input_ids=plain["input_ids"],
                                                     position_ids=plain["position_ids"]))
        packed = shard_batch_for_cp(ids, mesh, position_ids=_doc_positions(lengths), sequence_layout=cut_layout)
        _expect(ValueError, named, lambda: _captured(model, input_ids=packed["input_ids"],
                                                     position_ids=packed["position_ids"]))
        # with the offsets, each rank compares its own positions (a rank whose cut agrees raises as the others)
        _expect((ValueError, RuntimeError), named,
                lambda: _captured(model, **{k: v for k, v in packed.items()
                                            if k not in ("target_ids", "cp_sequence_layout")}))
        padded = shard_batch_for_cp(two, mesh, attention_mask=mask, sequence_layout=cut_layout)
        _expect(ValueError, named, lambda: _captured(model, input_ids=padded["input_ids"],
                                                     position_ids=padded["position_ids"],
                                                     attention_mask=padded["attention_mask"]))
        # without position ids the cut's own record of its layout is checked (plain, padded, packed rows)
        for batch in (plain, padded, packed):
            _expect(ValueError, tagged, lambda: _captured(model, **{k: v for k, v in batch.items()
                                                                    if k not in ("target_ids", "position_ids")}))
    # an odd number of local tokens cannot be two pieces
    _expect(ValueError, _odd(7, cp), lambda: _captured(balanced, input_ids=ids[:, :7]))


def _odd(s: int, cp: int) -> str:
    """The one message of an odd local length under 'balanced' (placement.check_local_length), wherever it is met."""
    return (rf"^sequence_layout='balanced' needs an even number of local tokens on every rank \(its two equal pieces "
            rf"of the row\), got {s}: the row length must be divisible by 2 x cp \({2 * cp}\); cut the batch with "
            rf"shard_batch_for_cp\(sequence_layout='balanced'\)")


def _check_layers_refuse_odd_lengths(mesh, cp: int) -> None:
    """A layer applied on its own (no model hook before it) meets the same rule with the same message: the GDN
    style (p2p, Ulysses), Ulysses attention, and the attention across Ulysses groups (u = 2: cp counts every rank of the row)."""
    config = tiny_config()
    x = torch.randn(1, 7, config.hidden_size)
    for mode in ("p2p", "ulysses"):
        gdn = LinearAttentionContextParallel(mode=mode, sequence_layout="balanced").apply(
            Qwen3_5GatedDeltaNet(config, 0), mesh)
        _expect(ValueError, _odd(7, cp), lambda: gdn(x))
    cos_sin = (torch.ones(1, 7, config.head_dim), torch.zeros(1, 7, config.head_dim))
    for method, u in (("ulysses", None), ("all_gather", 2)):
        attention = FullAttentionContextParallel(method, ulysses_degree=u, sequence_layout="balanced").apply(
            Qwen3_5Attention(config, 3), mesh)
        _expect(ValueError, _odd(7, cp), lambda: attention(x, cos_sin))


def _check_multimodal(mesh, single, cp: int, r: int) -> None:
    """The multimodal hook under 'balanced': the rank's mRoPE positions and input embeddings (image features placed
    at its image tokens) are its pieces of the whole row's (one rank holding the row: the reference). The images
    straddle piece boundaries."""
    S = 32 * cp
    ids, types, pixel_values, grid = image_batch(2, S, starts=(14, 30), seed=1)
    base = tiny_family_model("Qwen3_5ForConditionalGeneration")
    seen = {}
    for name, where, layout in (("row", single, "contiguous"), ("mine", mesh, "balanced")):
        model = parallelize_cp(copy.deepcopy(base), where, linear_attention_cp_mode="p2p", sequence_layout=layout)
        batch = shard_batch_for_cp(ids, where, mm_token_type_ids=types, sequence_layout=layout)
        seen[name] = _captured(model, input_ids=batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                               pixel_values=pixel_values, image_grid_thw=grid)
    assert torch.equal(seen["mine"]["position_ids"], local_slice(seen["row"]["position_ids"], r, cp, dim=-1,
                                                                 layout="balanced"))
    assert torch.equal(seen["mine"]["inputs_embeds"], local_slice(seen["row"]["inputs_embeds"], r, cp,
                                                                  layout="balanced"))
    _expect(ValueError, _odd(15, cp), lambda: _captured(model, input_ids=batch["input_ids"][:, :15],
                                                         mm_token_type_ids=batch["mm_token_type_ids"][:, :15],
                                                         pixel_values=pixel_values, image_grid_thw=grid))


def _check_trainer() -> None:
    """train.accelerator.sequence_layout reaches the model and the batch cut: a step at dp2 x cp2 goes through the
    input hook's layout check (packed rows: per-document positions with their offsets)."""
    from pathlib import Path

    from deltacp import sequence_layout_of
    from deltacp.train.config import load_config
    from deltacp.train.trainer import Trainer

    main = Path(__file__).resolve().parents[2] / "configs" / "tiny_cp4.yaml"
    cfg = load_config(main, ["train.accelerator.cp=2", "train.accelerator.sequence_layout=balanced",
                             "train.data.seq_len=64", "train.data.batch_size=2", "train.steps=1",
                             "train.logging.progress=none"])
    trainer = Trainer(cfg, progress=False)
    assert sequence_layout_of(trainer.model) == "balanced"
    trainer.train_step()


def layout_worker(rank, world):
    one_d = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    two_d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
    _check_cuts(one_d, world, rank)
    _check_layers_refuse_odd_lengths(one_d, world)
    _check_cuts(two_d, world // 2, rank % (world // 2))
    _check_hook(two_d, world // 2, rank % (world // 2))
    _check_multimodal(two_d, self_meshes(), world // 2, rank % (world // 2))
    _check_trainer()
    dist.barrier()


def test_balanced_batches_and_the_input_hook_cp4_cp2():
    run_distributed(layout_worker, 4, timeout_s=300)


def test_cp_trainer_refuses_an_unknown_sequence_layout_before_anything_else():
    from deltacp.integrations.trainer import CPTrainerMixin

    class Bare(CPTrainerMixin):  # no trainer behind it: the keyword is checked before the trainer is built
        pass

    with pytest.raises(ValueError, match=r"deltacp: sequence_layout='zigzag' is not supported; expected one of"):
        Bare(cp_size=2, sequence_layout="zigzag")
