"""`load_pretrained` refuses, naming what is wrong, before any weight is read: a directory that is not a checkpoint
or misses files, a tensor the checkpoint lacks or stores with another shape, a class or setting it does not take.
Stored tensors the model does not use are left unread with a warning (the multi-token-prediction head silently,
as transformers ignores it)."""

import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh

from deltacp import load_pretrained
from helpers import tiny_config

pytestmark = pytest.mark.fast


def _mesh():
    return init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    transformers.Qwen3_5ForCausalLM(tiny_config()).to(torch.bfloat16).save_pretrained(path)
    return path


def _rewrite(path, change):
    state = load_file(path / "model.safetensors")
    change(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def test_directories_that_are_not_checkpoints(single_rank_group, tmp_path, checkpoint):
    with pytest.raises(FileNotFoundError, match="not a local checkpoint directory nor a downloaded Hugging Face repo"):
        load_pretrained(tmp_path / "missing", _mesh())
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        load_pretrained(tmp_path / "empty", _mesh())
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"names 1 file\(s\) that are not there, e.g. model-00002-of-00002"):
        load_pretrained(checkpoint, _mesh())


def test_tensors_the_checkpoint_lacks_or_stores_differently(single_rank_group, checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(dict(config, intermediate_size=96)))
    with pytest.raises(ValueError, match=r"does not fit Qwen3_5ForCausalLM .*model.layers.0.mlp.down_proj.weight is "
                                         r"stored with shape \(64, 128\), model.layers.0.mlp.down_proj.weight has "
                                         r"\(64, 96\)"):
        load_pretrained(checkpoint, _mesh())
    (checkpoint / "config.json").write_text(json.dumps(config))
    _rewrite(checkpoint, lambda state: state.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) of Qwen3_5ForCausalLM, e.g. model.norm.weight"):
        load_pretrained(checkpoint, _mesh())


def test_a_text_checkpoint_is_not_a_multimodal_model(single_rank_group, checkpoint):
    with pytest.raises(ValueError, match=r"lacks \d+ tensor\(s\) of Qwen3_5ForConditionalGeneration, e.g. "
                                         r"model.visual.*no vision tower: load its text model with "
                                         r"model_class=Qwen3_5ForCausalLM"):
        load_pretrained(checkpoint, _mesh(), model_class="Qwen3_5ForConditionalGeneration",
                        config=transformers.Qwen3_5Config(text_config=tiny_config().to_dict()))


def test_classes_and_settings_it_does_not_take(single_rank_group, checkpoint):
    with pytest.raises(NotImplementedError, match=r"model class LlamaForCausalLM is not supported; expected one of "
                                                  r"\[.*Qwen3NextForCausalLM"):
        load_pretrained(checkpoint, _mesh(), model_class="LlamaForCausalLM")
    with pytest.raises(ValueError, match=r"dtype='int8' is not supported; expected one of \['float32', 'bfloat16'"):
        load_pretrained(checkpoint, _mesh(), dtype="int8")
    with pytest.raises(TypeError, match=r"load_pretrained: unknown keyword 'linear_attention_mode'; the CP settings "
                                        r"are \['cp', 'ulysses_degree', 'linear_attention_cp_mode'"):
        load_pretrained(checkpoint, _mesh(), linear_attention_mode="p2p")
    with pytest.raises(ValueError, match=r"activation_checkpointing=-1: expected False, True"):
        load_pretrained(checkpoint, _mesh(), activation_checkpointing=-1)
    with pytest.raises(ValueError, match="mp_policy is FSDP2 mixed precision: it needs fsdp=True"):
        load_pretrained(checkpoint, _mesh(), fsdp=False, mp_policy=dict(param_dtype=torch.bfloat16))


def test_unused_stored_tensors_are_left_with_a_warning(single_rank_group, checkpoint, caplog):
    def add(state):
        state["mtp.fc.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)  # ignored as transformers does
        state["model.extra.weight"] = torch.zeros(2, dtype=torch.bfloat16)

    _rewrite(checkpoint, add)
    with caplog.at_level(logging.WARNING, logger="deltacp.checkpoint_io.pretrained"):
        model = load_pretrained(checkpoint, _mesh())
    assert model.dtype == torch.bfloat16  # the checkpoint's dtype by default
    warned = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert len(warned) == 1 and "1 stored tensor(s)" in warned[0] and "model.extra.weight" in warned[0], warned


def test_a_quantized_checkpoint_is_refused(single_rank_group, checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match=r"a quantized checkpoint \(quantization_config: fp8\)"):
        load_pretrained(checkpoint, _mesh(), config=transformers.Qwen3_5TextConfig(**tiny_config().to_dict()))
