"""The parity plot: 2x2 panels (loss, grad norm, and their relative differences to the single device).

Uses matplotlib when it is installed; otherwise a tiny pure-Python PNG rasteriser (zlib + struct, a 3x5
pixel font for titles and axis ranges), so CI needs no plotting dependency.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

COLORS = [(0, 0, 0), (31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]

LOG_FLOOR = 1e-10  # log panels show exact zeros (bitwise-equal steps) at this floor

# Panels: (title, {label: [(step, value), ...]}, log_y)
Panel = tuple[str, dict[str, list[tuple[int, float]]], bool]


def write_plot(path: str | Path, panels: list[Panel], title: str) -> str:
    """Write the PNG; returns which writer made it ("matplotlib" or "builtin")."""
    labels: list[str] = []
    for _, series, _ in panels:
        labels += [label for label in series if label not in labels]
    color_of = {label: COLORS[i % len(COLORS)] for i, label in enumerate(labels)}
    panels = [(name, {k: [(x, max(y, LOG_FLOOR) if log_y else y) for x, y in v] for k, v in series.items()}, log_y)
              for name, series, log_y in panels]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _write_builtin(Path(path), panels, title, color_of)
        return "builtin"
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (name, series, log_y) in zip(axes.flat, panels):
        for label, points in series.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], label=label,
                    color=[c / 255 for c in color_of[label]], lw=1.2)
        if log_y:
            ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


# ---------------------------------------------------------------------------------------------------------------
# Built-in rasteriser
# ---------------------------------------------------------------------------------------------------------------

_FONT = {  # 3x5 glyphs, rows top to bottom, 3 bits each
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001010010010",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "+": "000010111010000", ":": "000010000010000", "(": "010100100100010", ")": "010001001001010",
    "/": "001001010100100", "_": "000000000000111", "=": "000111000111000", ",": "000000000010100",
    " ": "000000000000000", "A": "010101111101101", "B": "110101110101110", "C": "111100100100111",
    "D": "110101101101110", "E": "111100111100111", "F": "111100111100100", "G": "111100101101111",
    "H": "101101111101101", "I": "111010010010111", "J": "001001001101111", "K": "101101110101101",
    "L": "100100100100111", "M": "101111111101101", "N": "110101101101101", "O": "111101101101111",
    "P": "111101111100100", "Q": "111101101111001", "R": "110101110101101", "S": "111100111001111",
    "T": "111010010010010", "U": "101101101101111", "V": "101101101101010", "W": "101101111111101",
    "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
}


class _Canvas:
    def __init__(self, width: int, height: int):
        self.w, self.h = width, height
        self.px = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, color) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i:i + 3] = bytes(color)

    def line(self, x0, y0, x1, y1, color, thick: int = 1) -> None:
        x0, y0, x1, y1 = int(round(x0)), int(round(y0)), int(round(x1)), int(round(y1))
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for t in range(thick):
                self.dot(x0, y0 + t, color)
            if x0 == x1 and y0 == y1:
                break
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, color=(0, 0, 0), scale: int = 2) -> None:
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT[" "])
            for r in range(5):
                for c in range(3):
                    if glyph[r * 3 + c] == "1":
                        for a in range(scale):
                            for b in range(scale):
                                self.dot(x + c * scale + a, y + r * scale + b, color)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + \
            chunk(b"IEND", b"")


def _fmt(v: float) -> str:
    return f"{v:.3g}" if 1e-2 <= abs(v) < 1e4 or v == 0 else f"{v:.1e}"


def _write_builtin(path: Path, panels: list[Panel], title: str, color_of: dict) -> None:
    W, H = 1200, 820
    cv = _Canvas(W, H)
    cv.text(20, 10, title, scale=3)
    pw, ph = W // 2, (H - 40) // 2
    for k, (name, series, log_y) in enumerate(panels):
        ox, oy = (k % 2) * pw, 40 + (k // 2) * ph
        left, top, right, bottom = ox + 80, oy + 50, ox + pw - 20, oy + ph - 40
        cv.text(ox + 80, oy + 10, name)
        pts = [(x, y) for s in series.values() for x, y in s if math.isfinite(y)]
        if not pts:
            continue
        tf = (lambda v: math.log10(max(v, LOG_FLOOR))) if log_y else (lambda v: v)
        xs, ys = [p[0] for p in pts], [tf(p[1]) for p in pts]
        x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
        if x1 == x0:
            x1 = x0 + 1
        if y1 == y0:
            y0, y1 = y0 - 1, y1 + 1
        for a, b, c, d in ((left, top, right, top), (left, bottom, right, bottom), (left, top, left, bottom),
                           (right, top, right, bottom)):
            cv.line(a, b, c, d, (120, 120, 120))
        ylab = (lambda v: _fmt(10 ** v)) if log_y else _fmt
        cv.text(ox + 4, top, ylab(y1))
        cv.text(ox + 4, bottom - 10, ylab(y0))
        cv.text(left, bottom + 8, str(int(x0)))
        cv.text(right - 40, bottom + 8, str(int(x1)))
        cv.text((left + right) // 2 - 16, bottom + 8, "STEP")
        for i, (label, points) in enumerate(series.items()):
            color = color_of[label]
            cv.line(right - 200, top + 10 + 16 * i, right - 180, top + 10 + 16 * i, color, thick=2)
            cv.text(right - 175, top + 5 + 16 * i, label, color)
            prev = None
            for x, y in points:
                if not math.isfinite(y):
                    prev = None
                    continue
                px = left + (x - x0) / (x1 - x0) * (right - left)
                py = bottom - (tf(y) - y0) / (y1 - y0) * (bottom - top)
                if prev is not None:
                    cv.line(prev[0], prev[1], px, py, color, thick=2)
                prev = (px, py)
    path.write_bytes(cv.png())
