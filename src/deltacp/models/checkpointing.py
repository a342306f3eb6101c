"""Activation checkpointing of a CP'd model: each decoder layer recomputed in backward (non-reentrant).

Applied after CP and before FSDP2 (inside the FSDP unit's forward, so FSDP's unshard hooks run once). The
recompute of a p2p GDN layer replays the entering state its forward received, found in that forward's
`CPForwardContext` (the attention_mask argument the checkpoint keeps), instead of posting another receive.
"""

from __future__ import annotations

import functools
import logging

from torch import nn
from torch.utils.checkpoint import checkpoint

from deltacp.models.adapters import adapter_for

logger = logging.getLogger(__name__)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Full activation checkpointing per decoder layer of any supported model; returns the number of layers."""
    n = 0
    for layer in adapter_for(model).layers():
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
        n += 1
    logger.info("Applied full activation checkpointing to %d decoder layers", n)
    return n
