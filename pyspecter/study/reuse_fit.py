"""Reuse maps for eviction, fitted beside the learned routing predictors (study/predictor_fit.py) on the same
recorded router inputs and routing: ridge from x_j to which experts of layer j the next REUSE_HORIZON tokens of
the same sequence use (multi-hot), the penalty chosen by validation error. Held-out, an eviction simulation
compares them with LRU and Belady's MIN at the same slots (``simulate.py``). Also each layer's LRU miss curve
(``simulate.lru_miss_curve``), which the budget's slot allocation reads (budget.allocate_slots).
"""

from __future__ import annotations

import numpy as np

from pyspecter.learned import LearnedPredictor, Recency
from pyspecter.study.predictor_fit import Ridge
from pyspecter.study.simulate import eviction_misses, oracle_scores, simulate_cache

# Tokens ahead whose use keeps an expert, and how much a later use counts: the target of expert e is
# decay^(h-1) for its soonest use h within the horizon (0 if none), so the score orders experts by how soon they
# come back, which is what Belady's MIN evicts by. Simulated on smol-moe traces (maps fitted on the model's own
# decode text of one prompt set, scored on another; misses per token at 8 of 16 slots, LRU 22.5, MIN 12.3): use
# within 4 tokens, flat, 15.5; within 8, decay 0.7, 15.1; within 16, decay 0.8, 14.5.
REUSE_HORIZON = 16
REUSE_DECAY = 0.8
MIN_ROWS = 64  # fewer generated rows than this (random fixtures read random ids): fit on every row
REUSE_ALPHAS = (1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)  # multi-hot targets are noisy: strong ones win


def reuse_targets(ids: np.ndarray, lengths: list[int], n_expert: int, horizon: int,
                  decay: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(Y [n, L, E] float32: decay^(h-1) where the h-th next token of the same sequence (h <= ``horizon``) is
    the first to use the expert at that layer, else 0; has [n]: rows with a next token in their sequence, the
    only ones a reuse map learns from)."""
    n, L, _ = ids.shape
    Y = np.zeros((n, L, n_expert), np.float32)
    has = np.zeros(n, bool)
    layer = np.arange(L)[None, :, None]
    start = 0
    for ln in lengths:
        for h in range(horizon, 0, -1):  # far to near: the soonest use writes last
            if ln > h:
                rows = np.arange(start, start + ln - h)
                Y[rows[:, None, None], layer, ids[rows + h]] = decay ** (h - 1)
        has[start:start + max(ln - 1, 0)] = True
        start += ln
    return Y, has


def fit_reuse(X: list[np.ndarray], ids: np.ndarray, lengths: list[int], n_expert: int, val: np.ndarray,
              horizon: int = REUSE_HORIZON, decay: float = REUSE_DECAY,
              alphas: tuple[float, ...] = REUSE_ALPHAS, progress=None,
              rows: np.ndarray | None = None) -> tuple[list[np.ndarray], list[np.ndarray], list[float], np.ndarray]:
    """Per MoE layer j: (R [d, E], rb [E]) with x_j @ R + rb ≈ how soon each expert of layer j is used again
    (``reuse_targets``); the penalty whose maps miss least when they evict on the validation rows (half the
    experts as slots), then refitted on every row. Also the blend [L, 6] (``learned.blend_scores``): least
    squares of the same targets on the validation rows' map scores (from the maps fitted without those rows)
    and the layer's ``Recency`` features.
    ``rows``: the rows to learn from (default all); decode is what eviction serves, so the fit passes the rows
    whose next tokens the model generated: on smol-moe, maps fitted on 751 rows of the model's own greedy text
    evicted better than maps fitted on 12000 rows that were mostly prompts (16.1 against 19.5 misses per token
    at 8 of 16 slots; LRU 22.5)."""
    Y, has = reuse_targets(ids, lengths, n_expert, horizon, decay)
    if rows is not None and (has & rows).sum() >= MIN_ROWS:  # random fixtures generate nothing: all rows then
        has &= rows
    fit, chk = has & ~val, has & val
    slots = max(ids.shape[2], n_expert // 2)
    R, rb, chosen, blend = [], [], [], []
    for j in range(len(X)):
        r_fit = Ridge(X[j][fit])
        proj = r_fit.project(Y[fit, j])
        misses, held = [], []
        for a in alphas:  # judged by what the maps are for: misses of the validation text's own eviction
            B, c = r_fit.solve(proj, a)
            held.append(X[j][val].astype(np.float64) @ B + c)
            misses.append(eviction_misses(ids[val, j], slots, held[-1]) if chk.any() else 0)
        best = int(np.argmin(misses))  # argmin takes the first (smallest) penalty on a tie
        a = alphas[best]
        blend.append(_fit_blend(held[best][has[val]], Recency.features_of(ids[:, j], n_expert)[chk],
                                Y[chk, j]) if chk.sum() >= MIN_ROWS else _PLAIN)
        r_all = Ridge(X[j][has])
        B, c = r_all.solve(r_all.project(Y[has, j]), a)
        R.append(np.ascontiguousarray(B, np.float32))
        rb.append(np.asarray(c, np.float32))
        chosen.append(a)
        if progress is not None:
            progress(j + 1)
    return R, rb, chosen, np.stack(blend).astype(np.float32)


_PLAIN = np.array([1.0, 0, 0, 0, 0, 0])  # the map's score alone (too few rows to weigh it against the past)


def _fit_blend(scores: np.ndarray, recency: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """Weights [6] of (score, 4 recency features, 1) fitting Y [n, E] by least squares, lightly damped (6
    unknowns over n * E equations: well determined)."""
    A = np.concatenate([scores[..., None], recency, np.ones(scores.shape + (1,))], axis=-1).reshape(-1, 6)
    return np.linalg.solve(A.T @ A + 1e-3 * np.eye(6), A.T @ Y.reshape(-1))


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
