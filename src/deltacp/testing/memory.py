"""Peak resident memory of this process over a block of code (Linux), for the loading tests and bench/load.py.

    with PeakRSS() as peak:
        model = load_pretrained(...)
    peak.growth   # bytes: the highest resident set size inside the block, less the resident set size at its start

The kernel's high-water mark (VmHWM) is reset at the start of the block (`/proc/self/clear_refs`, "5", Linux 4.0+),
so the peak is the block's own, measured by the kernel (no sampling). Where the reset is refused, `exact` is False
and the peak is the process's lifetime high-water mark (an upper bound of the block's).
"""

from __future__ import annotations

from pathlib import Path


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakRSS:
    def __init__(self):
        self.start = self.peak = 0
        self.exact = False

    def __enter__(self) -> "PeakRSS":
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.exact = True
        except OSError:
            self.exact = False
        self.start = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        self.peak = _status_kib("VmHWM") * 1024

    @property
    def growth(self) -> int:
        return max(0, self.peak - self.start)
