"""Read per-rank Chrome traces of a p2p layer step and report the overlap and the serial chain.

    python bench/trace_report.py traces/p2p_rank0.json traces/p2p_rank1.json ...

Uses the `deltacp::` regions that the p2p path records (summary, output, H_in wait, sends). Times are
host times of the CPU-side regions (absolute across ranks of one host), in ms from rank 0's first region.
"""

from __future__ import annotations

import json


def _regions(path: str) -> dict[str, list[tuple[float, float]]]:
    with open(path) as f:
        trace = json.load(f)
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    out: dict[str, list[tuple[float, float]]] = {}
    for event in trace["traceEvents"]:
        name = event.get("name", "")
        if name.startswith("deltacp::") and event.get("ph") == "X":
            start = (base_us + event["ts"]) / 1e3
            out.setdefault(name, []).append((start, start + event.get("dur", 0) / 1e3))
    return out


def report(paths: list[str]) -> str:
    ranks = [_regions(p) for p in paths]
    t0 = min(min(s for s, _ in spans) for r in ranks for spans in r.values())

    def first(r, name, end=False):
        spans = r.get(name)
        return None if not spans else (spans[0][1] if end else spans[0][0]) - t0

    lines = ["p2p forward, per rank (ms from the first region of any rank):",
             f"{'rank':>4} {'summary':>17} {'H_in arrives':>13} {'H_out sent':>11} {'output':>17} "
             f"{'send vs output start':>21}"]
    for i, r in enumerate(ranks):
        summary = (first(r, "deltacp::p2p summary"), first(r, "deltacp::p2p summary", end=True))
        arrive = first(r, "deltacp::wait H_in", end=True)
        sent = first(r, "deltacp::send H_out")
        output = (first(r, "deltacp::p2p output"), first(r, "deltacp::p2p output", end=True))

        def fmt(x):
            return "-" if x is None else f"{x:.2f}"

        span = lambda a: "-" if a[0] is None else f"{a[0]:.2f}-{a[1]:.2f}"  # noqa: E731
        lead = "-" if sent is None or output[0] is None else f"{output[0] - sent:+.2f} ms"
        lines.append(f"{i:>4} {span(summary):>17} {fmt(arrive):>13} {fmt(sent):>11} {span(output):>17} {lead:>21}")
    start = first(ranks[0], "deltacp::send H_out")
    end = first(ranks[-1], "deltacp::wait H_in", end=True)
    if start is not None and end is not None:
        lines.append(f"serial chain: rank 0 sends H_out at {start:.2f} ms, the last rank has H_in at {end:.2f} ms: "
                     f"{end - start:.2f} ms over {len(ranks) - 1} hop(s)")
    lines.append("(send vs output start > 0: H_out left before the rank's own output kernels began)")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="one Chrome trace per rank, in rank order")
    print(report(parser.parse_args().traces))
