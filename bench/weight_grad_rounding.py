"""How the head's weight gradient rounds under RL's per-token weights, on CPU: `linear_token_logprobs` in bf16 with
weight_grad "accumulate" (a bf16 running sum over token chunks) vs "two_pass" (rounded once), against float64 full
logits, with random-sign per-token weights (GRPO's +-1 advantages over the token count) on the log-probabilities
and a small entropy term. The running sum's error grows with the number of chunks; two_pass's does not.

    PYTHONPATH=src python bench/weight_grad_rounding.py                 # H 64, V 2048, 4K-64K tokens (minutes)
    PYTHONPATH=src python bench/weight_grad_rounding.py --cases 4096:256
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from deltacp.ops.lm_head.logprobs import token_logprobs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--cases", nargs="+", default=["4096:256", "16384:256", "16384:1024", "65536:1024"],
                   help="tokens:chunk pairs")
    args = p.parse_args()
    H, V, T = args.hidden, args.vocab, 0.7
    torch.manual_seed(0)
    for case in args.cases:
        N, chunk = map(int, case.split(":"))
        h, w = torch.randn(N, H).bfloat16(), (torch.randn(V, H) / H ** 0.5).bfloat16()
        t = torch.randint(0, V, (N,))
        t[::13] = -100
        gw, gu = (torch.randn(N).sign() / N).double(), (0.01 * torch.ones(N) / N).double()
        exact = [x.double().requires_grad_() for x in (h, w)]
        log_p = F.log_softmax(F.linear(*exact) / T, -1)
        logp = log_p.gather(1, t.clamp(min=0)[:, None]).squeeze(1).masked_fill(t == -100, 0)
        _, ref = torch.autograd.grad((gw * logp - gu * (log_p.exp() * log_p).sum(-1)).sum(), exact)
        errs = {}
        for mode in ("accumulate", "two_pass"):
            leaves = [x.clone().requires_grad_() for x in (h, w)]
            lp, ent = token_logprobs(*leaves, None, t, T, True, chunk, weight_grad=mode, vocab_chunk_size=256)
            _, dw = torch.autograd.grad((gw.float() * lp + gu.float() * ent).sum(), leaves)
            errs[mode] = ((dw.double() - ref).norm() / ref.norm()).item()
        ratio = errs["accumulate"] / errs["two_pass"]
        print(f"tokens {N:6d} chunk {chunk:5d} ({N // chunk:3d} chunks): dW rel-L2 accumulate "
              f"{errs['accumulate']:.3e}, two_pass {errs['two_pass']:.3e} ({ratio:.1f}x)", flush=True)


if __name__ == "__main__":
    main()
