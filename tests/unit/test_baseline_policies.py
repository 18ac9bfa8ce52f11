"""The bench's two simple baselines, without llama.cpp: previous-token reuse (an eviction policy) and the static
hot set (a choice made once from a routing profile)."""

from __future__ import annotations

import numpy as np

from pyspecter.policies import hot_experts


def test_the_static_hot_set_is_the_most_used_experts_of_the_profile() -> None:
    counts = [3, 9, 9, 0, 5]
    assert hot_experts(counts, 3) == [1, 2, 4]  # ties keep the lower id: one profile, one answer
    assert hot_experts(counts, 0) == []
    assert hot_experts(counts, 9) == [1, 2, 4, 0, 3]
    assert hot_experts(np.array([0, 0, 7]), 1) == [2]
