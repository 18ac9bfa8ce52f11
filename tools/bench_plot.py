"""Plot TPOT vs budget per policy (one panel per tier) from the CSV tools/bench.sh writes."""

from __future__ import annotations

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(csv_path: str, png_path: str) -> None:
    rows = list(csv.DictReader(open(csv_path)))
    tiers = sorted({r["tier"] for r in rows})
    fig, axes = plt.subplots(1, len(tiers), figsize=(6 * len(tiers), 4.5), squeeze=False)
    for ax, tier in zip(axes[0], tiers, strict=True):
        series: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in rows:
            if r["tier"] == tier and r["tpot_ms"]:
                series[r["policy"]].append((float(r["budget_bytes"]) / 2**20, float(r["tpot_ms"])))
        for policy, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
        ax.set_xlabel("fast-tier budget for experts (MiB)")
        ax.set_ylabel("TPOT (ms, median)")
        ax.set_yscale("log")
        ax.set_title(f"{rows[0]['model']} — tier {tier}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
