"""``pyspecter fit-predictor``: the learned routing predictors' fit (models/predictor_fit.py, the same one the
embedded model is built with), scored on held-out text by what the study simulates: eviction by the reuse maps
against LRU, Belady's MIN and eviction knowing the next k tokens (``simulate.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from pyspecter.learned import LearnedPredictor, Recency
from pyspecter.models import predictor_fit
from pyspecter.study.simulate import eviction_misses, oracle_scores, simulate_cache


def fit_model(model_path: str | os.PathLike, out: str | os.PathLike | None = None, **options) -> dict:
    """``models.predictor_fit.fit_model`` (its keyword options), with the held-out eviction scored
    (``evaluate_reuse``) and kept in the predictor's metadata."""
    return predictor_fit.fit_model(model_path, out, judge_eviction=evaluate_reuse, **options)


# Lookaheads of the exact-future eviction rows in ``evaluate_reuse``: a draft drafts about 4 tokens
ORACLE_LOOKAHEADS = (1, 2, 4, 8, 16)


def evaluate_reuse(pred: LearnedPredictor, X: list[np.ndarray], ids: np.ndarray, slots: list[int]) -> dict:
    """Held-out eviction per slot count: misses per token of LRU, of eviction by the reuse maps, of eviction
    knowing the next k tokens' routing exactly (``oracle``: k -> misses, the bound on any predictor of k tokens)
    and of Belady's MIN (the optimum, which knows the whole future), each layer's cache on its own. The rows are
    prompts back to back; the exact-future rows see across a prompt's end, as MIN does."""
    n, L, _ = ids.shape
    E = pred.n_expert
    tot = {s: {"lru": 0, "learned": 0, "belady": 0, "oracle": dict.fromkeys(ORACLE_LOOKAHEADS, 0)} for s in slots}
    for j in range(L):  # what a layer's scores are does not depend on the slot count: once per layer
        lay = ids[:, j]
        sc = pred.reuse_rows(j, X[j], Recency.features_of(lay, E))
        distinct = sum(len({int(e) for e in row if e >= 0}) for row in lay)
        known = {k: oracle_scores(lay, E, k) for k in ORACLE_LOOKAHEADS}
        for s in slots:
            t = tot[s]
            t["lru"] += eviction_misses(lay, s)
            t["learned"] += eviction_misses(lay, s, sc)
            t["belady"] += distinct - simulate_cache(lay, s, "belady")
            for k, ks in known.items():
                t["oracle"][k] += eviction_misses(lay, s, ks)
    return {str(s): {"lru": t["lru"] / n, "learned": t["learned"] / n, "belady": t["belady"] / n,
                     "oracle": {str(k): v / n for k, v in t["oracle"].items()}} for s, t in tot.items()}


def describe(r: dict) -> str:
    """The summary as the CLI prints it."""
    lines = [f"learned routing predictor for {Path(r['model']).name} ({r['arch']}, {r['moe_layers']} MoE layers x "
             f"{r['n_expert']} experts, top-{r['n_expert_used']}): {r['kind']} maps for horizons 1..{r['horizons']}, "
             f"{r['nbytes'] / 2**20:.2f} MiB, fitted on {r['fit_tokens']} tokens in {r['seconds']:.0f}s",
             f"numpy router on the recorded inputs reproduces llama.cpp's choice on "
             f"{100 * r['router_reproduction']:.2f}% of (token, layer)",
             f"held-out ({r['held_out_tokens']} tokens of other text), top-{r['n_expert_used']} recall / exact set "
             "match, averaged over layers:"]
    for h, v in r["held_out"].items():
        what = "router itself (a check)" if h == "0" else f"{h} MoE layer{'s' if h != '1' else ''} ahead"
        lines.append(f"  h={h}: {100 * v['recall']:5.1f}% / {100 * v['exact']:5.1f}%   {what}")
    if r.get("held_out_eviction"):
        lines.append(f"held-out eviction (reuse maps: how soon each expert comes back within {r['reuse_horizon']} "
                     "tokens), misses per token with s slots per layer:")
        for s, v in r["held_out_eviction"].items():
            lines.append(f"  s={s}: learned {v['learned']:.2f}   LRU {v['lru']:.2f}   Belady's MIN {v['belady']:.2f}"
                         f"   (learned/LRU {v['learned'] / max(v['lru'], 1e-9):.2f}x)")
    where = "the model's sidecar, loaded automatically for this file" if r["sidecar"] else "not the sidecar"
    lines.append(f"written {r['out']} ({where})")
    return "\n".join(lines)
