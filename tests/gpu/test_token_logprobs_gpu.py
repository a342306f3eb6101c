"""The token log-probabilities (`linear_token_logprobs`: Triton kernels, weight_grad "two_pass" and "accumulate") on
CUDA at Qwen3.5's vocabulary: bf16 inputs vs an fp32 full-logits reference on the same bf16 values.

vocab 248,320, hidden 2048, 4K tokens (every 13th target ignored), temperature 0.7, random-sign per-token weights
on the log-probabilities (GRPO's advantages over the count) and small ones on the entropy: logp and entropy
(rel-L2 < 1e-3), dh and dW (< 1e-2); the Triton kernels against the PyTorch ones on the same GPU; peak memory
above the inputs = the weight's and hidden states' gradients + one logits buffer + small (never [tokens, vocab]);
torch.no_grad gives the same values without gradient buffers; cuBLAS's global reduced-precision setting restored.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import cuda_head_problem, rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the Triton log-probability kernels at vocab 248,320)")

V, H, N, T = 248_320, 2048, 4096, 0.7


@pytest.fixture(scope="module")
def problem():
    h, w, t, g = cuda_head_problem(N, H, V)
    gw = (torch.randint(0, 2, (N,), device="cuda", generator=g).float() * 2 - 1) / N
    gu = 0.01 * torch.randn(N, device="cuda", generator=g) / N
    hr, wr = h.float().requires_grad_(), w.float().requires_grad_()
    log_p = F.log_softmax(hr @ wr.T / T, dim=-1)
    logp = log_p.gather(-1, t.clamp(min=0)[:, None]).squeeze(-1).masked_fill(t == -100, 0)
    ent = -(log_p.exp() * log_p).sum(-1)
    grads = torch.autograd.grad((gw * logp + gu * ent).sum(), (hr, wr))
    ref = (logp.detach(), ent.detach(), *[x.bfloat16() for x in grads])  # gradients kept in bf16 (memory)
    del log_p, hr, wr
    torch.cuda.empty_cache()
    return h, w, t, gw, gu, ref


def _ours(h, w, t, gw, gu, **kw):
    from deltacp import linear_token_logprobs

    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = linear_token_logprobs(hl, wl, t, temperature=T, return_entropy=True, **kw)
    return logp.detach(), ent.detach(), *torch.autograd.grad((gw * logp + gu * ent).sum(), (hl, wl))


@pytest.mark.parametrize("mode", ["two_pass", "accumulate"])
def test_bf16_vs_fp32_reference(problem, mode):
    h, w, t, gw, gu, ref = problem
    flags = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    got = _ours(h, w, t, gw, gu, weight_grad=mode)
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction == flags, "global setting not restored"
    assert got[0].dtype == got[1].dtype == torch.float32 and got[2].dtype == got[3].dtype == torch.bfloat16
    errs = {k: rel_l2(a, b) for k, a, b in zip(("logp", "entropy", "dh", "dW"), got, ref)}
    print(mode, errs)
    assert torch.count_nonzero(got[0][t == -100]) == 0
    assert errs["logp"] < 1e-3 and errs["entropy"] < 1e-3, errs
    assert errs["dh"] < 1e-2 and errs["dW"] < 1e-2, errs


def test_triton_matches_torch_kernels(problem):
    """The same op with the PyTorch kernels on the same GPU: forward within fp32 rounding, gradients within one
    bf16 rounding of dlogits."""
    from deltacp.ops.lm_head.logprobs import token_logprobs

    h, w, t, gw, gu, _ = problem
    outs = []
    for impl in ("triton", "torch"):
        hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = token_logprobs(hl, wl, None, t, T, True, 512, impl=impl)
        outs.append((logp.detach(), ent.detach(), *torch.autograd.grad((gw * logp + gu * ent).sum(), (hl, wl))))
    errs = {k: rel_l2(a, b) for k, a, b in zip(("logp", "entropy", "dh", "dW"), *outs)}
    print(errs)
    assert errs["logp"] < 1e-6 and errs["entropy"] < 1e-6 and errs["dh"] < 3e-3 and errs["dW"] < 3e-3, errs


@pytest.mark.parametrize("mode", ["two_pass", "accumulate"])
def test_peak_memory(problem, mode):
    """Above the inputs: two_pass d hidden + d weight + pass 2's [tokens, columns] buffer (pass 1's buffer freed
    first); accumulate d hidden + d weight + the [chunk, vocab] buffer; plus O(tokens) vectors."""
    from deltacp import linear_token_logprobs
    from deltacp.ops.lm_head.chunks import chunk_sizes

    h, w, t, gw, gu, _ = problem
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logp, ent = linear_token_logprobs(hl, wl, t, temperature=T, return_entropy=True, weight_grad=mode)
    (gw * logp + gu * ent).sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    chunk, cols = chunk_sizes(N, H, V, torch.bfloat16, weight_grad=mode)
    buffer = 2 * chunk * V if mode == "accumulate" else 2 * N * cols
    expected = 2 * V * H + 2 * N * H + buffer
    print(f"{mode}: peak above inputs {extra / 2**20:.1f} MiB, dW + dh + buffer {expected / 2**20:.1f} MiB")
    assert expected <= extra <= expected + 8 * 2**20, (extra, expected)


def test_no_grad_same_values_no_buffers(problem):
    from deltacp import linear_token_logprobs

    h, w, t, gw, gu, _ = problem
    with_grad = _ours(h, w, t, gw, gu)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        logp, ent = linear_token_logprobs(h, w, t, temperature=T, return_entropy=True)
    extra = torch.cuda.max_memory_allocated() - base
    assert torch.equal(logp, with_grad[0]) and torch.equal(ent, with_grad[1])
    assert extra < 300 * 2**20, f"no-grad log-probabilities used {extra / 2**20:.0f} MiB above the inputs"
