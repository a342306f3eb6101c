"""Is a bf16 op's error at a head dim the precision's or a bug's? Ours and FLA's chunked GDN op (an independent bf16
implementation; its Hopper backward guard bypassed) against the same reference, the eager op in fp32 on the same
bf16 inputs (`tests/gpu/test_triton_head_dims_gpu.py`'s inputs: T = 8192, grouped heads repeated to 32 so that both
ops see the same heads, beta = 2 sigmoid(b), an entering state). One line per (K, V, gate regime): the rel-L2 of o,
the final state and every gradient, ours / FLA's.

    PYTHONPATH=src:tests:bench python bench/head_dim_precision.py --dims 128,128 256,256 --regimes init slow
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
from fla_ref import load_fla  # noqa: E402

NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def run(fn, xs, do, dht):
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    o, ht = fn(*leaves)
    grads = torch.autograd.grad((o.float() * do).sum() + (ht.float() * dht).sum(), leaves)
    return [o, ht, *grads]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dims", nargs="+", default=["128,128", "256,256"])
    p.add_argument("--regimes", nargs="+", default=["init", "slow"])
    a = p.parse_args()
    from test_triton_head_dims_gpu import make_inputs

    from deltacp.ops.gdn.eager import EagerGDNBackend
    from deltacp.ops.gdn.triton import TritonGDNBackend

    fla = load_fla(bypass_hopper_guard=True)
    ours, eager = TritonGDNBackend(), EagerGDNBackend()

    def gdn(be):
        return lambda q, k, v, g, beta, h0: be.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)

    print(f"rel-L2 against the eager op in fp32 on the same bf16 inputs; ours / {fla[0] if fla else 'FLA absent'}")
    for dims in a.dims:
        K, V = map(int, dims.split(","))
        for regime in a.regimes:
            q, k, v, g, beta, h0 = make_inputs(K, V, regime, seed=K * 1000 + V)
            rep = v.shape[2] // q.shape[2]
            q, k = (x.repeat_interleave(rep, dim=2) for x in (q, k))  # same heads for both ops
            xs = [q, k, v, g, beta, h0]
            gen = torch.Generator(device="cuda").manual_seed(7)
            do = torch.randn(v.shape, device="cuda", generator=gen).bfloat16().float()
            dht = torch.randn(h0.shape, device="cuda", generator=gen)
            ref = run(gdn(eager), [x.float() for x in xs], do, dht)
            mine = run(gdn(ours), xs, do, dht)
            theirs = run(fla[1], xs, do, dht) if fla else None
            cells = [f"{n} {rel(m, r):.2e}" + (f" / {rel(t, r):.2e}" if theirs else "")
                     for n, m, r, t in zip(NAMES, mine, ref, theirs or mine)]
            print(f"K={K} V={V} {regime}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
