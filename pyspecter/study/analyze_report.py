"""analyze()'s result as text and as PNG plots (a heatmap of expert use, hit-rate curves), without matplotlib."""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np


def _fmt(v: float | None, pct: bool = True) -> str:
    if v is None:
        return "   -  "
    return f"{100 * v:5.1f}%" if pct else f"{v:6.3g}"


def format_analysis(result: dict) -> str:
    """A terminal summary of analyze()'s result."""
    t = result["trace"]
    lines = [f"trace {t['path']}: {t['rows']} rows, {t['prompts']} prompts, {t['arch']}, "
             f"{len(t['moe_layers'])} MoE layers x {t['n_expert']} experts, top-{t['n_expert_used']}; "
             f"scored on {t['scored_rows']} ({t['n_scored_rows']} rows)", "",
             "predictor recall (precision) by lookahead"]
    hs = sorted({h for p in result["predictors"].values() for h in p["recall_at"]}, key=int)
    lines.append(f"  {'':20s}" + "".join(f"{'h=' + h:>18s}" for h in hs))
    for name, p in result["predictors"].items():
        cells = "".join(f"{_fmt(p['recall_at'][h])} ({_fmt(p['precision_at'][h])})   " for h in hs)
        unit = " [layers]" if p["lookahead_unit"] == "layers" else ""
        lines.append(f"  {name:20s}{cells}{unit}" if p["available"] else f"  {name:20s}n/a: {p.get('note')}")
    lines += _format_learned(result)
    c = result["cache"]
    lines += ["", "cache hit rate (warm) vs slots per layer"]
    lines.append("  slots    " + "".join(f"{s:>7d}" for s in c["slots"]))
    for pol in ("lru", "lfu", "belady"):
        lines.append(f"  {pol:8s} " + "".join(f"{_fmt(v):>7s}" for v in c[pol]["hit_rate_warm"]))
    b = result.get("batched")
    if b:
        lines += ["", "misses per row when B rows share a routing call (a verify step of B-1 accepted drafts), LRU, "
                      "against B = 1"]
        for s, row in zip(b["slots"], b["vs_one_row"], strict=True):
            lines.append(f"  {s:3d} slots " + "".join(f"  B={B}: {_fmt(v)}" for B, v in zip(b["batch"], row,
                                                                                             strict=True)))
    xl, xt = result["cross_layer"], result["cross_token"]
    lines += ["", f"cross-layer: best conditional predictor recall {_fmt(xl['recall'])} vs layer frequency "
              f"{_fmt(xl['frequency_baseline_recall'])} ({xl['fit']})",
              f"cross-token: consecutive-token overlap {_fmt(xt['overlap'])} "
              f"(random {_fmt(xt['random_baseline_overlap'])})"]
    spec = result.get("speculative")
    if spec:
        acc = ", ".join(f"h={h}: {_fmt(v)}" for h, v in spec["acceptance_at"].items())
        lines += ["", f"draft acceptance {acc}; mean accepted prefix {_fmt(spec['mean_accepted_prefix'], False)}"]
        conf = result["confidence"].get("draft-own-tokens", {}).get("1")
        if conf:
            lines.append("draft-own-tokens h=1 by router-weight threshold: thr recall precision upload-MiB/token")
            for i, thr in enumerate(conf["thresholds"]):
                up = conf["upload_bytes_per_token"][i]
                lines.append(f"  {thr:4.2f} {_fmt(conf['recall'][i])} {_fmt(conf['precision'][i])} "
                             f"{(up or 0) / 2**20:8.3f}")
    if result.get("plots"):
        lines += ["", "plots: " + ", ".join(v for k, v in result["plots"].items() if k != "note")]
        if result["plots"].get("note"):
            lines.append("  " + result["plots"]["note"])
    return "\n".join(lines)


def _format_learned(result: dict) -> list[str]:
    """One line per horizon: the learned predictor's recall and exact-set match beside the next-layer gate's."""
    d = result.get("learned") or {}
    if not d.get("available"):
        return ["", f"learned predictor: n/a: {d.get('note')}"] if d else []
    fit = d.get("fit") or {}
    lines = ["", f"learned predictor ({d['nbytes'] / 2**20:.2f} MiB, fitted on {fit.get('tokens', '?')} tokens of "
                 f"other text): top-{result['trace']['n_expert_used']} recall / exact-set match, MoE layers ahead"]
    gate = result["predictors"].get("next-layer-gate", {})
    for h, v in d["by_horizon"].items():
        g = gate.get("recall_at", {}).get(h) if gate.get("available") else None
        gx = gate.get("full_cover_at", {}).get(h) if gate.get("available") else None
        lines.append(f"  h={h}: learned {_fmt(v['recall'])} / {_fmt(v['exact'])}    next-layer-gate "
                     f"{_fmt(g)} / {_fmt(gx)}    ({v['samples']} layer-rows)")
    ev = d.get("eviction")
    if ev:
        blend = ", blended with each layer's recency and frequency" if ev.get("blend") else ""
        lines.append(f"eviction by its reuse maps (how soon each expert comes back, {ev['reuse_horizon']} tokens "
                     f"ahead{blend}), misses per token, one cache per layer:")
        for s, v in ev["misses_per_token"].items():
            lines.append(f"  {s} slots: learned {v['learned']:.2f}   LRU {v['lru']:.2f}   Belady's MIN "
                         f"{v['belady']:.2f}   (learned/MIN {v['learned'] / max(v['belady'], 1e-9):.2f}x, "
                         f"LRU/MIN {v['lru'] / max(v['belady'], 1e-9):.2f}x)")
            if v.get("oracle"):
                lines.append("    knowing the next k tokens' routing exactly: " + "   ".join(
                    f"k={k} {m:.2f} ({m / max(v['belady'], 1e-9):.2f}x)" for k, m in v["oracle"].items()))
    return lines


_VIRIDIS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], np.float64)


def _colormap(v: np.ndarray) -> np.ndarray:
    x = np.clip(v, 0, 1) * (len(_VIRIDIS) - 1)
    i = np.minimum(x.astype(int), len(_VIRIDIS) - 2)
    f = (x - i)[..., None]
    return (_VIRIDIS[i] * (1 - f) + _VIRIDIS[i + 1] * f).astype(np.uint8)


def write_png(path: str | os.PathLike, rgb: np.ndarray) -> None:
    """A minimal RGB PNG writer, so the heatmap needs no plotting library."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + np.ascontiguousarray(rgb[y], np.uint8).tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def plot(result: dict, plot_dir: str | os.PathLike) -> dict:
    """heatmap.png always (axes and labels only with matplotlib); hit_rate.png and recall.png need matplotlib."""
    d = Path(plot_dir)
    d.mkdir(parents=True, exist_ok=True)
    counts = np.asarray(result["frequency"]["counts"], np.float64)
    share = counts / counts.sum(1, keepdims=True).clip(min=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        cell = max(4, min(24, 1024 // max(counts.shape[1], 1)))
        img = _colormap(share / max(share.max(), 1e-12))
        write_png(d / "heatmap.png", np.repeat(np.repeat(img, cell, 0), cell, 1))
        return {"heatmap": str(d / "heatmap.png"),
                "note": "matplotlib is not installed: heatmap without axes (rows: MoE layers, columns: experts, "
                        "colour: share of the layer's selections); no curves"}
    out = {}
    fig, ax = plt.subplots(figsize=(max(6, counts.shape[1] / 5), max(3, counts.shape[0] / 4)))
    im = ax.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer #")
    ax.set_title("expert selection share per layer")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(d / "heatmap.png", dpi=100)
    plt.close(fig)
    out["heatmap"] = str(d / "heatmap.png")

    c = result["cache"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for pol in ("lru", "lfu", "belady"):
        ax.plot(c["slots"], [v if v is not None else np.nan for v in c[pol]["hit_rate_warm"]], marker=".", label=pol)
    ax.set_xlabel("slots per MoE layer")
    ax.set_ylabel("hit rate (compulsory misses excluded)")
    ax.set_ylim(0, 1.02)
    ax.legend()
    fig.tight_layout()
    fig.savefig(d / "hit_rate.png", dpi=100)
    plt.close(fig)
    out["hit_rate"] = str(d / "hit_rate.png")

    fig, ax = plt.subplots(figsize=(8.5, 4))
    for name, p in result["predictors"].items():
        if not p["available"]:
            continue
        hs = [h for h, v in p["recall_at"].items() if v is not None]
        # the oracle (recall 1 by construction) is a reference: a dashed line under the others, so a predictor
        # that also reaches 1 (a self-draft) stays visible on it
        style = dict(linestyle="--", color="0.5", zorder=1) if name == "oracle" else dict(marker="o", zorder=2)
        ax.plot([int(h) for h in hs], [p["recall_at"][h] for h in hs],
                label=name + (" (layers)" if p["lookahead_unit"] == "layers" else ""), **style)
    ax.set_xticks(sorted({int(h) for p in result["predictors"].values() for h in p["recall_at"]}))
    ax.set_xlabel("lookahead (tokens; layers for next-layer-gate)")
    ax.set_ylabel("recall")
    ax.set_ylim(0, 1.02)
    # outside the axes, right of them: inside, wherever matplotlib put it, it covered a line (the oracle's at 1,
    # the top edge, in issue 45), since the curves can be anywhere from 0 to 1
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(d / "recall.png", dpi=100)
    plt.close(fig)
    out["recall"] = str(d / "recall.png")
    return out


def dumps(result: dict) -> str:
    return json.dumps(result, indent=1)
