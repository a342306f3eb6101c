"""Inputs of a cost model for an exact intra-device sequence split of the GDN op (issue 50).

One long row of T tokens and H heads gives the chunk kernels H x (V tiles) programs for the sequential state pass;
on a GPU with more SMs than that, most of the device idles. Cutting the row into P segments that run as P batch rows
fills it, and the affine state summaries (transition M and offset S of each segment) make the split exact: one
summary pass over the P segments, a P-step scan of the summaries, then the op on the P rows with their exact initial
states. This bench times, on one device, the pieces such a split would cost, for each P:

- `op`: the op's forward + backward on [P, T/P] rows (what the split runs once the initial states are known);
- `summary`: the forward summary pass (M and S) on the same rows (the split's extra forward work);
- `prep`: the chunk preparation the summary and the op could share.

    python bench/gdn_split.py --heads 16 32 --lengths 32768 65536 --splits 1 2 4 8 16
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import emit, time_cuda  # noqa: E402


def inputs(P, T, H, D, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    L = T // P
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q, k, v = (r(P, L, H, D).bfloat16().requires_grad_() for _ in range(3))
    g = (-(torch.rand(P, L, H, generator=gen, device="cuda") * 0.1 + 0.01)).requires_grad_()
    beta = torch.rand(P, L, H, generator=gen, device="cuda").bfloat16().requires_grad_()
    h0 = (r(P, H, D, D) * 0.1).requires_grad_()
    return q, k, v, g, beta, h0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    from deltacp.ops.gdn.triton import TritonGDNBackend

    be = TritonGDNBackend()
    print(f"{'H':>4} {'T':>7} {'P':>4} {'op fwd+bwd ms':>14} {'summary ms':>11} {'prep ms':>8}", flush=True)
    for H in args.heads:
        for T in args.lengths:
            for P in args.splits:
                q, k, v, g, beta, h0 = inputs(P, T, H, args.dim)
                y, ht = be.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
                gy, gh = torch.randn_like(y), torch.randn_like(ht) * 0.1
                del y, ht

                def op():
                    y, ht = be.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
                    torch.autograd.grad((y, ht), (q, k, v, g, beta, h0), (gy, gh))

                def summary():
                    with torch.no_grad():
                        be.state_summary(k, v, g, beta, use_qk_l2norm_in_kernel=True)

                def prep():
                    with torch.no_grad():
                        be.prepare_chunks(k, v, g, beta, use_qk_l2norm_in_kernel=True)

                t_op = time_cuda(op, repeat=args.repeat)["median_ms"]
                t_sum = time_cuda(summary, repeat=args.repeat)["median_ms"]
                t_prep = time_cuda(prep, repeat=args.repeat)["median_ms"]
                print(f"{H:>4} {T:>7} {P:>4} {t_op:>14.2f} {t_sum:>11.2f} {t_prep:>8.2f}", flush=True)
                emit({"bench": "gdn_split", "H": H, "T": T, "P": P, "op_fwd_bwd_ms": t_op, "summary_ms": t_sum,
                      "prep_ms": t_prep, "device": torch.cuda.get_device_name()}, args.json)
                del q, k, v, g, beta, h0, gy, gh


if __name__ == "__main__":
    main()
