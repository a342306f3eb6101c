"""Model adapters on one rank: every supported class is recognised, unsupported classes and settings raise naming
them, and a parallelized model keeps transformers' own state_dict keys and save_pretrained."""

import copy
import os
from pathlib import Path

import pytest
import torch
import transformers
from torch.distributed.device_mesh import init_device_mesh

from deltacp import parallelize_cp, parallelize_qwen3_5_cp, supported_classes
from deltacp.models.adapters import adapter_for
from helpers import FAMILY_CLASSES, image_batch, tiny_config, tiny_family_model

pytestmark = pytest.mark.fast


def _mesh():
    return init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))


def test_supported_classes_and_the_old_name():
    assert parallelize_qwen3_5_cp is parallelize_cp
    for name in ("Qwen3_5ForCausalLM", "Qwen3_5TextModel", *FAMILY_CLASSES, "Qwen3NextModel"):
        assert name in supported_classes(), name
    for name in FAMILY_CLASSES:
        model = tiny_family_model(name, torch.float32)
        adapter = adapter_for(model)
        assert len(adapter.layers()) == 4 and adapter.head is model
        assert (adapter.multimodal is not None) == name.endswith("ConditionalGeneration")
        assert (adapter.moe is not None) == ("Moe" in name or "Next" in name)


def test_every_family_record_names_transformers_classes():
    """The family table (class names, importable without transformers) agrees with the installed transformers:
    each class's config_class (and a multimodal one's sub-configs), the norm of a tiny model, the view's name."""
    from deltacp.models.adapters import GDN_VIEWS
    from deltacp.families.registry import FAMILIES, family_of, trainable_classes

    for family in FAMILIES:
        classes = family.classes()
        assert classes is not None, family.name
        for role in ("causal_lm", "text_model"):
            if role in classes:  # GLM-5.3-Flash has no causal-LM class
                assert classes[role].config_class is getattr(transformers, family.text_config), (family.name, role)
        if family.conditional is not None:
            config_class = classes["conditional"].config_class
            assert config_class is getattr(transformers, family.multimodal_config), family.name
            assert config_class.sub_configs["text_config"] is getattr(transformers, family.text_config)
            assert config_class.sub_configs["vision_config"] is getattr(transformers, family.vision_config)
        assert family.mixer_view is None or family.mixer_view.__name__ in GDN_VIEWS, family.name
        assert (family.mixer_view is None) == (family.linear_mixer is None), family.name  # LFM2: no linear mixer
    models = {"Qwen3_5ForCausalLM": transformers.Qwen3_5ForCausalLM(tiny_config())}
    models.update({name: tiny_family_model(name, torch.float32) for name in FAMILY_CLASSES})
    for name, model in models.items():
        adapter = adapter_for(model)
        assert adapter.family is family_of(name) and name in trainable_classes()
        assert type(adapter.text.norm).__name__ == adapter.family.norm, name
        assert type(adapter.layers()[0].input_layernorm).__name__ == adapter.family.norm, name


def test_unsupported_classes_are_named(single_rank_group):
    config = tiny_family_model("Qwen3_5MoeForCausalLM", torch.float32).config
    for model in (transformers.Qwen3_5MoeForSequenceClassification(config) if hasattr(
            transformers, "Qwen3_5MoeForSequenceClassification") else torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)):
        with pytest.raises(NotImplementedError, match=rf"supports .*Qwen3NextForCausalLM.*; got {type(model).__name__}"):
            parallelize_cp(model, _mesh())


def test_unsupported_inputs_are_named(single_rank_group):
    model = parallelize_cp(tiny_family_model("Qwen3_5ForConditionalGeneration", torch.float32), _mesh())
    ids, types, pixel_values, grid = image_batch(1, 32, starts=(5,))
    with pytest.raises(NotImplementedError, match=r"does not support \['pixel_values_videos', 'video_grid_thw'\]"):
        model(input_ids=ids, mm_token_type_ids=types, pixel_values_videos=pixel_values.float(), video_grid_thw=grid,
              use_cache=False)
    with pytest.raises(ValueError, match="images under CP need mm_token_type_ids"):
        model(input_ids=ids, pixel_values=pixel_values.float(), image_grid_thw=grid, use_cache=False)
    with pytest.raises(ValueError, match="labels under CP"):
        model(input_ids=ids, labels=ids, use_cache=False)
    nxt = parallelize_cp(tiny_family_model("Qwen3NextForCausalLM", torch.float32), _mesh())
    with pytest.raises(ValueError, match=r"position_ids of shape \(3, 1, 32\) for Qwen3NextForCausalLM: expected "
                                         r"\[B, s\]"):
        nxt(input_ids=ids, position_ids=torch.arange(32).expand(3, 1, 32), use_cache=False)


@pytest.mark.parametrize("name", FAMILY_CLASSES)
def test_state_dict_keys_and_save_pretrained_survive(single_rank_group, tmp_path, name):
    base = tiny_family_model(name, torch.float32)
    model = parallelize_cp(copy.deepcopy(base), _mesh())
    assert list(model.state_dict()) == list(base.state_dict())
    model.save_pretrained(tmp_path)
    reloaded = type(base).from_pretrained(tmp_path)
    for key, value in base.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


def test_cp_forwards_survive_train_and_eval_of_a_from_pretrained_model(single_rank_group, tmp_path):
    """transformers 5.25's from_pretrained turns its hub-kernel layers on, and train()/eval() re-install them by
    replacing instance forwards (the GDN module's among them): parallelize_cp turns them off, keeping its own."""
    tiny_family_model("Qwen3_5MoeForCausalLM", torch.float32).save_pretrained(tmp_path)
    model = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path)
    assert model.use_kernels  # what makes the case
    parallelize_cp(model, _mesh())
    adapter = adapter_for(model)
    modules = [m for layer in adapter.layers() for m in (adapter.linear_attention(layer), adapter.full_attention(layer))
               if m is not None]
    installed = [m.forward for m in modules]
    model.train()
    model.eval()
    assert [m.forward for m in modules] == installed


def test_a_style_taken_from_deltacp_finds_the_family_views():
    """In a fresh interpreter, `from deltacp import LinearAttentionContextParallel` (nothing else of deltacp) applies
    to transformers' GDN and attention modules: taking a style registers the families' views (mutation seen failing:
    deltacp's lazy loader not importing the adapters)."""
    import subprocess
    import sys

    code = """
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from deltacp import FullAttentionContextParallel, LinearAttentionContextParallel
from deltacp.distributed.launch import free_port
from helpers import tiny_attention, tiny_config
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
LinearAttentionContextParallel(mode="p2p").apply(Qwen3_5GatedDeltaNet(tiny_config(), 0), mesh)
FullAttentionContextParallel("ulysses").apply(tiny_attention(tiny_config()), mesh)
dist.destroy_process_group()
print("APPLIED")
"""
    tests = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])))
    assert "APPLIED" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("name", ["BambaForCausalLM", "Zamba2ForCausalLM"])
def test_a_mamba2_family_takes_the_triton_backend_and_names_the_device_on_cpu(single_rank_group, name):
    """Under backend='triton' the Mamba2 layers run the Triton scalar-decay recurrence (no eager fall-back; Zamba2:
    those of its hybrid layers too); on CPU tensors the first kernel says what it needs."""
    from deltacp.ops.ssd.triton import TritonScalarDecay
    from deltacp.parallel.style import cp_layer_of

    model = tiny_family_model(name, torch.float32)
    parallelize_cp(model, _mesh(), linear_attention_backend="triton", linear_attention_cp_mode="p2p")
    adapter = adapter_for(model)
    layers = [m for m in map(adapter.linear_attention, adapter.layers()) if m is not None]
    assert len(layers) == (5 if name.startswith("Zamba2") else 3)
    assert all(isinstance(cp_layer_of(m).recurrence, TritonScalarDecay) for m in layers)
    with pytest.raises(RuntimeError, match=r"backend='triton' needs CUDA tensors; got qkv on device 'cpu'"):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long), use_cache=False)

@pytest.mark.fast
def test_a_family_without_attention_or_mlp():
    """Mamba2: the adapter finds its text model at `backbone`, a Mamba2 mixer in every block and no full attention;
    its checkpoints keep the text model under `backbone.`."""
    from deltacp.checkpoint_io.hf_format import text_prefix_of, text_prefixes
    from helpers import tiny_mamba2

    model = tiny_mamba2(torch.float32)
    adapter = adapter_for(model)
    assert adapter.family.attention is None and adapter.family.mlp is None
    assert adapter.text is model.backbone and text_prefix_of(model) == "backbone."
    assert "backbone." in text_prefixes(adapter.family.text_attribute)
    assert all(adapter.linear_attention(layer) is layer.mixer and adapter.full_attention(layer) is None
               for layer in adapter.layers())


@pytest.mark.parametrize("name", ["MambaForCausalLM", "FalconMambaForCausalLM", "JambaForCausalLM",
                                  "ZambaForCausalLM"])
def test_mamba1_takes_the_triton_backend(single_rank_group, monkeypatch, name):
    """Mamba1's selective scan runs on the Triton backend: parallelize_cp installs the Triton recurrence in every
    Mamba1 layer (Zamba's multi-head ones too: one scan per head), and a CPU forward stops at the first Triton
    kernel's device check (the fused conv's), never runs eager instead. (The kernels: tests/unit/test_selective_triton_interpret.py; on a GPU, test_selective_triton_gpu.py.)"""
    from deltacp.parallel.style import cp_layer_of
    from deltacp.ops.selective.triton import TritonSelectiveScan

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = parallelize_cp(tiny_family_model(name, torch.float32), _mesh(), linear_attention_backend="triton",
                           linear_attention_cp_mode="p2p")
    adapter = adapter_for(model)
    mixers = [adapter.linear_attention(layer) for layer in adapter.layers()]
    recs = [cp_layer_of(m).recurrence for m in mixers if m is not None]
    assert recs and all(isinstance(r, TritonSelectiveScan) for r in recs), recs
    with pytest.raises(RuntimeError, match="backend='triton' needs CUDA tensors; got .* on device 'cpu'"):
        model(input_ids=torch.randint(3, 100, (1, 8)), use_cache=False)


def test_recurrent_gemma_soft_cap_refusals_and_stale_states(single_rank_group, monkeypatch):
    """RecurrentGemma on a one-rank mesh: the Triton backend refused before any collective (the RG-LRU has eager
    kernels only); cp_cross_entropy of model(...).logits is transformers' own loss (the soft-cap in its forward), and
    the chunked head losses (cp_causal_lm_loss with its token statistics, cp_token_logprobs) give the same values
    and gradients with the cap in their kernels (the Triton kernels refuse a cap); the CP forwards never read
    transformers' state attributes (garbage there changes nothing, and they stay as they were), use_cache=True is
    refused; suspend_cp puts transformers' forwards back and the CP ones after."""
    import torch.distributed as dist

    from deltacp import (cp_causal_lm_loss, cp_cross_entropy, cp_linear_cross_entropy, cp_token_logprobs,
                         shard_batch_for_cp, suspend_cp)
    from helpers import tiny_recurrent_gemma

    real = {op: getattr(dist, op) for op in ("all_gather", "all_reduce", "broadcast")}

    def collective(*args, **kwargs):
        raise AssertionError("a collective ran before the refusal")

    base = tiny_recurrent_gemma(torch.float64)
    for op in real:
        monkeypatch.setattr(dist, op, collective)
    with pytest.raises(NotImplementedError, match=r"RG-LRU scan \(RecurrentGemma\) has eager kernels only; "
                                                  r"linear_attention_backend='triton' .*use linear_attention_backend="
                                                  r"'eager'"):
        parallelize_cp(copy.deepcopy(base), _mesh(), linear_attention_backend="triton")
    for op, fn in real.items():
        monkeypatch.setattr(dist, op, fn)

    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    expected = base(input_ids=ids, labels=ids, use_cache=False).loss
    model = parallelize_cp(copy.deepcopy(base), _mesh(), linear_attention_cp_mode="p2p")
    batch = shard_batch_for_cp(ids, _mesh(), model=model)
    targets = batch.pop("target_ids")
    logits = model(**batch, use_cache=False).logits  # transformers' soft-cap, in its forward
    assert logits.abs().max() < 2.0
    loss = cp_cross_entropy(logits, targets, _mesh())
    assert abs(loss.item() / expected.item() - 1) < 1e-6  # transformers: its scan and loss in float32
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # the chunked head losses cap the logits in their kernels, the model's own cap kept off their result
    fused, stats = cp_causal_lm_loss(model, targets, _mesh(), use_cache=False, return_token_stats=True,
                                     chunk_size=8, **batch)
    assert abs(fused.item() / loss.item() - 1) < 1e-13
    fused.backward()
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-11, atol=1e-13)
    model.zero_grad()
    valid = targets >= 0
    z = logits.detach()
    entropy = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)[valid].sum()
    assert abs(stats[0].item() / entropy.item() - 1) < 1e-12  # the logged entropy: of the capped logits
    logp = cp_token_logprobs(model, targets, _mesh(), temperature=0.7, use_cache=False, chunk_size=8, **batch)
    logp_ref = torch.log_softmax(z / 0.7, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(logp[valid], logp_ref[valid], rtol=1e-12, atol=1e-12)
    (logp * valid).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = model(**batch, use_cache=False).logits / 0.7
    (torch.log_softmax(out, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0] * valid).sum().backward()
    for p, g in zip(model.parameters(), got):
        torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12)
    model.zero_grad()
    with pytest.raises(NotImplementedError, match=r"Triton head kernels compute no logit soft-cap"):
        cp_linear_cross_entropy(torch.randn(4, 32), torch.randn(256, 32), targets[0, :4], _mesh(),
                                kernels="triton", logit_softcap=2.0)
    model.model._forward_hooks.clear()  # the tiny builder's (it drops transformers' states after each forward)
    blocks = [layer.temporal_block for layer in model.model.layers if hasattr(layer.temporal_block, "rg_lru")]
    for block in blocks:  # stale inference states of the wrong shape and value
        block.conv1d_state = torch.full((3, 5, 7), 1e3, dtype=torch.float64)
        block.rg_lru.recurrent_states = torch.full((3, 32), 1e3)
    again = cp_cross_entropy(model(**batch, use_cache=False).logits, targets, _mesh())
    assert again.item() == loss.item()
    assert all(b.conv1d_state.shape == (3, 5, 7) and b.rg_lru.recurrent_states.shape == (3, 32) for b in blocks)
    with pytest.raises(NotImplementedError, match=r"use_cache"):
        model(**batch, use_cache=True)
    with suspend_cp(model):  # transformers' forwards back (the attention is a token layer's attribute too: once)
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, base(input_ids=ids, use_cache=False).logits)
    assert all("forward" in layer.temporal_block.__dict__ for layer in model.model.layers)


def test_zamba2_shared_blocks_stay_one_parameter_set(single_rank_group, tmp_path):
    """Zamba2's shared blocks (one instance per hybrid layer, the parameters of a block's instances tied by
    transformers): after parallelize_cp, activation checkpointing and FSDP2 (`fully_shard_cp`: one unit per tied
    group) the instances of a block still hold the SAME parameters and the model as many as before; the gradient of a
    tied weight is the sum over its invocations (transformers' own, on the same input), each invocation with its
    own adapters; the Mamba2 layers of both layer kinds and the shared attention are found."""
    from deltacp import apply_activation_checkpointing, fully_shard_cp
    from helpers import float64_upcasts, rel_l2, tiny_zamba2

    base = tiny_zamba2(torch.float64)
    adapter = adapter_for(base)
    layers = adapter.layers()
    assert [adapter.linear_attention(layer) is not None for layer in layers] == [True] * 5
    assert [adapter.full_attention(layer) is not None for layer in layers] == [False, True, False, True, True]
    numel = sum(p.numel() for p in base.parameters())
    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    reference = copy.deepcopy(base)
    with float64_upcasts():
        reference(input_ids=ids, use_cache=False).logits.square().mean().backward()

    model = parallelize_cp(base, _mesh(), linear_attention_cp_mode="p2p")
    apply_activation_checkpointing(model)
    fully_shard_cp(model, _mesh())
    first, second, third = (layers[i].shared_transformer for i in (1, 3, 4))  # blocks 0, 1, 0
    for (name, p), (_, q) in zip(first.named_parameters(remove_duplicate=False),
                                 third.named_parameters(remove_duplicate=False)):
        assert p is q, name
    assert all(p is not q for p, q in zip(first.parameters(), second.parameters()))
    assert sum(p.numel() for p in model.parameters()) == numel
    with float64_upcasts():
        model(input_ids=ids, use_cache=False).logits.square().mean().backward()
    for name in ("self_attn.q_proj.weight", "self_attn.linear_q_adapter_list.0.0.weight",
                 "self_attn.linear_v_adapter_list.2.1.weight", "feed_forward.gate_up_proj.weight",
                 "feed_forward.gate_up_proj_adapter_list.2.0.weight"):
        mine = first.get_parameter(name).grad.full_tensor()
        theirs = reference.model.layers[1].shared_transformer.get_parameter(name).grad
        assert rel_l2(mine, theirs) < 1e-10, name

    # loaded without FSDP2 (to_empty gives every module its own parameter: load_pretrained ties them again), the
    # tied group read once under its first layer's names (transformers' save left the others out)
    from deltacp import load_pretrained

    reference.save_pretrained(tmp_path)
    loaded = load_pretrained(tmp_path, _mesh(), dtype=torch.float64, fsdp=False, linear_attention_cp_mode="p2p")
    blocks = [loaded.model.layers[i].shared_transformer for i in (1, 4)]
    assert all(p is q for p, q in zip(*(b.parameters() for b in blocks)))
    assert torch.equal(blocks[1].self_attn.q_proj.weight, reference.model.layers[4].shared_transformer.self_attn.
                       q_proj.weight)


def test_zamba_shared_block_stays_one_parameter_set(single_rank_group):
    """Zamba's ONE shared block (an instance per hybrid layer, all tied by transformers) after parallelize_cp,
    activation checkpointing and FSDP2 (one unit for the tied group): the instances hold the SAME parameters, the
    model as many as before, and a tied weight's gradient is the sum over both invocations (transformers' own, on the
    same input). (Loading: test_load_pretrained.py; without FSDP2, the Zamba2 test above.)"""
    from deltacp import apply_activation_checkpointing, fully_shard_cp
    from helpers import float64_upcasts, rel_l2, tiny_zamba

    base = tiny_zamba(torch.float64)
    adapter = adapter_for(base)
    layers = adapter.layers()
    assert [adapter.full_attention(layer) is not None for layer in layers] == [False, True, False, True]
    assert all(adapter.linear_attention(layer) is not None for layer in layers)
    numel = sum(p.numel() for p in base.parameters())
    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    reference = copy.deepcopy(base)
    reference(input_ids=ids, use_cache=False).logits.square().mean().backward()

    model = parallelize_cp(base, _mesh(), linear_attention_cp_mode="p2p")
    apply_activation_checkpointing(model)
    fully_shard_cp(model, _mesh())
    first, second = layers[1].shared_transf, layers[3].shared_transf
    assert all(p is q for p, q in zip(first.parameters(), second.parameters()))
    assert sum(p.numel() for p in model.parameters()) == numel
    with float64_upcasts():
        model(input_ids=ids, use_cache=False).logits.square().mean().backward()
    for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "feed_forward.up_proj.weight",
                 "input_layernorm.weight"):
        mine = first.get_parameter(name).grad.full_tensor()
        theirs = reference.model.layers[1].shared_transf.get_parameter(name).grad
        assert rel_l2(mine, theirs) < 1e-6, name  # transformers' float32 A and D in a float64 model



def test_xlstm_and_rwkv_are_refused_with_the_reason(single_rank_group, monkeypatch, tmp_path):
    """xLSTM (mLSTM) and RWKV-4 are refused (docs/design.md, "Refused: the stabilised recurrences"): parallelize_cp
    (in its one configuration exchange: no other collective first), load_pretrained and the registry's class lookup
    raise NotImplementedError naming the class and why; the trainer's config a ConfigError with the reason."""
    import torch.distributed as dist
    import transformers

    from deltacp import load_pretrained
    from deltacp.families.registry import family_of
    from deltacp.train.config import ConfigError, load_config

    MAIN = Path(__file__).resolve().parents[2] / "configs" / "tiny_cp4.yaml"

    models = {"xLSTMForCausalLM": transformers.xLSTMForCausalLM(transformers.xLSTMConfig(
                  vocab_size=64, hidden_size=32, embedding_dim=32, num_heads=2, num_blocks=1)),
              "RwkvForCausalLM": transformers.RwkvForCausalLM(transformers.RwkvConfig(
                  vocab_size=64, hidden_size=16, attention_hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  context_length=64))}
    why = {"xLSTMForCausalLM": r"max\(\|q n\|, exp\(-m\)\) \+ eps", "RwkvForCausalLM": r"ratio of the carried state"}
    for name, model in models.items():
        reason = rf"{name}: .*{why[name]}.*outside the recurrence contract"
        with pytest.raises(NotImplementedError, match=reason):
            family_of(name)
        key = rf"^train\.model\.model_class='{name}'"
        with pytest.raises(ConfigError, match=rf"{key} is not supported: .*{why[name]}"):
            load_config(MAIN, [f"train.model.model_class={name}"])
        model.save_pretrained(tmp_path / name)
        with pytest.raises(NotImplementedError, match=rf"^load_pretrained: {reason}"):
            load_pretrained(tmp_path / name, _mesh())
        with monkeypatch.context() as m:
            def collective(*args, **kwargs):
                raise AssertionError("a collective ran before the refusal")

            for op in ("all_gather", "all_reduce", "broadcast", "broadcast_object_list", "barrier", "send", "recv"):
                m.setattr(dist, op, collective)
            with pytest.raises(NotImplementedError, match=rf"^context parallelism: {reason}"):
                parallelize_cp(model, _mesh(), linear_attention_cp_mode="p2p")
