"""The MoE router's auxiliary load-balancing loss under CP: the single-device value from global statistics.

transformers' `load_balancing_loss_func` (Switch Transformer, eqs. 4-6), over the router logits of every layer
and every (unmasked) token:

    aux = E * sum_e f_e P_e        f_e = (top-k assignments to e) / N,  P_e = (sum of routing probs of e) / N

with N the number of (valid) token-layer rows. Under CP each rank holds its tokens' logits only, so transformers'
own value on a rank is that slice's. `cp_load_balancing_loss` all-reduces the per-expert counts, probability
sums and row count over the batch group (the CP group, or dp x cp) in one collective, and builds P_e as
`local + (global - local).detach()`: the value is the global one on every rank, the gradient is this rank's
share, so gradients summed over ranks (FSDP2, `all_reduce_cp_grads`) are the single-device gradients, as for
`cp_global_mean`. The counts carry no gradient (top-k), as in transformers.

A CP'd causal LM or conditional-generation model whose forward returns `aux_loss` (output_router_logits=True,
or the config's default) gets it replaced by this global value (a forward hook); `router_logits` stay the
rank's slice. `cp_causal_lm_loss` adds `router_aux_loss_coef * aux_loss`, as transformers adds it to its loss.
Accumulation: float32 (float64 for float64 logits); transformers accumulates in float32 even then.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def cp_load_balancing_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                           attention_mask: torch.Tensor | None, group) -> torch.Tensor:
    """Global auxiliary loss from this rank's router logits (a tuple of [B * s, E] per MoE layer) and its local
    padding mask [B, s] (or None). Collective over `group`; every rank must call it."""
    if not isinstance(router_logits, (tuple, list)) or not router_logits:
        raise ValueError("cp_load_balancing_loss: router_logits must be a non-empty tuple of [tokens, experts] "
                         "tensors, one per MoE layer")
    acc = torch.promote_types(router_logits[0].dtype, torch.float32)
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=acc, device=device)
    probs = torch.zeros(num_experts, dtype=acc, device=device)
    rows = torch.zeros((), dtype=acc, device=device)
    weight = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=acc)
    for logits in router_logits:
        routing = torch.softmax(logits.to(device), dim=-1)
        _, chosen = torch.topk(routing, top_k, dim=-1)
        w = torch.ones(chosen.shape[0], dtype=acc, device=device) if weight is None else weight
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        probs = probs + (routing.to(acc) * w[:, None]).sum(dim=0)
        rows = rows + w.sum()
    stats = torch.cat([counts, probs.detach(), rows[None]])
    dist.all_reduce(stats, group=group)
    global_counts, global_probs, global_rows = stats[:num_experts], stats[num_experts:-1], stats[-1].clamp(min=1)
    probs = probs + (global_probs - probs.detach())  # global value, this rank's gradient
    return num_experts * torch.sum((global_counts / global_rows) * (probs / global_rows))


def make_aux_loss_hook(num_experts: int, top_k: int, group):
    """Forward hook (with kwargs) on a CP'd causal LM: its `aux_loss`, when returned, becomes the global value."""

    def hook(module, args, kwargs, output):
        if getattr(output, "aux_loss", None) is None:
            return output
        if getattr(output, "router_logits", None) is None:
            raise ValueError("aux_loss under CP needs the router logits (output_router_logits=True)")
        mask = kwargs.get("attention_mask")
        output.aux_loss = cp_load_balancing_loss(output.router_logits, num_experts, top_k,
                                                 None if isinstance(mask, dict) else mask, group)
        return output

    return hook
