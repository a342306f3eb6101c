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


def apply_activation_checkpointing(model: nn.Module, every_n_layers: int = 1) -> int:
    """Activation checkpointing of every `every_n_layers`-th decoder layer (1: all) of any supported model;
    returns the number of layers checkpointed."""
    if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 1:
        raise ValueError(f"every_n_layers={every_n_layers!r} must be an integer >= 1")
    layers = adapter_for(model).layers()
    for layer in layers[::every_n_layers]:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    n = len(layers[::every_n_layers])
    logger.info("Applied activation checkpointing to %d of %d decoder layers", n, len(layers))
    return n
