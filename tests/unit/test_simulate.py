"""The reference cache simulator (study/simulate.py) against known traces and an exhaustive search."""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np
import pytest

from pyspecter.study.simulate import belady_misses, lru_stack_positions, per_layer, simulate_cache


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


def _set_lru_hits_by_definition(steps: np.ndarray, slots: int) -> int:
    """Set-LRU read straight from its definition: before each step the cache holds the ``slots`` experts used most
    recently (a step's first choice the most recent of its step), found by scanning the history backwards."""
    hits = 0
    for t, row in enumerate(steps):
        recent: list[int] = []
        for prev in steps[:t][::-1]:
            recent += [int(e) for e in prev if e >= 0 and int(e) not in recent]
        hits += sum(int(e) in recent[:slots] for e in row if e >= 0)
    return hits


def test_set_lru_is_the_stack_cache_at_every_size() -> None:
    rng = np.random.default_rng(2)
    steps = np.stack([rng.choice(9, 3, replace=False) for _ in range(150)])
    pos = lru_stack_positions(steps)
    for s in range(3, 10):
        assert int(((pos >= 0) & (pos < s)).sum()) == simulate_cache(steps, s, "lru")
        assert simulate_cache(steps, s, "lru") == _set_lru_hits_by_definition(steps, s)
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
