"""The kernels over a chunk of logits of the output-head ops, each in two implementations of one contract: PyTorch
(CPU, float64, any device: the readable reference) and Triton (`ops/fused/linear_ce.py`,
`ops/fused/token_logprobs.py`: CUDA bf16 / fp16 / fp32, imported only on that path). Each reads the logits in their
own dtype and computes in the accumulation dtype (float32; float64 stays float64); a kernel that writes a
gradient writes it over the logits in their dtype, rounded once.

Cross entropy (gradients in the forward):
  ce_rows(logits [n, vocab], targets [n], loss_rows [n], lse [n], scale, *, compute_grad)  (pass 1)
    loss_rows[i] = lse_i - logits[i, t_i] and lse[i] = lse_i (0 on ignored rows) and, with compute_grad, the
    logits overwritten by (softmax - onehot) * scale (0 on ignored rows): scale x d sum(loss_rows) / d logits.
  ce_grad_cols(logits [T, width], targets [T], lse [T], scale, col0)  (pass 2)
    logits holding the columns [col0, col0 + width) overwritten by (exp(logits - lse) - onehot) * scale, 0 on
    ignored rows: the same gradient, for those columns, from pass 1's lse.

Token log-probabilities under temperature T (s = logits / T, p = softmax(s)):
  lp_rows(logits [n, vocab], targets [n], lse [n], logp [n], ent [n] | None, temperature)  (forward)
    lse[i] = logsumexp(s_i), logp[i] = s[i, t_i] - lse_i (0 on ignored rows), ent[i] = sum_j p_ij (lse_i - s_ij)
    (on every row: an ignored target has a well-defined entropy); the logits are not written.
  lp_grad(logits [n, width], targets [n], lse [n], ent [n] | None, g_lp [n] | None, g_ent [n] | None,
          temperature, col0)  (backward, token chunks with col0 = 0 and vocabulary chunks alike)
    logits holding the columns [col0, col0 + width) overwritten by dz = (g_lp (onehot - p) - g_ent p (log p + ent))
    / T: the gradient of sum(g_lp logp + g_ent ent) (g_lp counts 0 on ignored rows; a None term is absent).
"""

from __future__ import annotations

import torch

from deltacp.ops.fused import check_device

IGNORE_INDEX = -100
"""Targets with this value are not trained on (transformers' convention): padding, each document's last token."""

KERNELS = ("auto", "torch", "triton")
"""The kernel choices: "torch" (any device, float64), "triton" (CUDA bf16 / fp16 / fp32, or any device under
TRITON_INTERPRET=1), "auto" (Triton for CUDA bf16 / fp16 / fp32 logits, torch otherwise)."""


# ---- PyTorch ----------------------------------------------------------------------------------------------------

def ce_rows_torch_(logits: torch.Tensor, targets: torch.Tensor, loss_rows: torch.Tensor, lse: torch.Tensor,
                   scale: torch.Tensor, *, compute_grad: bool) -> None:
    """Cross entropy pass 1: the logits upcast to loss_rows' dtype, then written back."""
    x = logits.to(loss_rows.dtype)  # the logits themselves for float32 / float64 (the gradient then in place)
    valid = targets != IGNORE_INDEX
    row_lse = torch.logsumexp(x, dim=-1)
    safe_t = targets.clamp(min=0)[:, None]
    target_logit = x.gather(1, safe_t).squeeze(1)
    loss_rows.copy_(torch.where(valid, row_lse - target_logit, 0))
    lse.copy_(torch.where(valid, row_lse, 0))
    if compute_grad:
        grad = x.sub_(row_lse[:, None]).exp_()
        grad.scatter_add_(1, safe_t, torch.full_like(row_lse[:, None], -1.0))
        grad.mul_(scale).masked_fill_(~valid[:, None], 0)
        if grad is not logits:
            logits.copy_(grad)


def ce_grad_cols_torch_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                        col0: int) -> None:
    """Cross entropy pass 2: the logits upcast to lse's dtype, then written back."""
    grad = logits.to(lse.dtype).sub_(lse[:, None]).exp_()  # ignored rows (lse 0) are overwritten below
    valid = targets != IGNORE_INDEX
    col = targets - col0
    hit = valid & (col >= 0) & (col < logits.shape[1])
    grad.scatter_add_(1, torch.where(hit, col, 0)[:, None], -hit.to(grad.dtype)[:, None])
    grad.mul_(scale).masked_fill_(~valid[:, None], 0)
    if grad is not logits:
        logits.copy_(grad)


def lp_rows_torch_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, logp: torch.Tensor,
                   ent: torch.Tensor | None, temperature: float) -> None:
    """Log-probabilities forward: s = logits / T in lse's dtype (a new tensor: the logits stay)."""
    s = logits.to(lse.dtype) / temperature
    row_lse = torch.logsumexp(s, dim=-1)
    valid = targets != IGNORE_INDEX
    target_s = s.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    logp.copy_(torch.where(valid, target_s - row_lse, 0))
    lse.copy_(row_lse)
    if ent is not None:
        log_p = s.sub_(row_lse[:, None])
        ent.copy_(-(log_p.exp() * log_p).sum(-1))


def lp_grad_torch_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
                   g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, temperature: float, col0: int) -> None:
    """Log-probabilities backward: dz over the columns [col0, col0 + width) in lse's dtype, written back."""
    log_p = (logits.to(lse.dtype) / temperature).sub_(lse[:, None])
    p = log_p.exp()
    grad = torch.zeros_like(p)
    if g_ent is not None:
        grad -= g_ent[:, None] * p * log_p.add_(ent[:, None])
    if g_lp is not None:
        valid = targets != IGNORE_INDEX
        g = torch.where(valid, g_lp, 0)
        grad -= g[:, None] * p
        col = targets - col0
        hit = valid & (col >= 0) & (col < logits.shape[1])
        grad.scatter_add_(1, torch.where(hit, col, 0)[:, None], torch.where(hit, g, 0)[:, None])
    logits.copy_(grad.div_(temperature))


# ---- Triton (lazy) ------------------------------------------------------------------------------------------------

def ce_rows_triton_(logits, targets, loss_rows, lse, scale, *, compute_grad):
    check_device("logits", logits, "kernels='triton'")  # the Triton paths' device rule (a chunk's first kernel)
    from deltacp.ops.fused.linear_ce import ce_rows_  # imports triton: only on this path

    ce_rows_(logits, targets, loss_rows, lse, scale, ignore_index=IGNORE_INDEX, compute_grad=compute_grad)


def ce_grad_cols_triton_(logits, targets, lse, scale, col0):
    from deltacp.ops.fused.linear_ce import ce_grad_cols_

    ce_grad_cols_(logits, targets, lse, scale, col0, ignore_index=IGNORE_INDEX)


def lp_rows_triton_(logits, targets, lse, logp, ent, temperature):
    check_device("logits", logits, "kernels='triton'")
    from deltacp.ops.fused.token_logprobs import lp_rows_

    lp_rows_(logits, targets, lse, logp, ent, temperature, ignore_index=IGNORE_INDEX)


def lp_grad_triton_(logits, targets, lse, ent, g_lp, g_ent, temperature, col0):
    from deltacp.ops.fused.token_logprobs import lp_grad_

    lp_grad_(logits, targets, lse, ent, g_lp, g_ent, temperature, col0, ignore_index=IGNORE_INDEX)


def check_kernels(what: str, impl, dtype: torch.dtype) -> None:
    """`impl` is one of KERNELS and fits logits of `dtype` (the Triton kernels take no float64); else ValueError
    naming `what` (the caller: the public functions pass their name)."""
    if impl not in KERNELS:
        raise ValueError(f"{what}: kernels={impl!r} is not supported; expected one of {KERNELS}")
    if impl == "triton" and dtype == torch.float64:
        raise ValueError(f"{what}: kernels='triton' takes bf16 / fp16 / fp32 logits, not float64 (kernels='torch' "
                         f"does)")


def select_impl(what: str, device: torch.device, dtype: torch.dtype, impl: str = "auto") -> str:
    """The kernels to run, "torch" or "triton" (`impl` checked by `check_kernels`): "auto" is "triton" for CUDA
    bf16 / fp16 / fp32 logits, "torch" otherwise; "torch" / "triton" force one (the model-facing losses pass
    their model's GDN backend's choice, `models/loss.head_kernels_of`; tests force "triton" on CPU tensors under
    TRITON_INTERPRET=1)."""
    check_kernels(what, impl, dtype)
    if impl == "auto":
        return "triton" if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16, torch.float32) \
            else "torch"
    return impl


def soft_capped(kernel, cap: float, writes_grad):
    """`kernel` over the soft-capped logits cap * tanh(logits / cap) (transformers' RecurrentGemma caps its logits
    so), formed in the accumulation dtype; where the kernel writes a gradient (`writes_grad(keywords)`), it is the
    gradient with respect to the capped logits, times the cap's derivative 1 - tanh^2, written over the logits."""

    def run(logits, *args, **kwargs):
        t = torch.tanh(logits.to(torch.promote_types(logits.dtype, torch.float32)) / cap)
        capped = t * cap
        kernel(capped, *args, **kwargs)
        if writes_grad(kwargs):
            logits.copy_(capped.mul_(1 - t * t))

    return run


def _no_triton_cap(what: str, softcap) -> None:
    if softcap is not None:
        raise NotImplementedError(f"{what}: the Triton head kernels compute no logit soft-cap (softcap={softcap}); "
                                  f"use kernels='torch'")


def ce_kernels(device: torch.device, dtype: torch.dtype, impl: str = "auto", softcap: float | None = None):
    """(pass 1, pass 2) kernels of the linear cross entropy (`select_impl`); softcap: of the logits
    (`soft_capped`, PyTorch kernels only)."""
    if select_impl("linear cross entropy", device, dtype, impl) == "triton":
        _no_triton_cap("linear cross entropy", softcap)
        return ce_rows_triton_, ce_grad_cols_triton_
    if softcap is None:
        return ce_rows_torch_, ce_grad_cols_torch_
    return (soft_capped(ce_rows_torch_, softcap, lambda kw: kw["compute_grad"]),
            soft_capped(ce_grad_cols_torch_, softcap, lambda kw: True))


def lp_kernels(device: torch.device, dtype: torch.dtype, impl: str = "auto", softcap: float | None = None):
    """(forward, backward) kernels of the token log-probabilities (`select_impl`); softcap: of the logits
    (`soft_capped`, PyTorch kernels only)."""
    if select_impl("token log-probabilities", device, dtype, impl) == "triton":
        _no_triton_cap("token log-probabilities", softcap)
        return lp_rows_triton_, lp_grad_triton_
    if softcap is None:
        return lp_rows_torch_, lp_grad_torch_
    return (soft_capped(lp_rows_torch_, softcap, lambda kw: False),
            soft_capped(lp_grad_torch_, softcap, lambda kw: True))
