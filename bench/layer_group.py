"""One layer group of a GDN hybrid (3 GDN layers + 1 full attention layer, Qwen3.5-2B shapes) under CP, per-rank cost
on one GPU: contiguous vs balanced sequence layout, p2p chain vs scan, 1-D vs 2-D.

    python bench/layer_group.py --cp 8 16 32 --global-len 131072 524288
    python bench/layer_group.py --device cpu --cp 4 8 --global-len 512 --hidden 64 ...   (a check that it runs)

One process simulates what ONE rank computes (fwd+bwd, bf16, the Triton GDN backend on CUDA), with communication
stated in bytes and turned into time only by stated links (as bench/attention_cp.py and bench/cp_layer.py do):

    configuration        GDN layer (x3)                               full attention layer
    contiguous 1-D       p2p over P ranks, chain (P - 1 hops)          all_gather / ring, queries [r s, (r+1) s)
    balanced 1-D         p2p, two pieces, chain (2P - 1 hops) or scan  all_gather / ring, pieces r and 2P-1-r
                         (ceil(log2 2P) rounds)
    contiguous 2-D u     Ulysses in groups of u, p2p chain across      Ulysses in groups, all_gather across
    balanced 2-D u       the same, two group pieces, scan across       the same, group pieces g and 2G-1-g

What is timed, and why only some ranks: a rank's attention work depends on which keys its queries see. Under the
contiguous layout it grows linearly with the rank (group) index g, so ranks g = 0 and G - 1 are timed and the mean
is their average (the linear work model); under the balanced layout it is the same on every rank by construction,
and ranks 0, G/2 and G - 1 are timed (their spread is reported; the mean is their average). A GDN layer costs the
same on every middle rank: one middle rank is timed per local length and layout, with a loopback state passing
(every state "arrives" at once), so its time holds the summaries, the local GDN and the dH_in pass but no wait.
The state passing itself is modelled message by message with the functions of bench/state_scan.py (its
measured small products on this device, --latency-us + bytes / --bw-gbps per message): the chain over P (or 2P)
positions, the scan over P (or 2P), forward and backward. Attention communication uses bench/attention_cp.py's
byte and link model (intra-node --intra-gbps inside --node-size GPUs, --inter-gbps across).

Modelled step of the layer group = 3 x (GDN compute + state passing fwd+bwd + halo and Ulysses all-to-all
bytes / link) + (attention compute of the slowest rank + its communication). Exits 1 if a timing is not finite.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention_cp  # noqa: E402
import state_scan  # noqa: E402
from cp_layer import LoopbackStatePassing, build_layer, fwd_bwd, loopback_halo  # noqa: E402
from timing import KERNEL_CLASSES, emit, profile_step  # noqa: E402


# ---------------------------------------------------------------------------------------------------------------
# Attention: one rank (group member) of one configuration
# ---------------------------------------------------------------------------------------------------------------


def attention_rank(args, method: str, P: int, S: int, u: int, g: int, balanced: bool, device, dtype,
                   profile: bool = False) -> dict:
    """fwd+bwd of the attention layer of member g of G = P / u groups: its group's tokens (u s, after the in-group
    Ulysses) for H / u query heads, against every key of the row (all_gather: the gathered row; ring: its own
    keys, the others passing by)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from deltacp.parallel.attention import ulysses_kv_heads
    from deltacp.parallel.attention_tiles import plan_span_tiles, ring_attention, tiled_attention
    from deltacp.parallel.placement import Pieces
    from deltacp.parallel.views import attention_view_of
    import deltacp.models.adapters  # noqa: F401  (registers the families' views: parallel/ knows no model class)

    H, Hk, D, B = args.heads, args.kv_heads, args.head_dim, 1
    G, L = P // u, u * (S // P)
    n_kv = Hk if u == 1 else ulysses_kv_heads(H, Hk, u).shape[1]
    module, config = attention_cp.attention_module(args, H // u, n_kv, device, dtype)
    view = attention_view_of(module)
    rotary = Qwen3_5TextRotaryEmbedding(config).to(device)
    pieces = Pieces(g, G, balanced, L)
    spans = pieces.spans()
    x = torch.randn(B, L, args.hidden, device=device, dtype=dtype, requires_grad=True)
    pos = pieces.row_index(device)[None]
    cos, sin = rotary(x, pos[None].expand(3, -1, -1))
    d_out = torch.randn_like(x)
    rest = torch.randn(2, B, n_kv, S - L, D, device=device, dtype=dtype, requires_grad=True)
    tiles = plan_span_tiles(B, S, spans, None, args.block)

    def step():
        q, k, v, gate = view.project(x, (cos, sin))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if method == "ring":
            o = ring_attention(q, k.contiguous(), v.contiguous(), tiles, module.scaling,
                               attention_cp.LoopbackRing(G, g), balanced=balanced, block=args.block)
        else:
            k_all, v_all = (_row_order(own, rest[i], spans) for i, own in enumerate((k, v)))
            o = tiled_attention(q, k_all, v_all, tiles, module.scaling)
        out = view.output(o.transpose(1, 2).reshape(B, L, -1), gate)
        out.backward(d_out)
        x.grad = rest.grad = None
        module.zero_grad(set_to_none=True)

    stats = attention_cp.time_call(step, args, device)
    if profile:
        stats["profile_ms"] = profile_step(step, args.profile_top)[0]
    del module, x, rest
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(stats, n_kv=n_kv)


def _row_order(own_BHLD: torch.Tensor, rest_BHRD: torch.Tensor, spans) -> torch.Tensor:
    """The row's keys [B, H, S, D]: the rank's own pieces at their spans, the other keys (`rest`, in row order)
    around them."""
    parts, r_at, l_at, row = [], 0, 0, 0
    for lo, hi in spans:
        parts.append(rest_BHRD[:, :, r_at:r_at + (lo - row)])
        r_at += lo - row
        parts.append(own_BHLD[:, :, l_at:l_at + (hi - lo)])
        l_at += hi - lo
        row = hi
    parts.append(rest_BHRD[:, :, r_at:])
    return torch.cat(parts, dim=2)


# ---------------------------------------------------------------------------------------------------------------
# GDN: one middle rank, and the state passing between ranks (modelled)
# ---------------------------------------------------------------------------------------------------------------


def gdn_rank(args, P: int, S: int, u: int, balanced: bool, device, dtype, mesh, profile: bool = False) -> dict:
    """fwd+bwd of a middle rank's GDN layer: Hv / u value heads (and their q/k heads) over the group's u s tokens
    (u = 1: all heads over s), p2p with a loopback state passing (member 1 of 3: every neighbouring piece is
    remote under both layouts, so every receive is served at once)."""
    from deltacp import LinearAttentionContextParallel, cp_layer_of

    Hk, Hv, K = args.qk_heads, args.v_heads, args.gdn_head_dim
    v_heads = Hv // u
    qk_heads = Hk // u if Hk % u == 0 else v_heads
    layer = LinearAttentionContextParallel(mode="p2p", backend=args.backend,
                                           sequence_layout="balanced" if balanced else "contiguous").apply(
        build_layer(_gdn_args(args), device, qk_heads=qk_heads, v_heads=v_heads), mesh)
    state = torch.randn(1, v_heads, K, K, device=device)
    cp_layer_of(layer).passing = LoopbackStatePassing(state, torch.randn_like(state))
    x = torch.randn(1, u * (S // P), args.hidden, device=device, dtype=dtype, requires_grad=True)
    with loopback_halo():
        step = fwd_bwd(layer, x, torch.randn_like(x))
        stats = attention_cp.time_call(step, args, device)
        if profile:
            stats["profile_ms"] = profile_step(step, args.profile_top)[0]
    del layer, x
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return stats


def _gdn_args(args):
    return argparse.Namespace(hidden=args.hidden, qk_heads=args.qk_heads, v_heads=args.v_heads,
                              head_dim=args.gdn_head_dim, dtype=args.dtype)


def passing_ms(args, n: int, v_heads: int, schedule: str, device, pairs: bool) -> float:
    """Modelled ms of one direction of the state passing over n positions (pieces), message by message with this
    device's small products (bench/state_scan.py). pairs: two positions per rank (balanced): each position's
    step costs both of its rank's steps (the two share a device; an upper bound)."""
    shape = (1, v_heads, args.gdn_head_dim, args.gdn_head_dim)
    key = (n, v_heads, schedule, pairs)
    if key in _PASSING:
        return _PASSING[key]
    clock = state_scan.StepClock(device)
    ms, ss = state_scan.random_maps(n, shape, torch.float32, device)
    lat, bw = args.latency_us * 1e-6, (args.across_gbps if args.across_gbps else args.intra_gbps) * 1e9
    state_bytes = shape[1] * shape[2] * shape[3] * 4
    runs = []
    for i in range(args.warmup + args.repeat):
        if schedule == "chain":
            runs.append(state_scan.time_chain(ms, ss, clock))
        else:
            runs.append(state_scan.time_scan(ms, ss, clock))
    runs = runs[args.warmup:]
    if schedule == "chain":
        apply_s = [statistics.median(col) for col in zip(*runs)]
        out = state_scan.critical_path_chain(apply_s, n, state_bytes, lat, bw) * 1e3
    else:
        spent = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        if pairs:
            spent = {(p, d, ph): t + spent.get((n - 1 - p, d, ph), 0.0) for (p, d, ph), t in spent.items()}
        out = state_scan.critical_path_scan(spent, n, state_scan.message_bytes(n, shape, 4), lat, bw) * 1e3
    _PASSING[key] = out
    return out


_PASSING: dict = {}


# ---------------------------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------------------------


def gbs(gbps: float) -> float:
    return gbps * 1e9 / 1e3  # bytes per ms


def configurations(args, P: int) -> list[dict]:
    """(name, layout, u, attention method, state passing) of every configuration at CP P."""
    out = [dict(name="contiguous 1-D", balanced=False, u=1, method=m, passing="chain") for m in ("all_gather", "ring")]
    out += [dict(name="balanced 1-D", balanced=True, u=1, method=m, passing=p)
            for m in ("all_gather", "ring") for p in ("chain", "scan")]
    for u in (2, 4, 8):
        if u < P and P % u == 0 and args.heads % u == 0 and args.v_heads % u == 0:
            out.append(dict(name=f"contiguous 2-D u={u}", balanced=False, u=u, method="all_gather", passing="chain"))
            out.append(dict(name=f"balanced 2-D u={u}", balanced=True, u=u, method="all_gather", passing="scan"))
    return [c for c in out if args.configs is None or c["name"].startswith(tuple(args.configs))]


def run(args, device, dtype, mesh) -> list[dict]:
    rows = []
    elem = torch.finfo(dtype).bits // 8
    K = args.gdn_head_dim
    conv_channels = 2 * args.qk_heads * K + args.v_heads * K
    for S in args.global_len:
        for P in args.cp:
            s = S // P
            attention_cache, gdn_cache = {}, {}
            for c in configurations(args, P):
                u, G, balanced = c["u"], P // c["u"], c["balanced"]
                akey = (c["method"], u, balanced)
                if akey not in attention_cache:
                    ranks = sorted({0, G // 2, G - 1}) if balanced else sorted({0, G - 1})
                    timed = {g: attention_rank(args, c["method"], P, S, u, g, balanced, device, dtype,
                                               profile=args.profile and g == ranks[-1])
                             for g in ranks}
                    times = [t["median_ms"] for t in timed.values()]
                    attention_cache[akey] = dict(
                        slowest=max(times), mean=statistics.mean(times) if balanced else (times[0] + times[-1]) / 2,
                        peak=max(t["peak_gib"] for t in timed.values()), n_kv=next(iter(timed.values()))["n_kv"],
                        profile=timed[ranks[-1]].get("profile_ms"))
                a = attention_cache[akey]
                gkey = (u, balanced)
                if gkey not in gdn_cache:
                    gdn_cache[gkey] = gdn_rank(args, P, S, u, balanced, device, dtype, mesh, profile=args.profile)
                gd = gdn_cache[gkey]
                # attention communication: bench/attention_cp.py's bytes and links
                scheme = c["method"] if u == 1 else f"2d-u{u}"
                intra, inter = attention_cp.comm_bytes(args, scheme, P, S, u, a["n_kv"], elem)
                attention_ms = attention_cp.modelled_ms(args, scheme, P, u, intra, inter, a["slowest"])
                # GDN communication: state passing (fwd + bwd), halo, in-group Ulysses all-to-alls
                positions = 2 * G if balanced else G
                v_heads = args.v_heads // u
                passing = 2 * passing_ms(args, positions, v_heads, c["passing"], device, balanced) if G > 1 else 0.0
                halo_bytes = 2 * 2 * (2 if balanced else 1) * 3 * conv_channels // u * elem  # fwd + bwd, per piece
                a2a_bytes = 0.0
                if u > 1:  # q|k|v|b|a out and o back, fwd and bwd, the share leaving the rank
                    a2a_bytes = 2 * s * (conv_channels + 2 * args.v_heads + args.v_heads * K) * elem * (u - 1) / u
                across = args.inter_gbps if P > args.node_size else args.intra_gbps
                gdn_ms = gd["median_ms"] + passing + halo_bytes / gbs(across) + a2a_bytes / gbs(
                    args.intra_gbps if u <= args.node_size else args.inter_gbps)
                row = dict(bench="layer_group", cp=P, global_len=S, config=c["name"], method=c["method"],
                           passing=c["passing"], u=u, attention_slowest_ms=a["slowest"],
                           attention_mean_ms=a["mean"], attention_imbalance=a["slowest"] / a["mean"],
                           attention_peak_gib=a["peak"], attention_model_ms=attention_ms,
                           gdn_compute_ms=gd["median_ms"], gdn_peak_gib=gd["peak_gib"], gdn_passing_ms=passing,
                           gdn_model_ms=gdn_ms, step_model_ms=3 * gdn_ms + attention_ms)
                if args.profile:  # the layer group's kernels: 3 GDN layers + the attention layer of the last rank
                    row["kernel_classes"] = {k: 3 * gd["profile_ms"].get(k, 0.0) + a["profile"].get(k, 0.0)
                                         for k in {*gd["profile_ms"], *a["profile"]}}
                rows.append(row)
                if args.json:
                    emit(row, args.json)
    return rows


def report(rows: list[dict]) -> bool:
    head = (f"{'CP':>3} {'tokens':>8} {'configuration':<20} {'attn':<10} {'pass':<5} | {'attn slow':>9} {'mean':>8} "
            f"{'slow/mean':>9} {'GiB':>6} | {'gdn ms':>7} {'pass ms':>7} {'GiB':>6} | {'step ms':>8}")
    print(head)
    print("-" * len(head))
    ok = True
    for r in rows:
        vals = [r[k] for k in r if k.endswith("_ms") or k.endswith("_gib")]
        ok &= all(math.isfinite(v) for v in vals)
        print(f"{r['cp']:>3} {r['global_len']:>8} {r['config']:<20} {r['method']:<10} {r['passing']:<5} | "
              f"{r['attention_slowest_ms']:>9.2f} {r['attention_mean_ms']:>8.2f} {r['attention_imbalance']:>9.3f} "
              f"{r['attention_peak_gib']:>6.2f} | {r['gdn_compute_ms']:>7.2f} {r['gdn_passing_ms']:>7.3f} "
              f"{r['gdn_peak_gib']:>6.2f} | {r['step_model_ms']:>8.2f}")
    profiled = [r for r in rows if "kernel_classes" in r]
    if profiled:
        classes = [c for c, _ in KERNEL_CLASSES] + ["other"]
        print("\nCUDA kernel time of the layer group by class (ms; share of its total): 3 x a middle rank's GDN layer "
              "+ the last timed rank's attention layer")
        print(f"{'CP':>3} {'tokens':>8} {'configuration':<20} {'attn':<10} " + " ".join(f"{c:>16}" for c in classes)
              + f" {'total':>9}")
        for r in profiled:
            prof, total = r["kernel_classes"], sum(r["kernel_classes"].values())
            print(f"{r['cp']:>3} {r['global_len']:>8} {r['config']:<20} {r['method']:<10} "
                  + " ".join(f"{prof.get(c, 0.0):>9.1f} ({100 * prof.get(c, 0.0) / total:>3.0f}%)" for c in classes)
                  + f" {total:>9.1f}")
    print("\nPer (CP, tokens): balanced 1-D (scan, best attention method) against contiguous 1-D (best method) and the"
          " best contiguous 2-D:")
    for key in sorted({(r["cp"], r["global_len"]) for r in rows}):
        group = [r for r in rows if (r["cp"], r["global_len"]) == key]
        best = lambda pred: min((r for r in group if pred(r)), key=lambda r: r["step_model_ms"], default=None)  # noqa: E731
        bal = best(lambda r: r["config"] == "balanced 1-D" and r["passing"] == "scan")
        con = best(lambda r: r["config"] == "contiguous 1-D")
        two = best(lambda r: r["config"].startswith("contiguous 2-D"))
        two_bal = best(lambda r: r["config"].startswith("balanced 2-D"))
        if bal is None or con is None:  # --configs left one side out: the steps measured, no ratio
            line = f"  CP{key[0]} {key[1]}: " + "; ".join(
                f"{r['config']} ({r['method']}, {r['passing']}) {r['step_model_ms']:.1f} ms"
                for r in (bal, con, two, two_bal) if r is not None)
            print(line)
            continue
        imb = max(r["attention_imbalance"] for r in group if r["config"] == "balanced 1-D")
        line = (f"  CP{key[0]} {key[1]}: balanced attention slowest/mean {imb:.3f} (contiguous "
                f"{max(r['attention_imbalance'] for r in group if r['config'] == 'contiguous 1-D'):.3f}); "
                f"step balanced 1-D {bal['step_model_ms']:.1f} ms ({bal['method']}) vs contiguous 1-D "
                f"{con['step_model_ms']:.1f} ({con['method']}): {con['step_model_ms'] / bal['step_model_ms']:.2f}x")
        if two is not None:
            line += (f"; vs best contiguous 2-D {two['config']} {two['step_model_ms']:.1f}: "
                     f"{two['step_model_ms'] / bal['step_model_ms']:.2f}x")
        if two_bal is not None:
            line += f"; best balanced 2-D {two_bal['config']} {two_bal['step_model_ms']:.1f}"
        print(line)
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cp", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--global-len", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8, help="full attention query heads")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256, help="full attention head dim")
    ap.add_argument("--qk-heads", type=int, default=16, help="GDN key heads")
    ap.add_argument("--v-heads", type=int, default=16, help="GDN value heads")
    ap.add_argument("--gdn-head-dim", type=int, default=128, help="GDN K = V")
    ap.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--backend", default=None, help="GDN backend: triton on CUDA, eager on CPU")
    ap.add_argument("--block", type=int, default=None, help="attention tile bound (None: the kernel's default)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--node-size", type=int, default=8)
    ap.add_argument("--intra-gbps", type=float, default=150.0, help="NVLink, GB/s")
    ap.add_argument("--inter-gbps", type=float, default=40.0, help="between nodes, GB/s")
    ap.add_argument("--across-gbps", type=float, default=None,
                    help="the state passing's link (default: --intra-gbps)")
    ap.add_argument("--latency-us", type=float, default=15.0, help="per-message latency of the state passing")
    ap.add_argument("--configs", nargs="+", default=None, metavar="PREFIX",
                    help="only the configurations whose name starts with one of these (e.g. 'balanced'); default all")
    ap.add_argument("--profile", action="store_true",
                    help="CUDA kernel time by class of each configuration's layer group (3 GDN layers of a middle "
                         "rank + the last timed rank's attention layer), one extra call each")
    ap.add_argument("--profile-top", type=int, default=8, help="with --profile: the kernels printed per call")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.backend = args.backend or ("triton" if cuda else "eager")
    if args.block is None:
        args.block = attention_cp_default_block(device, getattr(torch, args.dtype))
    dtype = getattr(torch, args.dtype)
    if args.profile and not cuda:
        ap.error("--profile reads CUDA kernel times: it needs --device cuda")
    if cuda:
        torch.cuda.set_device(0)
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from deltacp.distributed.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, device.type, mesh_dim_names=("cp",))
        print(f"# {device}, {args.dtype}, GDN backend {args.backend}; attention {args.heads}/{args.kv_heads} heads of "
              f"{args.head_dim}, GDN {args.qk_heads}/{args.v_heads} heads of {args.gdn_head_dim}, hidden "
              f"{args.hidden}; links: {args.intra_gbps:g} GB/s in a node of {args.node_size}, {args.inter_gbps:g} "
              f"across, {args.latency_us:g} us per state message; median of {args.repeat} after {args.warmup}")
        ok = report(run(args, device, dtype, mesh))
    finally:
        dist.destroy_process_group()
    if not ok:
        sys.exit("a timing is not finite")


def attention_cp_default_block(device, dtype) -> int:
    from deltacp.parallel.attention import DEFAULT_BLOCK
    from deltacp.parallel.attention_tiles import tile_kernel

    return DEFAULT_BLOCK[tile_kernel(torch.empty(0, device=device, dtype=dtype))]


if __name__ == "__main__":
    main()
