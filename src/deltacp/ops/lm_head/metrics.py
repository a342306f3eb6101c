"""Token statistics of an output head, for logging, without [tokens, vocab] logits: at every valid target, the entropy
of softmax(logits) and whether the target is the top-1 logit (what TRL's SFTTrainer logs from its fused head as
`entropy` and `mean_token_accuracy`). One pass over token chunks of logits (`chunks.chunk_loop`), no gradient: one
head-sized matmul per token beside the loss's own.
"""

from __future__ import annotations

import torch

from deltacp.ops.lm_head.chunks import chunk_loop, chunk_sizes
from deltacp.ops.lm_head.kernels import IGNORE_INDEX


def head_token_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                     chunk_size: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """[entropy sum, top-1 count, valid count] over the tokens whose target is not IGNORE_INDEX, in the accumulation
    dtype (float32; float64 stays float64). hidden [tokens, H], weight [V, H] (plain tensors), targets [tokens]; the
    logits in the input dtype as nn.Linear, reduced in the accumulation dtype (a tie for the top logit counts the
    first one, as argmax); softcap: the logits are cap * tanh(logits / cap), or None."""
    tokens, width = hidden.shape
    acc = torch.promote_types(hidden.dtype, torch.float32)
    chunk_size, _ = chunk_sizes(tokens, width, weight.shape[0], hidden.dtype, chunk_size)
    valid = targets != IGNORE_INDEX
    stats = torch.zeros(3, dtype=acc, device=hidden.device)

    def rows_fn(logits, rows, compute_grad):
        keep = valid[rows]
        z = logits[keep].to(acc)
        if softcap is not None:
            z = torch.tanh(z / softcap) * softcap
        lse = torch.logsumexp(z, dim=-1)
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
        top1 = z.argmax(-1) == targets[rows][keep]
        stats.add_(torch.stack([entropy.sum(), top1.sum().to(acc), keep.sum().to(acc)]))

    with torch.no_grad():
        chunk_loop(hidden.detach(), weight.detach(), None if bias is None else bias.detach(), rows_fn,
                   chunk_size=chunk_size)
    return stats
