"""LRU over a layer's routing: each access's place in the LRU stack, and from it the misses of every slot count
in one pass. The plan prices slot layers with it (hitrates.lru_hits), the predictor fit sizes the budget's slots
with it (models/reuse_fit.py), and the study's reference simulator re-exports it (study/simulate.py)."""

from __future__ import annotations

import numpy as np


def lru_stack_positions(steps: np.ndarray) -> np.ndarray:
    """For a stream of expert sets [T, U] (one layer), each access's position in the LRU stack before its step
    (-1: first touch). A cache of s slots that keeps each step's set resident (set-LRU) holds exactly the top s of
    this stack, so an access hits with s slots iff 0 <= position < s: one pass gives every slot count."""
    stack: list[int] = []  # most recent first
    pos = np.full(steps.shape, -1, np.int64)
    for s, row in enumerate(steps):
        need = [int(e) for e in row if e >= 0]
        where = {e: i for i, e in enumerate(stack)}
        for u, e in enumerate(row):
            if e >= 0 and int(e) in where:
                pos[s, u] = where[int(e)]
        # the step's experts move to the front in router order (ties need a rule; any that ignores cache size
        # keeps the one-stack property)
        gone = set(need)
        stack = need + [e for e in stack if e not in gone]
    return pos


def lru_miss_curve(ids: np.ndarray, n_expert: int, warm: int = 0) -> np.ndarray:
    """Misses per token of an LRU cache of s = 0..E slots on one layer's routing ids [n, k], from one
    stack-distance pass (``lru_stack_positions``: a hit with s slots is a hit with more). Below k slots every
    access misses. ``warm``: the first rows only fill the cache (a short trace's cold misses are not the steady
    state's)."""
    k = ids.shape[1]
    pos = lru_stack_positions(ids)[warm:][ids[warm:] >= 0]
    n = len(ids) - warm
    misses = np.array([np.sum((pos < 0) | (pos >= s)) for s in range(n_expert + 1)], np.float64)
    misses[:k] = len(pos)
    return (misses / max(n, 1)).astype(np.float32)
