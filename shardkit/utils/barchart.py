"""Horizontal grouped bar charts as PNG files, with or without matplotlib.

The demo and the benchmark runner draw one chart each. With matplotlib importable the chart is
drawn by matplotlib; without it, by a small writer here (``zlib`` + ``struct``, a 5x7 pixel
font), so a fresh clone still gets its picture. Costs: no communication; one RGB image in
memory (width x height x 3 bytes).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

__all__ = ["BarGroup", "write_bar_chart"]

COLORS = ((52, 101, 164), (245, 121, 0), (115, 210, 22), (204, 0, 0), (117, 80, 123))


@dataclass(frozen=True)
class BarGroup:
    """One group of bars: a label and ``{series name: value}`` (the same series in every group)."""

    label: str
    values: dict


def write_bar_chart(path: str, title: str, groups: list) -> str:
    """Write ``groups`` as a horizontal grouped bar chart PNG at ``path``; returns a line
    saying how it was drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _write_plain_png(path, title, groups)
        return f"chart: {path} (drawn without matplotlib)"
    series = list(groups[0].values)
    fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 0.5 * len(groups) + 1.5))
    for ax, name in zip(axes if len(series) > 1 else [axes], series):
        ax.barh([g.label for g in groups][::-1], [g.values[name] for g in groups][::-1])
        ax.set_title(name, fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"chart: {path}"


# ----------------------------------------------------------------------------- plain PNG

# 5x7 glyphs, each row five bits (most significant bit on the left).
_GLYPHS = {
    "A": (14, 17, 17, 31, 17, 17, 17), "B": (30, 17, 17, 30, 17, 17, 30),
    "C": (14, 17, 16, 16, 16, 17, 14), "D": (30, 17, 17, 17, 17, 17, 30),
    "E": (31, 16, 16, 30, 16, 16, 31), "F": (31, 16, 16, 30, 16, 16, 16),
    "G": (14, 17, 16, 23, 17, 17, 15), "H": (17, 17, 17, 31, 17, 17, 17),
    "I": (14, 4, 4, 4, 4, 4, 14), "J": (7, 2, 2, 2, 2, 18, 12),
    "K": (17, 18, 20, 24, 20, 18, 17), "L": (16, 16, 16, 16, 16, 16, 31),
    "M": (17, 27, 21, 21, 17, 17, 17), "N": (17, 17, 25, 21, 19, 17, 17),
    "O": (14, 17, 17, 17, 17, 17, 14), "P": (30, 17, 17, 30, 16, 16, 16),
    "Q": (14, 17, 17, 17, 21, 18, 13), "R": (30, 17, 17, 30, 20, 18, 17),
    "S": (15, 16, 16, 14, 1, 1, 30), "T": (31, 4, 4, 4, 4, 4, 4),
    "U": (17, 17, 17, 17, 17, 17, 14), "V": (17, 17, 17, 17, 17, 10, 4),
    "W": (17, 17, 17, 21, 21, 21, 10), "X": (17, 17, 10, 4, 10, 17, 17),
    "Y": (17, 17, 10, 4, 4, 4, 4), "Z": (31, 1, 2, 4, 8, 16, 31),
    "0": (14, 17, 19, 21, 25, 17, 14), "1": (4, 12, 4, 4, 4, 4, 14),
    "2": (14, 17, 1, 2, 4, 8, 31), "3": (31, 2, 4, 2, 1, 17, 14),
    "4": (2, 6, 10, 18, 31, 2, 2), "5": (31, 16, 30, 1, 1, 17, 14),
    "6": (6, 8, 16, 30, 17, 17, 14), "7": (31, 1, 2, 4, 8, 8, 8),
    "8": (14, 17, 17, 14, 17, 17, 14), "9": (14, 17, 17, 15, 1, 2, 12),
    ".": (0, 0, 0, 0, 0, 12, 12), ",": (0, 0, 0, 0, 12, 4, 8), "-": (0, 0, 0, 31, 0, 0, 0),
    "+": (0, 4, 4, 31, 4, 4, 0), "/": (0, 1, 2, 4, 8, 16, 0), ":": (0, 12, 12, 0, 12, 12, 0),
    "(": (2, 4, 8, 8, 8, 4, 2), ")": (8, 4, 2, 2, 2, 4, 8), "%": (24, 25, 2, 4, 8, 19, 3),
    "=": (0, 0, 31, 0, 31, 0, 0), "_": (0, 0, 0, 0, 0, 0, 31), " ": (0,) * 7,
}
_SCALE = 2
_CHAR_W = 6 * _SCALE


class _Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        x0, x1 = max(0, x0), min(self.width, x1)
        row = bytes(color) * max(0, x1 - x0)
        for y in range(max(0, y0), min(self.height, y1)):
            start = (y * self.width + x0) * 3
            self.pixels[start:start + len(row)] = row

    def text(self, x: int, y: int, s: str, color=(0, 0, 0)) -> None:
        for i, ch in enumerate(s.upper()):
            glyph = _GLYPHS.get(ch, _GLYPHS["-"])
            for r, bits in enumerate(glyph):
                for c in range(5):
                    if bits >> (4 - c) & 1:
                        px, py = x + i * _CHAR_W + c * _SCALE, y + r * _SCALE
                        self.rect(px, py, px + _SCALE, py + _SCALE, color)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.pixels[y * self.width * 3:(y + 1) * self.width * 3])
                       for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return (struct.pack(">I", len(data)) + kind + data
                    + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _short_number(v: float) -> str:
    """3179.3 -> '3179', 6.39 -> '6.39', 0.131 -> '0.131' (no exponents on a chart)."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _write_plain_png(path: str, title: str, groups: list) -> None:
    """One panel per series, a bar per group, labels and values in the 5x7 font."""
    series = list(groups[0].values)
    label_w = max(len(g.label) for g in groups) * _CHAR_W + 20
    panel_w, bar_h, gap = 360, 18, 8
    top = 60
    height = top + len(groups) * (bar_h + gap) + 30
    width = label_w + len(series) * (panel_w + 20)
    canvas = _Canvas(width, height)
    canvas.text(10, 10, title)
    for k, name in enumerate(series):
        x0 = label_w + k * (panel_w + 20)
        color = COLORS[k % len(COLORS)]
        canvas.text(x0, 36, name, color)
        peak = max(g.values[name] for g in groups) or 1.0
        for i, g in enumerate(groups):
            y = top + i * (bar_h + gap)
            if k == 0:
                canvas.text(10, y + 2, g.label)
            length = int((panel_w - 90) * g.values[name] / peak)
            canvas.rect(x0, y, x0 + length, y + bar_h, color)
            canvas.text(x0 + length + 6, y + 2, _short_number(g.values[name]))
        canvas.rect(x0 - 1, top - 4, x0, height - 26, (0, 0, 0))
    with open(path, "wb") as f:
        f.write(canvas.png())
