"""The token log-probability op: deltacp's `linear_token_logprobs` (no [tokens, vocab] logits; backward for any
per-token upstream gradients, recomputing the logits) vs TRL's paths and the obvious chunked PyTorch loop, bf16, on
CUDA, at Qwen3.5's vocabulary (248,320), temperature 0.7, 5% of the targets ignored, random-sign per-token
upstream weights (GRPO's advantages over the token count) on the log-probabilities (and up to 0.01 / count on the
entropy at the valid targets for the "+entropy" rows).

Per tokens: forward + backward median ms (CUDA events after warm-up, bench/timing.py), the peak memory above the
inputs (gradients included), or OOM. Then accuracy against an fp32 reference on the same bf16 values: at
--accuracy-tokens (4K) full fp32 logits (logp, entropy at the valid targets, dh, dW rel-L2 of every row), and at
--dw-tokens (64K) d weight of the deltacp rows and TRL's fused head against a chunked fp32 reference (the weight
gradient's rounding grows with the token count: `weight_grad` "accumulate" vs "two_pass"). Exits 1 when a
deltacp accuracy check fails or a deltacp row fails to run.

    PYTHONPATH=src python bench/logprobs_op.py                                  # 16K and 64K tokens, hidden 2048
    PYTHONPATH=src python bench/logprobs_op.py --tokens 16384 --ops deltacp "trl fused head" --json out.jsonl

Rows: "deltacp" (the default weight_grad="two_pass": d weight rounded once, 5 head-sized matmuls), "deltacp
accumulate" (d weight summed in bf16 over token chunks, 4 matmuls), "deltacp +entropy"; "trl fused head" (TRL's
`ChunkedLogProbFunction`, what GRPO's `add_fused_lm_head` runs: 4096-token x 32768-column tiles, fp32 [vocab,
hidden] and [tokens, hidden] accumulators, only the valid tokens scored) and "trl fused head +entropy"; "trl full
logits" (h @ W^T in bf16, then TRL's `selective_log_softmax(logits, ids, temperature)`: its fused Triton kernel on
CUDA); "torch chunked" (per 1024-token chunk: logits, float, / T, log_softmax, gather, under activation
checkpointing: the obvious user implementation). TRL's rows need trl installed (`pip install --no-deps
trl-1.16.0-py3-none-any.whl`: trl.kernels imports only torch and transformers); without it the fused head rows are
skipped and "trl full logits" runs a local copy of selective_log_softmax's PyTorch path (printed).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loss_op  # noqa: E402  (the inputs and the fwd+bwd / peak helpers)

IGNORE = loss_op.IGNORE
TEMPERATURE = 0.7
BOUNDS = {"logp": 1e-3, "entropy": 1e-3, "dh": 1e-2, "dW": 1e-2}
"""deltacp's accuracy bounds (rel-L2 vs the fp32 reference on the same bf16 values)."""


def _selective_log_softmax():
    """(TRL's selective_log_softmax(logits, index, temperature) or a local copy of its PyTorch path, its name)."""
    try:
        from trl.trainer.utils import selective_log_softmax

        return selective_log_softmax, "trl.trainer.utils.selective_log_softmax"
    except ImportError:
        pass
    try:  # what selective_log_softmax runs on CUDA (trl.trainer.utils needs accelerate, datasets, pandas)
        from trl.kernels import selective_log_softmax_and_entropy

        return (lambda logits, index, temperature: selective_log_softmax_and_entropy(logits, index, temperature)[0],
                "trl.kernels.selective_log_softmax_and_entropy (selective_log_softmax's CUDA path)")
    except ImportError:
        pass

    def local(logits, index, temperature=1.0):  # trl 1.16's PyTorch path for bf16 logits
        logits = logits / temperature
        return torch.stack([F.log_softmax(row, dim=-1).gather(-1, i[:, None]).squeeze(-1)
                            for row, i in zip(logits[None], index[None])])[0]

    return local, "a local copy of trl 1.16 selective_log_softmax's PyTorch path (trl not installed)"


def _torch_chunk(h, w, t):
    logp = F.log_softmax((h @ w.T).float() / TEMPERATURE, dim=-1).gather(-1, t.clamp(min=0)[:, None]).squeeze(-1)
    return logp.masked_fill(t == IGNORE, 0)


def contenders(with_trl: bool):
    """name -> fn(h, w, t) -> (logp [N] float, entropy [N] or None)."""
    from deltacp import linear_token_logprobs

    def deltacp(mode, entropy=False):
        def run(h, w, t):
            out = linear_token_logprobs(h, w, t, temperature=TEMPERATURE, return_entropy=entropy, weight_grad=mode)
            return out if entropy else (out, None)
        return run

    sls, sls_name = _selective_log_softmax()
    print(f"# trl full logits: {sls_name}", flush=True)

    def full_logits(h, w, t):
        return sls(h @ w.T, t.clamp(min=0), temperature=TEMPERATURE).masked_fill(t == IGNORE, 0), None

    def torch_chunked(h, w, t, chunk=1024):
        return torch.cat([checkpoint(_torch_chunk, h[s:s + chunk], w, t[s:s + chunk], use_reentrant=False)
                          for s in range(0, h.shape[0], chunk)]), None

    out = {"deltacp": deltacp("two_pass"), "deltacp accumulate": deltacp("accumulate"),
           "deltacp +entropy": deltacp("two_pass", True)}
    if with_trl:
        try:
            from trl.kernels import ChunkedLogProbFunction
        except ImportError as err:
            print(f"# trl not installed ({err}): its fused-head rows are skipped", flush=True)
        else:
            def trl_fused(entropy):
                def run(h, w, t):  # as add_fused_lm_head: the valid tokens only, scattered back
                    mask = t != IGNORE
                    logp, ent, *_ = ChunkedLogProbFunction.apply(h[mask], w, None, t[mask], TEMPERATURE, 32768,
                                                                 None, 1.0, ("entropy",) if entropy else ())
                    back = lambda x: x.new_zeros(mask.shape).masked_scatter(mask, x)  # noqa: E731
                    return back(logp), (back(ent) if entropy else None)
                return run
            out["trl fused head"] = trl_fused(False)
            out["trl fused head +entropy"] = trl_fused(True)
    out["trl full logits"] = full_logits
    out["torch chunked"] = torch_chunked
    return out


def make_inputs(n, hidden, vocab, seed=0):
    """loss_op's (h, w, t: 5% ignored) and the per-token upstream weights on logp and entropy."""
    h, w, t = loss_op.make_inputs(n, hidden, vocab, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 100)
    gw = (torch.randint(0, 2, (n,), device="cuda", generator=g).float() * 2 - 1) / n
    gu = (0.01 * torch.rand(n, device="cuda", generator=g) / n).masked_fill(t == IGNORE, 0)  # a masked bonus
    return h, w, t, gw, gu


def objective(fn, gw, gu):
    """(h, w, t) -> sum(gw logp + gu entropy) of a contender: a loss for loss_op's fwd_bwd / peak_above_inputs."""
    def run(h, w, t):
        logp, ent = fn(h, w, t)
        return (gw * logp).sum() + ((gu * ent).sum() if ent is not None else 0)
    return run


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def accuracy(fns, n, hidden, vocab, emit_fn):
    """Full fp32 logits of the same bf16 values: logp, entropy and the gradients of the objective."""
    h, w, t, gw, gu = make_inputs(n, hidden, vocab, seed=1)
    hr, wr = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    log_p = F.log_softmax(hr @ wr.T / TEMPERATURE, dim=-1)
    rlp = log_p.gather(-1, t.clamp(min=0)[:, None]).squeeze(-1).masked_fill(t == IGNORE, 0)
    rent = -(log_p.exp() * log_p).sum(-1)
    refs = {False: torch.autograd.grad((gw * rlp).sum(), (hr, wr), retain_graph=True),
            True: torch.autograd.grad((gw * rlp + gu * rent).sum(), (hr, wr))}
    del log_p, hr, wr
    torch.cuda.empty_cache()
    failures = []
    for name, fn in fns.items():
        hl, wl = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        logp, ent = fn(hl, wl, t)
        dh, dw = torch.autograd.grad(objective(lambda *_: (logp, ent), gw, gu)(hl, wl, t), (hl, wl))
        row = {"logp": _rel(logp.detach(), rlp), "dh": _rel(dh, refs[ent is not None][0]),
               "dW": _rel(dw, refs[ent is not None][1])}
        if ent is not None:  # at the valid targets (TRL's fused head writes 0 at ignored ones; deltacp computes all)
            row["entropy"] = _rel(ent.detach()[t != IGNORE], rent[t != IGNORE])
        emit_fn({"bench": "logprobs_op_accuracy", "op": name, "tokens": n, "hidden": hidden, "vocab": vocab,
                 **{f"{k}_rel_l2": v for k, v in row.items()}})
        if name.startswith("deltacp"):
            failures += [f"{name} {k} rel-L2 {v:.3e} > {BOUNDS[k]:.0e}" for k, v in row.items() if not v <= BOUNDS[k]]
        del logp, ent, dh, dw
        torch.cuda.empty_cache()
    return failures


def weight_grad_accuracy(fns, n, hidden, vocab, emit_fn, chunk=1024):
    """d weight at n tokens vs a chunked fp32 reference (fp32 logits, dz and d weight accumulation; TF32 off)."""
    h, w, t, gw, _ = make_inputs(n, hidden, vocab, seed=2)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        wf = w.detach().float()
        ref = torch.zeros_like(wf)
        for s in range(0, n, chunk):
            hc, tc = h.detach()[s:s + chunk].float(), t[s:s + chunk]
            dz = -torch.softmax(hc @ wf.T / TEMPERATURE, dim=-1)
            valid = tc != IGNORE
            dz[valid, tc[valid]] += 1
            dz *= torch.where(valid, gw[s:s + chunk], 0)[:, None] / TEMPERATURE
            ref.addmm_(dz.T, hc)
            del dz
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    failures = []
    for name in [k for k in fns if not k.endswith("+entropy") and k.split()[0] in ("deltacp", "trl")
                 and k != "trl full logits"]:
        wl = w.detach().clone().requires_grad_()
        logp, _ = fns[name](h.detach(), wl, t)
        (dw,) = torch.autograd.grad((gw * logp).sum(), (wl,))
        err = _rel(dw, ref)
        emit_fn({"bench": "logprobs_op_dW_accuracy", "op": name, "tokens": n, "hidden": hidden, "vocab": vocab,
                 "dW_rel_l2": err})
        if name == "deltacp" and not err <= BOUNDS["dW"]:
            failures.append(f"{name} dW rel-L2 at {n} tokens {err:.3e} > {BOUNDS['dW']:.0e}")
        del logp, dw
        torch.cuda.empty_cache()
    return failures


def main():
    from timing import emit, time_cuda

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=248_320)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--ops", nargs="+", default=None, help="a subset of the contenders' names")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--accuracy-tokens", type=int, default=4096, help="0: skip the full-logits accuracy rows")
    p.add_argument("--dw-tokens", type=int, default=65536, help="0: skip the long d weight accuracy rows")
    p.add_argument("--no-trl", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    fns = contenders(not args.no_trl)
    if args.ops:
        fns = {k: v for k, v in fns.items() if k in args.ops}
    out = lambda row: emit(row, args.json)  # noqa: E731
    failures = []
    if args.accuracy_tokens:
        failures += accuracy(fns, args.accuracy_tokens, args.hidden, args.vocab, out)
    if args.dw_tokens:
        failures += weight_grad_accuracy(fns, args.dw_tokens, args.hidden, args.vocab, out)
    table = []
    for n in args.tokens:
        h, w, t, gw, gu = make_inputs(n, args.hidden, args.vocab)
        for name, fn in fns.items():
            row = {"bench": "logprobs_op", "op": name, "tokens": n, "hidden": args.hidden, "vocab": args.vocab}
            loss = objective(fn, gw, gu)
            try:
                peak = loss_op.peak_above_inputs(loss, h, w, t)
                stats = time_cuda(lambda: loss_op.fwd_bwd(loss, h, w, t), warmup=args.warmup, repeat=args.repeat)
                row.update(fwd_bwd_median_ms=round(stats["median_ms"], 3), fwd_bwd_min_ms=round(stats["min_ms"], 3),
                           peak_above_inputs_gib=round(peak, 3))
            except torch.cuda.OutOfMemoryError:
                row.update(fwd_bwd_median_ms=None, peak_above_inputs_gib="OOM")
                if name.startswith("deltacp"):
                    failures.append(f"{name} at {n} tokens: out of memory")
            h.grad = w.grad = None
            out(row)
            table.append(row)
            torch.cuda.empty_cache()
        del h, w, t, gw, gu
        torch.cuda.empty_cache()
    print(f"\n{'op':<26} {'tokens':>7} {'fwd+bwd ms':>11} {'peak GiB':>9}")
    for r in table:
        ms = "-" if r["fwd_bwd_median_ms"] is None else f"{r['fwd_bwd_median_ms']:.1f}"
        print(f"{r['op']:<26} {r['tokens']:>7} {ms:>11} {r['peak_above_inputs_gib']!s:>9}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("deltacp accuracy checks passed")


if __name__ == "__main__":
    main()
