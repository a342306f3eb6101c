"""LFM2 on one rank, in what its conformance tables (tests/conformance/tables.py: LFM2 and LFM2-MoE, every knob,
mode, layout and input at CP2 / CP4 against transformers) do not run: the inference cache its config turns on by
default is refused naming it; the Triton backend runs the gated short conv's exact eager conv (no activation: the
fused Triton conv computes SiLU) and says so; `suspend_cp` gives the conv transformers' forward back.
Mutation seen failing (the conformance table, CP2): the conv halo one token short (a zero in place of the farthest
halo token): `test_conformance_cp2[LFM2]`, CP against single device logits 2.0e-5 on the long row."""

import logging

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from deltacp import parallelize_cp, suspend_cp
from helpers import tiny_lfm2

pytestmark = pytest.mark.fast


def _mesh():
    return init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))


def test_lfm2_cache_triton_backend_and_suspend(single_rank_group, caplog):
    ids = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    base = tiny_lfm2(torch.float64)
    ref = base(input_ids=ids, use_cache=False).logits
    model = parallelize_cp(tiny_lfm2(torch.float64), _mesh(), linear_attention_cp_mode="p2p")
    assert model.config.use_cache  # transformers then builds a DynamicCache and hands it to every layer
    with pytest.raises(NotImplementedError, match=r"Lfm2ShortConv .*\['cache'\]"):
        model(input_ids=ids)
    with caplog.at_level(logging.INFO, logger="deltacp.families.lfm2"):
        fused = parallelize_cp(tiny_lfm2(torch.float64), _mesh(), linear_attention_cp_mode="p2p",
                               linear_attention_backend="triton")
    assert "eager conv (no activation) in every backend" in caplog.text
    for m in (model, fused):
        torch.testing.assert_close(m(input_ids=ids, use_cache=False).logits, ref, rtol=1e-12, atol=1e-12)
    with suspend_cp(model):
        assert "forward" not in model.model.layers[0].conv.__dict__
        torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=1e-12, atol=1e-12)  # its cache allowed
    assert "forward" in model.model.layers[0].conv.__dict__
