"""Bitwise reproducibility of the Triton GDN kernels: the same inputs twice in one process, results compared bit
for bit, for the op (outputs and gradients), the state summary and p2p's dH_in pass. Every kernel writes each
output element once (no atomics), so any difference is a race or a miscompile. Prints one line per tensor.

    PYTHONPATH=src python bench/determinism.py --length 8192
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gdn_op import inputs  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--hk", type=int, default=32)
    p.add_argument("--hv", type=int, default=32)
    a = p.parse_args()
    from deltacp.ops.gdn.triton import TritonGDNBackend

    be = TritonGDNBackend()
    xs = inputs(a.length, a.hk, a.hv, 128, 128, seed=5)
    do, dht = torch.randn_like(xs[2]), torch.randn_like(xs[5])

    def run():
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        o, ht = be.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
        gr = torch.autograd.grad((o, ht), leaves, (do, dht))
        return [o, ht, *gr]

    def run_summary():  # forward only on this backend
        with torch.no_grad():
            return list(be.state_summary(*xs[1:5], use_qk_l2norm_in_kernel=True))

    def run_initial_state_grad():
        with torch.no_grad():
            return [be.initial_state_grad(*xs[:5], do, use_qk_l2norm_in_kernel=True)]

    cases = [("op", run, ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"]),
             ("summary", run_summary, ["M", "S"]),
             ("p2p dH0", run_initial_state_grad, ["dH0"])]
    print(f"T={a.length} Hk={a.hk} Hv={a.hv}: each computation twice on the same inputs")
    bad = 0
    for label, fn, names in cases:
        first, second = fn(), fn()
        for n, x, y in zip(names, first, second):
            same = torch.equal(x, y)
            bad += not same
            diff = (x.double() - y.double()).abs().max().item()
            print(f"  {label:<8} {n:<6} bitwise equal: {same}  max abs diff {diff:.3e}")
    print("all bitwise reproducible" if bad == 0 else f"{bad} tensors NOT reproducible")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
