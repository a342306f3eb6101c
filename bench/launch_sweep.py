"""Launch sweep of the SSD, KDA or selective-scan Triton kernels: per kernel, its num_warps, num_stages and tile
blocks (and SSD's GROUP_HEADS), by coordinate descent from the current launch table, timing the op's forward +
backward at one length.

Each candidate changes one setting of one kernel (the others at the best found so far). A candidate is kept only when
it compiles and launches (shared memory, registers) and its output, final state and every gradient stay within
`--match` rel-L2 of the source table's (a tiling changes the rounding, not the math; a miscompile shows as a large
difference). The candidates run in a worker process, restarted after a CUDA error (an illegal address loses the
context), and are timed against the current table measured in the same process. The printed table is a proposal:
the launch table changes only after the op's GPU tests pass with it. One setting at a time may miss a launch two
settings away (the selective scan's one-warp table, the KDA launches in bench/variants/): time those with --apply.

    python bench/launch_sweep.py --op kda --length 32768            # Kimi-Linear's 32 heads of 128, bf16
    python bench/launch_sweep.py --op ssd --length 32768            # Nemotron-H-8B's Mamba2 shape, bf16
    python bench/launch_sweep.py --op ssd --shape h128-g1-n256      # state 256's own entries (<name>/n256)
    python bench/launch_sweep.py --op selective --length 32768      # Falcon-Mamba-7B's Mamba1 shape, bf16
    python bench/launch_sweep.py --op kda --table-out t.json; python bench/launch_sweep.py --op kda --apply t.json \
        -- tests/gpu/test_kda_triton_gpu.py -q                         # the op's GPU tests on the proposal
    python bench/launch_sweep.py --op ssd --apply t.json -- bench/ssd_op.py --lengths 32768  # its bench on it
    echo '{"COMPOUND_PREC": 0}' > p.json; python bench/launch_sweep.py --op kda --apply p.json -- bench/kda_op.py
                                                                   # any other module constant the same way
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from op_peers import fwd_bwd, rel, timed_fwd_bwd  # noqa: E402
from timing import emit, time_cuda  # noqa: E402

# the neighbourhood of a setting; 1 and 2 warps and blocks of 8 since the selective scan's kernels ran fastest at one
# warp (2026-12-07), a launch these sets did not hold before (a block under a tl.dot's 16 fails to compile and is
# recorded as such)
BLOCKS = (8, 16, 32, 64)
WARPS = (1, 2, 4, 8)
SEGMENTS = (1, 2, 4)  # HS: the token segments of the selective scan's chunk_out and chunk_bwd
STAGES = (1, 2, 3)


SSD_SHAPE = "nemotron-h-8b"  # the SSD shape the table's plain entries are swept at (state 128)


def op_and_inputs(op: str, T: int | None, shape: str | None = None):
    """(the kernels' module, the launch names to sweep: those of bf16 inputs), and with a length T: (the module, the
    op, its inputs at the op's released shape, their names, the launch names). `shape` (SSD only, bench/ssd_op.py's
    SHAPES): a state size other than SSD_SHAPE's sweeps the "<name>/n<N>" entries (kernels._config)."""
    mod = importlib.import_module(f"deltacp.ops.{op}.triton.kernels")
    kernels = [n for n in mod.LAUNCH if "/" not in n]
    if op == "ssd" and shape not in (None, SSD_SHAPE):
        import ssd_op

        N, base_N = ssd_op.SHAPES[shape][2], ssd_op.SHAPES[SSD_SHAPE][2]
        if N != base_N:
            kernels = [f"{n}/n{N}" for n in kernels]
    if T is None:
        return mod, kernels
    if op == "kda":
        import kda_op as bench

        t = bench.make_inputs(T, 32, 128, 128, "slow", torch.bfloat16)
    elif op == "selective":
        import selective_op as bench

        t = bench.make_inputs(T, *bench.SHAPES["falcon-mamba-7b"], "slow", torch.bfloat16)
    else:
        import ssd_op as bench

        t = bench.make_inputs(T, *bench.SHAPES[shape or SSD_SHAPE], "slow", torch.bfloat16)
    return mod, bench.deltacp_op("triton"), t, bench.NAMES, kernels


def candidates(cfg: dict[str, int]):
    """Every config one setting away from cfg."""
    for key, values in (("num_warps", WARPS), ("num_stages", STAGES)):
        for v in values:
            if key in cfg and v != cfg[key]:
                yield {**cfg, key: v}
    for key in sorted(k for k in cfg if k.startswith("B")):
        for v in BLOCKS:
            if v != cfg[key]:
                yield {**cfg, key: v}
    for v in SEGMENTS if "HS" in cfg else ():
        if v != cfg["HS"]:
            yield {**cfg, "HS": v}


def child(job_path: str) -> None:
    """Measure the current table, then each trial of the job, one JSON line each; exits 3 at the first CUDA error
    (the context is lost: the parent starts a new process for the trials left)."""
    with open(job_path) as f:
        job = json.load(f)
    mod, fn, t, names, _ = op_and_inputs(job["op"], job["length"], job.get("shape"))
    y0, h0, g0 = fwd_bwd(fn, t, names)  # the reference: the table in the source, which the GPU tests verified
    ref = [y0.detach(), h0.detach()] + [g0[n].detach() for n in names]
    del y0, h0, g0

    def apply(table, group_heads):
        mod.LAUNCH.update({k: dict(v) for k, v in table.items()})
        if group_heads is not None:
            mod.GROUP_HEADS = group_heads

    def measure() -> tuple[float | None, str]:
        try:
            y, h, g = fwd_bwd(fn, t, names)
            worst = max(rel(a, b) for a, b in zip([y, h] + [g[n] for n in names], ref))
            if not worst <= job["match"]:
                return None, f"differs ({worst:.2e})"
            step = timed_fwd_bwd(fn, t, names)
            return time_cuda(step, warmup=2, repeat=job["repeat"])["median_ms"], f"rel {worst:.1e}"
        except torch.cuda.OutOfMemoryError as e:
            return None, f"OutOfMemoryError: {str(e).splitlines()[0][:80]}"
        except Exception as e:  # out of resources, a failed compile; a CUDA error ends the process
            note = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
            if "CUDA error" in str(e) or type(e).__name__ == "AcceleratorError":
                print(json.dumps({"index": job["next"], "ms": None, "note": note, "fatal": True}), flush=True)
                sys.exit(3)
            return None, note

    apply(job["table"], job.get("group_heads"))
    base, why = measure()
    print(json.dumps({"base": base, "note": why}), flush=True)
    for i, (name, trial) in enumerate(job["trials"]):
        if i < job["next"]:
            continue
        job["next"] = i
        if name == "GROUP_HEADS":
            apply(job["table"], trial)
        else:
            apply({**job["table"], name: trial}, job.get("group_heads"))
        ms, why = measure()
        print(json.dumps({"index": i, "ms": ms, "note": why}), flush=True)
        apply(job["table"], job.get("group_heads"))


def run_trials(args, table, group_heads, trials) -> tuple[float | None, list[tuple[float | None, str]]]:
    """(the current table's ms, [(ms or None, note)] per trial), each trial in a process that lives until a CUDA
    error."""
    results: list[tuple[float | None, str] | None] = [None] * len(trials)
    base, nxt = None, 0
    while nxt < len(trials):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(dict(op=args.op, length=args.length, shape=args.shape, match=args.match, repeat=args.repeat,
                           table=table,
                           group_heads=group_heads, trials=trials, next=nxt), f)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", f.name], capture_output=True,
                              text=True, env=os.environ)
        os.unlink(f.name)
        for line in proc.stdout.splitlines():
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            if "base" in row:
                base = row["base"] if base is None else min(base, row["base"] or base)
            elif "index" in row:
                results[row["index"]] = (row["ms"], row["note"])
                nxt = row["index"] + 1
        if proc.returncode not in (0, 3):
            print(proc.stderr[-2000:])
            raise SystemExit(f"the sweep's worker failed (exit {proc.returncode})")
    return base, results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=("kda", "ssd", "selective"))
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--shape", help=f"SSD only: a shape of bench/ssd_op.py's SHAPES (default {SSD_SHAPE}); another "
                    "state size sweeps its own entries, <name>/n<N>, starting from the plain ones")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--match", type=float, default=1e-2, help="rel-L2 bound against the source table's results")
    ap.add_argument("--gain", type=float, default=0.02, help="the least relative gain that moves the table")
    ap.add_argument("--budget", type=float, default=400, help="seconds; no kernel is started after them")
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--kernels", nargs="*", help="the launch names to sweep (default: all)")
    ap.add_argument("--table-out", help="write the proposed table here (JSON: the launch entries, GROUP_HEADS)")
    ap.add_argument("--apply", metavar="TABLE", help="with a --table-out table in place of the source's, run the "
                    "arguments after --: pytest's, or a bench script (bench/*.py) and its arguments")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:len(argv) - len(rest) - (1 if rest or "--" in argv else 0)])
    if args.apply:
        import pytest

        mod, _ = op_and_inputs(args.op, None)
        with open(args.apply) as f:
            proposal = json.load(f)
        for key, value in proposal.items():  # LAUNCH updated; any other module constant (GROUP_HEADS,
            if value is None:                  # COMPOUND_PREC) replaced; a name the module lacks is an error
                continue
            if not hasattr(mod, key):
                raise SystemExit(f"{args.apply}: {mod.__name__} has no {key}")
            if key == "LAUNCH":
                mod.LAUNCH.update(value)
            else:
                setattr(mod, key, value)
        if rest and rest[0].endswith(".py") and not os.path.basename(rest[0]).startswith("test_"):
            print(f"{rest[0]} with the proposed {args.op} table: {proposal}", flush=True)
            sys.argv = rest
            runpy.run_path(rest[0], run_name="__main__")
            return
        print(f"pytest with the proposed {args.op} table: {proposal}")
        raise SystemExit(pytest.main(rest))
    if args.worker:
        return child(args.worker)
    if args.op is None:
        ap.error("--op is required")
    start = time.time()
    if args.shape is not None and args.op != "ssd":
        ap.error("--shape is for --op ssd")
    mod, kernels = op_and_inputs(args.op, None, args.shape)
    table = {k: dict(v) for k, v in mod.LAUNCH.items()}
    for name in kernels:  # a state size's own entries start from the plain ones
        table.setdefault(name, dict(mod.LAUNCH[name.split("/")[0]]))
    group_heads = getattr(mod, "GROUP_HEADS", None)
    # GROUP_HEADS is one setting for every shape: swept at the plain entries' shape only
    sweep_groups = group_heads is not None and not args.kernels and all("/" not in n for n in kernels)
    # --kernels by their plain names; at another state size, that size's entries
    wanted = [next((n for n in kernels if n.split("/")[0] == k), k) for k in args.kernels or []]
    knobs = (wanted or list(kernels)) + (["GROUP_HEADS"] if sweep_groups else [])
    first = None
    for _, name in itertools.product(range(args.passes), knobs):
        if time.time() - start > args.budget:
            print("budget spent: stopping")
            break
        if name == "GROUP_HEADS":
            trials = [(name, v) for v in (4, 8, 16, 32) if v != group_heads]
        else:
            trials = [(name, c) for c in candidates(table[name])]
        base, results = run_trials(args, table, group_heads, trials)
        first = first or base
        print(f"{name}: the current table {base:.2f} ms")
        best, choice = base, None
        for (_, trial), (ms, note) in zip(trials, results):
            emit(dict(op=args.op, T=args.length, kernel=name, config=trial, ms=ms, base_ms=base, note=note), args.json)
            print(f"    {trial}: {'-' if ms is None else f'{ms:.2f} ms'} ({note})")
            if ms is not None and ms < best * (1 - args.gain):
                best, choice = ms, trial
        if choice is not None:
            print(f"  -> {name} = {choice}")
            if name == "GROUP_HEADS":
                group_heads = choice
            else:
                table[name] = choice
    print(f"{args.op} T={args.length}: from {first:.2f} ms; {time.time() - start:.0f} s. Proposed table:")
    for name in kernels:
        print(f"    {name!r}: {table[name]},")
    if group_heads is not None:
        print(f"    GROUP_HEADS = {group_heads}")
    if args.table_out:
        with open(args.table_out, "w") as f:
            json.dump({"LAUNCH": table, "GROUP_HEADS": group_heads}, f)


if __name__ == "__main__":
    main()
