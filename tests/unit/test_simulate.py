"""The reference cache simulator (study/simulate.py) against known traces and an exhaustive search."""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np
import pytest

from pyspecter.study.simulate import EvictionDuel, belady_misses, lru_stack_positions, per_layer, simulate_cache


def _optimal_misses(steps: list[tuple[int, ...]], slots: int) -> int:
    """The fewest misses any cache of ``slots`` can have on the stream, from empty: every choice of victims tried."""

    @cache
    def go(i: int, resident: frozenset[int]) -> int:
        if i == len(steps):
            return 0
        need = set(steps[i])
        miss = [e for e in need if e not in resident]
        evict = max(0, len(resident) + len(miss) - slots)
        return len(miss) + min(go(i + 1, frozenset((resident - set(vs)) | need))
                               for vs in itertools.combinations(sorted(resident - need), evict))

    return go(0, frozenset())


def test_belady_is_optimal_by_exhaustive_search() -> None:
    rng = np.random.default_rng(1)
    for _ in range(120):
        E, U = int(rng.integers(3, 7)), int(rng.integers(1, 3))
        slots, T = int(rng.integers(U, E + 1)), int(rng.integers(3, 10))
        steps = np.stack([rng.choice(E, U, replace=False) for _ in range(T)])
        accesses = T * U
        best = _optimal_misses([tuple(int(e) for e in r) for r in steps], slots)
        assert accesses - simulate_cache(steps, slots, "belady") == best, (steps.tolist(), slots)
        for p in ("lru", "lfu"):  # no policy beats the optimum
            assert accesses - simulate_cache(steps, slots, p) >= best


def test_set_lru_is_the_stack_cache_at_every_size() -> None:
    rng = np.random.default_rng(2)
    steps = np.stack([rng.choice(9, 3, replace=False) for _ in range(150)])
    pos = lru_stack_positions(steps)
    for s in range(3, 10):
        assert int(((pos >= 0) & (pos < s)).sum()) == simulate_cache(steps, s, "lru")
    with pytest.raises(ValueError):
        simulate_cache(steps, 3, "fifo")


def test_lru_and_belady_on_a_known_trace() -> None:
    # one layer, 2 slots: a b c a b c ... LRU misses every time; MIN keeps one of the pair and misses 1 in 2
    steps = [(ord(c),) for c in "abcabcabc"]
    assert simulate_cache(steps, 2, "lru") == 0
    assert 9 - simulate_cache(steps, 2, "belady") == 6
    # the bench's bound starts from the best cache it could hold (the first `slots` experts used): those loads
    # are free
    trace = [(0, s) for s in steps]
    assert belady_misses(trace, 3) == 3 - 3
    assert belady_misses(trace, 2) == 6 - 2
    assert belady_misses(trace, 1) == 9 - 1


def test_belady_per_layer_multi_expert_steps_and_extra_slots() -> None:
    trace = [(0, (1, 2)), (1, (1, 2)), (0, (1, 2)), (1, (3, 4))]
    assert per_layer(trace) == {0: [(1, 2), (1, 2)], 1: [(1, 2), (3, 4)]}
    # from the best start: layer 0 holds 1 and 2 already, layer 1 starts with 1 and 2 and must load 3 and 4
    assert belady_misses(trace, 2) == 0 + 2
    # two extra slots in layer 1 hold all four of its experts: its loads are first uses, all free
    assert belady_misses(trace, 2, {1: 2}) == 0


def _duel_run(duel: EvictionDuel, seed: int, scores_know: bool) -> EvictionDuel:
    """600 calls of 2 experts in 8, scored by what the next 3 calls use (or by exactly what they do not)."""
    rng = np.random.default_rng(seed)
    seq = [sorted(rng.choice(8, 2, replace=False).tolist()) for _ in range(600)]
    for t, needed in enumerate(seq):
        soon = {e for later in seq[t + 1:t + 4] for e in later}
        duel.observe(0, needed, [float((e in soon) == scores_know) for e in range(8)])
    return duel


def test_the_duel_evicts_by_the_scores_only_once_they_miss_less_than_lru() -> None:
    for scores_know in (True, False):
        assert not EvictionDuel({0: 4}).use_learned  # LRU until the scores have shown they miss less
        duel = _duel_run(EvictionDuel({0: 4}, decay=0.99), 0, scores_know)
        lru, learned = duel.totals
        assert duel.use_learned is scores_know and (learned < lru) is scores_know


def test_a_duel_that_trusts_the_scores_starts_on_them_and_still_leaves_bad_ones() -> None:
    assert EvictionDuel({0: 4}, start_learned=True).use_learned
    for scores_know in (True, False):
        duel = _duel_run(EvictionDuel({0: 4}, decay=0.99, start_learned=True), 1, scores_know)
        assert duel.use_learned is scores_know
