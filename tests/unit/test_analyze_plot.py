"""analyze --plot: recall.png's legend sits beside the curves, never on them (issue 45: it covered the oracle's
line at recall 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyspecter.study import analyze_report


def _result() -> dict:
    slots = [1, 2, 3, 4]
    curve = {"hit_rate_warm": [0.2, 0.4, 0.6, 0.8]}
    recall = {"1": 0.9, "2": 0.8, "3": 0.7, "4": 0.6}
    predictors = {name: {"available": True, "recall_at": dict(recall), "lookahead_unit": "tokens"}
                  for name in ("draft-same-tokens", "prev-token", "frequency")}
    predictors["oracle"] = {"available": True, "recall_at": dict.fromkeys(recall, 1.0), "lookahead_unit": "tokens"}
    return {"frequency": {"counts": [[3, 1, 0, 2], [1, 1, 4, 0]]},
            "cache": {"slots": slots, "lru": curve, "lfu": curve, "belady": curve}, "predictors": predictors}


def test_recall_legend_is_outside_the_axes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))  # kept to be measured
    out = analyze_report.plot(_result(), tmp_path)
    assert Path(out["recall"]).is_file()
    fig = figures[-1]  # recall.png is drawn last
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    axes = ax.get_window_extent(renderer)
    assert legend.x0 >= axes.x1, (legend, axes)  # wholly right of the plotting area
    assert legend.x1 <= fig.bbox.x1 + 1, (legend, fig.bbox)  # and inside the saved image
    for f in figures:
        real_close(f)
