"""Rank 0's progress: step, loss, grad norm, lr, tokens/s and peak memory, as a bar or one line per step."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch


def peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB alloc"
    return f"peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB rss"


class Progress:
    def __init__(self, total_steps: int, *, mode: str = "auto", interval: int = 1, metrics_file: str | None = None,
                 enabled: bool = True, stream=None):
        self.total, self.interval, self.enabled = total_steps, interval, enabled
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "line"
        self.mode = mode
        self.metrics = None
        if enabled and metrics_file:  # (preflight checked that its directory is writable or can be created)
            Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self.metrics = open(metrics_file, "a")
        self.start = time.perf_counter()
        self._open_bar = False

    def update(self, row: dict, device: torch.device) -> None:
        if not self.enabled:
            return
        if self.metrics is not None:
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()
        step = row["step"]
        if self.mode == "none" or (step % self.interval and step != self.total):
            return
        width = 20
        done = int(width * step / self.total)
        bar = "#" * done + "." * (width - done)
        line = (f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] loss {row['loss']:.4f} | "
                f"gnorm {row['grad_norm']:.3e} | lr {row['lr']:.2e} | {row['tokens_per_s']:,.0f} tok/s | "
                f"{peak_memory(device)}")
        if self.mode == "bar":
            self.stream.write("\r" + line)
            self._open_bar = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._open_bar:
            self.stream.write("\n")
            self._open_bar = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open_bar:
            self.stream.write("\n")
            self._open_bar = False
        if self.metrics is not None:
            self.metrics.close()
