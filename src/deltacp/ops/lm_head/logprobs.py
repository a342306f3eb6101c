"""Per-token log-probabilities (and entropy) of an output head under a temperature, never [tokens, vocab] logits:
the log-probabilities of reinforcement learning (policy, old policy, reference model), whose gradient is not the
last op of a step (advantages, ratios, KL terms come after), so backward takes ANY per-token upstream gradients
and recomputes the logits chunk by chunk (`chunks.chunk_loop`). The model-facing call under CP is
`deltacp.losses.cp_token_logprobs`.

    logp = linear_token_logprobs(hidden, weight, target_ids, temperature=0.7)                  # [...], float32
    logp, entropy = linear_token_logprobs(hidden, weight, target_ids, return_entropy=True)

With s = (hidden @ weight.T + bias) / T (the logits in the input dtype as nn.Linear, divided in float32) and
p = softmax(s): logp = s[target] - logsumexp(s) (0 where the target is IGNORE_INDEX), entropy = sum_j p_j
(logsumexp(s) - s_j) at every token (an ignored target's row has a well-defined entropy, as TRL computes it
before masking: mask it yourself, as TRL's `entropy` metric and `top_entropy_quantile` do with the completion
mask). Backward, for upstream gradients g_lp and g_ent [tokens]: dz_j = (g_lp (onehot_j - p_j) - g_ent p_j
(log p_j + entropy)) / T over recomputed logits, then d hidden = dz W, d weight and d bias as the cross entropy's.
"""

from __future__ import annotations

import torch

from deltacp.ops.lm_head.checks import check_chunk, check_head, check_temperature, check_weight_grad
from deltacp.ops.lm_head.chunks import chunk_loop, chunk_sizes, wants_grad
from deltacp.ops.lm_head.kernels import check_kernels, lp_kernels


def token_logprobs_fwd(hidden, weight, bias, targets, temperature, with_entropy, chunk_size, kernels):
    """(logp [tokens], entropy [tokens] or None, lse [tokens]) in the accumulation dtype: one pass over token
    chunks of logits, nothing written over them, no gradient buffer."""
    tokens = hidden.shape[0]
    acc = torch.promote_types(hidden.dtype, torch.float32)
    lse = torch.empty(tokens, dtype=acc, device=hidden.device)
    logp = torch.empty(tokens, dtype=acc, device=hidden.device)
    ent = torch.empty(tokens, dtype=acc, device=hidden.device) if with_entropy else None
    rows_kernel = kernels[0]

    def rows_fn(logits, rows, compute_grad):
        rows_kernel(logits, targets[rows], lse[rows], logp[rows], None if ent is None else ent[rows], temperature)

    chunk_loop(hidden, weight, bias, rows_fn, chunk_size=chunk_size)
    return logp, ent, lse


def token_logprobs_bwd(hidden, weight, bias, targets, lse, ent, g_lp, g_ent, temperature, chunk_size,
                       vocab_chunk_size, weight_grad, *, need_hidden, need_weight, need_bias, kernels):
    """(d hidden, d weight, d bias) of sum(g_lp logp + g_ent entropy) (a None upstream gradient counts 0), each
    rounded once to its input's dtype: the logits recomputed chunk by chunk, the gradient kernel over them."""
    grad_kernel = kernels[1]

    def rows_fn(logits, rows, compute_grad):
        if compute_grad:
            grad_kernel(logits, targets[rows], lse[rows], None if ent is None else ent[rows],
                        None if g_lp is None else g_lp[rows], None if g_ent is None else g_ent[rows], temperature, 0)

    def cols_fn(logits, col0):
        grad_kernel(logits, targets, lse, ent, g_lp, g_ent, temperature, col0)

    return chunk_loop(hidden, weight, bias, rows_fn, chunk_size=chunk_size, need_hidden=need_hidden,
                      need_weight=need_weight, need_bias=need_bias, weight_grad=weight_grad, cols_fn=cols_fn,
                      vocab_chunk_size=vocab_chunk_size, rows_only_for_grad=True)


class _LinearTokenLogprobs(torch.autograd.Function):
    """(logp, entropy) or logp of `token_logprobs_fwd`; saves hidden, weight, bias (references), the targets and
    the per-token lse and entropy ([tokens] each); backward is `token_logprobs_bwd` for the incoming per-token
    gradients (None for an unused output). Backward may run more than once (retain_graph: it recomputes), but not
    with create_graph=True (double backward raises)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, return_entropy, chunk_size, vocab_chunk_size,
                weight_grad, impl, softcap):
        kernels = lp_kernels(hidden.device, hidden.dtype, impl, softcap)
        logp, ent, lse = token_logprobs_fwd(hidden, weight, bias, targets, temperature, return_entropy, chunk_size,
                                            kernels)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.settings = (temperature, chunk_size, vocab_chunk_size, weight_grad, kernels)
        ctx.set_materialize_grads(False)
        return (logp, ent) if return_entropy else logp

    @staticmethod
    def backward(ctx, g_lp, g_ent=None):
        if torch.is_grad_enabled():
            raise RuntimeError("linear_token_logprobs / cp_token_logprobs: backward with create_graph=True (double "
                               "backward) is not supported; compute log_softmax of full logits for that")
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (g_lp is None and g_ent is None) or not (need_h or need_w or need_b):
            return (None,) * 11
        temperature, chunk_size, vocab_chunk_size, weight_grad, kernels = ctx.settings
        flat = [None if g is None else g.reshape(-1).to(lse.dtype).contiguous() for g in (g_lp, g_ent)]
        grads = token_logprobs_bwd(hidden, weight, bias, targets, lse, ent, *flat, temperature, chunk_size,
                                   vocab_chunk_size, weight_grad, need_hidden=need_h, need_weight=need_w,
                                   need_bias=need_b, kernels=kernels)
        return (*grads, None, None, None, None, None, None, None, None)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                   temperature: float = 1.0, return_entropy: bool = False, chunk_size: int | None = None, *,
                   vocab_chunk_size: int | None = None, weight_grad: str = "two_pass", impl: str = "auto",
                   softcap: float | None = None):
    """`linear_token_logprobs` on hidden [tokens, H] and targets [tokens], no checks (callers check); `impl`: the
    kernels (`kernels.KERNELS`: "auto", Triton for CUDA bf16 / fp16 / fp32; "torch"; "triton"); softcap: the
    logits' (`kernels.soft_capped`), or None."""
    chunk_size, vocab_chunk_size = chunk_sizes(hidden.shape[0], hidden.shape[1], weight.shape[0], hidden.dtype,
                                               chunk_size, vocab_chunk_size, weight_grad)
    if not wants_grad(hidden, weight, bias):
        with torch.no_grad():
            logp, ent, _ = token_logprobs_fwd(hidden, weight, bias, targets, temperature, return_entropy,
                                              chunk_size, lp_kernels(hidden.device, hidden.dtype, impl, softcap))
        return (logp, ent) if return_entropy else logp
    return _LinearTokenLogprobs.apply(hidden, weight, bias, targets, temperature, bool(return_entropy), chunk_size,
                                      vocab_chunk_size, weight_grad, impl, softcap)


def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor, *,
                          bias: torch.Tensor | None = None, temperature: float = 1.0, return_entropy: bool = False,
                          chunk_size: int | None = None, vocab_chunk_size: int | None = None,
                          weight_grad: str = "two_pass", kernels: str = "auto", softcap: float | None = None):
    """Per-token log-probabilities of `target_ids` under softmax((hidden @ weight.T + bias) / temperature), without
    [tokens, vocab] logits; with return_entropy, (logp, entropy) of the same tempered distribution.

    hidden [..., H]; weight [V, H] (a plain tensor: under FSDP2 use `cp_token_logprobs(model, ...)`, which runs
    inside the root module's forward where the head's weight is unsharded); target_ids [...] (hidden's leading
    shape; IGNORE_INDEX = -100 rows get logp 0, their entropy is computed all the same); bias [V] or None;
    temperature a finite number > 0 (TRL's `temperature`: logits / T). Outputs target_ids' shape in float32
    (float64 for float64 inputs); logits are computed in the input dtype as nn.Linear, `chunk_size` tokens at a
    time (None: `chunks.chunk_sizes` for the weight_grad), divided by T and reduced in float32.

    Backward takes any upstream gradients of logp and entropy (advantage-weighted ratios, KL terms, entropy
    bonuses) and recomputes the logits chunk by chunk. The weight's gradient, by `weight_grad`:
      "two_pass" (default): rounded once, from a pass over `vocab_chunk_size` vocabulary rows of every token (as
        nn.Linear's backward): 5 head-sized matmuls in all (forward 1, backward 4);
      "accumulate": summed in place over the token chunks in the weight's dtype: 4 matmuls, but the running
        sum's roundings grow with the chunk count. Under random-sign per-token weights (GRPO's advantages) its
        bf16 error is 2.4x two_pass's at 16 chunks and 4.5x at 64 (NOTES.md, the log-probability op), where the
        cross entropy's one-signed gradient barely notices; TRL's fused head keeps an fp32 [vocab, hidden]
        accumulator for the same reason.
    Saved for backward: references to the inputs plus 4 bytes a token (8 with entropy; float64 twice that).

    kernels: the kernels over each logits chunk (`ops/lm_head/kernels.py`, one contract): "auto" (default) Triton
    for CUDA bf16 / fp16 / fp32 inputs, PyTorch otherwise; "torch" PyTorch on any device and dtype; "triton" the
    Triton kernels (CUDA, or any device under TRITON_INTERPRET=1; not float64). `cp_token_logprobs` passes the
    model's GDN backend's choice (eager: "torch", triton: "triton").

    softcap: the logits are cap * tanh(logits / cap) before the temperature (transformers' RecurrentGemma), formed in
    float32 (float64 stays float64) by the PyTorch kernels (the Triton ones refuse it); None: none.
    """
    fn = "linear_token_logprobs"
    check_head(fn, hidden, weight, bias, target_ids, ("hidden", "weight", "bias", "target_ids"),
               "cp_token_logprobs(model, target_ids, cp_mesh, **inputs)")
    if tuple(target_ids.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{fn}: target_ids must have hidden's leading shape {tuple(hidden.shape[:-1])}, got "
                         f"{tuple(target_ids.shape)}")
    check_temperature(fn, temperature)
    check_chunk(fn, "chunk_size", chunk_size)
    check_chunk(fn, "vocab_chunk_size", vocab_chunk_size)
    check_weight_grad(fn, weight_grad)
    check_kernels(fn, kernels, hidden.dtype)
    out = token_logprobs(hidden.flatten(0, -2) if hidden.ndim > 1 else hidden[None], weight, bias,
                         target_ids.reshape(-1).to(hidden.device), temperature, return_entropy, chunk_size,
                         vocab_chunk_size=vocab_chunk_size, weight_grad=weight_grad, impl=kernels, softcap=softcap)
    if return_entropy:
        return tuple(x.view(target_ids.shape) for x in out)
    return out.view(target_ids.shape)
