"""Mamba2 (SSD) op benchmark: deltacp's Triton scalar-decay recurrence against the public Mamba2 kernels, in one
process (timing method: bench/timing.py).

The op every stack computes, forward + backward (gradients of every input and of the entering state):
    dt = softplus(dt_raw + dt_bias); h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_tᵀ; y_t = C_t h_t + D x_t
x [1, T, H, P], dt_raw [1, T, H], B, C [1, T, G, N] (G groups of heads), A, D, dt_bias [H], an entering state.
- deltacp: the Mamba2 view's glue (`families/mamba2.py`: dt = softplus(dt_raw + dt_bias) and g = dt A in fp32, D
  expanded over the tokens: [T, H] work) and `TritonScalarDecay` (chunk 64), which reads x, dt and D and forms
  v = dt x and the skip D x in its kernels (and dx, ddt, dD in its backward);
- mamba_ssm: `mamba_chunk_scan_combined` (its Triton SSD kernels, chunk 128 and 256), when importable: its package
  root imports its CUDA selective-scan extension, so gpu_checks.sh stages a copy of its Triton files with an empty
  package root (.whl/mamba_ssm_triton; the guard is bypassed, the SSD kernels are unchanged);
- FLA: `chunk_simple_gla` (the same scalar-decay recurrence; no groups: B and C repeated to the heads), when its
  wheels are installed. FLA 0.6.0 refuses its backward on Hopper with Triton >= 3.4, < 3.7.1 (bench/fla_ref.py);
  `--fla-bypass-hopper-guard` lifts the refusal to time it, its label says so and its rel-L2 shows what it computed.

Accuracy: rel-L2 of y and of every gradient against deltacp's eager recurrence in float64 (itself checked against
transformers' torch SSD and a token recurrence in tests/unit/test_scalar_decay.py) on the same inputs, in three gate
regimes (fast: g about -0.4..-1.6 per token; slow: about -1e-2; near-frozen: about -1e-5).

    PYTHONPATH=src python bench/ssd_op.py --lengths 8192 16384 32768 65536 --json out.jsonl
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from op_peers import compare  # noqa: E402

# (label, heads, groups, state size N, head dim P): Nemotron-H-8B's Mamba2 layer (128 heads of 64, 8 groups, state
# 128), and the other shapes the Mamba2 hybrids use (one group; state 128 or 256; 64-128 heads)
SHAPES = {"nemotron-h-8b": (128, 8, 128, 64), "h128-g1-n256": (128, 1, 256, 64), "h64-g1-n128": (64, 1, 128, 64)}
REGIMES = {"fast": ((4.0, 16.0), 0.1), "slow": ((1.0, 2.0), 0.01), "frozen": ((0.01, 0.02), 1e-3)}  # |A|, dt


def make_inputs(T, H, G, N, P, regime, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    (a_lo, a_hi), dt_mean = REGIMES[regime]

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda") * scale

    x = rnd(1, T, H, P)
    b, c = rnd(1, T, G, N, scale=N ** -0.5), rnd(1, T, G, N, scale=N ** -0.5)
    dt_raw = rnd(1, T, H, scale=0.5)
    dt_bias = torch.full((H,), math.log(math.expm1(dt_mean)), device="cuda")
    a_log = torch.empty(H, device="cuda").uniform_(math.log(a_lo), math.log(a_hi), generator=gen)
    d = torch.rand(H, generator=gen, device="cuda") + 0.5
    h0 = rnd(1, H, N, P, scale=0.1)
    t = dict(x=x.to(dtype), dt_raw=dt_raw, dt_bias=dt_bias, A=-a_log.exp(), B=b.to(dtype), C=c.to(dtype), D=d,
             h0=h0)
    return {k: v.requires_grad_() for k, v in t.items()}


def deltacp_op(backend):
    """y, final state [1, H, N, P] by deltacp's recurrence (the Mamba2 view's glue around it)."""
    from deltacp.ops.recurrence import RecurrenceInputs

    if backend == "triton":
        from deltacp.ops.ssd.triton import TritonScalarDecay as Rec
    else:
        from deltacp.ops.ssd.eager import ScalarDecay as Rec
    rec = Rec()

    def run(x, dt_raw, dt_bias, A, B, C, D, h0):
        dt = F.softplus(dt_raw.float() + dt_bias.float())
        o, ht = rec.forward(RecurrenceInputs(C, B, x, dt * A.float(), dt, D.float().expand_as(dt)), initial_state=h0,
                            output_final_state=True)
        return o, ht

    return run


def mamba_ssm_op(chunk):
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError:
        return None

    def run(x, dt_raw, dt_bias, A, B, C, D, h0):
        y, ht = mamba_chunk_scan_combined(x, dt_raw, A, B, C, chunk_size=chunk, D=D, dt_bias=dt_bias,
                                          dt_softplus=True, initial_states=h0.transpose(-1, -2),
                                          return_final_states=True)
        return y, ht.transpose(-1, -2)

    return run


def fla_op(bypass_hopper_guard: bool = False):
    """-> (label, fn) or None when FLA is not importable (`bypass_hopper_guard`: bench/fla_ref.py)."""
    try:
        import fla
        import fla.ops.common.chunk_o as fla_chunk_o
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        return None
    label = f"fla-{fla.__version__}-simple_gla"
    if bypass_hopper_guard and hasattr(fla_chunk_o, "TRITON_ABOVE_3_7_1") and not fla_chunk_o.TRITON_ABOVE_3_7_1:
        fla_chunk_o.TRITON_ABOVE_3_7_1 = True
        label += " (Hopper guard bypassed)"

    def run(x, dt_raw, dt_bias, A, B, C, D, h0):
        H, G = x.shape[2], B.shape[2]
        dt = F.softplus(dt_raw.float() + dt_bias.float())
        x32 = x.float()
        q, k = (t.repeat_interleave(H // G, dim=2) for t in (C, B))
        o, ht = chunk_simple_gla(q, k, (x32 * dt[..., None]).to(x.dtype), dt * A.float(), scale=1.0,
                                 initial_state=h0, output_final_state=True)
        return o.float() + D.float()[:, None] * x32, ht

    return label, run


def stacks(args):
    out = [("deltacp-triton", deltacp_op("triton"))]
    if args.no_peers:
        return out
    for chunk in (128, 256):
        fn = mamba_ssm_op(chunk)
        if fn is None:  # a missing public kernel is said, never silently left out
            print("NOTE: mamba_ssm's Triton SSD is not importable here: no row for it")
            break
        import mamba_ssm

        out.append((f"mamba_ssm-{mamba_ssm.__version__}-c{chunk}", fn))
    fla = fla_op(args.fla_bypass_hopper_guard)
    if fla is None:
        print("NOTE: flash-linear-attention is not importable here: no row for it")
    else:
        out.append(fla)
    return out


NAMES = ("x", "dt_raw", "dt_bias", "A", "B", "C", "D", "h0")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--accuracy-length", type=int, default=8192)
    ap.add_argument("--accuracy-bound", type=float, default=2e-2,
                    help="deltacp's worst bf16 rel-L2 allowed (exit 1 above it)")
    ap.add_argument("--regimes", nargs="*", default=list(REGIMES), choices=list(REGIMES),
                    help="gate regimes of the accuracy rows (none: timing only)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--fla-bypass-hopper-guard", action="store_true",
                    help="time FLA's chunk_simple_gla past its Hopper refusal (its rel-L2 rows say what it computed)")
    ap.add_argument("--profile", type=int, default=None, metavar="T",
                    help="kernel time of one fwd+bwd of each stack at this length (the first --shapes shape)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    runs = stacks(args)
    print("stacks:", [label for label, _ in runs], flush=True)
    failed = []
    for i, shape in enumerate(args.shapes):
        H, G, N, P = SHAPES[shape]
        failed += compare(runs, lambda T, regime: make_inputs(T, H, G, N, P, regime, torch.bfloat16),  # noqa: B023
                          deltacp_op("eager"), NAMES, regimes=args.regimes, lengths=args.lengths,
                          accuracy_length=args.accuracy_length, bound=args.accuracy_bound, repeat=args.repeat,
                          profile=args.profile if i == 0 else None, json=args.json, tag={"shape": shape})
    for msg in failed:
        print("FAIL", msg)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
