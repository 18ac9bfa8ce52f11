"""The bench's replay (study/replay.py) on hand-made call streams: its rules, and agreement with the one-layer
simulator (study/simulate.py) where the two model the same cache."""

from __future__ import annotations

import numpy as np

from pyspecter.study.replay import Call, replay
from pyspecter.study.simulate import eviction_misses


def _decode(ids: np.ndarray, il: int = 0) -> list[Call]:
    return [Call(0, t, il, row[None, :]) for t, row in enumerate(ids)]


def test_decode_alone_reads_what_the_engines_lru_step_misses() -> None:
    # one expert a call: no ties in recency (C's slot table breaks them by slot, the simulator by insertion)
    ids = np.random.default_rng(0).integers(0, 8, size=(300, 1))
    for slots in (1, 3, 5):
        assert replay(_decode(ids), {0: slots}, 8, "lru") == eviction_misses(ids, slots)


def test_a_batch_fills_slots_in_expert_order_and_is_not_counted() -> None:
    batch = Call(0, -1, 0, np.array([[5, 1], [7, 3], [2, 6]]))  # six experts, four slots: 1, 2, 3, 5 stay
    after = [Call(0, 0, 0, np.array([[1, 2]])), Call(0, 1, 0, np.array([[6, 7]]))]
    assert replay([batch], {0: 4}, 8) == 0
    assert replay([batch, *after], {0: 4}, 8) == 2  # 1 and 2 were kept; 6 and 7 were computed on the host


def test_a_batch_reads_the_next_layers_most_used_experts_ahead() -> None:
    first = [Call(0, 0, 1, np.array([[4, 5]])), Call(0, 1, 1, np.array([[4, 6]]))]  # layer 1 used 4 most
    batch = Call(1, -1, 0, np.array([[0, 1], [2, 3]]))  # four experts in layer 0: four read ahead in layer 1
    later = Call(1, 0, 1, np.array([[4, 5]]))
    slots = {0: 4, 1: 4}
    with_ahead = replay([*first, batch, later], slots, 8)
    assert with_ahead == 3  # 4, 5, 6 in decode; then 4 and 5 resident (read ahead or kept)
    drop = Call(1, 0, 1, np.array([[2, 3]]))  # layer 1 read 4, 5, 6 and then 0 (ties by id) ahead of need
    assert replay([*first, batch, drop], slots, 8) == 5
    assert replay([*first, batch, drop], slots, 8, lookahead=False) == 5
