"""Accuracy of the Triton GDN op when the gates barely decay (long memory), against the fp32 reference.

The GPU op tests use gates that decay by about e^-4 per chunk, so errors carried over many chunks are damped.
Here the gates are scaled so that the whole sequence decays by about e^-(--total-decay), as in the summary
tests: what the bf16 state recurrences accumulate over a long chain becomes visible. Prints one row per case.

    PYTHONPATH=src python bench/long_memory_accuracy.py --lengths 8192 32768
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192])
    p.add_argument("--total-decay", type=float, default=20.0, help="about -sum(g) over the sequence")
    a = p.parse_args()
    from test_triton_gdn import make_inputs, ref_chunk, rel_l2  # the GPU tests' inputs and fp32 reference

    from deltacp.ops.gdn.triton import TritonGDNBackend

    be = TritonGDNBackend()
    names = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    print(f"{'T':>6} {'gates':>10} " + " ".join(f"{n:>8}" for n in names))
    for T in a.lengths:
        for label in ("op test", "long"):
            q, k, v, g, beta, h0 = make_inputs(T, 32, seed=3)
            if label == "long":
                g = g * (a.total_decay / -g[0, :, 0].sum().item())
            do = torch.randn(1, T, 32, 128, device="cuda")
            dht = torch.randn(1, 32, 128, 128, device="cuda")
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
            o, ht = be.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
            gr = torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), leaves)
            rl = [x.detach().float().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
            ro, rht = ref_chunk(*rl[:5], h0=rl[5])
            rg = torch.autograd.grad((ro * do).sum() + (rht * dht).sum(), rl)
            errs = [rel_l2(o, ro), rel_l2(ht, rht)] + [rel_l2(x, y) for x, y in zip(gr, rg)]
            print(f"{T:>6} {label:>10} " + " ".join(f"{e:8.2e}" for e in errs), flush=True)


if __name__ == "__main__":
    main()
