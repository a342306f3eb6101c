"""The loss op: deltacp's fused linear cross entropy (gradients in the forward, two passes: token chunks for the
loss, logsumexp and dh, vocabulary chunks for dW) vs liger-kernel's LigerFusedLinearCrossEntropyLoss vs an older
deltacp op (logits recomputed in backward, kept here as a baseline), bf16, on CUDA.

Per (hidden, tokens): forward+backward median ms (CUDA events after warm-up: bench/timing.py), the peak memory
above the inputs (torch.cuda.max_memory_allocated after a reset, minus what was allocated before: gradients
included), and at one small size the gradients' rel-L2 vs an fp32 full-logits reference on the same bf16 values.
Every op is the mean over the valid targets (5% ignored) as `cp_linear_cross_entropy` on one rank.
liger-kernel is a benchmark-only extra: its rows are skipped when it is not installed.

    PYTHONPATH=src python bench/loss_op.py                       # vocab 248,320; hidden 2048, 4096; 16K/32K/64K
    PYTHONPATH=src python bench/loss_op.py --hidden 2048 --tokens 16384 --json out.jsonl
    PYTHONPATH=src python bench/loss_op.py --ops "deltacp two_pass" liger --vocab-chunk 8192   # pass 2 chunk forced

Rows: "deltacp" (the defaults: weight_grad="accumulate", chunks by `deltacp.losses.chunk_sizes`), "deltacp
two_pass" (d weight rounded once, 4 matmuls), "deltacp two_pass bf16 split-K" (the same with cuBLAS's
reduced-precision split-K reductions left to the global setting: FP32_MATMUL_REDUCTIONS = False), "old recompute" (the baseline below), "liger" (bf16 weight-grad accumulation, its default) and "liger
fp32-accum" where that option exists.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
IGNORE = -100


# ---- an older deltacp op (main before the in-forward-gradient loss), kept here as a baseline --------------------
class _OldChunkedSum(torch.autograd.Function):
    """scale x sum of CE over valid rows; forward keeps the per-row logsumexp, backward recomputes every chunk's
    logits, forms (softmax - onehot) x scale x grad_output in fp32, rounds it to bf16 and adds d_logits.T @ h to
    the weight-grad accumulator: fp32 (a bf16 product added in fp32), or with weight_acc_dtype=bf16 a bf16
    running sum (addmm in place: each chunk's fp32 product added and rounded once, liger-kernel's default)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, weight_acc_dtype, scale):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        valid = targets != IGNORE
        lse = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (hidden[rows] @ weight.T).to(acc)
            lse[rows] = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, targets[rows].clamp(min=0)[:, None]).squeeze(1)
            total += torch.where(valid[rows], lse[rows] - target_logit, 0).sum()
            del logits
        scale = torch.ones((), dtype=acc, device=hidden.device) if scale is None else scale.to(acc)
        ctx.save_for_backward(hidden, weight, targets, lse, scale)
        ctx.chunk_size, ctx.weight_acc_dtype = chunk_size, weight_acc_dtype
        return total * scale

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, targets, lse, scale = ctx.saved_tensors
        acc = lse.dtype
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros_like(weight, dtype=ctx.weight_acc_dtype or acc)
        row_scale = (targets != IGNORE).to(acc) * (grad_total.to(acc) * scale)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows]
            d_logits = (h @ weight.T).to(acc).sub_(lse[rows, None]).exp_()
            d_logits.scatter_add_(1, targets[rows].clamp(min=0)[:, None], torch.full_like(lse[rows, None], -1.0))
            d_logits.mul_(row_scale[rows, None])
            d_logits = d_logits.to(hidden.dtype)
            torch.mm(d_logits, weight, out=d_hidden[rows])
            if d_weight.dtype == d_logits.dtype:
                d_weight.addmm_(d_logits.T, h)
            else:
                d_weight += d_logits.T @ h
            del d_logits
        return d_hidden, d_weight.to(weight.dtype), None, None, None, None


def old_chunked_sum(hidden, weight, targets, chunk_size=1024, *, weight_acc_dtype=None, scale=None):
    return _OldChunkedSum.apply(hidden, weight, targets, chunk_size, weight_acc_dtype, scale)


# ---- the contenders: (hidden, weight, targets) -> mean loss -------------------------------------------------------
def contenders(with_liger: bool, chunk_size=None, vocab_chunk_size=None):
    from deltacp import losses as L
    from deltacp.ops.lm_head import chunks as C

    def deltacp(fp32_reductions, weight_grad="accumulate", chunk=chunk_size):
        def run(h, w, t):
            saved, C.FP32_MATMUL_REDUCTIONS = C.FP32_MATMUL_REDUCTIONS, fp32_reductions
            try:  # the mean: 1 / count folded into the gradients before rounding, as cp_linear_cross_entropy
                return L.linear_cross_entropy_sum(h, w, None, t, chunk, vocab_chunk_size=vocab_chunk_size,
                                                  scale=1.0 / (t != IGNORE).sum().float(), weight_grad=weight_grad)
            finally:
                C.FP32_MATMUL_REDUCTIONS = saved
        return run

    out = {
        "deltacp": deltacp(True),
        "deltacp two_pass": deltacp(True, "two_pass"),
        "deltacp two_pass bf16 split-K": deltacp(False, "two_pass"),
        "old recompute": lambda h, w, t: old_chunked_sum(h, w, t) / (t != IGNORE).sum(),
    }
    if with_liger:
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError as err:
            print(f"# liger-kernel not installed ({err}): its rows are skipped", flush=True)
        else:
            liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE)
            out["liger"] = lambda h, w, t: liger(w, h, t)
            try:
                liger32 = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, accum_dtype=torch.float32)
                out["liger fp32-accum"] = lambda h, w, t: liger32(w, h, t)
            except TypeError:
                pass
    return out


def make_inputs(n, hidden, vocab, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * hidden ** -0.5).bfloat16()
    t = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    t[torch.rand(n, device="cuda", generator=g) < 0.05] = IGNORE
    return h.requires_grad_(), w.requires_grad_(), t


def fwd_bwd(fn, h, w, t):
    h.grad = w.grad = None
    fn(h, w, t).backward()


def peak_above_inputs(fn, h, w, t):
    h.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd(fn, h, w, t)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    h.grad = w.grad = None
    return peak / 2**30


def accuracy(fns, n, hidden, vocab, emit_fn):
    h, w, t = make_inputs(n, hidden, vocab, seed=1)
    hr, wr = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.cross_entropy(hr @ wr.T, t, ignore_index=IGNORE)
    rdh, rdw = torch.autograd.grad(ref, (hr, wr))
    for name, fn in fns.items():
        hl, wl = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        v = fn(hl, wl, t)
        dh, dw = torch.autograd.grad(v, (hl, wl))
        rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
        emit_fn({"bench": "loss_op_accuracy", "op": name, "tokens": n, "hidden": hidden, "vocab": vocab,
                 "value_rel": abs(v.item() - ref.item()) / ref.item(), "dh_rel_l2": rel(dh, rdh),
                 "dW_rel_l2": rel(dw, rdw)})
    del h, w, hr, wr, rdh, rdw
    torch.cuda.empty_cache()


def main():
    from timing import emit, time_cuda

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=248_320)
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 65536])
    p.add_argument("--ops", nargs="+", default=None, help="a subset of the contenders' names")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--accuracy-tokens", type=int, default=4096, help="0: skip the accuracy rows")
    p.add_argument("--no-liger", action="store_true")
    p.add_argument("--chunk", type=int, default=None, help="deltacp's pass-1 token chunk (default: budgeted)")
    p.add_argument("--vocab-chunk", type=int, default=None, help="deltacp's pass-2 vocabulary chunk (default: "
                                                                 "budgeted)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    fns = contenders(not args.no_liger, args.chunk, args.vocab_chunk)
    if args.ops:
        fns = {k: v for k, v in fns.items() if k in args.ops}
    out = lambda row: emit(row, args.json)  # noqa: E731
    if args.accuracy_tokens:
        accuracy(fns, args.accuracy_tokens, args.hidden[0], args.vocab, out)
    for hidden in args.hidden:
        for n in args.tokens:
            h, w, t = make_inputs(n, hidden, args.vocab)
            for name, fn in fns.items():
                peak = peak_above_inputs(fn, h, w, t)
                stats = time_cuda(lambda: fwd_bwd(fn, h, w, t), warmup=args.warmup, repeat=args.repeat)
                h.grad = w.grad = None
                out({"bench": "loss_op", "op": name, "tokens": n, "hidden": hidden, "vocab": args.vocab,
                     "fwd_bwd_median_ms": round(stats["median_ms"], 3), "fwd_bwd_min_ms": round(stats["min_ms"], 3),
                     "peak_above_inputs_gib": round(peak, 3),
                     "weight_bf16_gib": round(args.vocab * hidden * 2 / 2**30, 3)})
                torch.cuda.empty_cache()
            del h, w, t
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
