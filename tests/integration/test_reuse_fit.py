"""Fitting the reuse maps (models/reuse_fit.py) on synthetic data, judged as the fit judges them: by the misses of
the engine's own eviction step, which C runs (study/simulate.py's ``eviction_misses`` replays csrc/policy.cpp), so
these need the built library."""

from __future__ import annotations

import numpy as np
import pytest

from pyspecter import learned
from pyspecter.models import predictor_fit as pf
from pyspecter.models import reuse_fit as rf
from pyspecter.study import simulate as sim


def test_lru_miss_curve_is_a_direct_lru_simulation_for_every_size() -> None:
    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(8, 2, replace=False) for _ in range(400)])
    curve = sim.lru_miss_curve(ids, 8)
    assert curve[0] == curve[1] == pytest.approx(2.0)  # below top-k every access misses
    for s in range(2, 9):  # one token's experts are placed as a set: the stack model is off by a few at most
        assert curve[s] * len(ids) == pytest.approx(sim.eviction_misses(ids, s), rel=0.02)
    assert np.all(np.diff(curve) <= 1e-6)  # more slots never miss more (LRU's inclusion property)
    assert curve[8] * len(ids) == 8  # all slots: first uses only


def test_knowing_more_of_the_future_never_evicts_worse_and_ends_at_belady() -> None:
    rng = np.random.default_rng(5)
    ids = np.stack([rng.choice(8, 2, replace=False, p=np.linspace(2, 1, 8) / 12) for _ in range(600)])
    distinct = 2 * len(ids)
    belady = distinct - sim.simulate_cache(ids, 4, "belady")
    by_k = [sim.eviction_misses(ids, 4, sim.oracle_scores(ids, 8, k)) for k in (1, 2, 4, 8, 64)]
    assert by_k[0] < sim.eviction_misses(ids, 4)  # even one token of the future beats recency
    assert all(a >= b - 2 for a, b in zip(by_k, by_k[1:], strict=False))  # ties may differ by a miss or two
    assert by_k[-1] == pytest.approx(belady, abs=3)


def _reuse_data(n: int, seed: int):
    """One layer whose next token's two experts are a linear function of this token's input."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    W = np.random.default_rng(99).normal(size=(16, 8))
    nxt = np.argsort(-(x @ W), axis=1)[:, :2]  # the experts row t + 1 uses
    ids = np.concatenate([rng.choice(8, (1, 2), replace=False), nxt[:-1]])[:, None, :]  # [n, 1, 2]
    return [x], ids


def test_reuse_maps_evict_what_the_next_tokens_do_not_need() -> None:
    X, ids = _reuse_data(4000, seed=0)
    R, rb, alphas, _ = rf.fit_reuse(X, ids, [400] * 10, 8, pf.validation_rows([400] * 10), horizon=1)
    assert R[0].shape == (16, 8) and rb[0].shape == (8,) and alphas[0] in rf.REUSE_ALPHAS
    Xe, ide = _reuse_data(1000, seed=1)
    scores = Xe[0] @ R[0] + rb[0]
    lru = sim.eviction_misses(ide[:, 0], 4)
    learned_ = sim.eviction_misses(ide[:, 0], 4, scores)
    assert learned_ < 0.85 * lru  # the future is in x: evicting by it beats recency by far


def test_the_blend_weighs_the_past_where_the_hidden_state_says_nothing() -> None:
    rng = np.random.default_rng(4)
    n, E = 4000, 16
    ids, work = [], list(range(5))
    for _ in range(n):  # each token picks 2 of a slowly drifting working set of 5, whatever x is
        if rng.random() < 0.05:
            work[int(rng.integers(5))] = int(rng.choice([e for e in range(E) if e not in work]))
        ids.append(rng.choice(work, 2, replace=False))
    ids = np.array(ids)[:, None, :]
    X = [rng.normal(size=(n, 16)).astype(np.float32)]  # noise: the maps learn nothing
    lengths = [400] * 10
    R, rb, _, blend = rf.fit_reuse(X, ids, lengths, E, pf.validation_rows(lengths), horizon=4)
    assert blend.shape == (1, 6) and blend[0, 1:5].sum() > 3 * abs(blend[0, 0])
    rec = learned.Recency.features_of(ids[:, 0], E)
    plain = X[0] @ R[0] + rb[0]
    lru = sim.eviction_misses(ids[:, 0], 6)
    blended = sim.eviction_misses(ids[:, 0], 6, learned.blend_scores(blend[0], plain, rec))
    alone = sim.eviction_misses(ids[:, 0], 6, plain)
    assert blended <= 1.05 * lru and 3 * lru < alone, (blended, lru, alone)  # the map alone evicts at random


def test_reuse_maps_fit_on_every_row_when_too_few_are_generated() -> None:
    X, ids = _reuse_data(800, seed=0)
    only_last = np.zeros(800, bool)
    only_last[399::400] = True  # a fixture's "generated" rows: the last of each sequence, with no next token
    val = pf.validation_rows([400, 400])
    R, rb, _, _ = rf.fit_reuse(X, ids, [400, 400], 8, val, horizon=1, rows=only_last)
    assert np.isfinite(R[0]).all() and np.isfinite(rb[0]).all()
