"""unsharded_parameters (GRPO's generation on the model outside CP) holds FSDP2's parameters unsharded inside and,
on exit, sets back the reshard_after_forward that fully_shard_cp was given (not always True); and the auto
checkpointing budget of ranks that share one GPU is shared among them."""

import pytest
import torch
from torch.distributed.tensor import DTensor

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("reshard", [True, False])
def test_unsharded_parameters_restores_reshard_after_forward(single_rank_group, reshard):
    from torch.distributed.device_mesh import init_device_mesh

    from transformers import Qwen3_5ForCausalLM

    from deltacp import fully_shard_cp, parallelize_cp, unsharded_parameters
    from helpers import tiny_config

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    model = fully_shard_cp(parallelize_cp(Qwen3_5ForCausalLM(tiny_config()), mesh), mesh,
                           reshard_after_forward=reshard)
    layer = model.model.layers[0]
    ids = torch.randint(0, 64, (1, 8))
    with unsharded_parameters(model):
        model(input_ids=ids, use_cache=False)
        assert not isinstance(next(layer.parameters()), DTensor)  # held unsharded through the forward
    assert isinstance(next(layer.parameters()), DTensor)  # resharded on exit
    model(input_ids=ids, use_cache=False)
    # after a forward outside: resharded again only if fully_shard_cp was told so
    assert isinstance(next(layer.parameters()), DTensor) == reshard


def test_the_fraction_budget_is_shared_by_the_ranks_on_one_gpu(monkeypatch):
    from deltacp.train.config import TrainConfig
    from deltacp.train.trainer import checkpointing_budget

    class Props:
        total_memory = 100 * 2 ** 30

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    cfg = TrainConfig(activation_checkpointing="auto", activation_checkpointing_budget_fraction=0.5)
    cuda = torch.device("cuda", 0)
    for local_world, share in ((1, 1), (2, 1), (4, 2), (5, 3)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
        assert checkpointing_budget(cfg, cuda) == int(50 * 2 ** 30 / share), local_world
