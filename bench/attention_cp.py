"""Full attention under CP, per-rank cost on one GPU: Ulysses, KV all-gather, ring and 2-D (Ulysses u x all-gather).

    python bench/attention_cp.py --per-rank-cost --cp 8 16 32 --global-len 131072 262144 524288 1048576

The layer is transformers' Qwen3_5Attention (defaults: hidden 2048, 8 query heads, 2 KV heads, head dim 256, bf16,
as the 0.8B/2B models). One process simulates what ONE rank computes in each scheme at CP degree P and global
length S (fwd+bwd of projections, q/k norms, rotary, attention, output gate and projection), with the
communication stated in bytes and turned into time only by the stated bandwidths:

    scheme         rank's work (B = 1)                                          communication (per rank, fwd+bwd)
    ulysses        Hq/P heads over all S tokens (needs Hq % P == 0)              4 all-to-alls (q, k, v | o) over P
    all_gather      Hq heads, its s = S/P queries vs keys [0, (r+1) s)            KV all-gather + reduce-scatter over P
    ring           as all_gather, KV passed block by block (2 blocks in memory)  P-1 KV hops fwd, P-1 + P (KV, dKV) bwd
    2d-uN          Hq/N heads, its group's N s queries vs keys [0, (g+1) N s)   all-to-alls over N + KV all-gather
                                                                                 over P/N groups

Causal load imbalance: with contiguous slices the last rank (group) sees all earlier keys, the first only its
own; both are timed (`first`, `last`), the step costs the last. Ulysses is balanced (every rank sees the whole
row for its heads). The model: step time = compute of the slowest rank + bytes / bandwidth, NVLink
(--intra-gbps) inside a node of --node-size GPUs and the slower link (--inter-gbps) between nodes; Ulysses groups
are consecutive ranks (inside a node when u <= node size), the across-group traffic crosses nodes once P > node
size. Ring: compute + the part of its traffic not hidden behind compute (its hops overlap the tiles).

Two more measurements of the attention tiles alone (no projections):

    python bench/attention_cp.py --tiles          # per rank at CP4, 16K-128K tokens per rank: flash vs the table
    python bench/attention_cp.py --packed-docs    # a 64K packed row of 10 vs 1,000 documents

--tiles times one rank's tiles (all_gather and ring, contiguous and balanced layouts) with flash forced on every
tile (the kernel the tiles ran before the measured table) and with the table's choice (`CUDNN_TILES`: cuDNN
where it was measured faster), and fails below --min-speedup (1.5). With --tiles-before DIR it also times the
tiles of the deltacp source in DIR/src (e.g. `git archive 8764f85^1 src`, the source before the table: its kernels
and merges) in a child process, and the bound is then checked against that source. --packed-docs times Ulysses'
per-document attention of a whole packed row and a CP rank's tiles of it, at 10 and 1,000 documents of equal length
(and the per-document SDPA loop they replaced), and fails when 1,000 documents take more than --max-packed-ratio (1.3)
times the time of 10.

A correctness check runs first (bf16 tiles vs the fp32 reference at 8K: with documents, and without through each
fused kernel); the script exits 1 if it fails or any timing is not finite. --json appends rows. `--device cpu`
runs tiny shapes on the CPU (to check the script; times are not meaningful).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import emit, time_cuda  # noqa: E402


def attention_module(args, heads, kv_heads, device, dtype):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    config = Qwen3_5TextConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                               num_hidden_layers=1, layer_types=["full_attention"], num_attention_heads=heads,
                               num_key_value_heads=kv_heads, head_dim=args.head_dim, linear_num_key_heads=2,
                               linear_num_value_heads=2)
    torch.manual_seed(0)
    return Qwen3_5Attention(config, 0).to(device=device, dtype=dtype), config


def time_call(fn, args, device):
    if device.type == "cuda":
        return time_cuda(fn, warmup=args.warmup, repeat=args.repeat)
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "p90_ms": max(times), "peak_gib": 0.0}


class _Received:
    """A finished exchange (module level: a class made inside `exchange` is a reference cycle that keeps the
    received block alive until Python's cyclic collector runs, which inflated the peak memory of later rows)."""

    def __init__(self, block):
        self.block = block

    def wait(self):
        return self.block


class LoopbackRing:
    """A ring of `size` ranks seen from one rank: every exchange "receives" a block of the same shape at once."""

    def __init__(self, size, rank):
        self.size, self.rank, self.log = size, rank, None

    def exchange(self, t, what="kv"):
        return _Received(t.clone())


def rank_step(args, scheme, P, S, device, dtype, last):
    """fwd+bwd of one rank's attention layer under `scheme`; `last`: the last rank (group), else the first."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from deltacp.parallel.attention import causal_document_attention, ulysses_kv_heads
    from deltacp.parallel.views import attention_view_of
    from deltacp.parallel.attention_tiles import plan_tiles, ring_attention, tiled_attention
    import deltacp.models.adapters  # noqa: F401  (registers the families' views: parallel/ knows no model class)

    H, Hk, D, B = args.heads, args.kv_heads, args.head_dim, 1
    s = S // P
    if scheme == "ulysses":
        u, L, q0 = P, S, 0
    elif scheme in ("all_gather", "ring"):
        u, L = 1, s
        q0 = (P - 1) * s if last else 0
    else:  # 2d-uN
        u = int(scheme.split("u")[1])
        L = u * s
        q0 = (P // u - 1) * L if last else 0
    n_kv = Hk if u == 1 else ulysses_kv_heads(H, Hk, u).shape[1]
    module, config = attention_module(args, H // u, n_kv, device, dtype)
    view = attention_view_of(module)
    rotary = Qwen3_5TextRotaryEmbedding(config).to(device)
    x = torch.randn(B, L, args.hidden, device=device, dtype=dtype, requires_grad=True)
    pos = torch.arange(q0, q0 + L, device=device)[None]
    cos, sin = rotary(x, pos[None].expand(3, -1, -1))
    d_out = torch.randn_like(x)
    keys_elsewhere = S - L if scheme != "ulysses" else 0
    rest = torch.randn(2, B, n_kv, keys_elsewhere, D, device=device, dtype=dtype, requires_grad=True)

    def step():
        q, k, v, gate = view.project(x, (cos, sin))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if scheme == "ulysses":
            o = causal_document_attention(q, k, v, None, scale=module.scaling, dropout_p=0.0)
        else:
            tiles = plan_tiles(B, S, q0, L, None, args.block)
            if scheme == "ring":  # blocks of L keys pass by; the rank's own block is k, v
                o = ring_attention(q, k.contiguous(), v.contiguous(), tiles, module.scaling,
                                   LoopbackRing(S // L, q0 // L), block=args.block)
            else:  # the gathered row: keys before, own keys, keys after (all held, as the all-gather does)
                before, after = rest[:, :, :, :q0], rest[:, :, :, q0:]
                k_all = torch.cat([before[0], k, after[0]], dim=2)
                v_all = torch.cat([before[1], v, after[1]], dim=2)
                o = tiled_attention(q, k_all, v_all, tiles, module.scaling)
        out = view.output(o.transpose(1, 2).reshape(B, L, -1), gate)
        out.backward(d_out[:, :L] if out.shape[1] == L else d_out)
        x.grad = rest.grad = None
        module.zero_grad(set_to_none=True)

    stats = time_call(step, args, device)
    del module, x, rest
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return stats, u, n_kv


def comm_bytes(args, scheme, P, S, u, n_kv, elem):
    """(bytes inside a Ulysses group, bytes across groups) one rank sends per fwd+bwd of the layer."""
    H, Hk, D = args.heads, args.kv_heads, args.head_dim
    s = S // P
    if scheme == "ulysses":  # q | k | v out, o back; the same again in backward
        n_kv = ulysses_n_kv(args, P)
        return 2 * s * (H + 2 * n_kv * P + H) * D * elem * (P - 1) / P, 0.0
    a2a = 0.0
    if scheme.startswith("2d"):
        a2a = 2 * s * (H + 2 * n_kv * u + H) * D * elem * (u - 1) / u
    groups = P // u
    kv_per_group = u * s * n_kv * 2 * D * elem  # K and V of one group's tokens, one rank's heads
    if scheme == "ring":  # fwd: P-1 KV hops; bwd: P-1 KV hops + P dKV hops (fp32)
        return 0.0, (groups - 1) * kv_per_group * 2 + groups * kv_per_group * 4 / elem
    # all-gather fwd + reduce-scatter of the KV gradient bwd
    return a2a, 2 * (groups - 1) * kv_per_group


def ulysses_n_kv(args, degree):
    from deltacp.parallel.attention import ulysses_kv_heads

    return ulysses_kv_heads(args.heads, args.kv_heads, degree).shape[1]


def modelled_ms(args, scheme, P, u, intra_bytes, inter_bytes, compute_ms):
    """compute + transfer at the stated bandwidths (no overlap; ring: its hops overlap compute)."""
    gbs = lambda gbps: gbps * 1e9 / 1e3  # noqa: E731  bytes per ms
    node = args.node_size
    if scheme == "ulysses":  # one all-to-all over P ranks: the share to other nodes crosses the slow link
        remote = max(0, P - node) / max(P - 1, 1)
        return compute_ms + max(intra_bytes * (1 - remote) / gbs(args.intra_gbps),
                                intra_bytes * remote / gbs(args.inter_gbps))
    ulysses_ms = intra_bytes / gbs(args.intra_gbps if u <= node else args.inter_gbps)
    across_link = args.inter_gbps if P > node else args.intra_gbps
    across_ms = inter_bytes / gbs(across_link)
    if scheme == "ring":
        return compute_ms + ulysses_ms + max(0.0, across_ms - compute_ms)
    return compute_ms + ulysses_ms + across_ms


def correctness_check(device) -> list[str]:
    """bf16 tiles (the kernels CUDA uses) vs an fp32 reference, small tiles: rel-L2 < 1e-2. With documents (packed
    diagonals: varlen flash; visible tiles: flash), and without them through each fused kernel (the table's
    choice, cuDNN and flash forced)."""
    from deltacp.parallel.attention_tiles import pack_diagonals, plan_tiles, tiled_attention

    torch.manual_seed(0)
    S, H, Hk, D = (8192, 8, 2, 256) if device.type == "cuda" else (256, 4, 2, 16)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    documents = torch.tensor([0, 17, S // 3, S // 3 + 1, S // 2 + 5, S])
    q, k, v = (torch.randn(1, h, S, D, device=device) for h in (H, Hk, Hk))
    d_out = torch.randn(1, H, S // 2, D, device=device)
    failures = []
    for case, cu, kernel in (("documents", documents, None), ("table", None, None), ("cudnn", None, "cudnn"),
                             ("flash", None, "flash")):
        results = {}
        for name, dt, block in (("ref", torch.float64 if device.type == "cpu" else torch.float32, 1024),
                                ("tiles", dtype, 1000)):
            qq, kk, vv = (t.to(dt).requires_grad_() for t in (q, k, v))
            tiles = pack_diagonals(plan_tiles(1, S, S // 2, S // 2, cu, block), block)
            o = tiled_attention(qq[:, :, S // 2:], kk, vv, tiles, D ** -0.5, kernel=kernel if name == "tiles" else None)
            grads = torch.autograd.grad((o.float() * d_out).sum(), (qq, kk, vv))
            results[name] = (o, *grads)
        errors = {what: ((a.double() - b.double()).norm() / b.double().norm()).item()
                  for what, a, b in zip(("output", "dq", "dk", "dv"), results["tiles"], results["ref"])}
        print(f"check: {case} tiles {dtype} vs reference, rel-L2 (bound 1e-2): "
              + ", ".join(f"{what} {err:.2e}" for what, err in errors.items()))
        failures += [f"{case} tiles {what} rel-L2 {err:.2e}" for what, err in errors.items() if not err < 1e-2]
    return failures


def run_per_rank_cost(args, device):
    dtype = getattr(torch, args.dtype)
    elem = torch.finfo(dtype).bits // 8
    failures = correctness_check(device)
    rows = []
    for P in args.cp:
        for S in args.global_len:
            if S % P:
                continue
            schemes = []
            if args.heads % P == 0:
                schemes.append("ulysses")
            schemes += [x for x in ("all_gather", "ring") if x in args.schemes]
            schemes += [f"2d-u{u}" for u in args.two_d if u < P and P % u == 0 and args.heads % u == 0]
            for scheme in schemes:
                if scheme == "ulysses" and "ulysses" not in args.schemes:
                    continue
                gc.collect()  # nothing of the previous row stays allocated into this row's peak
                last, u, n_kv = rank_step(args, scheme, P, S, device, dtype, last=True)
                first = last if scheme == "ulysses" else rank_step(args, scheme, P, S, device, dtype, last=False)[0]
                intra, inter = comm_bytes(args, scheme, P, S, u, n_kv, elem)
                row = dict(bench="attention_cp_per_rank", cp=P, global_len=S, local_len=S // P, scheme=scheme,
                           ulysses_degree=u, kv_heads_per_rank=n_kv, heads=args.heads, kv_heads=args.kv_heads,
                           head_dim=args.head_dim, hidden=args.hidden, dtype=args.dtype,
                           last_ms=last["median_ms"], first_ms=first["median_ms"], last_p90_ms=last["p90_ms"],
                           peak_gib=max(last["peak_gib"], first["peak_gib"]), bytes_intra=intra, bytes_inter=inter,
                           model_ms=modelled_ms(args, scheme, P, u, intra, inter, last["median_ms"]),
                           intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps, node_size=args.node_size)
                if not all(math.isfinite(row[k]) for k in ("last_ms", "first_ms", "model_ms")):
                    failures.append(f"CP{P} {S} {scheme}: non-finite timing")
                rows.append(row)
                if args.json:
                    emit(row, args.json)
    print(f"\nFull attention per-rank cost on one {device.type}: hidden {args.hidden}, heads {args.heads}, KV heads "
          f"{args.kv_heads}, head dim {args.head_dim}, {args.dtype}, B=1, fwd+bwd; model: NVLink {args.intra_gbps} "
          f"GB/s inside a node of {args.node_size}, {args.inter_gbps} GB/s between nodes")
    print(f"{'CP':>3} {'global':>8} {'scheme':<10} {'kv/rk':>5} | {'last ms':>9} {'first ms':>9} {'last/1st':>8} | "
          f"{'MiB intra':>9} {'MiB inter':>9} {'peak GiB':>8} | {'model ms':>9}")
    for r in rows:
        print(f"{r['cp']:>3} {r['global_len']:>8} {r['scheme']:<10} {r['kv_heads_per_rank']:>5} | "
              f"{r['last_ms']:>9.2f} {r['first_ms']:>9.2f} {r['last_ms'] / r['first_ms']:>8.2f} | "
              f"{r['bytes_intra'] / 2**20:>9.1f} {r['bytes_inter'] / 2**20:>9.1f} {r['peak_gib']:>8.2f} | "
              f"{r['model_ms']:>9.2f}")
    print("(last/first: the causal imbalance of contiguous slices, slowest over fastest rank; MiB: bytes one rank "
          "sends per fwd+bwd inside its Ulysses group / across groups; model: last-rank compute + bytes at the stated "
          "bandwidths, ring hiding its hops behind compute)")
    if failures:
        print("FAILED: " + "; ".join(failures))
    return 1 if failures else 0


def tiles_step(args, method, balanced, P, L, kernel, device, dtype):
    """fwd+bwd of one rank's attention tiles (queries, keys and values given; no projections): all_gather, the rank's
    L queries against the gathered row of P L keys; ring, its own block and a loopback ring of P. Contiguous: the
    last rank (the slowest); balanced: rank 0 (every rank does the same work)."""
    from deltacp.parallel.attention import DEFAULT_BLOCK
    from deltacp.parallel.attention_tiles import plan_span_tiles, ring_attention, tile_kernel, tiled_attention
    from deltacp.parallel.placement import Pieces

    H, Hk, D, S = args.heads, args.kv_heads, args.head_dim, P * L
    g = 0 if balanced else P - 1
    torch.manual_seed(0)
    q = torch.randn(1, H, L, D, device=device, dtype=dtype, requires_grad=True)
    block = args.block or DEFAULT_BLOCK[tile_kernel(q)]
    tiles = plan_span_tiles(1, S, Pieces(g, P, balanced, L).spans(), None, block)
    keys = S if method == "all_gather" else L
    k, v = (torch.randn(1, Hk, keys, D, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    d_out = torch.randn(1, H, L, D, device=device, dtype=dtype)

    # kernel "default": no kernel or block keyword (the tiles of a deltacp source older than the table:
    # --tiles-before)
    chosen = {} if kernel == "default" else {"kernel": kernel}
    ring_bound = {} if kernel == "default" else {"block": block}

    def step():
        if method == "all_gather":
            o = tiled_attention(q, k, v, tiles, D ** -0.5, **chosen)
        else:
            o = ring_attention(q, k, v, tiles, D ** -0.5, LoopbackRing(P, g), balanced=balanced, **chosen,
                               **ring_bound)
        o.backward(d_out)
        q.grad = k.grad = v.grad = None

    stats = time_call(step, args, device)
    del q, k, v
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return stats["median_ms"]


def tiles_rows(args):
    """(tokens per rank, balanced, method) of every --tiles row."""
    return [(L, balanced, method) for L in args.local_len for balanced in (False, True)
            for method in ("all_gather", "ring")]


def tiles_before(args) -> dict:
    """ms per --tiles row of the deltacp source at --tiles-before (its own kernels and merges), timed in a child
    process that imports deltacp from there."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(args.tiles_before, "src"),
                                                        os.path.dirname(os.path.abspath(__file__))]))
    cmd = [sys.executable, os.path.abspath(__file__), "--tiles-worker", "--device", args.device,
           "--tiles-cp", str(args.tiles_cp), "--local-len", *map(str, args.local_len), "--heads", str(args.heads),
           "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim), "--dtype", args.dtype,
           "--warmup", str(args.warmup), "--repeat", str(args.repeat)]
    if args.block:
        cmd += ["--block", str(args.block)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"--tiles-before {args.tiles_before}: the child failed:\n{done.stderr[-3000:]}")
    out = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[(r["local_len"], r["balanced"], r["method"])] = r["ms"]
    return out


def run_tiles_worker(args, device):
    """--tiles-worker: the rows of --tiles with the imported deltacp's default kernels, one JSON line each."""
    import deltacp

    print(f"# deltacp from {os.path.dirname(deltacp.__file__)}", file=sys.stderr)
    dtype = getattr(torch, args.dtype)
    for L, balanced, method in tiles_rows(args):
        gc.collect()
        ms = tiles_step(args, method, balanced, args.tiles_cp, L, "default", device, dtype)
        print(json.dumps(dict(local_len=L, balanced=balanced, method=method, ms=ms)), flush=True)
    return 0


def run_tiles(args, device):
    """The tile kernels before and after: flash on every tile (the kernel before the table, with this source's
    merges) against the table's choice, per rank, fwd+bwd; with --tiles-before, also the tiles of that older source
    (its kernels and merges: the speed-up the issue asks for is against it). Fails unless every row is at least
    --min-speedup faster than the baseline: the older source when given, else flash on every tile."""
    dtype = getattr(torch, args.dtype)
    failures = correctness_check(device)
    before = tiles_before(args) if args.tiles_before else {}
    rows = []
    for L, balanced, method in tiles_rows(args):
        gc.collect()
        ms = {kernel: tiles_step(args, method, balanced, args.tiles_cp, L, kernel, device, dtype)
              for kernel in ("flash", None)}
        row = dict(bench="attention_cp_tiles", cp=args.tiles_cp, local_len=L, method=method,
                   layout="balanced" if balanced else "contiguous", heads=args.heads, kv_heads=args.kv_heads,
                   head_dim=args.head_dim, dtype=args.dtype, flash_ms=ms["flash"], table_ms=ms[None],
                   speedup=ms["flash"] / ms[None])
        if before:
            row.update(before_ms=before[(L, balanced, method)], speedup_before=before[(L, balanced, method)] / ms[None])
        rows.append(row)
        if args.json:
            emit(row, args.json)
        print(f"  {L:>7} {row['layout']:<10} {method:<10} flash {ms['flash']:9.2f} ms, "
              f"table {ms[None]:9.2f} ms, {row['speedup']:.2f}x", flush=True)
        gain = row.get("speedup_before", row["speedup"])
        if not (math.isfinite(gain) and gain >= args.min_speedup):
            failures.append(f"{L} {row['layout']} {method}: {gain:.2f}x < {args.min_speedup}x "
                            f"(vs {'the source before' if before else 'flash on every tile'})")
    print(f"\nAttention tiles per rank at CP{args.tiles_cp} on one {device.type} ({args.heads} heads, {args.kv_heads} "
          f"KV heads, head dim {args.head_dim}, {args.dtype}, B=1, fwd+bwd of the tiles alone; contiguous: the last "
          f"rank, balanced: rank 0); flash on every tile (the kernel before the table) vs the measured table "
          f"(attention_tiles.CUDNN_TILES)" + (f"; before: the deltacp source at {args.tiles_before}" if before else ""))
    extra = f" {'before ms':>9}" if before else ""
    print(f"{'tokens/rank':>11} {'layout':<10} {'method':<10} |{extra} {'flash ms':>9} {'table ms':>9} | "
          f"{'vs flash':>8}" + (f" {'vs before':>9}" if before else ""))
    for r in rows:
        print(f"{r['local_len']:>11} {r['layout']:<10} {r['method']:<10} |"
              + (f" {r['before_ms']:>9.2f}" if before else "")
              + f" {r['flash_ms']:>9.2f} {r['table_ms']:>9.2f} | {r['speedup']:>7.2f}x"
              + (f" {r['speedup_before']:>8.2f}x" if before else ""))
    if failures:
        print("FAILED: " + "; ".join(failures))
    return 1 if failures else 0


def document_loop(q, k, v, cu, scale):
    """The per-document attention before the packed tiles: one causal SDPA per document (for comparison)."""
    import torch.nn.functional as F

    bounds = cu.tolist()
    return torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                                     scale=scale, enable_gqa=True)
                      for a, b in zip(bounds[:-1], bounds[1:])], dim=2)


def run_packed_docs(args, device):
    """A packed row of --packed-len tokens holding n documents of equal length, n in --docs: fwd+bwd of Ulysses'
    per-document attention over the whole row (cp = 1, or one Ulysses rank's heads) and of a CP rank's tiles
    (all_gather, the last of --tiles-cp contiguous ranks), the tile plan built in every step as the model does; and
    the per-document SDPA loop it replaces. Fails unless the most documents take at most --max-packed-ratio times
    the time of the fewest."""
    from deltacp.parallel.attention import DEFAULT_BLOCK, causal_document_attention
    from deltacp.parallel.attention_tiles import tile_kernel, tiled_attention
    from deltacp.parallel.documents import AttentionDocuments

    dtype = getattr(torch, args.dtype)
    H, Hk, D, S, P = args.heads, args.kv_heads, args.head_dim, args.packed_len, args.tiles_cp
    L = S // P
    torch.manual_seed(0)
    q = torch.randn(1, H, S, D, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, Hk, S, D, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    d_out = torch.randn_like(q)
    scale = D ** -0.5
    block = args.block or DEFAULT_BLOCK[tile_kernel(q)]

    def path(name, cu):
        if name == "row":
            return lambda: causal_document_attention(q, k, v, AttentionDocuments.build(cu), scale=scale,
                                                     dropout_p=0.0).backward(d_out)
        if name == "cp rank":
            def rank():
                tiles = AttentionDocuments.build(cu).tiles(1, S, [(S - L, S)], block)
                tiled_attention(q[:, :, S - L:], k, v, tiles, scale).backward(d_out[:, :, S - L:])
            return rank
        return lambda: document_loop(q, k, v, cu, scale).backward(d_out)

    rows, failures = [], []
    for name in ("row", "cp rank", "loop (before)"):
        ms = {}
        for n in args.docs:
            cu = torch.linspace(0, S, n + 1).round().long()
            ms[n] = time_call(path(name, cu), args, device)["median_ms"]
            q.grad = k.grad = v.grad = None
        ratio = ms[max(args.docs)] / ms[min(args.docs)]
        rows.append((name, ms, ratio))
        if args.json:
            emit(dict(bench="attention_packed_docs", path=name, tokens=S, docs=list(ms), ms=list(ms.values()),
                      ratio=ratio), args.json)
        if name != "loop (before)" and not (math.isfinite(ratio) and ratio <= args.max_packed_ratio):
            failures.append(f"{name}: {max(args.docs)} documents take {ratio:.2f}x the time of {min(args.docs)} "
                            f"(bound {args.max_packed_ratio}x)")
    print(f"\nPacked row of {S} tokens, documents of equal length, fwd+bwd ms ({H} heads, {Hk} KV heads, head dim {D}, "
          f"{args.dtype}; row: Ulysses' per-document attention over the whole row; cp rank: the last of {P} ranks' "
          f"{L} queries, all_gather tiles; plans built in every step)")
    print(f"{'path':<14} | " + " ".join(f"{str(n) + ' docs':>10}" for n in args.docs) + f" | {'ratio':>6}")
    for name, ms, ratio in rows:
        print(f"{name:<14} | " + " ".join(f"{ms[n]:>10.2f}" for n in args.docs) + f" | {ratio:>6.2f}")
    if failures:
        print("FAILED: " + "; ".join(failures))
    return 1 if failures else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-rank-cost", action="store_true", help="one process: per-rank cost by scheme")
    parser.add_argument("--tiles", action="store_true",
                        help="per-rank attention tiles, flash on every tile vs the measured kernel table")
    parser.add_argument("--packed-docs", action="store_true",
                        help="a packed row of few vs many documents (and the per-document loop before)")
    parser.add_argument("--local-len", type=int, nargs="+", default=[16384, 32768, 65536, 131072],
                        help="--tiles: tokens per rank")
    parser.add_argument("--tiles-before", default=None, metavar="DIR",
                        help="--tiles: also time the tiles of the deltacp source in DIR (DIR/src; e.g. a checkout of "
                             "the commit before the kernel table): the speed-up is then checked against it")
    parser.add_argument("--tiles-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tiles-cp", type=int, default=4, help="--tiles / --packed-docs: the CP degree simulated")
    parser.add_argument("--min-speedup", type=float, default=1.5, help="--tiles: fail below this speed-up")
    parser.add_argument("--packed-len", type=int, default=65536, help="--packed-docs: tokens of the packed row")
    parser.add_argument("--docs", type=int, nargs="+", default=[10, 1000], help="--packed-docs: document counts")
    parser.add_argument("--max-packed-ratio", type=float, default=1.3,
                        help="--packed-docs: fail when the most documents take more than this times the fewest")
    parser.add_argument("--cp", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--global-len", type=int, nargs="+", default=[131072, 262144])
    parser.add_argument("--schemes", nargs="+", default=["ulysses", "all_gather", "ring"],
                        choices=["ulysses", "all_gather", "ring"])
    parser.add_argument("--two-d", type=int, nargs="*", default=[2, 4], help="Ulysses degrees of the 2-D rows")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--block", type=int, default=None, help="tile bound in tokens (default: the kernel's)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--intra-gbps", type=float, default=350.0, help="NVLink bandwidth per GPU (GB/s)")
    parser.add_argument("--inter-gbps", type=float, default=50.0, help="between-node bandwidth per GPU (GB/s)")
    parser.add_argument("--node-size", type=int, default=8)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", default=None, help="append JSON rows to this file")
    args = parser.parse_args()
    modes = [m for m in ("per_rank_cost", "tiles", "packed_docs", "tiles_worker") if getattr(args, m)]
    if len(modes) != 1:
        sys.exit("bench/attention_cp.py: give one of --per-rank-cost, --tiles, --packed-docs (a multi-GPU job: "
                 "tests/gpu/multi_gpu_checks.py runs all_gather/ring/2-D over NCCL)")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/attention_cp.py needs a CUDA GPU (or --device cpu for a smoke run)")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cpu":
        args.dtype = "float32"
    start = time.time()
    rc = {"per_rank_cost": run_per_rank_cost, "tiles": run_tiles, "packed_docs": run_packed_docs,
          "tiles_worker": run_tiles_worker}[modes[0]](args, device)
    print(f"(wall {time.time() - start:.0f} s)")
    sys.exit(rc)


if __name__ == "__main__":
    main()
