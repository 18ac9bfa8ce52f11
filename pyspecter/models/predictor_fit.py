"""Fitting learned routing predictors (runtime side: pyspecter/learned.py) from recorded router inputs
(models/predictor_data.py records them through llama.cpp). A model builder's work, like the surrogates' neuron
groups (models/calibration.py): the embedded model fits its predictor here when it is built
(models/embedded.py), and ``pyspecter fit-predictor`` (study/predictor_fit.py) runs the same fit and scores its
eviction on held-out text. The runtime only loads what it writes.

Targets: layer j's router logits, computed here as ffn_gate_inp(j) @ x_j (+ bias) from the model's own router
weights, so only the router inputs x need recording.

The maps: ridge regression from x_j (plus an intercept) to the logits of layers j+h, h = 0..H (h = 0 is the
router itself: a check, not stored). All horizons of one source share one eigendecomposition of the centred Gram
matrix, so every penalty costs one more matrix product. The penalty is chosen per (layer, horizon) by top-k
recall on a validation tail of the fit text (the last fifth of its sequences), the rank calibration of the
runtime's probabilities is measured there too, and the maps are then refitted on all of it.

The reuse maps for eviction and the LRU miss curves are fitted beside them (models/reuse_fit.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pyspecter.learned import (
    FORMAT,
    LearnedPredictor,
    gap_bins,
    model_key,
    selection_scores,
    sidecar_path,
)
from pyspecter.models.ridge import Ridge
from pyspecter.router_ahead import Routers

ALPHAS = (1e-7, 1e-5, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
VAL_SHARE = 0.2
# (predictor, held-out router inputs per layer, held-out routing ids [n, L, k], slot counts) -> misses per token by
# slot count
EvictionJudge = Callable[[LearnedPredictor, list[np.ndarray], np.ndarray, list[int]], dict]


# --- the math (pure numpy; unit-tested on synthetic data) ------------------------------------------------------

def set_match(pred_ids: np.ndarray, true_ids: np.ndarray, n_expert: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row: |P ∩ N| / |N| (top-k recall) and P == N (exact set match), for id lists [..., k] (-1 = none)."""
    E = n_expert
    p = (np.asarray(pred_ids)[..., :, None] == np.arange(E)).any(axis=-2)
    t = (np.asarray(true_ids)[..., :, None] == np.arange(E)).any(axis=-2)
    hits = (p & t).sum(-1)
    return hits / np.maximum(t.sum(-1), 1), (p == t).all(-1)


GAP_QUANTILES = (0.5, 0.75, 0.9)


def rank_calibration(scores: np.ndarray, true_ids: np.ndarray, n_expert: int) -> tuple[np.ndarray, np.ndarray]:
    """(table [B, n_expert], edges [B - 1]): table[b, r] is the share of rows in confidence bin b on which the
    expert ranked r by ``scores`` [n, E] is among ``true_ids`` [n, k]. A row's bin is set by its predicted gap
    between ranks k-1 and k (``learned.gap_bins``), cut at GAP_QUANTILES of the rows' gaps: on smol-moe one layer
    ahead, rows in the top tenth of gaps keep 99% of their top-k, rows below the median 69%."""
    k = np.asarray(true_ids).shape[1]
    order = np.argsort(-scores, axis=-1, kind="stable")
    truth = (np.asarray(true_ids)[:, :, None] == np.arange(n_expert)).any(axis=1)  # [n, E]
    at_rank = np.take_along_axis(truth, order, axis=-1)
    ranked = np.take_along_axis(scores, order, axis=-1)
    gap = ranked[:, k - 1] - ranked[:, k]
    edges = np.quantile(gap, GAP_QUANTILES).astype(np.float32)
    bins = gap_bins(gap, edges)
    overall = at_rank.mean(axis=0)
    table = np.stack([at_rank[bins == b].mean(axis=0) if (bins == b).any() else overall
                      for b in range(len(edges) + 1)])
    return table.astype(np.float32), edges


@dataclass
class Fitted:
    """Study-side maps for every (source j, horizon h), h = 0 included: (B [d, E], c [E], alpha)."""

    maps: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, float]]
    rank_prob: np.ndarray  # [L, H + 1, B, E]: rank calibration per confidence bin (rank_calibration)
    gap_edges: np.ndarray  # [L, H + 1, B - 1]
    n_layers: int
    horizons: int
    # reduced rank: per source j, (P [d, r], Vᵀ [r, n_t * E]) of its horizons 1..n_t (maps hold P @ Vᵀ's blocks)
    factors: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def logits(self, j: int, h: int, x: np.ndarray) -> np.ndarray:
        B, c, _ = self.maps[(j, h)]
        return np.asarray(x, np.float64) @ B + c


def fit_maps(X: list[np.ndarray], routers: Routers, horizons: int, val: np.ndarray,
             alphas: tuple[float, ...] = ALPHAS, progress=None, rank: int = 0) -> Fitted:
    """Fit every (j, h) map from router inputs X[j] [n, d] (rows aligned across layers; ``val`` marks the
    validation rows). Penalty and rank calibration from fit-on-rest / score-on-val, then a refit on all rows.
    rank > 0: the horizons 1..H of each source share a rank-r factorisation (``Ridge.reduce_rank``), which costs
    d*r + r*H*E multiply-adds per token instead of d*H*E; the penalty is still chosen at full rank."""
    L, E = len(X), routers.weight[0].shape[0]
    fit = ~val
    logits = [routers.logits(j, X[j]) for j in range(L)]
    true_ids = [routers.select(j, lg) for j, lg in enumerate(logits)]
    maps: dict = {}
    factors: dict = {}
    B = len(GAP_QUANTILES) + 1
    rank_prob = np.zeros((L, horizons + 1, B, E), np.float32)
    gap_edges = np.zeros((L, horizons + 1, B - 1), np.float32)
    for j in range(L):
        hs = [h for h in range(horizons + 1) if j + h < L]
        Y = np.concatenate([logits[j + h] for h in hs], axis=1)
        r_fit = Ridge(X[j][fit])
        proj = r_fit.project(Y[fit])
        best = {h: (-1.0, alphas[-1], None) for h in hs}
        for a in alphas:
            B, c = r_fit.solve(proj, a)
            pred = X[j][val].astype(np.float64) @ B + c
            for i, h in enumerate(hs):
                lg = pred[:, i * E:(i + 1) * E]
                rec = float(set_match(routers.select(j + h, lg), true_ids[j + h][val], E)[0].mean())
                if rec > best[h][0] + 1e-9:  # alphas ascend: a tie keeps the smaller penalty
                    best[h] = (rec, a, lg)
        alpha_cols = np.repeat([best[h][1] for h in hs], E)
        m, d = (len(hs) - 1) * E, X[j].shape[1]  # columns E: are horizons 1..n_t
        ahead = m > 0 and 0 < rank and rank * (d + m) < d * m  # factor only where two matmuls are cheaper
        if ahead:  # the calibration must describe the reduced maps
            B, c = r_fit.solve(proj, alpha_cols)
            P, Vt, cr = r_fit.reduce_rank(B[:, E:], c[E:], rank)
            pred = X[j][val].astype(np.float64) @ P @ Vt + cr
            for i, h in enumerate(hs[1:]):
                best[h] = (best[h][0], best[h][1], pred[:, i * E:(i + 1) * E])
        for h in hs:
            lg = best[h][2]
            rank_prob[j, h], gap_edges[j, h] = rank_calibration(
                selection_scores(lg, routers.gating, routers.sel_bias[j + h]), true_ids[j + h][val], E)
        r_all = Ridge(X[j])
        B, c = r_all.solve(r_all.project(Y), alpha_cols)
        if ahead:
            P, Vt, cr = r_all.reduce_rank(B[:, E:], c[E:], rank)
            factors[j] = (P, Vt)
            B, c = np.concatenate([B[:, :E], P @ Vt], 1), np.concatenate([c[:E], cr])
        for i, h in enumerate(hs):
            maps[(j, h)] = (B[:, i * E:(i + 1) * E], c[i * E:(i + 1) * E], best[h][1])
        if progress is not None:
            progress(j + 1)
    return Fitted(maps, rank_prob, gap_edges, L, horizons, factors)


def to_runtime(fitted: Fitted, layers: list[int], routers: Routers, meta: dict,
               reuse: tuple[list[np.ndarray], list[np.ndarray]] | None = None,
               curves: np.ndarray | None = None) -> LearnedPredictor:
    """The runtime predictor: horizons 1..H of each source stacked into one float32 matrix (or its two factors);
    ``reuse``: the reuse maps (R, rb) of ``fit_reuse``; ``curves``: LRU miss curves [L, E + 1]."""
    A, A2, b = [], [], []
    for j in range(fitted.n_layers):
        hs = [h for h in range(1, fitted.horizons + 1) if (j, h) in fitted.maps]
        if not hs:
            A.append(None)
            A2.append(None)
            b.append(None)
            continue
        if j in fitted.factors:
            P, Vt = fitted.factors[j]
            A.append(np.ascontiguousarray(P, np.float32))
            A2.append(np.ascontiguousarray(Vt, np.float32))
        else:
            A.append(np.ascontiguousarray(np.concatenate([fitted.maps[(j, h)][0] for h in hs], 1), np.float32))
            A2.append(None)
        b.append(np.concatenate([fitted.maps[(j, h)][1] for h in hs]).astype(np.float32))
    # runtime rank tables are indexed [target position, h - 1]: the table of map (j, h) describes layer j+h
    rp = np.zeros((fitted.n_layers, fitted.horizons, *fitted.rank_prob.shape[2:]), np.float32)
    edges = np.zeros((fitted.n_layers, fitted.horizons, fitted.gap_edges.shape[-1]), np.float32)
    for (j, h) in fitted.maps:
        if h >= 1:
            rp[j + h, h - 1], edges[j + h, h - 1] = fitted.rank_prob[j, h], fitted.gap_edges[j, h]
    sel = [None if s is None else np.asarray(s, np.float32) for s in routers.sel_bias]
    R, rb = reuse if reuse is not None else ([], [])
    return LearnedPredictor(meta={**meta, "format": FORMAT, "horizons": fitted.horizons, "gating": routers.gating},
                            layers=list(layers), A=A, b=b, rank_prob=rp, gap_edges=edges, sel_bias=sel, A2=A2,
                            R=list(R), rb=list(rb), miss_curves=curves)


def evaluate(fitted: Fitted, X: list[np.ndarray], routers: Routers, true_ids: np.ndarray | None = None) -> dict:
    """Held-out scores per (layer, horizon): top-k recall and exact-set match of the map's top-k against the
    router's (true_ids [n, L, k] when given, e.g. llama.cpp's own routing; else the numpy router on X)."""
    L, E = fitted.n_layers, routers.weight[0].shape[0]
    H = fitted.horizons
    recall = np.full((L, H + 1), np.nan)
    exact = np.full((L, H + 1), np.nan)
    truth = [true_ids[:, j] if true_ids is not None else routers.select(j, routers.logits(j, X[j])) for j in range(L)]
    for (j, h) in fitted.maps:
        pred = routers.select(j + h, fitted.logits(j, h, X[j]))
        r, e = set_match(pred, truth[j + h], E)
        recall[j + h, h], exact[j + h, h] = r.mean(), e.mean()
    return {"recall": recall, "exact": exact, "n_rows": int(len(X[0]))}


def summarize(scores: dict) -> dict:
    """Per horizon: recall and exact match averaged over the layers that have that horizon (every layer weighs
    the same: each has the same rows)."""
    out = {}
    for h in range(scores["recall"].shape[1]):
        r, e = scores["recall"][:, h], scores["exact"][:, h]
        ok = ~np.isnan(r)
        if ok.any():
            out[str(h)] = {"recall": float(r[ok].mean()), "exact": float(e[ok].mean()), "layers": int(ok.sum())}
    return out


def validation_rows(seq_lengths: list[int], share: float = VAL_SHARE) -> np.ndarray:
    """The rows of the last ``share`` of the sequences (whole sequences: neighbouring tokens share context, so a
    random row split would validate on rows almost seen)."""
    n = sum(seq_lengths)
    val = np.zeros(n, bool)
    k = max(1, round(len(seq_lengths) * share)) if len(seq_lengths) > 1 else 0
    start = sum(seq_lengths[: len(seq_lengths) - k])
    val[start:] = True
    if k == 0:  # one sequence: its tail
        val[int(n * (1 - share)):] = True
    return val


# --- the command ---------------------------------------------------------------------------------------------

def fit_model(model_path: str | os.PathLike, out: str | os.PathLike | None = None, *, horizons: int = 4,
              n_tokens: int = 12000, eval_tokens: int = 2048, n_threads: int = 1, progress: bool = True,
              rank: int = 0, judge_eviction: EvictionJudge | None = None,
              sequences: list[tuple[list[int], int]] | None = None) -> dict:
    """Record, fit, score on held-out text, save (by default to the model's sidecar, which the runtime finds by
    the file's content key). Returns a JSON-able summary. ``judge_eviction``: how the held-out eviction is scored
    (misses per token by slot count, kept in the predictor's metadata), which is a study's simulation; None
    scores only the prediction (recall). ``sequences``: fit on this text, (tokens, prompt length) pairs read in
    batches (predictor_data.record_sequences), instead of generating ``n_tokens`` of it here."""
    from pyspecter._version import __version__
    from pyspecter.errors import SpecterError
    from pyspecter.layout import read_layout
    from pyspecter.models.predictor_data import Progress, load_routers, record, record_sequences

    t0 = time.monotonic()
    path = Path(model_path)
    lay = read_layout(path).require_moe()
    L = len(lay.layers)
    if horizons < 1:
        raise SpecterError(f"--horizons must be at least 1, got {horizons}")
    if rank < 0:
        raise SpecterError(f"--rank must be 0 (full) or positive, got {rank}")
    if n_tokens < 64 or eval_tokens < 1:
        raise SpecterError("--tokens must be at least 64 and --eval-tokens at least 1")
    H = min(horizons, L - 1)
    if H < 1:
        raise SpecterError(f"{path}: one MoE layer has no later layer to predict")
    key = model_key(path)
    routers = load_routers(path)
    fit = record(path, n_tokens, n_threads=n_threads, progress=progress) if sequences is None \
        else record_sequences(path, sequences, n_threads=n_threads, progress=progress)
    reproduction = _reproduction(routers, fit["X"], fit["ids"])
    bar = Progress("fitting", L, "layers") if progress else None
    fitted = fit_maps(fit["X"], routers, H, validation_rows(fit["lengths"]),
                      progress=bar.update if bar else None, rank=rank)
    from pyspecter.lru import lru_miss_curve
    from pyspecter.models.reuse_fit import REUSE_HORIZON, fit_reuse

    if bar:
        bar.close()
    bar = Progress("fitting reuse maps", L, "layers") if progress else None
    R, rb, reuse_alpha, blend = fit_reuse(fit["X"], fit["ids"], fit["lengths"], lay.n_expert,
                                          validation_rows(fit["lengths"]), progress=bar.update if bar else None,
                                          rows=fit.get("generated"))
    curves = np.stack([lru_miss_curve(fit["ids"][:, j], lay.n_expert) for j in range(L)])
    if bar:
        bar.close()
    ev = record(path, eval_tokens, held_out=True, n_threads=n_threads, progress=progress)
    scores = evaluate(fitted, ev["X"], routers, ev["ids"])  # against llama.cpp's own routing
    held = summarize(scores)
    fit_meta = {"tokens": len(fit["X"][0]), "sequences": len(fit["lengths"]), "held_out_tokens": len(ev["X"][0]),
                "held_out": held, "router_reproduction": reproduction,
                "kind": f"reduced-rank ridge, r={rank}" if fitted.factors else "ridge",
                "alpha": {f"{j}:{h}": m[2] for (j, h), m in fitted.maps.items()}}
    meta = {"model_key": key, "model": str(path), "model_name": lay.name, "arch": lay.arch,
            "n_expert": lay.n_expert, "n_expert_used": lay.n_expert_used, "n_embd": int(fit["X"][0].shape[1]),
            "pyspecter": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "fit": fit_meta,
            "reuse_horizon": REUSE_HORIZON}
    pred = to_runtime(fitted, [Lr.index for Lr in lay.layers], routers, meta, reuse=(R, rb), curves=curves)
    pred.blend = blend
    E, k = lay.n_expert, lay.n_expert_used
    eviction = (judge_eviction(pred, ev["X"], ev["ids"], sorted({max(k, E // 2), max(k, round(0.3 * E))}))
                if judge_eviction is not None else None)
    if eviction is not None:
        fit_meta["held_out_eviction"] = eviction
    fit_meta["reuse_alpha"] = reuse_alpha
    fit_meta["reuse_blend"] = np.round(blend, 4).tolist()
    dest = pred.save(Path(out) if out is not None else sidecar_path(path, key))
    return {"out": str(dest), "sidecar": out is None, "model": str(path), "model_key": key, "arch": lay.arch,
            "moe_layers": L, "n_expert": lay.n_expert, "n_expert_used": lay.n_expert_used, "horizons": H,
            "kind": fit_meta["kind"],
            "nbytes": pred.nbytes, "fit_tokens": fit_meta["tokens"], "held_out_tokens": fit_meta["held_out_tokens"],
            "router_reproduction": reproduction, "held_out": held, "reuse_horizon": REUSE_HORIZON,
            "held_out_eviction": eviction,
            "per_layer": {"recall": _nan_none(scores["recall"]), "exact": _nan_none(scores["exact"])},
            "seconds": round(time.monotonic() - t0, 1)}


def _reproduction(routers: Routers, X: list[np.ndarray], ids: np.ndarray) -> float:
    """Share of (row, layer) where the numpy router on the recorded input picks llama.cpp's set: near 1 unless
    the recorded tensor is not the router's input (or rows are misaligned); near-ties flip a few."""
    E = routers.weight[0].shape[0]
    return float(np.mean([set_match(routers.select(j, routers.logits(j, x)), ids[:, j], E)[1].mean()
                          for j, x in enumerate(X)]))


def _nan_none(a: np.ndarray) -> list:
    """[L][H+1] with None where a layer has no map at that horizon (JSON has no NaN)."""
    return [[None if v != v else round(float(v), 4) for v in row] for row in a]
