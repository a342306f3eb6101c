"""Gate initialisation that makes state hand-over between ranks observable."""

from __future__ import annotations

import torch


def long_memory_gates_(model: torch.nn.Module) -> torch.nn.Module:
    """Give every linear-recurrent layer slowly decaying heads (per-token decay exp(g) from about 0.6 to 0.998).

    transformers' default init draws A from [0.01, 16], which forgets the state within a few tokens: a
    broken hand-over of the state between ranks would then go unnoticed. With these gates the state of
    one rank still matters hundreds of tokens into the next.
    """
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):  # a linear mixer of any family (GDN, Mamba2, KDA)
                module.A_log.copy_(torch.empty(module.A_log.shape, device="cpu").uniform_(-5, -1, generator=gen))
                module.dt_bias.copy_(torch.empty(module.dt_bias.shape, device="cpu").uniform_(-1, 1, generator=gen))
            elif hasattr(module, "A_log") and hasattr(module, "dt_proj"):  # Mamba1: dt's bias is dt_proj's
                module.A_log.copy_(torch.empty(module.A_log.shape, device="cpu").uniform_(-5, -1, generator=gen))
                module.dt_proj.bias.copy_(
                    torch.empty(module.dt_proj.bias.shape, device="cpu").uniform_(-1, 1, generator=gen))
            elif hasattr(module, "A_log") and hasattr(module, "dt_proj_bias"):  # Zamba's Mamba1 heads
                module.A_log.copy_(torch.empty(module.A_log.shape, device="cpu").uniform_(-5, -1, generator=gen))
                module.dt_proj_bias.copy_(
                    torch.empty(module.dt_proj_bias.shape, device="cpu").uniform_(-1, 1, generator=gen))
    return model
