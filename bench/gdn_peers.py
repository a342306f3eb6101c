"""GDN op against the public GDN kernels, in one process (timing method: bench/timing.py).

The op every stack computes, forward + backward (gradients of q, k, v, g, beta and the entering state): q, k
l2-normalised inside, scale K^-1/2, a log decay g [1, T, Hv] and beta [1, T, Hv] per token and value head, an
entering state [1, Hv, K, V], the final state out. Stacks:
- deltacp: `TritonGDNBackend` (the op the GDN views run);
- FLA Triton: flash-linear-attention's `chunk_gated_delta_rule` with its FlashQLA backend switched off
  (`FLA_FLASH_QLA=0`) and its Hopper backward guard bypassed (bench/fla_ref.py says why);
- FlashQLA: `flash_qla.chunk_gated_delta_rule` with `auto_cp=False` (one sequence per program) and with its
  default `auto_cp=True` (its intra-device sequence split: approximate, it drops the entering state of a piece
  once the cumulative gate passes -10).

Accuracy: rel-L2 of o, the final state and every gradient against deltacp's eager GDN in float64 (itself checked
against transformers' torch GDN and a token recurrence in the unit tests) on the same bf16 inputs, in three gate
regimes (fast: g about -1 per token; slow: about -1e-2; near-frozen: about -1e-5), at --accuracy-length (long
enough for FlashQLA's split to engage). --profile T adds the CUDA kernel time of one fwd+bwd of each stack at T,
by kernel.

    PYTHONPATH=src python bench/gdn_peers.py --lengths 8192 16384 32768 65536 --hk 16 --hv 16 --json out.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fla_ref import load_fla  # noqa: E402
from op_peers import compare  # noqa: E402

REGIMES = {"fast": (0.5, 1.5), "slow": (0.005, 0.02), "frozen": (5e-6, 2e-5)}  # -g per token and head, uniform
NAMES = ("q", "k", "v", "g", "beta", "h0")


def make_inputs(T, Hk, Hv, K, V, regime, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lo, hi = REGIMES[regime]
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q, k, v = r(1, T, Hk, K).bfloat16(), r(1, T, Hk, K).bfloat16(), r(1, T, Hv, V).bfloat16()
    g = -(torch.rand(1, T, Hv, generator=gen, device="cuda") * (hi - lo) + lo)
    beta = torch.rand(1, T, Hv, generator=gen, device="cuda").bfloat16()
    h0 = r(1, Hv, K, V) * 0.1
    return {n: t.requires_grad_() for n, t in zip(NAMES, (q, k, v, g, beta, h0))}


def deltacp_op(backend):
    if backend == "triton":
        from deltacp.ops.gdn.triton import TritonGDNBackend as Backend
    else:
        from deltacp.ops.gdn.eager import EagerGDNBackend as Backend
    be = Backend()

    def run(q, k, v, g, beta, h0):
        return be.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)

    return run


def fla_triton_op():
    loaded = load_fla(bypass_hopper_guard=True)
    if loaded is None:
        return None
    label, fn = loaded

    def run(*xs):
        before = os.environ.get("FLA_FLASH_QLA")
        os.environ["FLA_FLASH_QLA"] = "0"  # FLA's own Triton kernels, not the FlashQLA backend it prefers
        try:
            return fn(*xs)
        finally:
            if before is None:
                del os.environ["FLA_FLASH_QLA"]
            else:
                os.environ["FLA_FLASH_QLA"] = before

    return f"{label} triton", run


def flashqla_op(auto_cp):
    try:
        import flash_qla
    except ImportError:
        return None

    def run(q, k, v, g, beta, h0):
        return flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, auto_cp=auto_cp)

    return f"flashqla-{flash_qla.__version__} auto_cp={auto_cp}", run


def stacks(args):
    out = [("deltacp-triton", deltacp_op("triton"))]
    if args.no_peers:
        return out
    for name, made in (("flash-linear-attention", fla_triton_op()), ("flash_qla", flashqla_op(False)),
                       ("flash_qla", flashqla_op(True))):
        if made is None:  # a missing peer is said, never silently left out
            print(f"NOTE: {name} is not importable here: no row for it")
        else:
            out.append(made)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--hk", type=int, default=16)
    ap.add_argument("--hv", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--accuracy-length", type=int, default=16384)
    ap.add_argument("--accuracy-bound", type=float, default=2e-2,
                    help="deltacp's worst bf16 rel-L2 allowed (exit 1 above it)")
    ap.add_argument("--regimes", nargs="*", default=list(REGIMES), choices=list(REGIMES),
                    help="gate regimes of the accuracy rows (none: timing only)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--profile", type=int, default=None, metavar="T",
                    help="kernel time of one fwd+bwd of each stack at this length")
    ap.add_argument("--no-fill", action="store_true",
                    help="deltacp's state kernels at the table's BV (the one-wave rule, launch.fill_bv, off): its A/B")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.no_fill:
        from deltacp.ops.gdn.triton.launch import LAUNCH, LAUNCH_WIDE_K
        for entry in (*LAUNCH.values(), *LAUNCH_WIDE_K.values()):
            entry.pop("FILL_BV", None)
    torch.backends.cuda.matmul.allow_tf32 = False
    Hk, Hv, D = args.hk, args.hv, args.dim
    runs = stacks(args)
    print("stacks:", [label for label, _ in runs], flush=True)
    failed = compare(runs, lambda T, regime: make_inputs(T, Hk, Hv, D, D, regime), deltacp_op("eager"), NAMES,
                     regimes=args.regimes, lengths=args.lengths, accuracy_length=args.accuracy_length,
                     bound=args.accuracy_bound, repeat=args.repeat, profile=args.profile, json=args.json,
                     tag={"Hk": Hk, "Hv": Hv, "K": D})
    for msg in failed:
        print("FAIL", msg)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
