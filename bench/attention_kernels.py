"""The measurements behind `attention_tiles.CUDNN_TILES`: one attention tile, flash (FA2) against cuDNN, as the tiles
run them (a visible tile's query heads folded onto its KV heads; the diagonal's K/V repeated per query head for
flash, read as GQA by cuDNN), forward and backward separately, bf16, B = 1. For visible tiles also cuDNN with
the query heads not folded (its own GQA; fwd+bwd, for comparison).

    python bench/attention_kernels.py                       # head dims 128 and 256, tiles 1K-64K (about 2 minutes)

Prints, per head dim and tile kind (diagonal: causal square; visible: no mask), the median ms of each kernel and
cuDNN's speed-up, then the table rows this device supports, in `CUDNN_TILES`'s form: from which shorter tile side
on cuDNN is faster (forward + backward) at every measured shape. Also measured: cuDNN's cost at a shape it has not
seen (it builds an execution plan per shape), whether each kernel's backward is bitwise reproducible run to run
(with and without torch.use_deterministic_algorithms(True)), and varlen flash on a 64K packed row of 10 and 1,000
documents. Exits 1 when a timing is not finite, when flash under the deterministic switch is not reproducible,
or when `CUDNN_TILES` names this device but cuDNN is slower than flash at a shape its row covers (the table is out
of date: paste the printed rows).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import emit, time_cuda  # noqa: E402

from deltacp.parallel.attention_tiles import (CUDNN_TILES, Tile, TileAccumulator, pack_diagonals,  # noqa: E402
                                              plan_span_tiles, tile_backward, tile_forward)


def _inputs(H, Hk, D, lq, lk, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(1, H, lq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, Hk, lk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v


def _one_tile(kernel, t, q, k, v, scale):
    """Forward of one tile and what its backward needs (the merged o and lse of a lone tile are its own)."""
    acc = TileAccumulator(q)
    o_t, lse_t, meta = tile_forward(kernel, t, q, k, v, scale)
    acc.add(t, o_t, lse_t)
    return acc.o.to(q.dtype), acc.lse, meta


def time_tile(args, kernel, t, q, k, v):
    scale = q.shape[-1] ** -0.5
    do = torch.randn_like(q)
    fwd = time_cuda(lambda: tile_forward(kernel, t, q, k, v, scale), warmup=args.warmup, repeat=args.repeat)
    o, lse, meta = _one_tile(kernel, t, q, k, v, scale)
    bwd = time_cuda(lambda: tile_backward(kernel, t, meta, do, q, k, v, o, lse, scale), warmup=args.warmup,
                    repeat=args.repeat)
    return fwd["median_ms"], bwd["median_ms"]


def time_cudnn_gqa(args, q, k, v):
    """fwd+bwd ms of cuDNN on a visible tile with the query heads NOT folded (cuDNN's own GQA), for comparison with
    the folded form the tiles run."""
    scale = q.shape[-1] ** -0.5
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
    out = cudnn(q, k, v, None, True, 0.0, False, False, scale=scale)
    do = torch.randn_like(q)

    def backward():
        torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, out[0], out[1], out[6], out[7], None, out[2], out[3], out[4], out[5], 0.0, False, scale=scale)
    fwd = time_cuda(lambda: cudnn(q, k, v, None, True, 0.0, False, False, scale=scale), warmup=args.warmup,
                    repeat=args.repeat)
    return fwd["median_ms"] + time_cuda(backward, warmup=args.warmup, repeat=args.repeat)["median_ms"]


def backward_bits(kernel, t, q, k, v, deterministic):
    """Whether two identical backward calls give the same bits (dq, dk, dv)."""
    scale = q.shape[-1] ** -0.5
    do = torch.randn_like(q)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        o, lse, meta = _one_tile(kernel, t, q, k, v, scale)
        a = tile_backward(kernel, t, meta, do, q, k, v, o, lse, scale)
        b = tile_backward(kernel, t, meta, do, q, k, v, o, lse, scale)
        torch.cuda.synchronize()
    finally:
        torch.use_deterministic_algorithms(before)
    return all(torch.equal(x, y) for x, y in zip(a, b))


def shapes(lengths):
    """(kind, lq, lk): the diagonal squares, visible squares, and visible tiles of few queries on many keys."""
    out = [("diagonal", n, n) for n in lengths] + [("visible", n, n) for n in lengths]
    out += [("visible", n, 8 * n) for n in lengths if 8 * n <= max(lengths)]
    return out


def derived_rows(capability, results):
    """{(capability, head_dim, kind): shortest side} from which cuDNN wins at every measured shape."""
    rows = {}
    for (head_dim, kind) in sorted({(r["head_dim"], r["kind"]) for r in results}):
        measured = [(min(r["lq"], r["lk"]), r["speedup"]) for r in results
                    if (r["head_dim"], r["kind"]) == (head_dim, kind)]
        wins = [s for s in sorted({side for side, _ in measured})
                if all(speedup > 1.0 for side, speedup in measured if side >= s)]
        if wins:
            rows[(capability, head_dim, kind)] = min(wins)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 65536])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/attention_kernels.py needs a CUDA GPU")
    capability = torch.cuda.get_device_capability()
    print(f"{torch.cuda.get_device_name()} capability {capability}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}; {args.heads} query heads, {args.kv_heads} KV heads, bf16")
    start, failures, results = time.time(), [], []
    print(f"\n{'D':>4} {'kind':<8} {'lq':>6} {'lk':>6} | {'flash fwd':>9} {'bwd':>8} | {'cudnn fwd':>9} {'bwd':>8} | "
          f"{'speed-up':>8} | {'cudnn GQA unfolded':>18}")
    for D in args.head_dims:
        for kind, lq, lk in shapes(args.lengths):
            q, k, v = _inputs(args.heads, args.kv_heads, D, lq, lk)
            t = Tile((0, 1), (0, lq), (lk - lq, lk) if kind == "diagonal" else (0, lk), kind == "diagonal")
            ms = {kernel: time_tile(args, kernel, t, q, k, v) for kernel in ("flash", "cudnn")}
            unfolded = time_cudnn_gqa(args, q, k, v) if kind == "visible" else float("nan")
            row = dict(bench="attention_kernels", head_dim=D, kind=kind, lq=lq, lk=lk, capability=list(capability),
                       flash_fwd_ms=ms["flash"][0], flash_bwd_ms=ms["flash"][1], cudnn_fwd_ms=ms["cudnn"][0],
                       cudnn_bwd_ms=ms["cudnn"][1], speedup=sum(ms["flash"]) / sum(ms["cudnn"]),
                       cudnn_gqa_unfolded_ms=unfolded)
            results.append(row)
            if args.json:
                emit(row, args.json)
            print(f"{D:>4} {kind:<8} {lq:>6} {lk:>6} | {ms['flash'][0]:>9.2f} {ms['flash'][1]:>8.2f} | "
                  f"{ms['cudnn'][0]:>9.2f} {ms['cudnn'][1]:>8.2f} | {row['speedup']:>8.2f} | {unfolded:>18.2f}",
                  flush=True)
            if not all(math.isfinite(x) for x in (*ms["flash"], *ms["cudnn"])):
                failures.append(f"D {D} {kind} {lq}x{lk}: non-finite timing")
            del q, k, v
    measured = derived_rows(tuple(capability), results)
    print("\nCUDNN_TILES rows for this device (shorter tile side from which cuDNN is faster fwd+bwd at every "
          "measured shape):")
    for key, side in measured.items():
        print(f"    {key}: {side},")
    for (cap, D, kind), side in CUDNN_TILES.items():
        if tuple(cap) != tuple(capability) or D not in args.head_dims:
            continue
        slower = [r for r in results if (r["head_dim"], r["kind"]) == (D, kind) and min(r["lq"], r["lk"]) >= side
                  and r["speedup"] <= 1.0]
        if slower:
            failures.append(f"CUDNN_TILES row {(cap, D, kind)}: {side} but cuDNN is slower at "
                            f"{[(r['lq'], r['lk']) for r in slower]}")

    # cuDNN at shapes it has not seen: an execution plan is built (and cached) per shape
    D = max(args.head_dims)
    print("\nFirst call at a new shape (fwd+bwd, ms; what a batch of new document lengths would pay per tile):")
    for kernel in ("cudnn", "flash"):
        firsts, steadies = [], []
        for i, n in enumerate((8192 + 64, 8192 + 192, 8192 + 320)):
            q, k, v = _inputs(args.heads, args.kv_heads, D, n, n, seed=i)
            t = Tile((0, 1), (0, n), (0, n), True)
            do = torch.randn_like(q)

            def step():
                o, lse, meta = _one_tile(kernel, t, q, k, v, D ** -0.5)
                tile_backward(kernel, t, meta, do, q, k, v, o, lse, D ** -0.5)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            firsts.append(1e3 * (time.perf_counter() - t0))
            steadies.append(time_cuda(step, warmup=1, repeat=3)["median_ms"])
        print(f"  {kernel:<6} first {', '.join(f'{x:.1f}' for x in firsts)}; steady "
              f"{', '.join(f'{x:.1f}' for x in steadies)}")

    print("\nBackward bitwise reproducible run to run (16K diagonal / 16K x 16K visible):")
    for deterministic in (False, True):
        for kernel in ("cudnn", "flash"):
            same = []
            for causal in (True, False):
                q, k, v = _inputs(args.heads, args.kv_heads, D, 16384, 16384, seed=7)
                same.append(backward_bits(kernel, Tile((0, 1), (0, 16384), (0, 16384), causal), q, k, v,
                                          deterministic))
            print(f"  {kernel:<6} use_deterministic_algorithms({deterministic}): {same}")
            if deterministic and kernel == "flash" and not all(same):
                failures.append("flash under torch.use_deterministic_algorithms(True) is not reproducible")
    S = 65536
    for n in (10, 1000):
        q, k, v = _inputs(args.heads, args.kv_heads, D, S, S, seed=n)
        cu = torch.linspace(0, S, n + 1).round().long()
        (t,) = pack_diagonals(plan_span_tiles(1, S, [(0, S)], cu, None), None)
        same = backward_bits("flash_varlen", t, q, k, v, True)
        fwd, bwd = time_tile(args, "flash_varlen", t, q, k, v)
        print(f"varlen flash, 64K row of {n} documents: fwd {fwd:.2f} ms, bwd {bwd:.2f} ms; deterministic backward "
              f"reproducible: {same}")
        if not same:
            failures.append(f"varlen flash ({n} documents) under the deterministic switch is not reproducible")
    print(f"(wall {time.time() - start:.0f} s)")
    if failures:
        print("FAILED: " + "; ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
