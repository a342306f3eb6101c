"""Mamba1 selective-scan op benchmark: deltacp's Triton selective scan against the public paths that run here, in
one process (timing method: bench/timing.py; driver: bench/op_peers.py `compare`).

The op every stack computes, forward + backward (gradients of x, dt, A, B, C, D and z), no entering state (none of
the public paths takes one), the final state returned:
    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t;   y_t = (C_t h_t + D x_t) silu(z_t)
x, dt (after softplus), z [1, T, I] bf16; A [I, N], D [I] fp32; B, C [1, T, N] bf16. Shapes: Falcon-Mamba-7B's
(I = 8192, N = 16; Jamba's is the same) and Mamba-2.8B's (I = 5120).
- deltacp: `TritonSelectiveScan` (what the Mamba views run with backend="triton"), A and D expanded over the rows;
- transformers: `mamba_selective_scan` (models/mamba: the torch loop of the Mamba / FalconMamba mixers' slow path,
  [I, T, N] decays materialised, one step per token), on the channels-first views it takes;
- mamba_ssm: `selective_scan_fn` (its CUDA kernel) and `selective_scan_ref` (torch), when importable. The GPU
  machine's mamba_ssm (gpu_checks.sh peers_env) is its Triton files with an empty package root: its CUDA extension
  and `selective_scan_interface` are NOT there, and the script says so instead of a row.
The torch loops take seconds per call (one step per token, forward and backward): they are timed at --torch-lengths
only (default 2048), after one warm-up call, over --torch-repeat calls. (At 8K, five calls of transformers' loop,
forward and forward + backward, did not finish in 6 minutes on an H100, 2026-12-06.)

Accuracy: rel-L2 of y, the final state and every gradient against deltacp's eager op in float64 (itself checked
against transformers' `mamba_selective_scan` and a token recurrence, tests/unit/test_selective_scan.py) on the
same inputs, at --accuracy-length (2048: the float64 reference holds several [T, I, N] tensors), in three gate
regimes: fast (|A| in [1, 16], dt ~ 0.7), slow (|A| in [0.01, 0.1], dt ~ 0.05), near-frozen (A = -1e-4).

    PYTHONPATH=src python bench/selective_op.py --lengths 8192 16384 32768 65536 --json out.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from op_peers import compare  # noqa: E402

SHAPES = {"falcon-mamba-7b": (8192, 16), "mamba-2.8b": (5120, 16)}  # I, N
REGIMES = {"fast": ((1.0, 16.0), 0.0), "slow": ((0.01, 0.1), -3.0), "frozen": ((1e-4, 1e-4), -3.0)}  # |A|, dt shift
NAMES = ("x", "dt", "A", "B", "C", "D", "z")


def make_inputs(T, I, N, regime, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    (lo, hi), shift = REGIMES[regime]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    x, z = rnd(1, T, I), rnd(1, T, I)
    dt = F.softplus(rnd(1, T, I) + shift)
    A = -torch.empty(I, N, device="cuda").uniform_(lo, hi, generator=gen)
    B, C = rnd(1, T, N), rnd(1, T, N)
    D = torch.rand(I, generator=gen, device="cuda") + 0.5
    t = dict(x=x.to(dtype), dt=dt.to(dtype), A=A, B=B.to(dtype), C=C.to(dtype), D=D, z=z.to(dtype))
    return {k: v.requires_grad_() for k, v in t.items()}


def deltacp_op(backend):
    """(y [1, T, I], final state [1, I, N]) by deltacp's recurrence, as the Mamba view calls it."""
    from deltacp.ops.recurrence import RecurrenceInputs

    if backend == "triton":
        from deltacp.ops.selective.triton import TritonSelectiveScan as Rec
    else:
        from deltacp.ops.selective.eager import SelectiveScan as Rec
    rec = Rec()

    def run(x, dt, A, B, C, D, z):
        I, N = A.shape
        y, ht = rec.forward(RecurrenceInputs(x, dt, A.expand(1, I, N), B, C, D.expand(1, I), z),
                            output_final_state=True)
        return y[:, :, 0], ht.reshape(1, I, N)

    return run


def transformers_op():
    """transformers' torch loop itself (or a sentence saying why not): its hub-kernel wrapper would send CUDA inputs to mamba_ssm's CUDA kernel
    where that is installed (tests/helpers.py `_kernel_fallback_target` unwraps it)."""
    from helpers import _kernel_fallback_target

    try:
        from transformers.models.mamba.modeling_mamba import mamba_selective_scan
    except ImportError as e:
        return f"ImportError: {e}"

    torch_loop = _kernel_fallback_target(mamba_selective_scan) or mamba_selective_scan

    def run(x, dt, A, B, C, D, z):
        y, h = torch_loop(x.mT, dt.mT, A, B.mT, C.mT, D=D, z=z.mT, return_last_state=True)
        return y.mT, h

    return run


def mamba_ssm_ops():
    """[(label, fn)] for mamba_ssm's selective scans, or a sentence saying why there are none."""
    try:
        import mamba_ssm
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn, selective_scan_ref
    except Exception as e:  # noqa: BLE001  (ImportError, or its CUDA extension failing to load)
        return f"{type(e).__name__}: {str(e)[:200]}"

    def wrap(fn):
        def run(x, dt, A, B, C, D, z):
            y, h = fn(x.mT, dt.mT, A, B.mT, C.mT, D=D, z=z.mT, return_last_state=True)
            return y.mT, h

        return run

    v = mamba_ssm.__version__
    return [(f"mamba_ssm-{v}-selective_scan_fn", wrap(selective_scan_fn)),
            (f"mamba_ssm-{v}-selective_scan_ref", wrap(selective_scan_ref))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--torch-lengths", type=int, nargs="*", default=[2048],
                    help="lengths at which the torch loops (transformers, selective_scan_ref) are timed")
    ap.add_argument("--torch-repeat", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=["falcon-mamba-7b"], choices=list(SHAPES))
    ap.add_argument("--accuracy-length", type=int, default=2048)
    ap.add_argument("--accuracy-bound", type=float, default=2e-2,
                    help="deltacp's worst bf16 rel-L2 allowed (exit 1 above it)")
    ap.add_argument("--regimes", nargs="*", default=list(REGIMES), choices=list(REGIMES))
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--profile", type=int, default=None, metavar="T",
                    help="kernel time of one fwd+bwd of ours at this length (the first --shapes shape)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    fast = [("deltacp-triton", deltacp_op("triton"))]  # timed at every length
    loops = []  # the torch loops: timed at --torch-lengths
    if not args.no_peers:
        import transformers

        fn = transformers_op()
        if isinstance(fn, str):
            print(f"NOTE: transformers {transformers.__version__} has no `mamba_selective_scan` ({fn}): no row for it")
        else:
            loops.append((f"transformers-{transformers.__version__}-torch_loop", fn))
        peers = mamba_ssm_ops()
        if isinstance(peers, str):  # a missing public kernel is said, never silently left out
            print(f"NOTE: mamba_ssm's selective_scan_fn (CUDA) and selective_scan_ref are not importable here "
                  f"({peers}): no rows for them (the GPU machine's mamba_ssm holds its Triton files only)")
        else:
            fast.append(peers[0])
            loops.append(peers[1])
    print("stacks:", [label for label, _ in fast + loops], flush=True)
    failed = []
    for i, shape in enumerate(args.shapes):
        I, N = SHAPES[shape]

        def make(T, regime):
            return make_inputs(T, I, N, regime, torch.bfloat16)  # noqa: B023

        # accuracy of every stack; timings of the fast ones at every length, of the torch loops at a few
        failed += compare(fast + loops, make, deltacp_op("eager"), NAMES, regimes=args.regimes, lengths=[],
                          accuracy_length=args.accuracy_length, bound=args.accuracy_bound, json=args.json,
                          tag={"shape": shape, "part": "accuracy"})
        lengths = sorted(set(args.lengths) | (set(args.torch_lengths) if loops else set()))  # the loops' beside
        failed += compare(fast, make, None, NAMES, regimes=[], lengths=lengths, accuracy_length=0,
                          bound=args.accuracy_bound, repeat=args.repeat, json=args.json,
                          profile=args.profile if i == 0 else None, tag={"shape": shape, "part": "timing"})
        if loops and args.torch_lengths:
            failed += compare(loops, make, None, NAMES, regimes=[], lengths=args.torch_lengths, accuracy_length=0,
                              bound=args.accuracy_bound, repeat=args.torch_repeat, warmup=1, json=args.json,
                              tag={"shape": shape, "part": "timing, torch loops"})
    for msg in failed:
        print("FAIL", msg)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
