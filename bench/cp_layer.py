"""Full linear attention layer under CP: forward+backward time per mode and backend (timing method: bench/timing.py).

The layer is transformers' Qwen3_5GatedDeltaNet (hidden 2048, QK/V heads 16/32, K = V = 128, bf16 by
default): projections, conv (with halo), q/k norm, GDN, gated norm, out projection.

Two ways to run it:

  CP job (any number of ranks; NCCL with one GPU per rank, gloo when ranks share a GPU):
    torchrun --nproc-per-node 4 bench/cp_layer.py --global-len 32768 65536 --modes ulysses p2p --backend triton
  Per-rank cost on one GPU (one process): the computation one rank performs under each mode at CP degree P,
  with communication stated in bytes and turned into time only by the explicit --bw-gbps / --latency-us:
    python bench/cp_layer.py --per-rank-cost --cp 4 8 --global-len 32768 65536 131072 --backend triton

Timing: warm-up 5, repeat 20, barrier + synchronize around each iteration, max over ranks per
iteration, median / min / p90; peak allocated memory (max over ranks). Prints a table; --json appends rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import emit, max_over_ranks, time_cuda  # noqa: E402


def layer_config(args, qk_heads=None, v_heads=None):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=1,
        layer_types=["linear_attention"], num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        linear_num_key_heads=qk_heads or args.qk_heads, linear_num_value_heads=v_heads or args.v_heads,
        linear_key_head_dim=args.head_dim, linear_value_head_dim=args.head_dim, linear_conv_kernel_dim=4)


def build_layer(args, device, qk_heads=None, v_heads=None):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from deltacp.models.gates import long_memory_gates_

    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(layer_config(args, qk_heads, v_heads), 0)
    return long_memory_gates_(layer).to(device=device, dtype=getattr(torch, args.dtype))


def self_mesh(device_type):
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    mine = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r])
        if r == rank:
            mine = group
    return DeviceMesh.from_group(mine, device_type, mesh_dim_names=("cp",))


def fwd_bwd(layer, x, d_out):
    def step():
        out = layer(x)
        out.backward(d_out)
        x.grad = None
        layer.zero_grad(set_to_none=True)
    return step


# ---------------------------------------------------------------------------------------------------
# CP job
# ---------------------------------------------------------------------------------------------------


def run_cp_job(args):
    from torch.distributed.device_mesh import DeviceMesh

    from deltacp import LinearAttentionContextParallel

    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh_dim_names=("cp",))
    rows = []
    for S in args.global_len:
        s = S // world
        for mode in args.modes:
            layer = LinearAttentionContextParallel(mode=mode, backend=args.backend).apply(
                build_layer(args, device), mesh)
            x = torch.randn(args.batch, s, args.hidden, device=device, dtype=layer.out_proj.weight.dtype,
                            requires_grad=True)
            d_out = torch.randn_like(x)
            stats = time_cuda(fwd_bwd(layer, x, d_out), warmup=args.warmup, repeat=args.repeat,
                              barrier=dist.barrier)
            peak = max_over_ranks(stats["peak_gib"])
            row = dict(bench="cp_layer", cp=world, global_len=S, local_len=s, mode=mode, backend=args.backend,
                       tokens_per_s=args.batch * S / (stats["median_ms"] / 1e3), **stats, peak_gib_max=peak)
            rows.append(row)
            if rank == 0 and args.json:
                emit(row, args.json)
            del layer, x, d_out
            torch.cuda.empty_cache()
    if rank == 0:
        print(f"\nCP layer fwd+bwd, CP{world}, hidden {args.hidden}, QK/V heads {args.qk_heads}/{args.v_heads}, "
              f"K=V={args.head_dim}, {args.dtype}, backend {args.backend}, B={args.batch}")
        print(f"{'global':>8} {'local':>7} {'mode':<11} {'median ms':>10} {'min ms':>8} {'p90 ms':>8} "
              f"{'tokens/s':>11} {'peak GiB':>9}")
        for r in rows:
            print(f"{r['global_len']:>8} {r['local_len']:>7} {r['mode']:<11} {r['median_ms']:>10.2f} "
                  f"{r['min_ms']:>8.2f} {r['p90_ms']:>8.2f} {r['tokens_per_s']:>11.0f} {r['peak_gib_max']:>9.2f}")
    if args.trace and "p2p" in args.modes:
        trace_p2p(args, mesh, device)


def trace_p2p(args, mesh, device):
    """One profiled p2p forward+backward per rank, written as Chrome traces (one file per rank)."""
    from torch.profiler import ProfilerActivity, profile

    from deltacp import LinearAttentionContextParallel

    S = args.global_len[0]
    layer = LinearAttentionContextParallel(mode="p2p", backend=args.backend).apply(build_layer(args, device), mesh)
    x = torch.randn(args.batch, S // dist.get_world_size(), args.hidden, device=device,
                    dtype=layer.out_proj.weight.dtype, requires_grad=True)
    step = fwd_bwd(layer, x, torch.randn_like(x))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    os.makedirs(args.trace, exist_ok=True)
    path = os.path.join(args.trace, f"p2p_rank{dist.get_rank()}.json")
    prof.export_chrome_trace(path)
    dist.barrier()
    if dist.get_rank() == 0:
        from trace_report import report

        print(report([os.path.join(args.trace, f"p2p_rank{r}.json") for r in range(dist.get_world_size())]))


# ---------------------------------------------------------------------------------------------------
# Per-rank cost on one GPU
# ---------------------------------------------------------------------------------------------------


class LoopbackStatePassing:
    """Stands in for a middle rank's StatePassing: H_in "arrives" at once, dH_out too; sends are kept.

    With it the p2p layer runs exactly a middle rank's computation (summary forward, M @ H_in + S, outputs
    and final state from H_in; backward: dH_in from the outputs, Mᵀ dH_out, the local backward with dH_out)
    with no communication. is_first and is_last together: a layer with no state passing at all. The p2p layer reads
    which pieces of the row it holds from (rank, size): a middle rank is 1 of 3 (under the balanced layout too,
    every neighbouring piece of rank 1 of 3 is remote), the first 0 of 3, the last 2 of 3, a lone one 0 of 1.
    """

    schedule = "chain"

    def __init__(self, state_in, grad_state_out, is_last=False, is_first=False, rank=None, size=None):
        self.is_first, self.is_last = is_first, is_last
        self.rank, self.size = (0, 1) if is_first and is_last else (0, 3) if is_first else (2, 3) if is_last else (1, 3)
        if rank is not None:  # a given position among `size` ranks (packed rows: which documents it holds)
            self.rank, self.size = rank, size
        self.log = None
        self.state_in, self.grad_state_out, self.sent = state_in, grad_state_out, []

    def send(self, t, peer, what):
        self.sent.append(t)

    def post_recv(self, like, peer, what):
        value = self.state_in if what == "H_in" else self.grad_state_out

        class Ready:
            def wait(self):
                return value

        return Ready()

    def wait_sends(self):
        self.sent.clear()


class loopback_halo:
    """The conv halo of a simulated rank: zeros of the right shape instead of the collective (its bytes are
    modelled; a loopback rank's process group has one member, while its pieces say 1 of 3)."""

    def __enter__(self):
        import deltacp.parallel.conv as conv

        self.conv, self.saved = conv, conv.conv_halo_exchange
        conv.conv_halo_exchange = lambda x, halo, group, pieces: x.new_zeros(
            (pieces.per_member, x.shape[0], halo, x.shape[2]))
        return self

    def __exit__(self, *exc):
        self.conv.conv_halo_exchange = self.saved


def run_per_rank_cost(args):
    from deltacp import LinearAttentionContextParallel, cp_layer_of
    from deltacp.ops.gdn.summary import apply_summary

    device = torch.device("cuda", 0)
    mesh = self_mesh("cuda")
    dtype_bytes = torch.finfo(getattr(torch, args.dtype)).bits // 8
    K = V = args.head_dim
    Hk, Hv, D, B = args.qk_heads, args.v_heads, args.hidden, args.batch
    rows = []
    for P in args.cp:
        for S in args.global_len:
            s = S // P
            # Ulysses: a rank runs H/P heads over all S tokens; its projections of s tokens x all channels
            # cost as much as S tokens x its channels, so an (Hk', Hv/P)-head layer over S tokens is its work.
            qk_local = Hk // P if Hk % P == 0 else Hv // P
            uly = LinearAttentionContextParallel(mode="ulysses", backend=args.backend).apply(
                build_layer(args, device, qk_heads=qk_local, v_heads=Hv // P), mesh)
            x = torch.randn(B, S, D, device=device, dtype=getattr(torch, args.dtype), requires_grad=True)
            u = time_cuda(fwd_bwd(uly, x, torch.randn_like(x)), warmup=args.warmup, repeat=args.repeat)
            del uly, x
            torch.cuda.empty_cache()
            conv_ch = 2 * Hk * K + Hv * V
            packed_ch = 2 * (qk_local * P) * K + Hv * V + 2 * Hv
            a2a_bytes = 2 * (s * B * (packed_ch + Hv * V) * dtype_bytes) * (P - 1) / P  # fwd + bwd, leaving rank
            # P2P middle rank: all heads over s tokens, summary, M @ H_in + S, outputs from H_in, dH_in.
            p2p = LinearAttentionContextParallel(mode="p2p", backend=args.backend).apply(build_layer(args, device),
                                                                                        mesh)
            state = torch.randn(B, Hv, K, V, device=device)
            cp_layer_of(p2p).passing = LoopbackStatePassing(state, torch.randn_like(state))
            x = torch.randn(B, s, D, device=device, dtype=getattr(torch, args.dtype), requires_grad=True)
            p = time_cuda(fwd_bwd(p2p, x, torch.randn_like(x)), warmup=args.warmup, repeat=args.repeat)
            # The last rank's work: the same minus the summary (nobody reads its H_out).
            cp_layer_of(p2p).passing = LoopbackStatePassing(state, torch.randn_like(state), is_last=True)
            last = time_cuda(fwd_bwd(p2p, x, torch.randn_like(x)), warmup=args.warmup, repeat=args.repeat)
            # No state passing at all (the same layer on s tokens alone): what p2p adds is middle - solo.
            cp_layer_of(p2p).passing = LoopbackStatePassing(state, torch.randn_like(state), is_last=True,
                                                                    is_first=True)
            solo = time_cuda(fwd_bwd(p2p, x, torch.randn_like(x)), warmup=args.warmup, repeat=args.repeat)
            m = torch.randn(B, Hv, K, K, device=device)
            hop = time_cuda(lambda: apply_summary(m, state, state), warmup=args.warmup, repeat=args.repeat)
            del p2p, x
            torch.cuda.empty_cache()
            state_bytes = B * Hv * K * V * 4
            halo_bytes = B * 3 * conv_ch * dtype_bytes
            p2p_bytes = 2 * (state_bytes + halo_bytes)
            bw = args.bw_gbps * 1e9 / 1e3  # bytes per ms
            lat = args.latency_us / 1e3
            uly_comm = a2a_bytes / bw + 4 * lat
            # The chain: forward and backward each wait (P-1) hops of (apply, latency, state transfer).
            chain = 2 * (P - 1) * (hop["median_ms"] + lat + state_bytes / bw)
            row = dict(bench="cp_layer_per_rank", cp=P, global_len=S, local_len=s, backend=args.backend,
                       ulysses_compute_ms=u["median_ms"], ulysses_peak_gib=u["peak_gib"], ulysses_bytes=a2a_bytes,
                       ulysses_model_ms=u["median_ms"] + uly_comm, p2p_compute_ms=p["median_ms"],
                       p2p_peak_gib=p["peak_gib"], p2p_bytes=p2p_bytes, p2p_hop_ms=hop["median_ms"],
                       p2p_model_ms=p["median_ms"] + chain + 2 * halo_bytes / bw,
                       compute_ratio=p["median_ms"] / u["median_ms"], bw_gbps=args.bw_gbps,
                       p2p_no_summary_ms=last["median_ms"],
                       summary_share=(p["median_ms"] - last["median_ms"]) / p["median_ms"],
                       p2p_solo_ms=solo["median_ms"],
                       p2p_overhead_share=(p["median_ms"] - solo["median_ms"]) / p["median_ms"],
                       latency_us=args.latency_us)
            rows.append(row)
            if args.json:
                emit(row, args.json)
    print(f"\nPer-rank cost on one GPU: hidden {D}, QK/V heads {Hk}/{Hv}, K=V={K}, {args.dtype}, backend "
          f"{args.backend}, B={B}; comm modelled with bw {args.bw_gbps} GB/s, latency {args.latency_us} us")
    print(f"{'CP':>3} {'global':>7} {'local':>6} | {'uly ms':>8} {'uly MiB':>8} {'uly GiB':>8} | {'p2p ms':>8} "
          f"{'p2p MiB':>8} {'p2p GiB':>8} {'hop ms':>7} {'summ %':>6} {'p2p %':>6} | {'p2p/uly':>7} | "
          f"{'model uly':>9} {'model p2p':>9}")
    for r in rows:
        print(f"{r['cp']:>3} {r['global_len']:>7} {r['local_len']:>6} | {r['ulysses_compute_ms']:>8.2f} "
              f"{r['ulysses_bytes'] / 2**20:>8.1f} {r['ulysses_peak_gib']:>8.2f} | {r['p2p_compute_ms']:>8.2f} "
              f"{r['p2p_bytes'] / 2**20:>8.1f} {r['p2p_peak_gib']:>8.2f} {r['p2p_hop_ms']:>7.3f} "
              f"{100 * r['summary_share']:>6.1f} {100 * r['p2p_overhead_share']:>6.1f} | "
              f"{r['compute_ratio']:>7.3f} | {r['ulysses_model_ms']:>9.2f} {r['p2p_model_ms']:>9.2f}")
    print("(ms: median fwd+bwd compute of one rank; MiB: bytes a rank sends per fwd+bwd; GiB: peak allocated;"
          " summ %: share of a middle p2p rank's time spent on the summary (vs the last rank, which has none);"
          " p2p %: share spent on all that state passing adds (vs the same layer with no state passing);"
          " model: compute + bytes/bw + latency terms, p2p adding its serial chain of P-1 hops each way)")


def run_packed_per_rank_cost(args):
    """Per-rank cost of a packed row (log-normal document mix): every rank's own slice is timed (its documents
    decide what it computes), and a step costs the slowest rank. ulysses: H/P heads over the whole row; p2p: the
    slice of rank r with the state passing of rank r (loopback, no communication)."""
    from deltacp import LinearAttentionContextParallel, cp_layer_of
    from deltacp.parallel.documents import CPForwardContext, PackedDocuments
    from deltacp.testing.documents import cu_of, doc_lengths

    device = torch.device("cuda", 0)
    mesh = self_mesh("cuda")
    dtype = getattr(torch, args.dtype)
    Hk, Hv, D, B, K, V = args.qk_heads, args.v_heads, args.hidden, 1, args.head_dim, args.head_dim
    rows = []
    for S in args.global_len:
        big = (33 * 1024 + 517, 40 * 1024 + 3) if S >= 3 * 40 * 1024 else ()
        lens = doc_lengths(S, median=args.median, sigma=1.3, seed=args.seed, big=big)
        cu = cu_of(lens)
        print(f"packed row: {S} tokens, {len(lens)} documents, median {sorted(lens)[len(lens) // 2]}, "
              f"max {max(lens)}")
        for P in args.cp:
            s = S // P
            ctx = CPForwardContext(documents=PackedDocuments.build(cu, S))
            qk_local = Hk // P if Hk % P == 0 else Hv // P
            uly = LinearAttentionContextParallel(mode="ulysses", backend=args.backend).apply(
                build_layer(args, device, qk_heads=qk_local, v_heads=Hv // P), mesh)
            x = torch.randn(B, S, D, device=device, dtype=dtype, requires_grad=True)
            d_out = torch.randn_like(x)

            def uly_step():
                uly(x, attention_mask=ctx).backward(d_out)
                x.grad = None
                uly.zero_grad(set_to_none=True)

            u = time_cuda(uly_step, warmup=args.warmup, repeat=args.repeat)
            del uly, x, d_out
            torch.cuda.empty_cache()
            p2p = LinearAttentionContextParallel(mode="p2p", backend=args.backend).apply(build_layer(args, device),
                                                                                        mesh)
            state = torch.randn(B, Hv, K, V, device=device)
            per_rank = []
            for r in range(P):
                cp_layer_of(p2p).passing = LoopbackStatePassing(
                    state, torch.randn_like(state), is_first=r == 0, is_last=r == P - 1, rank=r, size=P)
                x = torch.randn(B, s, D, device=device, dtype=dtype, requires_grad=True)
                d_out = torch.randn_like(x)

                def p2p_step():
                    p2p(x, attention_mask=CPForwardContext(documents=ctx.documents)).backward(d_out)
                    x.grad = None
                    p2p.zero_grad(set_to_none=True)

                per_rank.append(time_cuda(p2p_step, warmup=args.warmup, repeat=args.repeat))
            del p2p
            torch.cuda.empty_cache()
            worst = max(per_rank, key=lambda t: t["median_ms"])
            row = dict(bench="cp_layer_per_rank_packed", cp=P, global_len=S, documents=len(lens),
                       backend=args.backend, ulysses_ms=u["median_ms"], ulysses_peak_gib=u["peak_gib"],
                       p2p_slowest_rank_ms=worst["median_ms"], p2p_fastest_rank_ms=min(t["median_ms"] for t in per_rank),
                       p2p_peak_gib=max(t["peak_gib"] for t in per_rank))
            rows.append(row)
            if args.json:
                emit(row, args.json)
    print(f"\nPer-rank compute of a packed row (fwd+bwd, one GPU, no communication): hidden {D}, QK/V heads "
          f"{Hk}/{Hv}, K=V={K}, {args.dtype}, backend {args.backend}")
    print(f"{'CP':>3} {'global':>7} {'docs':>5} | {'uly ms':>8} {'uly GiB':>8} | {'p2p slowest':>11} "
          f"{'p2p fastest':>11} {'p2p GiB':>8} | {'p2p/uly':>7}")
    for r in rows:
        print(f"{r['cp']:>3} {r['global_len']:>7} {r['documents']:>5} | {r['ulysses_ms']:>8.2f} "
              f"{r['ulysses_peak_gib']:>8.2f} | {r['p2p_slowest_rank_ms']:>11.2f} {r['p2p_fastest_rank_ms']:>11.2f} "
              f"{r['p2p_peak_gib']:>8.2f} | {r['p2p_slowest_rank_ms'] / r['ulysses_ms']:>7.3f}")
    print("(all_gather is eager-only, a comparison mode: not timed here)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["ulysses", "p2p"], choices=["ulysses", "p2p", "all_gather"])
    parser.add_argument("--backend", default="triton", choices=["eager", "triton"])
    parser.add_argument("--global-len", type=int, nargs="+", default=[32768])
    parser.add_argument("--cp", type=int, nargs="+", default=[4, 8], help="CP degrees (per-rank cost mode)")
    parser.add_argument("--per-rank-cost", action="store_true", help="one process: per-rank computation by mode")
    parser.add_argument("--packed", action="store_true",
                        help="with --per-rank-cost: a packed row of log-normal documents (--median, --seed)")
    parser.add_argument("--median", type=float, default=2048, help="median document length (--packed)")
    parser.add_argument("--seed", type=int, default=7, help="document mix seed (--packed)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--qk-heads", type=int, default=16)
    parser.add_argument("--v-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--bw-gbps", type=float, default=200.0, help="link bandwidth for the comm model (GB/s)")
    parser.add_argument("--latency-us", type=float, default=10.0, help="per-message latency for the comm model")
    parser.add_argument("--trace", default=None, help="directory for p2p Chrome traces (CP job, p2p mode)")
    parser.add_argument("--json", default=None, help="append JSON rows to this file")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        sys.exit("bench/cp_layer.py needs a CUDA GPU")
    if "RANK" not in os.environ:  # plain python: a one-rank group
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    shared_gpu = world > torch.cuda.device_count()
    torch.cuda.set_device(0 if shared_gpu else local_rank)
    # NCCL refuses two ranks on one GPU: ranks sharing a GPU talk over gloo (staged through host memory).
    dist.init_process_group("gloo" if shared_gpu else "nccl")
    start = time.time()
    try:
        if args.per_rank_cost:
            with loopback_halo():
                run_packed_per_rank_cost(args) if args.packed else run_per_rank_cost(args)
        else:
            run_cp_job(args)
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        print(f"(wall {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
