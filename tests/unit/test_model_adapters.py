"""Model adapters on one rank: every supported class is recognised, unsupported classes and settings raise naming
them, and a parallelized model keeps transformers' own state_dict keys and save_pretrained."""

import copy

import pytest
import torch
import transformers
from torch.distributed.device_mesh import init_device_mesh

from deltacp import parallelize_cp, parallelize_qwen3_5_cp, supported_classes
from deltacp.models.adapters import adapter_for
from helpers import FAMILY_CLASSES, image_batch, tiny_family_model

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
