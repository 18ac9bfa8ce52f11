"""Reuse maps for eviction, fitted beside the learned routing predictors (models/predictor_fit.py) on the same
recorded router inputs and routing: ridge from x_j to which experts of layer j the next REUSE_HORIZON tokens of
the same sequence use (multi-hot), the penalty chosen by the misses of the engine's own eviction step on the
validation rows (``eviction_misses``). Each layer's LRU miss curve, which the budget's slot allocation reads
(budget.allocate_slots), is pyspecter/lru.py's.

The eviction step lives here because the fit needs it, and the fit is a model builder's work that never imports
the study tooling; study/simulate.py, the reference simulator, uses this same function.
Held-out, the study compares the maps with LRU and Belady's MIN (study/predictor_fit.py ``evaluate_reuse``).
"""

from __future__ import annotations

import numpy as np

from pyspecter.learned import Recency
from pyspecter.models.ridge import Ridge
from pyspecter.native import Replay

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


# --- the engine's eviction step (C's own, replayed) -------------------------------------------------------

def eviction_misses(ids: np.ndarray, slots: int, scores: np.ndarray | None = None) -> int:
    """Misses of one layer's cache of ``slots`` over routing ids [n, k]: LRU, or (scores [n, E], each row's
    prediction made at that row) evicting the resident expert with the lowest predicted reuse, LRU among equals;
    what does not fit stays out. The engine's own bookkeeping step (C's duel), run by C (csrc/replay.cpp)."""
    ids = np.asarray(ids)
    n_expert = int(max(ids.max(initial=-1) + 1, 0 if scores is None else np.shape(scores)[1], 1))
    with Replay({0: slots}, n_expert, lookahead=False, duel=True) as r:
        for t, row in enumerate(ids):
            r.call(0, row, None if scores is None else scores[t])
        st = r.stats()
    return st["ghost_lru_misses" if scores is None else "ghost_score_misses"]


