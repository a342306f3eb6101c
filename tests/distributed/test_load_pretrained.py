"""`load_pretrained` and `save_pretrained` on 4 gloo CPU ranks, one spawn, against transformers on one process.

The checkpoints are written by transformers itself (`save_pretrained`, bf16, split into several safetensors files
with their index: routed experts stored per expert, as transformers 5.25 writes them, fused for LaRA-mini, whose
mapping also fuses its GDN input projections into one `in_proj` and renames its gated norm), plus one in the layout of
the released Qwen3.5 MoE checkpoints (multimodal names, fused experts, a multi-token-prediction tensor) loaded as
the text-only causal LM, a Kimi-Linear one with its dense MLPs under `mlp.` (transformers writes
`block_sparse_moe.` for every layer), and Mamba2 and Mamba ones with the input embedding under the older name
`embedding`.
Every supported class, CP4 (p2p) with FSDP2 over the 4 ranks, float32:

- every parameter (gathered) and buffer equals `from_pretrained(dtype=float32)`'s exactly (bf16 -> float32 is
  exact), and this rank's logits equal that model's logits of its slice to float32 accuracy (CP sums in another
  order);
- `save_pretrained` of the sharded model (several files, small blocks) reloads with plain `from_pretrained` to the
  same parameters (one class in bf16 too), with the names and shapes transformers wrote;
- replicated parameters (fsdp=False) with activation checkpointing load the same parameters;
- peak RSS growth per rank while loading a ~100 MB one-file bf16 checkpoint as float32 stays under 0.75x its bytes
  (the rank's float32 share is 0.5x, plus one block in flight; a float32 copy of the whole model would be 2.0x, and
  reading through safetensors' memory map measured 0.86-1.05x: the issue's bound is 1.0x).
"""

import copy
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import save_file

from deltacp import load_pretrained, save_pretrained, shard_batch_for_cp
from deltacp.distributed.launch import run_distributed
from deltacp.checkpoint_io.hf_format import read_index
from deltacp.testing.memory import PeakRSS
from helpers import (FAMILY_CLASSES, TEXT_VOCAB, cp_mesh, full_tensors, local_slice, rel_l2, tiny_config,
                     tiny_family_model, tiny_olmo_hybrid, tiny_qwen4_exp)

WORLD = 4
CLASSES = ("Qwen3_5ForCausalLM",) + FAMILY_CLASSES + ("OlmoHybridForCausalLM", "BambaForCausalLM",
                                                     "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM",
                                                     "FalconH1ForCausalLM", "BailingHybridForCausalLM",
                                                     "KimiLinearForCausalLM", "Qwen4ExpForCausalLM",
                                                     "MiniMaxForCausalLM", "LaraMiniForCausalLM",
                                                     "Lfm2MoeForCausalLM",  # LFM2-MoE: experts per expert w1/w3/w2
                                                     "Lfm3ForCausalLM",  # LFM3: g_proj stored as gate_proj
                                                     "Mamba2ForCausalLM", "MambaForCausalLM",
                                                     "FalconMambaForCausalLM",
                                                     "JambaForCausalLM",  # experts stored per expert
                                                     "Zamba2ForCausalLM",  # shared blocks: stored once
                                                     "ZambaForCausalLM",  # one shared block, stored once
                                                     # tied head; a bf16 normalizer buffer, not stored
                                                     "RecurrentGemmaForCausalLM")
SETTINGS = {"Qwen4ExpForCausalLM": dict(full_attention_cp="all_gather")}  # its indexed layers' method


def _tiny(name):
    if name == "Qwen3_5ForCausalLM":
        return transformers.Qwen3_5ForCausalLM(tiny_config(tie_word_embeddings=True))  # tied embeddings
    if name == "OlmoHybridForCausalLM":
        return tiny_olmo_hybrid(rope=False, dtype=torch.float32)  # NoPE, as the released checkpoints
    if name == "Qwen4ExpForCausalLM":  # a PLE layer: its n-gram embedding stored in 4 row shards (ngram_embedding.
        # shard_*, transformers' conversion mapping; the released model: 512); conv halo 6 (8 tokens a rank)
        return tiny_qwen4_exp(torch.float32, ple_layer_ids=[1], ngram_vocab_size_base=64, split_ngram_parts=4,
                              ple_conv_kernel_size=3)
    if name == "LaraMiniForCausalLM":  # untied: the head is stored too; in_proj fused, out_norm, experts fused
        return tiny_family_model(name, torch.float32, tie_word_embeddings=False)
    return tiny_family_model(name, torch.float32)  # (Bamba, Granite-4.0-H, Nemotron-H, Falcon-H1: Mamba2, eager)


def _released_moe_layout(root):
    """A Qwen3.5 MoE checkpoint as Qwen releases them: the multimodal class's names, experts fused
    (mlp.experts.gate_up_proj / down_proj), a multi-token-prediction head (mtp.*), two files with their index."""
    model = tiny_family_model("Qwen3_5MoeForConditionalGeneration", torch.float32).to(torch.bfloat16)
    path = root / "released_moe"
    model.config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["mtp.fc.weight"] = torch.ones(4, 4, dtype=torch.bfloat16)
    keys = sorted(state)
    names = {k: f"model-0000{1 + (i >= len(keys) // 2)}-of-00002.safetensors" for i, k in enumerate(keys)}
    for name in set(names.values()):
        save_file({k: state[k] for k in keys if names[k] == name}, path / name, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return path


def _kimi_dense_under_mlp(root):
    """transformers' Kimi-Linear checkpoint with the dense layers' MLPs stored under `mlp.` (the routed ones stay
    under `block_sparse_moe.`, experts per expert as w1 / w3 / w2): both spellings load in transformers."""
    from safetensors.torch import load_file

    path = root / "kimi_dense_mlp"
    tiny_family_model("KimiLinearForCausalLM", torch.float32).to(torch.bfloat16).save_pretrained(path)
    state = load_file(path / "model.safetensors")
    dense = {k: k.replace(".block_sparse_moe.", ".mlp.") for k in state
             if ".block_sparse_moe." in k and k.rsplit(".", 2)[-2] in ("gate_proj", "up_proj", "down_proj")
             and ".shared_experts." not in k}
    assert dense, "no dense MLP in the tiny Kimi-Linear"
    save_file({dense.get(k, k): v for k, v in state.items()}, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _older_embedding_name(root, name):
    """The checkpoint of class `name` of this file (several files and their index) with the input embedding under its
    older name `backbone.embedding.weight` (the state-spaces Mamba / Mamba2 conversions). transformers'
    `MambaModel.load_hook` / `Mamba2Model.load_hook` rename it, but 5.25's from_pretrained never calls the hook: it
    reports the tensor MISSING and initialises it anew. deltacp reads it (`Family.checkpoint_load_aliases`); the
    reference is from_pretrained of the original."""
    from safetensors.torch import load_file

    src, path = root / name, root / f"{name}_older_names"
    path.mkdir()
    older = {}
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            state = load_file(src / f)
            older.update({k: k.replace(".embeddings.", ".embedding.") for k in state})
            save_file({older[k]: v for k, v in state.items()}, path / f, metadata={"format": "pt"})
        elif f.endswith(".json"):
            (path / f).write_bytes((src / f).read_bytes())
    assert "backbone.embedding.weight" in older.values()
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())
        index["weight_map"] = {older[k]: v for k, v in index["weight_map"].items()}
        index_file.write_text(json.dumps(index))
    return path


OLDER_NAMES = ("Mamba2ForCausalLM", "MambaForCausalLM")
REFERENCE = {f"{name}_older_names": name for name in OLDER_NAMES}  # case -> the checkpoint read as the reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """[(case, directory, class to load)], and the ~100 MB checkpoint of the memory check."""
    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(0)
    cases = []
    for name in CLASSES:
        _tiny(name).to(torch.bfloat16).save_pretrained(root / name, max_shard_size="60KB")
        cases.append((name, root / name, name))
    cases.append(("released_moe", _released_moe_layout(root), "Qwen3_5MoeForCausalLM"))
    cases.append(("kimi_dense_mlp", _kimi_dense_under_mlp(root), "KimiLinearForCausalLM"))
    cases += [(f"{name}_older_names", _older_embedding_name(root, name), name) for name in OLDER_NAMES]
    big = tiny_config(vocab_size=32768, hidden_size=512, intermediate_size=2048, num_attention_heads=8, head_dim=64,
                      linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                      linear_value_head_dim=64)
    transformers.Qwen3_5ForCausalLM(big).to(torch.bfloat16).save_pretrained(root / "big")  # one file
    return cases, root / "big"


def _decays_from_slopes(model):
    """A copy of a MiniMax model with its in-block decay buffers recomputed in float32 from each layer's stored slope
    (transformers' own `decay_factors`): a bf16 checkpoint stores them rounded to bf16 (1e-4 of the tiny model's
    logits), while deltacp forms every factor from the stored slope (`families/minimax.py`)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "slope_rate"):
                for buffer, value in zip((attn.query_decay, attn.key_decay, attn.diagonal_decay),
                                         attn.decay_factors(attn.slope_rate)):
                    buffer.copy_(value)
    return model


def _full(model):
    return full_tensors(model.state_dict())


def _logits(model, ids, mesh=None):
    with torch.no_grad():
        if mesh is None:
            return model(input_ids=ids, use_cache=False).logits
        batch = shard_batch_for_cp(ids, mesh)
        return model(**{k: v for k, v in batch.items() if k != "target_ids"}, use_cache=False).logits


def _compare(got: dict, ref: dict, what: str) -> list[str]:
    if set(got) != set(ref):
        return [f"{what}: keys differ: {sorted(set(got) ^ set(ref))[:4]}"]
    return [f"{what}: {n} differs" for n in ref if not (got[n].dtype == ref[n].dtype and torch.equal(got[n], ref[n]))]


def worker(rank, world, cases, big, out_root):
    mesh = cp_mesh()
    failures = []
    ids = torch.randint(0, TEXT_VOCAB, (1, 32), generator=torch.Generator().manual_seed(5))
    for case, path, cls_name in cases:
        cls = getattr(transformers, cls_name)
        model = load_pretrained(path, mesh, dtype=torch.float32, model_class=cls_name,
                                linear_attention_cp_mode="p2p", **SETTINGS.get(cls_name, {}))
        ref = cls.from_pretrained(path.with_name(REFERENCE.get(case, path.name)), dtype=torch.float32).eval()
        failures += _compare(_full(model), ref.state_dict(), case)
        failures += _compare(dict(model.named_buffers()), dict(ref.named_buffers()), f"{case} buffers")
        logits_ref = _logits(_decays_from_slopes(ref) if cls_name == "MiniMaxForCausalLM" else ref, ids)
        err = rel_l2(_logits(model, ids, mesh), local_slice(logits_ref, rank, world))
        if not err < 2e-6:
            failures.append(f"{case}: logits rel-L2 {err:.2e} against from_pretrained")

        out = out_root / case
        save_pretrained(model, out, max_shard_size="40KB", block_bytes=512)  # collective: rank 0 writes
        in_bf16 = case == "Qwen3_5MoeForConditionalGeneration"  # experts, vision tower: converted block by block
        if in_bf16:
            save_pretrained(model, out.with_name(f"{case}-bf16"), dtype=torch.bfloat16)
        if rank == 0:
            if len([f for f in os.listdir(out) if f.endswith(".safetensors")]) < 2:
                failures.append(f"{case}: the save is one file despite max_shard_size")
            failures += _compare(cls.from_pretrained(out).state_dict(), ref.state_dict(), f"{case} saved")
            if in_bf16:
                failures += _compare(cls.from_pretrained(out.with_name(f"{case}-bf16")).state_dict(),
                                     cls.from_pretrained(path).state_dict(), f"{case} saved bf16")
            if case in CLASSES:  # the names and shapes transformers' save_pretrained wrote
                written = {k: t.shape for k, t in read_index(out).items()}
                theirs = {k: t.shape for k, t in read_index(path).items()}
                if case == "OlmoHybridForCausalLM":  # its conv pieces: q, k, v rows (transformers: equal thirds)
                    convs = [k for k in theirs if "_conv1d." in k]
                    if sorted(convs) != sorted(k for k in written if "_conv1d." in k):
                        failures.append(f"{case}: saved conv piece names differ from transformers'")
                    gdn = ref.model.layers[0].linear_attn  # the released layout: key_dim, key_dim, value_dim rows
                    rows = [written[f"model.layers.0.linear_attn.{p}_conv1d.weight"][0] for p in "qkv"]
                    if rows != [gdn.key_dim, gdn.key_dim, gdn.value_dim]:
                        failures.append(f"{case}: saved conv pieces of {rows} rows, not q, k, v's")
                    written = {k: v for k, v in written.items() if k not in convs}
                    theirs = {k: v for k, v in theirs.items() if k not in convs}
                if written != theirs:
                    failures.append(f"{case}: saved names/shapes differ from transformers' save_pretrained")

    case, path, cls_name = cases[0]  # replicated parameters, activation checkpointing on every decoder layer
    model = load_pretrained(path, mesh, dtype=torch.float32, fsdp=False, activation_checkpointing=True)
    ref = getattr(transformers, cls_name).from_pretrained(path, dtype=torch.float32)
    failures += _compare(_full(model), ref.state_dict(), f"{case} fsdp=False")
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        failures.append(f"{case} fsdp=False: the tied embeddings are no longer tied")

    nbytes = sum(os.path.getsize(big / f) for f in os.listdir(big) if f.endswith(".safetensors"))
    with PeakRSS() as peak:
        model = load_pretrained(big, mesh, dtype=torch.float32)
    ratio = peak.growth / nbytes
    print(f"rank {rank}: peak RSS growth {peak.growth / 2**20:.1f} MiB = {ratio:.3f}x of the {nbytes / 2**20:.1f} MiB "
          f"bf16 checkpoint (float32 share {0.5 * 4 / world:.2f}x)")
    if not peak.exact:
        failures.append("the peak RSS could not be reset (/proc/self/clear_refs)")
    if not ratio < 0.75:  # the float32 share (0.5x) + one block in flight; the 1.0x of the issue is the outer bound
        failures.append(f"peak RSS growth {ratio:.3f}x of the checkpoint's bytes, not under 0.75x (1.0x: the issue's "
                        f"bound; 0.86-1.05x when safetensors' memory map reads the slices)")
    assert not failures, f"rank {rank}:\n  " + "\n  ".join(failures)


def test_load_and_save_every_class_on_4_ranks(checkpoints, tmp_path):
    cases, big = checkpoints
    run_distributed(worker, WORLD, cases, big, tmp_path, timeout_s=600)


def test_save_pretrained_on_one_process_writes_what_transformers_writes(checkpoints, tmp_path):
    """No process group: the writer alone (what the export uses); MoE per expert, tied embeddings left out."""
    for name in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"):
        model = _tiny(name)
        model.save_pretrained(tmp_path / "theirs")
        save_pretrained(copy.deepcopy(model), tmp_path / "ours")
        theirs, ours = read_index(tmp_path / "theirs"), read_index(tmp_path / "ours")
        assert {k: (t.shape, t.dtype) for k, t in ours.items()} == {k: (t.shape, t.dtype) for k, t in theirs.items()}
        reloaded = type(model).from_pretrained(tmp_path / "ours")
        assert not _compare(reloaded.state_dict(), model.state_dict(), name)
        for sub in ("ours", "theirs"):
            for f in os.listdir(tmp_path / sub):
                os.remove(tmp_path / sub / f)
