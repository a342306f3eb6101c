"""GDN op benchmark: eager fp32 PyTorch reference vs the Triton backend (timing method: bench/timing.py).

B=1, H=32, K=V=128 by default; forward, backward, fwd+bwd (median/min/p90 ms over CUDA events after warm-up),
peak allocated memory, rel-L2 of the Triton outputs and gradients vs eager, and a per-stage time breakdown.
Eager is deltacp's EagerGDNBackend in fp32 when importable, else transformers' torch_chunk_gated_delta_rule.

    PYTHONPATH=src python bench/gdn_op.py --lengths 8192 16384 32768 65536 --json out.jsonl
    PYTHONPATH=src python bench/gdn_op.py --varlen --fla    # packed 128K row of documents: ours vs FLA varlen
    PYTHONPATH=src python bench/gdn_op.py --dims 128,128 96,192 256,256 --lengths 16384 --no-eager --fla
                                                            # head dims (K,V) of the Triton contract
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fla_ref import load_fla, load_fla_varlen  # noqa: E402
from timing import emit, time_cuda  # noqa: E402

FLA_REF_MS = {8192: (0.93, 3.50), 16384: (1.42, 4.35), 32768: (2.19, 7.98), 65536: (4.34, 15.87)}  # fwd, fwd+bwd
TARGET_SPEEDUP = {8192: 12.7, 16384: 22.4, 32768: 40.1, 65536: 74.2}


def eager_fn():
    try:
        from deltacp.ops.gdn.eager import EagerGDNBackend

        be = EagerGDNBackend()
        return "deltacp-eager-fp32", lambda q, k, v, g, b, h0: be.chunk_gated_delta_rule(
            q, k, v, g, b, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    except ImportError:
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        def run(q, k, v, g, b, h0):
            rep = v.shape[2] // q.shape[2]
            q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
            return torch_chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)

        return "transformers-torch-fp32", run


def inputs(T, Hk, Hv, K, V, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = r(1, T, Hk, K).bfloat16(), r(1, T, Hk, K).bfloat16(), r(1, T, Hv, V).bfloat16()
    g = F.logsigmoid(r(1, T, Hv) + 2.0) * 0.5
    beta = torch.sigmoid(r(1, T, Hv)).bfloat16()
    h0 = r(1, Hv, K, V) * 0.1
    return [q, k, v, g, beta, h0]


def bench_impl(fn, xs, do, dht, warmup, repeat):
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    do = do.to(xs[2].dtype)  # the output's dtype (that of v), cast once here rather than in every timed backward

    def fwd():
        return fn(*leaves)

    def bwd(out):
        # autograd.grad, not .backward(): q, k, v stand for activations, so nothing accumulates into a .grad
        # (.backward() on these leaves adds five accumulation kernels, ~0.55 ms at 32K, to every step timed)
        o, ht = out
        torch.autograd.grad((o, ht), leaves, (do, dht))

    def fwdbwd():
        bwd(fwd())

    res = {"fwd": time_cuda(fwd, warmup=warmup, repeat=repeat),
           "bwd": time_cuda(bwd, warmup=warmup, repeat=repeat, setup=fwd),
           "fwdbwd": time_cuda(fwdbwd, warmup=warmup, repeat=repeat)}
    for x in leaves:
        x.grad = None
    o, ht = fwd()
    grads = torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), leaves)
    return res, (o.detach(), ht.detach(), [gr.detach() for gr in grads])


def stage_breakdown(warmup, repeat, T, Hk, Hv):
    """Median ms of each stage of the Triton op (the stages of bench/gdn_kernels.py at their current config)."""
    from gdn_kernels import make_stages

    stages, _ = make_stages(T, Hk, Hv)
    order = ["l2norm_qk", "tril_merge", "wu_fwd", "state_fwd", "o_fwd", "dv_local", "state_bwd", "dqkwg",
             "wy_bwd", "summary_fwd"]
    names = {"tril_merge": "wy_fwd (T, W, U)"}
    return {names.get(n, n): time_cuda(stages[n], warmup=warmup, repeat=repeat)["median_ms"] for n in order}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    p.add_argument("--hk", type=int, default=None, help="key heads (value heads are --hv); default 32, 16 with --varlen")
    p.add_argument("--hv", type=int, default=32)
    p.add_argument("--dims", nargs="+", default=["128,128"], metavar="K,V",
                   help="head dims (head_k_dim,head_v_dim) to time, each at every length (default 128,128)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--eager-warmup", type=int, default=2)
    p.add_argument("--eager-repeat", type=int, default=5)
    p.add_argument("--no-eager", action="store_true")
    p.add_argument("--stages", action="store_true", help="per-stage time breakdown of the Triton backend")
    p.add_argument("--fla", action="store_true",
                   help="also time flash-linear-attention (if installed), its Hopper backward guard bypassed")
    p.add_argument("--json", default=None, help="append JSON rows to this file")
    p.add_argument("--varlen", action="store_true",
                   help="packed documents instead: one row of --total tokens (log-normal document lengths, median "
                        "--median, a few > 32K, fixed seed), ours vs FLA varlen (with --fla) vs our unpacked op")
    p.add_argument("--total", type=int, default=131072)
    p.add_argument("--median", type=float, default=2048)
    p.add_argument("--profile", action="store_true", help="with --varlen: GPU time per kernel (torch.profiler) of "
                   "one fwd+bwd of our varlen and unpacked op, instead of the timing table")
    p.add_argument("--seed", type=int, default=7, help="document mix (fixed; the mix printed first)")
    a = p.parse_args()
    if a.hk is None:
        a.hk = 16 if a.varlen else 32
    if a.varlen:
        return varlen_main(a)
    fla = load_fla(bypass_hopper_guard=True) if a.fla else None
    if a.fla and fla is None:
        print("flash-linear-attention is not installed: the FLA columns show the issue's reference figures")

    from deltacp.ops.gdn.triton import TritonGDNBackend

    be = TritonGDNBackend()

    def tri(q, k, v, g, b, h0):
        return be.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)

    ename, efn = eager_fn()
    table = []
    dims = [tuple(int(d) for d in kv.split(",")) for kv in a.dims]
    for (K, V), T in [(kv, T) for kv in dims for T in a.lengths]:
        xs = inputs(T, a.hk, a.hv, K, V, seed=T)
        be.check(*xs[:5])
        do = torch.randn(1, T, a.hv, V, device="cuda").bfloat16().float()
        dht = torch.randn(1, a.hv, K, V, device="cuda")
        ours, (o, ht, gr) = bench_impl(tri, xs, do, dht, a.warmup, a.repeat)
        row = {"T": T, "Hk": a.hk, "Hv": a.hv, "K": K, "V": V, "impl": "triton",
               **{f"{s}_{k}": v for s, r in ours.items() for k, v in r.items()}}
        if not a.no_eager:
            exs = [x.float() for x in xs]
            eag, (eo, eht, egr) = bench_impl(efn, exs, do, dht, a.eager_warmup, a.eager_repeat)
            row.update({f"eager_{s}_{k}": v for s, r in eag.items() for k, v in r.items()})
            row["eager"] = ename
            row["rel_l2"] = {"o": rel(o, eo), "ht": rel(ht, eht),
                             **{f"d{n}": rel(x, y) for n, x, y in zip(("q", "k", "v", "g", "beta", "h0"), gr, egr)}}
            row["speedup_fwdbwd"] = eag["fwdbwd"]["median_ms"] / ours["fwdbwd"]["median_ms"]
        try:  # FLA at a head dim it refuses (or fails on): no FLA columns for that row
            fres, (fo, fht, fgr) = (None, (None,) * 3) if fla is None else bench_impl(fla[1], xs, do, dht, a.warmup,
                                                                                     a.repeat)
        except Exception as e:  # noqa: BLE001  (a timing reference, never a check)
            print(f"FLA failed at K={K} V={V} T={T}: {type(e).__name__}: {str(e)[:200]}")
            fres = None
            torch.cuda.empty_cache()
        if fres is not None:
            row.update({f"fla_{s}_{k}": v for s, r in fres.items() for k, v in r.items()})
            row["fla"] = fla[0]
            if not a.no_eager:  # FLA's own accuracy on this stack, against the same eager reference
                row["fla_rel_l2"] = {"o": rel(fo, eo), "ht": rel(fht, eht),
                                     **{f"d{n}": rel(x, y) for n, x, y in
                                        zip(("q", "k", "v", "g", "beta", "h0"), fgr, egr)}}
            del fo, fht, fgr
        if not a.no_eager:
            del eo, eht, egr
        if a.stages and (K, V) == (128, 128):
            row["stages_ms"] = stage_breakdown(a.warmup, a.repeat, T, a.hk, a.hv)
        emit(row, a.json)
        table.append(row)
        del o, ht, gr, xs
        torch.cuda.empty_cache()

    print(f"\nB=1 Hk={a.hk} Hv={a.hv}, bf16 in / fp32 state; median ms (CUDA events, warm-up {a.warmup}, "
          f"repeat {a.repeat}; eager warm-up {a.eager_warmup}, repeat {a.eager_repeat}); eager = {ename}")
    print(f"FLA columns: {fla[0] + ', measured here' if fla else 'the issue reference figures (not measured here)'}")
    print(f"{'K':>3} {'V':>3} {'T':>6} {'fwd':>7} {'bwd':>7} {'f+b':>7} {'peakGiB':>8} | {'eagF+B':>8} {'eagGiB':>7} "
          f"{'speedup':>8} {'target':>7} | {'FLAfwd':>6} {'FLAf+b':>6} | worst rel-L2")
    for r in table:
        e = r.get("eager_fwdbwd_median_ms", float("nan"))
        worst = max(r["rel_l2"].values()) if "rel_l2" in r else float("nan")
        nan2 = (float("nan"),) * 2  # the FLA figures are for K = V = 128
        ref_ms = FLA_REF_MS.get(r["T"], nan2) if (r["K"], r["V"]) == (128, 128) else nan2
        fla_ms = ((r["fla_fwd_median_ms"], r["fla_fwdbwd_median_ms"]) if "fla_fwd_median_ms" in r else ref_ms)
        print(f"{r['K']:>3} {r['V']:>3} {r['T']:>6} {r['fwd_median_ms']:7.2f} {r['bwd_median_ms']:7.2f} {r['fwdbwd_median_ms']:7.2f} "
              f"{r['fwdbwd_peak_gib']:8.2f} | {e:8.1f} {r.get('eager_fwdbwd_peak_gib', float('nan')):7.2f} "
              f"{r.get('speedup_fwdbwd', float('nan')):7.1f}x {TARGET_SPEEDUP.get(r['T'], float('nan')):6.1f}x | "
              f"{fla_ms[0]:6.2f} {fla_ms[1]:6.2f} | {worst:.2e}")
        if "rel_l2" in r:
            print("       ours rel-L2 vs eager: " + " ".join(f"{n}={x:.1e}" for n, x in r["rel_l2"].items()))
        if "fla_rel_l2" in r:
            print("       FLA rel-L2 vs eager: " + " ".join(f"{n}={x:.1e}" for n, x in r["fla_rel_l2"].items()))
        if "stages_ms" in r:
            print("       stages ms: " + " ".join(f"{n}={t:.3f}" for n, t in r["stages_ms"].items()))


def varlen_main(a):
    """One packed row: our varlen op, FLA's varlen op (--fla, when installed), our unpacked op on the same row (as
    one sequence: a reference for the cost of the re-layout and resets, not the same result). Accuracy of both
    varlen ops vs the eager backend's fp32 varlen result (--no-eager skips it)."""
    from deltacp.testing.documents import cu_of, doc_lengths

    from deltacp.ops.gdn.triton import TritonGDNBackend
    from deltacp.ops.gdn.varlen import VarlenLayout

    T, Hk, Hv = a.total, a.hk, a.hv
    big = (33 * 1024 + 517, 40 * 1024 + 3) if T >= 3 * 40 * 1024 else ()  # a few documents > 32K
    lens = doc_lengths(T, median=a.median, sigma=1.3, seed=a.seed, big=big)
    cu_cpu = cu_of(lens)
    layout = VarlenLayout.build(cu_cpu, T)  # built once per step, as a CP step hands it to every layer
    N = len(lens)
    sl = sorted(lens)
    print(f"packed row: T={T}, {N} documents, median {sl[N // 2]}, min {sl[0]}, max {sl[-1]}, "
          f"{sum(n > 32768 for n in lens)} > 32K, chunk-aligned layout {layout.padded} tokens "
          f"(+{100 * (layout.padded / T - 1):.1f}%); B=1 Hk={Hk} Hv={Hv} K=V=128 bf16")
    be = TritonGDNBackend()
    xs = inputs(T, Hk, Hv, 128, 128, seed=1)
    be.check(*xs[:5])
    do = torch.randn(1, T, Hv, 128, device="cuda").bfloat16().float()
    dht = torch.randn(1, Hv, 128, 128, device="cuda")

    def ours(q, k, v, g, b, h0):
        return be.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=layout)

    def unpacked(q, k, v, g, b, h0):
        return be.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)

    impls = [("ours varlen", ours)]
    fla = load_fla_varlen(bypass_hopper_guard=True) if a.fla else None
    if a.fla and fla is None:
        print("flash-linear-attention is not installed: no FLA rows (nothing measured for it)")
    if fla is not None:
        cu = cu_cpu.cuda()

        def theirs(q, k, v, g, b, h0):  # h0 enters document 0, the others start from 0; the last final state
            h0n = torch.cat([h0, h0.new_zeros(N - 1, *h0.shape[1:])])
            o, ht = fla[1](q, k, v, g, b, h0n, cu, cu_cpu)
            return o, ht[-1:]

        impls.append((f"{fla[0]} varlen", theirs))
    impls.append(("ours unpacked (1 seq)", unpacked))
    if a.profile:
        return profile_impls([i for i in impls if i[0].startswith("ours")], xs, do, dht)
    rows, outs = [], {}
    for name, fn in impls:
        torch.cuda.reset_peak_memory_stats()
        res, out = bench_impl(fn, xs, do, dht, a.warmup, a.repeat)
        rows.append((name, res))
        if "unpacked" not in name:
            outs[name] = out
        emit({"varlen": True, "T": T, "docs": N, "Hk": Hk, "Hv": Hv, "impl": name,
              **{f"{s}_{k}": v for s, r in res.items() for k, v in r.items()}}, a.json)
    errs = {}
    if not a.no_eager:
        from deltacp.ops.gdn.eager import EagerGDNBackend

        eb = EagerGDNBackend()

        def ref(q, k, v, g, b, h0):
            return eb.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True, cu_seqlens=layout)

        leaves = [x.detach().float().clone().requires_grad_() for x in xs]
        ro, rht = ref(*leaves)
        rg = torch.autograd.grad((ro * do).sum() + (rht * dht).sum(), leaves)
        for name, (o, ht, gr) in outs.items():
            errs[name] = {"o": rel(o, ro), "ht": rel(ht, rht),
                          **{f"d{n}": rel(x, y) for n, x, y in zip(("q", "k", "v", "g", "beta", "h0"), gr, rg)}}
        del ro, rht, rg, leaves
    print(f"\nmedian ms over CUDA events (warm-up {a.warmup}, repeat {a.repeat}), all measured on this device"
          + ("; FLA's Hopper backward guard was BYPASSED (FLA 0.6.0 refuses its backward on Hopper with Triton "
             "3.4-3.7.0): its figures and accuracy are on a stack FLA itself does not support" if fla else ""))
    print(f"{'impl':<40} {'fwd':>7} {'bwd':>7} {'f+b':>7} {'peakGiB':>8} | worst rel-L2 vs eager fp32 varlen")
    for name, r in rows:
        e = errs.get(name)
        print(f"{name:<40} {r['fwd']['median_ms']:7.2f} {r['bwd']['median_ms']:7.2f} {r['fwdbwd']['median_ms']:7.2f} "
              f"{r['fwdbwd']['peak_gib']:8.2f} | " + (f"{max(e.values()):.2e}" if e else "-"))
        if e:
            print("       " + " ".join(f"{n}={x:.1e}" for n, x in e.items()))


def profile_impls(impls, xs, do, dht, top=14):
    from torch.profiler import ProfilerActivity, profile

    do = do.to(xs[2].dtype)  # cast once, as in bench_impl
    for name, fn in impls:
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        for _ in range(2):  # warm-up (compiles)
            o, ht = fn(*leaves)
            torch.autograd.grad((o, ht), leaves, (do, dht))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            o, ht = fn(*leaves)
            torch.autograd.grad((o, ht), leaves, (do, dht))
            torch.cuda.synchronize()
        evs = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in evs) / 1e3
        print(f"\n{name}: GPU kernel time {total:.2f} ms (one fwd+bwd)")
        for e in evs[:top]:
            print(f"  {e.device_time_total / 1e3:8.3f} ms  x{e.count:<3d} {e.key[:90]}")


if __name__ == "__main__":
    main()
