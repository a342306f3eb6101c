"""Rotary frequencies under CP (`models/rotary.py`): which modules get the batch's largest position, and the refusal
of a position-dependent rope type deltacp cannot reproduce. The exactness itself is the conformance tables' rope rows
(tests/conformance)."""

import pytest
import torch
from torch import nn

from deltacp.models.rotary import check_rotary, install_global_rotary, position_dependent_types

pytestmark = pytest.mark.fast


class HandMadeDynamic(nn.Module):
    """A rotary that rescales from its call's positions by its own code, not transformers' decorator."""

    rope_type = "dynamic"

    def forward(self, x, position_ids):
        return x


def test_position_dependent_types_and_the_refusal():
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    def rotary(**params):
        config = Qwen3_5TextConfig(head_dim=16, max_position_embeddings=48,
                                   rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5, **params})
        return Qwen3_5TextRotaryEmbedding(config)

    assert position_dependent_types(rotary(rope_type="default")) == []
    assert position_dependent_types(rotary(rope_type="dynamic", factor=2.0)) == ["dynamic"]
    text = nn.ModuleDict({"rotary_emb": rotary(rope_type="dynamic", factor=2.0)})
    check_rotary(text)  # transformers' decorated forward: made exact, not refused
    assert install_global_rotary(text, None, lambda: True) == ["rotary_emb"]
    x, positions = torch.zeros(1, 4, 16), torch.arange(4)[None]
    torch.testing.assert_close(text["rotary_emb"](x, positions), type(text["rotary_emb"]).forward(
        text["rotary_emb"], x, positions))  # suspended: transformers' own forward, nothing exchanged
    with pytest.raises(ValueError, match=r"own \(HandMadeDynamic, rope_type \['dynamic'\]\).*not through "
                                         r"transformers' dynamic_rope_update"):
        check_rotary(nn.ModuleDict({"own": HandMadeDynamic()}))
