"""shardkit.utils.charts: every chart is a matplotlib PNG with its figures beside it as JSON."""

import json

import pytest

from shardkit.utils.charts import (BarGroup, ChartError, chart_json_path, write_bar_chart,
                                   write_line_chart)


def test_line_chart_writes_png_and_the_curves_as_json(tmp_path):
    path = str(tmp_path / "loss.png")
    curves = {"fp32": [3.0, 2.5, 2.0], "qwZ+qgZ": [3.0, 2.6, 2.1]}
    write_line_chart(path, "loss", curves, "step", "loss")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(chart_json_path(path)) as f:
        saved = json.load(f)
    assert saved["curves"] == curves and saved["xlabel"] == "step"


def test_bar_chart_writes_png_and_the_groups_as_json(tmp_path):
    path = str(tmp_path / "bars.png")
    write_bar_chart(path, "t", [BarGroup("a", {"ms": 1.0}), BarGroup("b", {"ms": 2.0})])
    with open(chart_json_path(path)) as f:
        assert [g["label"] for g in json.load(f)["groups"]] == ["a", "b"]


def test_nothing_to_draw_is_a_clear_error(tmp_path):
    with pytest.raises(ChartError, match="no curves"):
        write_line_chart(str(tmp_path / "x.png"), "t", {}, "step", "loss")
    with pytest.raises(ChartError, match="no groups"):
        write_bar_chart(str(tmp_path / "y.png"), "t", [])
