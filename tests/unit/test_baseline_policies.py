"""The bench's two simple baselines, without llama.cpp: previous-token reuse (an eviction policy) and the static
hot set (a choice made once from a routing profile)."""

from __future__ import annotations

import numpy as np

from pyspecter.policies import hot_experts, hot_hit_curve


def test_the_static_hot_set_is_the_most_used_experts_of_the_profile() -> None:
    counts = [3, 9, 9, 0, 5]
    assert hot_experts(counts, 3) == [1, 2, 4]  # ties keep the lower id: one profile, one answer
    assert hot_experts(counts, 0) == []
    assert hot_experts(counts, 9) == [1, 2, 4, 0, 3]
    assert hot_experts(np.array([0, 0, 7]), 1) == [2]


def test_the_hot_sets_hit_curve_is_what_each_hot_set_holds_of_the_routing() -> None:
    """hot_hit_curve: for every slot count s, the share of the rows (-1: none) whose expert is among the s most
    used of the profile, counted directly against hot_experts."""
    counts = [3, 9, 9, 0, 5]
    ids = np.array([[1, 4], [0, 2], [3, -1], [2, 1]])
    curve = hot_hit_curve(counts, ids)
    rows = [int(e) for e in ids.ravel() if e >= 0]
    for s in range(len(counts) + 1):
        assert curve[s] == sum(e in hot_experts(counts, s) for e in rows) / len(rows)
    assert curve[0] == 0.0 and curve[-1] == 1.0 and list(curve) == sorted(curve)
