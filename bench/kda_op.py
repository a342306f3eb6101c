"""KDA op benchmark: deltacp's Triton KDA against flash-linear-attention's `chunk_kda`, in one process (timing method:
bench/timing.py).

The op (forward + backward, gradients of q, k, v, g, beta and the entering state): q/k l2-normalised inside, scale
K^-1/2, per-channel log decay g [1, T, H, K], beta [1, T, H], an entering state [1, H, K, V] - at Kimi-Linear-48B-A3B's
KDA shape (transformers' KimiLinearConfig defaults: 32 heads, K = V = 128) by default.

Accuracy: rel-L2 of o, the final state and every gradient against deltacp's eager KDA in float64 (itself checked
against a token recurrence and transformers' Kimi / Bailing KDA in tests/unit/test_kda_eager.py) on the same bf16
inputs, three gate regimes per channel: fast (g about -0.3..-1.5 per token), slow (about -1e-2), near-frozen
(about -1e-5).

    PYTHONPATH=src python bench/kda_op.py --lengths 8192 16384 32768 65536 --json out.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from op_peers import compare  # noqa: E402

REGIMES = {"fast": (0.3, 1.5), "slow": (0.005, 0.02), "frozen": (5e-6, 2e-5)}  # -g per token and channel, uniform
NAMES = ("q", "k", "v", "g", "beta", "h0")


def make_inputs(T, H, K, V, regime, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lo, hi = REGIMES[regime]
    q, k = (torch.randn(1, T, H, K, generator=gen, device="cuda").to(dtype) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, device="cuda").to(dtype)
    g = -(torch.rand(1, T, H, K, generator=gen, device="cuda") * (hi - lo) + lo)
    beta = torch.rand(1, T, H, generator=gen, device="cuda")
    h0 = torch.randn(1, H, K, V, generator=gen, device="cuda") * 0.1
    return {n: t.requires_grad_() for n, t in zip(NAMES, (q, k, v, g, beta, h0))}


def deltacp_op(backend):
    from deltacp.ops.recurrence import RecurrenceInputs

    if backend == "triton":
        from deltacp.ops.kda.triton import TritonKimiDeltaRule as Rule
    else:
        from deltacp.ops.kda.eager import KimiDeltaRule as Rule
    rule = Rule(qk_l2norm=True, scale=None)

    def run(q, k, v, g, beta, h0):
        return rule.forward(RecurrenceInputs(q, k, v, g, beta), initial_state=h0, output_final_state=True)

    return run


def fla_op():
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None

    def run(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta.to(q.dtype), initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)

    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--accuracy-length", type=int, default=4096)
    ap.add_argument("--accuracy-bound", type=float, default=2e-2)
    ap.add_argument("--regimes", nargs="*", default=list(REGIMES), choices=list(REGIMES),
                    help="gate regimes of the accuracy rows (none: timing only)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--profile", type=int, default=None, metavar="T",
                    help="kernel time of one fwd+bwd of each stack at this length")
    ap.add_argument("--no-peers", action="store_true", help="deltacp's op alone")
    ap.add_argument("--peers-only", action="store_true", help="the public kernels alone (with --ncu: their profile)")
    ap.add_argument("--ncu", action="store_true",
                    help="under `ncu --profile-from-start off`: one warm fwd+bwd of each stack at the first length "
                         "inside the profiler's range, nothing else (no accuracy, no timing)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    H, D = args.heads, args.dim
    from deltacp.ops.kda.triton import kernels

    # the label names the compounding kernels' products (kernels.COMPOUND_PREC: WY's, STATE_PREC: the state
    # kernels'; 1 three tf32 passes, 0 one), OPERANDS16 (W, Kt, Qg in fp16) and STATE16 (1: h, dh, 2: vn, dvn too,
    # in scaled fp16)
    prec = {1: "tf32x3", 0: "tf32"}
    label = f"deltacp-triton-{prec[kernels.COMPOUND_PREC]}"
    if kernels.STATE_PREC != kernels.COMPOUND_PREC:
        label += f"-state-{prec[kernels.STATE_PREC]}"
    if kernels.OPERANDS16:
        label += "-fp16-operands"
    if kernels.STATE16:
        label += f"-fp16-states{kernels.STATE16}"
    runs = [(label, deltacp_op("triton"))]
    fla = None if args.no_peers else fla_op()
    if args.no_peers:
        pass
    elif fla is None:  # a missing public kernel is said, never silently left out
        print("NOTE: flash-linear-attention is not importable here: no row for it")
    else:
        import fla as fla_pkg

        runs.append((f"fla-{fla_pkg.__version__}-chunk_kda", fla))
    if args.peers_only:
        if args.no_peers or len(runs) == 1:
            sys.exit("--peers-only: no public kernel to run (--no-peers given, or FLA not importable)")
        runs = runs[1:]
    print("stacks:", [label for label, _ in runs], flush=True)
    if args.ncu:
        from op_peers import timed_fwd_bwd

        t = make_inputs(args.lengths[0], H, D, D, "slow", torch.bfloat16)
        steps = [timed_fwd_bwd(fn, t, NAMES) for _, fn in runs]
        for step in steps:  # compiled and autotuned outside the profiled range
            step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for step in steps:
            step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    failed = compare(runs, lambda T, regime: make_inputs(T, H, D, D, regime, torch.bfloat16), deltacp_op("eager"),
                     NAMES, regimes=args.regimes, lengths=args.lengths, accuracy_length=args.accuracy_length,
                     bound=args.accuracy_bound, repeat=args.repeat, profile=args.profile, json=args.json,
                     tag={"H": H, "K": D})
    for msg in failed:
        print("FAIL", msg)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
