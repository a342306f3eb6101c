"""MiniMax-Text-01 on one rank, in what its conformance table (tests/conformance/tables.py: every knob, mode, layout
and input at CP2 / CP4 against transformers) does not run: the inference cache its config turns on by default is
refused naming it, and the Triton backend runs the scalar-decay kernels (`ops/ssd/triton`: no value scale, no skip,
one q/k head per head, head dim 128 in the released model) or refuses, never falls back to eager.
Mutation seen failing (the conformance table, CP2): the view reading the slope of layer l + 1 (single device against
transformers: logits 6.6e-2 on the packed row)."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from deltacp import parallelize_cp
from helpers import tiny_minimax

pytestmark = pytest.mark.fast


def _mesh():
    return init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))


def test_the_default_cache_is_refused_naming_it(single_rank_group):
    model = parallelize_cp(tiny_minimax(torch.float32), _mesh(), linear_attention_cp_mode="p2p")
    ids = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    assert model.config.use_cache  # transformers then builds a MiniMaxCache and hands it to every layer
    with pytest.raises(NotImplementedError, match=r"MiniMaxLightningAttention .*\['cache', 'use_cache'\].*use_cache="
                                                  r"False"):
        model(input_ids=ids)
    assert torch.isfinite(model(input_ids=ids, use_cache=False).logits).all()


def test_triton_backend_takes_the_scalar_decay_kernels_or_refuses(single_rank_group):
    from deltacp.ops.gdn.backends import get_gdn_backend
    from deltacp.ops.ssd.triton import TritonScalarDecay
    from deltacp.parallel.views import mixer_view_of

    model = tiny_minimax(torch.float32)
    view = mixer_view_of(model.model.layers[0].self_attn)
    assert view.conv is None and isinstance(view.recurrence(get_gdn_backend("triton")), TritonScalarDecay)
    parallelize_cp(model, _mesh(), linear_attention_cp_mode="p2p", linear_attention_backend="triton")
    with pytest.raises(ValueError, match="the Triton scalar-decay recurrence needs CUDA tensors"):
        model(input_ids=torch.randint(3, 256, (1, 16)), use_cache=False)
