"""Where the Triton GDN op spends its time, kernel by kernel, and which launch configuration is fastest.

--profile: torch.profiler over forward+backward of deltacp's Triton op (and of flash-linear-attention when
           installed, see bench/fla_ref.py), one row per GPU kernel: calls and ms per fwd+bwd, and for ours the
           unique HBM bytes each kernel must move and the time that takes at --hbm-tbps (its memory floor).
--time:    median ms (and extra peak memory) of named stages at their current configuration.
--sweep:   for each kernel in --kernels, time its stage under candidate launch configurations (block widths,
           warps, pipeline stages), check the result equals the current configuration's, print a table
           and the fastest configuration (to be copied into ops/gdn/triton/launch.py by hand).

    PYTHONPATH=src python bench/gdn_kernels.py --profile --length 65536
    PYTHONPATH=src python bench/gdn_kernels.py --sweep --length 32768 --kernels state_fwd state_bwd
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fla_ref import load_fla  # noqa: E402
from gdn_op import inputs  # noqa: E402
from timing import time_cuda  # noqa: E402


def grid(**axes):
    keys = list(axes)
    return [dict(zip(keys, vals)) for vals in itertools.product(*axes.values())]


# BV=16 with 8 warps: illegal memory access on the H200 (Triton 3.6, 2026-12-02), so not in the grid
SUMMARY_STATE_GRID = (grid(BV=[16, 32, 64], num_warps=[2, 4], num_stages=[1, 2, 3])
                      + grid(BV=[32, 64], num_warps=[8], num_stages=[1, 2]))
CANDIDATES = {
    "state_fwd": grid(BV=[32, 16, 64], num_warps=[4, 2], num_stages=[1, 2, 3]) + grid(BV=[32, 64], num_warps=[8],
                                                                                     num_stages=[1, 2, 3]),
    "state_bwd": grid(BV=[32, 16, 64], num_warps=[4, 2], num_stages=[1, 2, 3]) + grid(BV=[32, 64], num_warps=[8],
                                                                                     num_stages=[1, 2, 3]),
    "summary_state_fwd": SUMMARY_STATE_GRID,
    # SPLIT: 0 tf32 products, 1 bf16 products with hi/lo splits (wy.py says which)
    # (BK=32 with SPLIT>=1: illegal memory accesses on the H200, Triton 3.6, which poison the CUDA context for the
    # rest of the sweep; BK32 BV32 at 1 stage ran and was slower than BK64)
    "wy_bwd": grid(SPLIT=[0, 1], BK=[64], BV=[64], num_warps=[4, 8], num_stages=[1, 2]),
    "dqkwg": grid(BK=[64, 128], BV=[32, 64], num_warps=[2, 4, 8], num_stages=[1, 2, 3]),
    "o_fwd": grid(BV=[32, 64, 128], num_warps=[4, 8], num_stages=[2, 3]),
    "dv_local": grid(BV=[32, 64, 128], num_warps=[4, 8], num_stages=[2, 3]),
    "wu_fwd": [dict(SPLIT=s, BK=b, BV=b, num_warps=w, num_stages=st)
               for s, b, w, st in itertools.product([1, 0], [32, 64, 128], [4, 8], [1, 2, 3])],
    "kkt_inv_diag": grid(num_warps=[1, 2, 4]),
    "tril_merge": grid(MERGE_PREC=["tf32x3", "ieee"], num_warps=[1, 2, 4]),
}


REFERENCE_OUTPUTS = {"wy_bwd": ["dk", "dv", "dbeta", "dg"], "wu_fwd": ["w", "u"]}


def make_stages(T, Hk, Hv):
    """-> (name -> callable running that kernel's stage on fixed inputs, returning tensors to compare;
    name -> callable giving an fp64 reference of those tensors, where one exists)."""
    from deltacp.ops.gdn.triton import chunk as C
    from deltacp.ops.gdn.triton.chunk_h import state_bwd, state_fwd
    from deltacp.ops.gdn.triton.chunk_o import dqkwg, dv_local, o_fwd
    from deltacp.ops.gdn.triton.wy import wu_fwd, wy_bwd, wy_fwd, wy_inverse
    from deltacp.testing.wy_reference import wu_reference, wy_bwd_reference

    q, k, v, g, beta, h0 = inputs(T, Hk, Hv, 128, 128, seed=1)
    q, k = C.l2norm(q), C.l2norm(k)
    scale = q.shape[-1] ** -0.5
    do = torch.randn_like(v)
    dht = torch.randn_like(h0)
    gc = C.chunk_cumsum(g)
    ai, w, u = wy_fwd(k, v, beta, gc)
    h, vn, _ = state_fwd(k, w, u, gc, h0, output_final_state=True)
    lo = v.dtype  # the dtypes chunk_gdn_bwd uses between kernels
    dvl = dv_local(q, k, gc, do, scale, out_dtype=lo)
    dh, dvn, _ = state_bwd(q, k, w, gc, do, dvl, dht, scale=scale, V=v.shape[3], need_dh0=True, dvn_dtype=lo)
    _, dk, dw, _ = dqkwg(q, k, vn, h, dh, do, dvn, gc, scale, dq_dtype=lo)
    prepared = C.prepare_chunks_fwd(k, v, g, beta)
    s_w = C._summary_transition_w(k, v, beta, gc, ai)
    s_x0 = torch.eye(k.shape[3], device=k.device).expand(*h0.shape[:2], k.shape[3], k.shape[3]).contiguous()

    refs = {"wy_bwd": lambda: wy_bwd_reference(k, v, beta, gc, dw, dvn, dk),
            "wu_fwd": lambda: wu_reference(k, v, beta, gc)}
    return {
        "summary": lambda: C.state_summary(k, v, g, beta),
        "initial_state_grad": lambda: C.initial_state_grad(q, k, v, g, beta, do),
        "kkt_inv_diag": lambda: wy_inverse(k, beta, gc, v.shape[2]),
        "tril_merge": lambda: wy_inverse(k, beta, gc, v.shape[2]),
        "wu_fwd": lambda: wu_fwd(k, v, beta, gc, ai),
        "state_fwd": lambda: state_fwd(k, w, u, gc, h0, output_final_state=True),
        "o_fwd": lambda: o_fwd(q, k, vn, h, gc, scale),
        "dv_local": lambda: dv_local(q, k, gc, do, scale, out_dtype=lo),
        "state_bwd": lambda: state_bwd(q, k, w, gc, do, dvl, dht, scale=scale, V=v.shape[3], need_dh0=True,
                                       dvn_dtype=lo),
        "dqkwg": lambda: dqkwg(q, k, vn, h, dh, do, dvn, gc, scale, dq_dtype=lo),
        "wy_bwd": lambda: wy_bwd(k, v, beta, gc, ai, dw, dvn, dk, dk_dtype=lo, dv_dtype=lo),
        "l2norm_qk": lambda: (C.l2norm(q), C.l2norm(k)),
        "summary_fwd": lambda: C.state_summary_fwd(k, v, g, beta),
        # p2p's stages: the shared preparation, then the summary from it (M and S, or S alone as on rank 0)
        "prepare": lambda: C.prepare_chunks_fwd(k, v, g, beta),
        "summary_prepared": lambda: C.state_summary_fwd(k, v, None, beta, prepared=prepared),
        "summary_s_only": lambda: C.state_summary_fwd(k, v, None, beta, prepared=prepared, need_transition=False),
        "summary_state_fwd": lambda: state_fwd(k, s_w, None, gc, s_x0, store_h=False, store_vn=False,
                                               output_final_state=True, fp32_dot=True,
                                               dot_precision=C.SUMMARY_DOT_PRECISION),
    }, refs


def flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "__dataclass_fields__"):  # e.g. PreparedChunks: the tensors it holds
        out = [getattr(out, f) for f in out.__dataclass_fields__]
    return [t for x in out if x is not None for t in flat(x)]


def max_rel(a, b):
    return max(((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item() for x, y in zip(a, b))


def sweep(a):
    from deltacp.ops.gdn.triton.launch import LAUNCH

    stages, refs = make_stages(a.length, a.hk, a.hv)
    for name in a.kernels:
        table_cfg = LAUNCH[name]
        # each row runs the BV it names: the one-wave rule (FILL_BV, launch.fill_bv) is off during the sweep
        base_cfg = {k: v for k, v in table_cfg.items() if k != "FILL_BV"}
        ref = [t.clone() for t in flat(stages[name]())]
        exact = refs[name]() if name in refs else None  # fp64: tells a miscompiled shape from a reordering
        rows = []
        t_start = time.time()
        cands = [{}] + [c for c in CANDIDATES[name] if {**base_cfg, **c} != base_cfg]  # current one first
        for cand in cands:
            if time.time() - t_start > a.budget_s:
                print(f"  {name}: time budget of {a.budget_s}s reached, rest of the grid skipped", flush=True)
                break
            LAUNCH[name] = {**base_cfg, **cand}
            vs_exact = ""
            try:
                out = flat(stages[name]())
                again = flat(stages[name]())
                # a race or miscompile shows as run-to-run differences (each kernel writes its outputs once,
                # with no atomics, so a correct one is bitwise reproducible)
                vs_exact = "" if all(torch.equal(x, y) for x, y in zip(out, again)) else " NONDETERMINISTIC"
                err = max_rel(out, ref)
                if exact is not None:
                    vs_exact += " fp64: " + " ".join(f"{n}={max_rel([x], [y]):.1e}"
                                                    for n, x, y in zip(REFERENCE_OUTPUTS[name], out, exact))
                ms = time_cuda(stages[name], warmup=a.warmup, repeat=a.repeat)["median_ms"]
            except Exception as e:  # e.g. out of shared memory for this block shape: report, go on
                ms, err = float("nan"), float("nan")
                print(f"  {name} {cand}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            rows.append((ms, err, {**base_cfg, **cand}, vs_exact))
        LAUNCH[name] = table_cfg
        base_ms = rows[0][0] if rows else float("nan")
        base_exact = rows[0][3] if rows else ""
        rows.sort(key=lambda r: (r[0] != r[0], r[0]))
        print(f"\n{name} (T={a.length}; current {base_cfg}: {base_ms:.3f} ms{base_exact})")
        for ms, err, cand, vs_exact in rows[: a.top]:
            print(f"  {ms:8.3f} ms  rel vs current {err:.1e}{vs_exact}  {cand}")
        if rows and rows[0][1] == rows[0][1] and rows[0][1] > 1e-2:
            print("  WARNING: fastest configuration changes the result")


def time_stages(a):
    stages, _ = make_stages(a.length, a.hk, a.hv)
    print(f"T={a.length} Hk={a.hk} Hv={a.hv} K=V=128: median ms (warm-up {a.warmup}, repeat {a.repeat})")
    ref = None
    for name in a.time:
        out = [t.clone() for t in flat(stages[name]())]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ms = time_cuda(stages[name], warmup=a.warmup, repeat=a.repeat)["median_ms"]
        extra = (torch.cuda.max_memory_allocated() - base) / 2**30
        same_shapes = ref is not None and [t.shape for t in out] == [t.shape for t in ref]
        diff = f"  max rel vs {a.time[0]}: {max_rel(out, ref):.1e}" if same_shapes else ""
        print(f"  {name:<20} {ms:8.3f} ms  peak +{extra:.2f} GiB{diff}")
        ref = out if ref is None else ref


def dram_bytes(T, Hk, Hv, K=128, V=128, B=1):
    """Unique bytes each of our kernels must move through HBM for one call on bf16 inputs (every tensor read
    or written once; re-reads that hit L2 and the per-program scratch of wy_bwd not counted): a lower bound.
    -> kernel name prefix -> bytes per call."""
    e, f = 2, 4  # bf16, fp32
    nk, nv, nt = B * T * Hk, B * T * Hv, T // 64
    qk, vv, gb = nk * K * e, nv * V * e, nv * (f + e)  # q or k; v-sized bf16; g (fp32) + beta (bf16)
    wk = nv * K * e  # W, or k per value head
    ai, hs = nv * 64 * f, B * nt * Hv * K * V * e  # T = (I + A)^-1; per-chunk states (bf16)
    return {
        "l2norm_fwd": 2 * qk + nk * f,
        "l2norm_bwd": 3 * qk + nk * f,
        "kkt_inv_diag": qk + gb + nv * 16 * f,
        "tril_merge": qk + gb + nv * 16 * f + ai,
        "wu_fwd": ai + qk + vv + gb + wk + vv,
        "state_fwd": qk + wk + vv + nv * f + hs + vv,
        "o_fwd": 2 * qk + hs + vv + nv * f + vv,
        "dv_local": 2 * qk + nv * f + vv + vv,
        "state_bwd": 2 * qk + wk + nv * f + 2 * vv + hs + vv,
        "dqkwg": 2 * qk + 3 * vv + 2 * hs + nv * f + wk + 2 * nv * K * f + nv * f,
        "wy_bwd": qk + vv + gb + ai + nv * K * f + vv + nv * K * f + wk + vv + 2 * nv * f,
    }


def kernel_table(fn, iters):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name if len(e.name) < 60 else e.name[:57] + "..."
            per[name][0] += 1
            per[name][1] += e.device_time_total / 1000.0
    rows = sorted(((n, c / iters, t / iters) for n, (c, t) in per.items()), key=lambda r: -r[2])
    return rows


def profile_ops(a):
    from deltacp.ops.gdn.triton import TritonGDNBackend

    be = TritonGDNBackend()
    impls = [("deltacp-triton", lambda q, k, v, g, b, h0: be.chunk_gated_delta_rule(
        q, k, v, g, b, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True))]
    fla = load_fla(bypass_hopper_guard=True)
    if fla is not None:
        impls.append(fla)
    else:
        print("flash-linear-attention not installed: profiling deltacp only")
    xs = inputs(a.length, a.hk, a.hv, 128, 128, seed=2)
    do = torch.randn_like(xs[2])
    dht = torch.randn_like(xs[5])
    for label, fn in impls:
        leaves = [x.detach().clone().requires_grad_() for x in xs]

        def step():  # autograd.grad: no accumulation into .grad (q, k, v stand for activations)
            o, ht = fn(*leaves)
            torch.autograd.grad((o, ht), leaves, (do, dht))

        rows = kernel_table(step, a.repeat)
        total = sum(r[2] for r in rows)
        print(f"\n{label}: T={a.length} Hk={a.hk} Hv={a.hv} K=V=128, GPU kernel time per fwd+bwd {total:.2f} ms")
        ours = label.startswith("deltacp")
        floors = dram_bytes(a.length, a.hk, a.hv) if ours else {}
        print(f"  {'ms':>7} {'calls':>5}  " + (f"{'GB':>6} {'floor ms':>8} {'x floor':>7}  " if ours else "")
              + "kernel")
        floor_sum = 0.0
        for n, c, t in rows:
            if t < 0.005:
                continue
            key = next((k for k in floors if n.startswith(k + "_kernel")), None)
            if key is None:
                print(f"  {t:7.3f} {c:5.1f}  " + (" " * 26 if ours else "") + n)
                continue
            gb = floors[key] * c / 1e9
            floor_ms = gb / a.hbm_tbps
            floor_sum += floor_ms
            print(f"  {t:7.3f} {c:5.1f}  {gb:6.2f} {floor_ms:8.3f} {t / floor_ms:6.1f}x  {n}")
        if ours:
            print(f"  DRAM floor (unique bytes at {a.hbm_tbps} TB/s) of the kernels above: {floor_sum:.2f} ms")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", action="store_true", help="per-kernel time of fwd+bwd (deltacp, and FLA if installed)")
    p.add_argument("--sweep", action="store_true", help="launch-configuration sweep of --kernels")
    p.add_argument("--time", nargs="+", default=None, metavar="STAGE",
                   help="median ms of these stages at their current configuration (results of the same shapes "
                        "as the first are compared with it), e.g. summary initial_state_grad")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--hk", type=int, default=32)
    p.add_argument("--hv", type=int, default=32)
    p.add_argument("--kernels", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--top", type=int, default=5, help="rows printed per kernel")
    p.add_argument("--budget-s", type=float, default=60.0, help="wall-time limit per kernel's sweep")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for --profile's floor column "
                                                               "(H200: 4.8 TB/s peak)")
    a = p.parse_args()
    if not (a.profile or a.sweep or a.time):
        p.error("choose --profile, --sweep and/or --time")
    if a.time:
        time_stages(a)
    if a.profile:
        profile_ops(a)
    if a.sweep:
        sweep(a)


if __name__ == "__main__":
    main()
