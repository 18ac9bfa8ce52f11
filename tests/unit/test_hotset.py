"""The adaptive hot set's rule, without llama.cpp: decayed counts from a profile, the set they choose, and the
uploads that move the slots from one set to the next."""

from __future__ import annotations

import numpy as np
import pytest

from pyspecter.hotset import HotSet, curves, moves
from pyspecter.policies import hot_experts


def test_the_profile_chooses_the_first_set_and_the_texts_counts_take_over() -> None:
    profile = {3: [9, 7, 1, 0], 5: [0, 0, 4, 8]}
    h = HotSet(profile, {3: 2, 5: 1}, n_used=2, n_expert=4, every=4, decay=0.5)
    assert h.chosen == {3: [0, 1], 5: [3]}
    # the profile is one window's selections (every * n_used = 8), so a window that uses other experts replaces it
    assert h.scores[3].sum() == pytest.approx(8.0)
    uses = np.zeros((6, 4), np.uint32)
    uses[3] = [0, 1, 3, 4]
    uses[5] = [0, 0, 0, 8]  # layer 5 keeps its set: not reported as changed
    assert h.update(uses) == {3: [3, 2]}
    assert h.chosen[5] == [3]
    want = 0.5 * np.array([9, 7, 1, 0]) * 8 / 17 + uses[3]
    assert h.scores[3] == pytest.approx(want)
    assert h.chosen[3] == hot_experts(want, 2)


def test_a_window_like_the_last_changes_nothing() -> None:
    h = HotSet({0: [4, 4, 0, 0]}, {0: 2}, n_used=2, n_expert=4, every=4, decay=0.8)
    assert h.update(np.array([[4, 4, 0, 0]], np.uint32)) == {}
    assert h.update(np.array([[0, 4, 4, 0]], np.uint32)) == {}  # 1 still leads, 0 decays but keeps its rank
    assert sorted(h.chosen[0]) == [0, 1]


def test_moves_keep_what_stays_and_fill_empty_slots_first() -> None:
    assert moves([5, 2, 7], [2, 5, 7]) == []  # the same set, in any order: nothing uploaded
    assert moves([5, 2, 7], [2, 9, 5]) == [(2, 9)]  # 7 left: its slot gets 9
    assert moves([5, -1, 7], [8, 9, 5]) == [(1, 8), (2, 9)]  # the empty slot first, hottest first
    assert moves([-1, -1], [1, 0]) == [(0, 1), (1, 0)]
    owner = [0, 1, 2, 3]
    for slot, e in moves(owner, [3, 6, 0, 4]):
        owner[slot] = e
    assert sorted(owner) == [0, 3, 4, 6]


@pytest.mark.parametrize("prompt", [0, 23])
def test_the_curves_are_what_the_set_holds_and_loads_window_by_window(prompt: int) -> None:
    """hotset.curves, every slot count from one ranking a window, against the set itself run with s slots: each
    window met by the set chosen before it, the moves between windows, none after the last. With a prompt, its
    rows are one window (a prefill), not scored, and the loads are per answer token (tools/hotset_study.py)."""
    rng = np.random.default_rng(7)
    E, k, every = 8, 2, 16
    ids = rng.choice(E, size=(70, k), p=np.arange(1, E + 1) / (E * (E + 1) / 2))
    ids[::5, 1] = -1  # rows without an expert are not rows
    profile = [5, 1, 0, 3, 9, 2, 2, 4]
    held, loaded = curves(profile, ids, k, every=every, prompt=prompt)
    answer = ids[prompt:]
    used = answer[answer >= 0]
    windows = ([ids[:prompt]] if prompt else []) + [answer[w:w + every] for w in range(0, len(answer), every)]
    for s in range(E + 1):
        h = HotSet({0: profile}, {0: s}, k, E, every=every)
        hits = n = 0
        owner = list(h.chosen[0])
        for i, win in enumerate(windows):
            if i or not prompt:
                hits += int(np.isin(win[win >= 0], owner).sum())
            h.update(np.bincount(win[win >= 0], minlength=E)[None, :])
            if i + 1 < len(windows):
                for slot, e in moves(owner, h.chosen[0]):
                    owner[slot] = e
                    n += 1
        assert held[s] == pytest.approx(hits / len(used))
        assert loaded[s] == pytest.approx(n / len(answer))
    assert held[0] == 0.0 and held[E] == 1.0 and loaded[0] == loaded[E] == 0.0
