"""The replay (csrc/replay.cpp, ``native.Replay``): native residency's own eviction code run over a routing trace
on a private slot table. Its rules on hand-made call streams, the duel and the held slots' ghost against their
definitions, and the bench's replay (study/replay.py) against the Python replay it replaced, on a recorded trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyspecter.native import Replay
from pyspecter.study.replay import Call, replay
from pyspecter.study.simulate import EvictionDuel, batched_misses, eviction_misses, lru_stack_positions

DATA = Path(__file__).parent / "data"


def _decode(ids: np.ndarray, il: int = 0) -> list[Call]:
    return [Call(0, t, il, row[None, :]) for t, row in enumerate(ids)]


def test_decode_alone_reads_what_the_engines_lru_step_misses() -> None:
    # one expert a call: the slot table and the duel's bookkeeping cache tell LRU's ties apart alike
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


def _recorded_calls() -> tuple[list[Call], dict[str, dict[int, int]]]:
    """smol-moe's routing calls on the first three packaged eval prompts, each prefilled and then decoded 16 greedy
    tokens (``record_calls``, the bench's run), and the bench's slots per layer at 50% and 30% (``bench_slots``)."""
    d = np.load(DATA / "smol_moe_calls.npz")
    ends = np.cumsum(d["rows"] * 2)
    calls = [Call(int(p), int(t), int(il), ids.reshape(-1, 2).astype(np.int32))
             for p, t, il, ids in zip(d["prompt"], d["step"], d["il"], np.split(d["ids"], ends[:-1]), strict=True)]
    return calls, {pct: dict(enumerate(d[f"slots{pct}"].tolist())) for pct in ("50", "30")}


# What study/replay.py's Python slot table (ReplayLayer, its own victim and ranks, deleted when the replay moved to
# C) read on the recorded calls, per policy: (with the prompts' read-ahead, without), at 50% and 30%.
PYTHON_REPLAY_READS = {
    "50": {"lru": (1108, 1106), "lfu": (1081, 1082), "prev-token": (1143, 1141)},
    "30": {"lru": (1614, 1613), "lfu": (1612, 1612), "prev-token": (1623, 1624)},
}


@pytest.mark.parametrize("budget", ["50", "30"])
def test_the_c_replay_reads_what_the_python_replay_read_on_a_recorded_trace(budget: str) -> None:
    calls, slots = _recorded_calls()
    assert len(calls) == 3 * 17 * 30 and any(len(c.ids) > 1 for c in calls)
    for policy, (ahead, plain) in PYTHON_REPLAY_READS[budget].items():
        got = (replay(calls, slots[budget], 16, policy), replay(calls, slots[budget], 16, policy, lookahead=False))
        assert got == (ahead, plain), (policy, got)


def test_the_score_policy_evicts_the_lowest_score_and_counts_bytes() -> None:
    calls = _decode(np.array([[0], [1], [2], [3]]))
    keep_0 = lambda c: np.array([9, 1, 1, 1], np.float32)  # noqa: E731  # expert 0 scored highest: kept
    with Replay({0: 2}, 4, "score", expert_bytes={0: 100}) as r:
        for c in calls:
            r.call(c.il, c.ids, keep_0(c))
        r.call(0, [0])
        st = r.stats()
    assert st["hits"] == 1 and st["reads"] == st["misses"] == 4 and st["evictions"] == 2 and st["bytes"] == 400
    assert replay(calls + _decode(np.array([[0]])), {0: 2}, 4, "lru") == 5  # LRU lets 0 go


def test_bad_replays_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        Replay({0: 2}, 4, "fifo")
    with pytest.raises(ValueError, match="refused"):
        Replay({0: -1}, 4)
    with Replay({1: 2}, 4) as r, pytest.raises(ValueError, match="layer 0"):
        r.call(0, [1])  # layer 0 has no slots: not replayed


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
        assert not EvictionDuel({0: 4}, 8).use_learned  # LRU until the scores have shown they miss less
        duel = _duel_run(EvictionDuel({0: 4}, 8, decay=0.99), 0, scores_know)
        lru, learned = duel.totals
        assert duel.use_learned is scores_know and (learned < lru) is scores_know


def test_a_duel_that_trusts_the_scores_starts_on_them_and_still_leaves_bad_ones() -> None:
    assert EvictionDuel({0: 4}, 8, start_learned=True).use_learned
    for scores_know in (True, False):
        duel = _duel_run(EvictionDuel({0: 4}, 8, decay=0.99, start_learned=True), 1, scores_know)
        assert duel.use_learned is scores_know



def test_ghost_lru_matches_the_reference_lru() -> None:
    """The held slots' ghost (C's, replayed: 2 usable slots and 2 held) is set-LRU (study/simulate.py) where the last
    expert of a call counts as the most recent: the reference's stack, fed each call's experts in reverse."""
    rng = np.random.default_rng(0)
    calls = []
    with Replay({0: 2}, 10, held=2) as ghost:
        for _ in range(200):
            needed = sorted({int(x) for x in rng.integers(0, 10, size=2)})
            ghost.call(0, needed)
            calls.append((needed[::-1] + [-1])[:2])
        got = ghost.stats()["held_ghost_misses"]
    pos = lru_stack_positions(np.array(calls))
    assert got == int(((pos < 0) | (pos >= 4))[np.array(calls) >= 0].sum()) > 0


def test_batched_calls_replay_each_row_as_the_slot_table_would_and_read_each_expert_once_per_call() -> None:
    rng = np.random.default_rng(3)
    ids = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(120)])  # [T, 2, 2]
    one_prompt = np.zeros(len(ids), int)

    def table_misses(calls: list[Call], slots: int) -> int:
        with Replay({0: slots, 1: slots}, 8, "lru", lookahead=False) as r:
            for c in calls:
                r.call(c.il, c.ids)
            return r.stats()["misses"]

    for slots in (2, 4, 6):
        # one row a call: the slot table's own LRU, layer after layer as decode calls them
        rows = [Call(0, t, j, ids[t, j][None, :]) for t in range(len(ids)) for j in range(2)]
        assert batched_misses(ids, one_prompt, 8, slots, 1) == table_misses(rows, slots)
        # two rows a call: each expert once per call
        pairs = [Call(0, t, j, ids[t:t + 2, j]) for t in range(0, len(ids), 2) for j in range(2)]
        assert batched_misses(ids, one_prompt, 8, slots, 2) == table_misses(pairs, slots)
    # room for every expert: only first uses miss, whatever the batch
    first_uses = sum(len(np.unique(ids[:, j])) for j in range(2))
    assert {batched_misses(ids, one_prompt, 8, 8, b) for b in (1, 3, len(ids))} == {first_uses}
    # no call spans two prompts: one row per prompt batches as one row a call
    assert batched_misses(ids, np.arange(len(ids)), 8, 4, 4) == batched_misses(ids, one_prompt, 8, 4, 1)
