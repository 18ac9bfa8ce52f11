"""How well the router-ahead maps (pyspecter/router_ahead.py) predict the next MoE layers' routing, teacher-forced
on the held-out text, against a fitted predictor where the model has one.

    python -m pyspecter.study.router_ahead_eval MODEL [-n TOKENS] [--horizons H] [--predictor P.npz]

Every MoE layer's router input and llama.cpp's routing are recorded (models/predictor_data's recorder) over the
first TOKENS tokens of the held-out text, fed as one sequence (every row an output, so every layer reports it).
Per horizon h, pooled over source layers: top-k precision (= recall: both sets have k experts), the share at each
predicted rank (what the calibration table holds), and the precision and recall of what the planner would
prefetch (the ranks whose calibrated chance reaches min_prob). Deterministic: the same file gives the same numbers.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from pyspecter.learned import selection_scores, top_ids
from pyspecter.models.predictor_fit import set_match


def record_forced(model_path: str, n_tokens: int, n_threads: int = 2) -> tuple[list[np.ndarray], np.ndarray]:
    """(X: per MoE layer [n, n_embd], ids [n, L, k]) over the held-out text's first n_tokens tokens."""
    from pyspecter import native
    from pyspecter.layout import read_layout
    from pyspecter.models.predictor_data import _Recorder
    from pyspecter.study.forced import heldout_text

    lay = read_layout(model_path).require_moe()
    with native.Model(model_path) as model:
        toks = model.tokenize(heldout_text(), add_special=False)[:n_tokens]
        rec = _Recorder(model, lay)
        try:
            n_ctx = -(-(len(toks) + 8) // 256) * 256
            with native.Context(model, n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=n_threads) as ctx:
                ctx.decode(toks, logits_all=True)
            return rec.take()
        finally:
            rec.close()


def at_rank(scores: np.ndarray, true_ids: np.ndarray, n_expert: int) -> np.ndarray:
    """[n, E] whether the expert at predicted rank r was truly selected."""
    order = np.argsort(-scores, axis=-1, kind="stable")
    truth = (true_ids[:, :, None] == np.arange(n_expert)).any(axis=1)
    return np.take_along_axis(truth, order, axis=-1)


def score(scores_by_src: dict[int, np.ndarray], ids: np.ndarray, h: int, n_expert: int, k: int,
          min_prob: float = 0.5) -> dict:
    """Pooled over sources j (scores [n, E] of layer j+h): top-k precision, share by rank, and the planner's
    set at min_prob (ranks whose pooled share reaches it)."""
    hits = [at_rank(s, ids[:, j + h], n_expert) for j, s in scores_by_src.items()]
    rec = [set_match(top_ids(s, k), ids[:, j + h], n_expert)[0].mean() for j, s in scores_by_src.items()]
    pooled = np.concatenate(hits).mean(axis=0)
    chosen = pooled >= min_prob
    got = np.concatenate(hits)[:, chosen]
    return {"h": h, "topk_precision": float(np.mean(rec)), "per_source": [round(float(r), 4) for r in rec],
            "by_rank": [round(float(p), 4) for p in pooled[: 2 * k]],
            "planner_ranks": int(chosen.sum()),
            "planner_precision": float(got.mean()) if got.size else None,
            "planner_recall": float(got.sum(1).mean() / k) if got.size else 0.0}


def evaluate(model_path: str, n_tokens: int, horizons: int, predictor: str | None) -> dict:
    from pyspecter.layout import read_layout
    from pyspecter.router_ahead import maps, read_routers

    lay = read_layout(model_path).require_moe()
    E, k, n = lay.n_expert, lay.n_expert_used, len(lay.layers)
    X, ids = record_forced(model_path, n_tokens)
    routers = read_routers(model_path, lay)
    # the recorder's routing is llama.cpp's: the numpy router on the recorded inputs must reproduce it (h = 0)
    same = np.mean([set_match(top_ids(selection_scores(X[j] @ maps(routers, j, 0)[0], routers.gating,
                                                       routers.sel_bias[j]), k), ids[:, j], E)[0].mean()
                    for j in range(n)])
    out: dict = {"model": model_path, "rows": int(len(ids)), "n_expert": E, "k": k, "layers": n,
                 "router_reproduces": float(same), "router_ahead": [], "router_ahead_no_norm": []}
    for h in range(1, min(horizons, n - 1) + 1):
        for key, fold in (("router_ahead", True), ("router_ahead_no_norm", False)):
            sc = {}
            for j in range(n - h):
                W, b = maps(routers, j, h, fold)
                sc[j] = selection_scores(X[j] @ W + b, routers.gating, routers.sel_bias[j + h])
            out[key].append(score(sc, ids, h, E, k))
    if predictor:
        from pyspecter.learned import LearnedPredictor

        p = LearnedPredictor.load(predictor)
        out["fitted"] = []
        for h in range(1, min(horizons, p.horizons, n - 1) + 1):
            sc = {j: p._scores(j, X[j])[:, h - 1] for j in range(n - h) if p.n_targets(j) >= h}
            out["fitted"].append(score(sc, ids, h, E, k))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="router_ahead_eval")
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=512)
    ap.add_argument("--horizons", type=int, default=2)
    ap.add_argument("--predictor")
    a = ap.parse_args(argv)
    json.dump(evaluate(a.model, a.n, a.horizons, a.predictor), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
