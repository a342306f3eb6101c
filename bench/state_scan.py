"""p2p state passing, chain vs log-depth scan (`parallel/scan.py`): the time from "every rank has its summary"
to "every rank has its entering state", per rank, with P ranks simulated on one device.

    python bench/state_scan.py --device cuda --cp 2 4 8 16 32 64          # 32 heads, K = V = 128 (Qwen3.5 GDN)
    python bench/state_scan.py --device cpu --cp 2 3 5 8 --heads 2 --head-dim 16     # a check that it runs

What is measured: each simulated rank's own compute, step by step (CUDA events on a GPU, perf_counter on CPU),
with the kernels the distributed code runs (`ScanState` for the scan, `apply_summary` for the chain). What is
modelled: every message costs `--latency-us + bytes / --bw-gbps` (state the link you mean; the defaults are an
intra-node NVLink guess). The critical path is then evaluated message by message:
- chain: rank r's H_out leaves after H_in arrives and one apply M @ H + S; P - 1 messages of one state, P - 2
  applies (rank 0 sends S, the last rank applies nothing);
- scan: in round d a rank builds its message and posts its exchange; a message moves once sender and receiver
  have both posted; the exchange ends when the rank's send and receive have both arrived; then it absorbs. The
  time is when the last rank leaves the scan (a rank blocked on its send is not free either).
The summaries themselves (computed in both modes before any of this) are excluded. Backward is the same
computation on transposed maps in reverse rank order, so it costs the same.

Columns: chain / scan ms (compute only, then with the modelled links), rounds, bytes one rank sends at most, and
the summary buffers a rank holds besides its own (M, S): chain H_in and H_out; scan its peak of inc + exc + the
received message (a composition briefly adds its result).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from deltacp.ops.gdn.summary import apply_summary
from deltacp.parallel.scan import scan_rounds, scan_schedule, simulate_exclusive_scan


class StepClock:
    """Times steps on the device: CUDA events (read after one synchronize) or perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[object, object, object]] = []  # (key, start, end)

    @contextlib.contextmanager
    def step(self, key):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((key, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.pending.append((key, t0, time.perf_counter()))

    def collect(self) -> dict:
        """{key: seconds}, summed over steps with the same key."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict = {}
        for key, a, b in self.pending:
            s = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[key] = out.get(key, 0.0) + s
        self.pending.clear()
        return out


def random_maps(P: int, shape, dtype, device, seed: int = 0):
    B, H, K, V = shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    eye = torch.eye(K, dtype=dtype)
    ms = [None] + [(0.5 * eye + torch.randn(B, H, K, K, generator=gen, dtype=dtype) / (4 * K**0.5)).to(device)
                   for _ in range(1, P - 1)] + [None]  # rank 0: S only; the last rank computes no summary
    ss = [torch.randn(B, H, K, V, generator=gen, dtype=dtype).to(device) for _ in range(P - 1)] + [None]
    return ms, ss


def time_chain(ms, ss, clock: StepClock) -> list[float]:
    """Seconds of each rank's apply M @ H + S (ranks 1 .. P-2), the chain's compute on its critical path."""
    h = ss[0]
    for r in range(1, len(ss) - 1):
        with clock.step(r):
            h = apply_summary(ms[r], ss[r], h)
    spent = clock.collect()
    return [spent.get(r, 0.0) for r in range(len(ss))]


def time_scan(ms, ss, clock: StepClock) -> dict:
    """{(position, round, "out" | "in"): seconds} of one simulated scan."""
    simulate_exclusive_scan(ms, ss, on_step=lambda st, d, phase: clock.step((st.position, d, phase)))
    return clock.collect()


def message_bytes(P: int, shape, itemsize: int) -> list[list[int]]:
    """[round][position] bytes that position sends in that round (0: nothing)."""
    B, H, K, V = shape
    out = []
    for d in range(scan_rounds(P)):
        row = []
        for p in range(P):
            rnd = scan_schedule(p, P)[d]
            row.append(0 if rnd.send_to is None else B * H * K * (V + (K if rnd.send_m else 0)) * itemsize)
        out.append(row)
    return out


def live_bytes(P: int, shape, itemsize: int) -> int:
    """Peak over positions and rounds of inc + exc + the received message, from the schedule (what `ScanState`
    holds: [M | S] while a window does not reach position 0, else S alone)."""
    B, H, K, V = shape
    full, s_only = B * H * K * (K + V) * itemsize, B * H * K * V * itemsize
    peak = 0
    for p in range(P):
        inc = 0 if p == P - 1 else (s_only if p == 0 else full)
        exc = 0
        for rnd in scan_schedule(p, P):
            recv = 0 if rnd.recv_from is None else (full if rnd.recv_m else s_only)
            peak = max(peak, inc + exc + recv)
            if rnd.recv_from is not None:
                exc = recv
                if inc:
                    inc = full if rnd.recv_m else s_only
            if not rnd.inc_kept:
                inc = 0
    return peak


def critical_path_chain(apply_s: list[float], P: int, msg: int, lat: float, bw: float) -> float:
    t = 0.0
    for r in range(1, P):  # message r-1 -> r, then rank r's apply (none on the last rank)
        t += lat + msg / bw + apply_s[r]
    return t


def critical_path_scan(spent: dict, P: int, msgs: list[list[int]], lat: float, bw: float) -> float:
    """When the last rank leaves the scan. A message moves once both ends have posted their round (rendezvous) and
    takes lat + bytes / bw; a rank's exchange ends when its send and its receive have both arrived (one batch,
    waited whole), then it absorbs."""
    done = [0.0] * P  # when each position finished its previous round
    for d in range(scan_rounds(P)):
        posted = [done[p] + spent.get((p, d, "out"), 0.0) for p in range(P)]  # message built, exchange posted
        new = list(done)
        for p in range(P):
            rnd = scan_schedule(p, P)[d]
            t = posted[p]
            if rnd.recv_from is not None:
                t = max(t, max(posted[rnd.recv_from], posted[p]) + lat + msgs[d][rnd.recv_from] / bw)
            if rnd.send_to is not None:
                t = max(t, max(posted[rnd.send_to], posted[p]) + lat + msgs[d][p] / bw)
            new[p] = t + spent.get((p, d, "in"), 0.0)
        done = new
    return max(done)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32, help="value heads per rank (the state's H)")
    ap.add_argument("--head-dim", type=int, default=128, help="K = V")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--latency-us", type=float, default=15.0, help="modelled per-message latency")
    ap.add_argument("--bw-gbps", type=float, default=150.0, help="modelled link bandwidth, GB/s")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # one simulated rank at a time, as on its own core
    dtype = getattr(torch, args.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape = (args.batch, args.heads, args.head_dim, args.head_dim)
    lat, bw = args.latency_us * 1e-6, args.bw_gbps * 1e9
    state_bytes = args.batch * args.heads * args.head_dim ** 2 * itemsize
    clock = StepClock(device)
    print(f"# device {device}, state [B={shape[0]}, H={shape[1]}, K={shape[2]}, V={shape[3]}] {args.dtype} "
          f"({state_bytes / 2**20:.2f} MiB); links modelled as {args.latency_us:g} us + bytes / {args.bw_gbps:g} GB/s; "
          f"per-step median of {args.repeat}")
    head = (f"{'P':>4} {'rounds':>6} | {'chain ms':>9} {'scan ms':>9} | {'chain+link':>10} {'scan+link':>10} "
            f"{'faster':>6} | {'sent/rank chain':>15} {'sent/rank scan':>14} | {'buffers/rank chain':>18} "
            f"{'scan':>10}")
    print(head)
    print("-" * len(head))
    for P in args.cp:
        if P < 2:
            continue
        ms, ss = random_maps(P, shape, dtype, device)
        msgs = message_bytes(P, shape, itemsize)
        chain_runs, scan_runs = [], []
        for i in range(args.warmup + args.repeat):
            apply_s, spent = time_chain(ms, ss, clock), time_scan(ms, ss, clock)
            if i >= args.warmup:
                chain_runs.append(apply_s)
                scan_runs.append(spent)
        # the median of every step over the repeats, then the critical path (a max over ranks of noisy steps
        # would otherwise pick the worst outlier of each round)
        apply_s = [statistics.median(col) for col in zip(*chain_runs)]
        spent = {key: statistics.median(run[key] for run in scan_runs) for key in scan_runs[0]}
        chain_c = critical_path_chain(apply_s, P, 0, 0.0, 1e30) * 1e3
        scan_c = critical_path_scan(spent, P, msgs, 0.0, 1e30) * 1e3
        chain_l = critical_path_chain(apply_s, P, state_bytes, lat, bw) * 1e3
        scan_l = critical_path_scan(spent, P, msgs, lat, bw) * 1e3
        sent_scan = max(sum(msgs[d][p] for d in range(len(msgs))) for p in range(P))
        held_chain = 2 * state_bytes  # H_in and H_out, besides the rank's own (M, S) in both modes
        print(f"{P:>4} {scan_rounds(P):>6} | {chain_c:>9.3f} {scan_c:>9.3f} | {chain_l:>10.3f} {scan_l:>10.3f} "
              f"{'scan' if scan_l < chain_l else 'chain':>6} | {_mib(state_bytes):>15} {_mib(sent_scan):>14} | "
              f"{_mib(held_chain):>18} {_mib(live_bytes(P, shape, itemsize)):>10}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


if __name__ == "__main__":
    main()
