"""Charts as PNG files drawn by matplotlib, each with its figures beside it as JSON.

The demo, the benchmark runner and ``python -m shardkit plan --chart`` draw one grouped bar
chart each through :func:`write_bar_chart`; curves over steps (the ZeRO++ loss check) go
through :func:`write_line_chart`. matplotlib is an optional dependency (in the
``test`` and ``dev`` extras); without it :func:`write_bar_chart` raises :class:`ChartError`
saying how to install it, and callers keep their other outputs. Costs: no communication; one
figure in memory while drawing.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

__all__ = ["BarGroup", "ChartError", "write_bar_chart", "write_line_chart", "chart_json_path"]


class ChartError(RuntimeError):
    """A chart could not be drawn (matplotlib missing, nothing to draw)."""


@dataclass(frozen=True)
class BarGroup:
    """One group of bars: a label and ``{series name: value}`` (the same series in every group)."""

    label: str
    values: dict


def chart_json_path(path: str) -> str:
    """Where the figures of the chart at ``path`` go: ``x.png`` -> ``x.chart.json``."""
    root, _ = os.path.splitext(path)
    return root + ".chart.json"


def _with_suffix(path: str) -> str:
    """``path``, with ``.png`` added when it has no suffix (matplotlib saves a PNG there under
    that name, so the line naming the file must say it). Local."""
    return path if os.path.splitext(path)[1] else path + ".png"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ChartError("charts need matplotlib, which is not installed: "
                         "pip install matplotlib (or pip install -e '.[test]')") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def write_bar_chart(path: str, title: str, groups: list) -> str:
    """Draw ``groups`` as horizontal bars, one panel per series, into the PNG at ``path``,
    and write ``{"title", "groups": [{"label", "values"}]}`` to :func:`chart_json_path`.
    Returns a line naming both files. Raises :class:`ChartError` without matplotlib or
    without groups."""
    if not groups:
        raise ChartError(f"write_bar_chart({path!r}): no groups to draw")
    series = list(groups[0].values)
    missing = [g.label for g in groups if list(g.values) != series]
    if missing:
        raise ChartError(f"write_bar_chart: groups {missing} do not have the series {series}")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(series), squeeze=False,
                             figsize=(4 * len(series), 0.5 * len(groups) + 1.5))
    labels = [g.label for g in groups][::-1]  # first group on top
    for ax, name in zip(axes[0], series):
        ax.barh(labels, [g.values[name] for g in groups][::-1])
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=8)
    for ax in axes[0][1:]:
        ax.set_yticklabels([])
    fig.suptitle(title)
    fig.tight_layout()
    path = _with_suffix(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    with open(chart_json_path(path), "w") as f:
        json.dump({"title": title, "groups": [asdict(g) for g in groups]}, f, indent=2)
    return f"chart: {path} (figures: {chart_json_path(path)})"


def write_line_chart(path: str, title: str, curves: dict, xlabel: str, ylabel: str) -> str:
    """Draw ``{name: [y per step]}`` as lines over steps 1, 2, ... into the PNG at ``path``, and
    write ``{"title", "xlabel", "ylabel", "curves"}`` to :func:`chart_json_path`. Returns a line
    naming both files. Raises :class:`ChartError` without matplotlib or without curves."""
    if not curves:
        raise ChartError(f"write_line_chart({path!r}): no curves to draw")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, linewidth=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    path = _with_suffix(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    with open(chart_json_path(path), "w") as f:
        json.dump({"title": title, "xlabel": xlabel, "ylabel": ylabel,
                   "curves": {k: list(v) for k, v in curves.items()}}, f, indent=2)
    return f"chart: {path} (figures: {chart_json_path(path)})"
