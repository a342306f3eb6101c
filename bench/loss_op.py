"""The loss op: deltacp's fused linear cross entropy (gradients in the forward) vs liger-kernel's
LigerFusedLinearCrossEntropyLoss vs the previous deltacp op (logits recomputed in backward), bf16, on CUDA.

Per (hidden, tokens): forward+backward median ms (CUDA events after warm-up: bench/timing.py), the peak memory
above the inputs (torch.cuda.max_memory_allocated after a reset, minus what was allocated before: gradients
included), and at one small size the gradients' rel-L2 vs an fp32 full-logits reference on the same bf16 values.
Every op is the mean over the valid targets (5% ignored) as `cp_linear_cross_entropy` on one rank.
liger-kernel is a benchmark-only extra: its rows are skipped when it is not installed.

    PYTHONPATH=src python bench/loss_op.py                       # vocab 248,320; hidden 2048, 4096; 16K/32K/64K
    PYTHONPATH=src python bench/loss_op.py --hidden 2048 --tokens 16384 --json out.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
IGNORE = -100


# ---- the previous deltacp op (main before the in-forward-gradient loss), kept here as a baseline ---------------
class _OldChunkedSum(torch.autograd.Function):
    """sum of CE over valid rows; forward keeps the per-row logsumexp, backward recomputes every chunk's logits,
    forms softmax - onehot in fp32 and adds d_logits.T @ h (a bf16 [V, H] product) to an fp32 accumulator."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):
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
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size = chunk_size
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, targets, lse = ctx.saved_tensors
        acc = lse.dtype
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros_like(weight, dtype=acc)
        row_scale = (targets != IGNORE).to(acc) * grad_total.to(acc)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows]
            d_logits = (h @ weight.T).to(acc).sub_(lse[rows, None]).exp_()
            d_logits.scatter_add_(1, targets[rows].clamp(min=0)[:, None], torch.full_like(lse[rows, None], -1.0))
            d_logits.mul_(row_scale[rows, None])
            d_logits = d_logits.to(hidden.dtype)
            torch.mm(d_logits, weight, out=d_hidden[rows])
            d_weight += d_logits.T @ h
            del d_logits
        return d_hidden, d_weight.to(weight.dtype), None, None


def old_chunked_sum(hidden, weight, targets, chunk_size=1024):
    return _OldChunkedSum.apply(hidden, weight, targets, chunk_size)


# ---- the contenders: (hidden, weight, targets) -> mean loss -------------------------------------------------------
def contenders(with_liger: bool):
    from deltacp.models.loss import linear_cross_entropy_sum

    def mean(sum_fn):
        def run(h, w, t):
            return sum_fn(h, w, t) / (t != IGNORE).sum()
        return run

    out = {
        "deltacp": mean(lambda h, w, t: linear_cross_entropy_sum(h, w, None, t)),
        "deltacp bf16-accum": mean(lambda h, w, t: linear_cross_entropy_sum(h, w, None, t,
                                                                            grad_accum_dtype=torch.bfloat16)),
        "old chunked": mean(old_chunked_sum),
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
    p.add_argument("--json", default=None)
    args = p.parse_args()
    fns = contenders(not args.no_liger)
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
