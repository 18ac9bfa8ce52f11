"""The prefetch plan's decisions, without llama.cpp: most probable first, nothing that cannot land in time,
and eviction by predicted reuse (the Python hook's plan; decoding runs the native planner)."""

from __future__ import annotations

import time

import numpy as np
from test_decisions import _Api, _layout, _Upload

from pyspecter import learned
from pyspecter.plan import RECENCY, LayerAhead, PrefetchPlan
from pyspecter.policies import EvictionDuel, Predicted
from pyspecter.residency import Residency


class _Tier:
    def __init__(self) -> None:
        self.uploads: list[tuple[int, int, int]] = []

    def upload_async(self, il: int, e: int, slot: int) -> _Upload:
        self.uploads.append((il, e, slot))
        return _Upload(ok=True, done=False)


class _Cache:
    """What the plan uses of an ExpertCache: the slot table, the tier, the link speed and the counters."""

    def __init__(self, n_slots: int = 3, gbps: float | None = 1.0) -> None:
        self.layout = _layout(n_expert=8, n_layers=2, expert_bytes=1_000_000)
        self.residency = Residency(type("M", (), {"ptr": 1})(), self.layout, n_slots, n_slots, Predicted(),
                                   api=_Api())
        self.layers = self.residency.layers
        self.expert_bytes = {L.index: L.expert_bytes for L in self.layout.layers}
        self.tier = _Tier()
        self.stats = type("S", (), {"prefetches": 0})()
        self.totals = type("T", (), {"hook_ns": 0})()
        self.uploaded = 0
        self._gbps = gbps

    def usable(self, il: int) -> int:
        return self.residency.usable(il)

    def link_gbps(self) -> float | None:
        return self._gbps

    def count_upload(self, il: int) -> None:
        self.uploaded += 1


def _probs(**p: float) -> np.ndarray:
    out = np.zeros(8, np.float32)
    for k, v in p.items():
        out[int(k[1:])] = v
    return out


def test_most_probable_first_and_only_what_lands_in_time() -> None:
    cache = _Cache(n_slots=3)
    plan = PrefetchPlan(cache, min_prob=0.25)  # type: ignore[arg-type]
    now = time.perf_counter()
    # 1 MB experts on a 1 GB/s link: 1 ms each; the layer is due in 2.5 ms, so two can land, not three
    plan.predict(1, _probs(e5=0.9, e2=0.6, e7=0.4, e3=0.1), now + 0.0025)
    assert plan.issue([1]) == 2
    assert [e for _, e, _ in cache.tier.uploads] == [5, 2]
    assert plan.skipped_late == 1  # e7 would land after the layer asked; e3 is below min_prob
    # a batch needs the union: per-token rows are merged by their most likely
    plan.predict(0, np.stack([_probs(e1=0.9), _probs(e4=0.8)]), now + 1.0)
    assert plan.issue([0]) == 2


def test_eviction_by_predicted_reuse_never_gives_up_a_likelier_expert() -> None:
    cache = _Cache(n_slots=2, gbps=None)  # no link measured yet: no cut-off
    plan = PrefetchPlan(cache)  # type: ignore[arg-type]
    res = cache.residency
    res.assign(0, 1, 0)
    res.assign(0, 2, 1)
    st = cache.layers[0]
    plan.predict(0, _probs(e1=0.9, e2=0.3, e6=0.5), time.perf_counter() + 1)
    assert Predicted().rank(st, 1) < Predicted().rank(st, 0)  # expert 2 is the likelier victim
    assert plan.issue([0]) == 1
    assert cache.tier.uploads == [(0, 6, 1)] and st.where[2] == -1 and st.where[1] == 0
    # expert 1 (0.9) is never evicted for expert 7 (0.4)
    plan.predict(0, _probs(e1=0.9, e7=0.4), time.perf_counter() + 1)
    assert plan.issue([0]) == 0


def test_recency_floor_and_newer_predictions() -> None:
    cache = _Cache()
    plan = PrefetchPlan(cache)  # type: ignore[arg-type]
    plan.used(0, {3, 4}, 0.01)
    st = cache.layers[0]
    assert st.need[3] == RECENCY and st.need[0] == 0.0
    plan.predict(0, _probs(e3=0.1, e4=0.9, e5=0.3), time.perf_counter())
    assert st.need[3] == RECENCY and st.need[4] == np.float32(0.9) and st.need[5] == np.float32(0.3)
    plan.enabled = False
    assert plan.issue([0]) == 0


class _Reuse:
    """A predictor with reuse maps only: expert e's score is x[e]."""

    has_reuse = True
    blend = None

    def reuse(self, il: int, x: np.ndarray, recency=None) -> np.ndarray:
        assert recency is None  # no blend: the layer's past is not tracked
        return np.asarray(x, np.float32)

    def predict(self, il: int, x: np.ndarray) -> dict:
        raise AssertionError("the plan is off: nothing may be predicted ahead")


def test_reuse_scores_pick_the_victims_of_the_layers_own_call_with_the_plan_off() -> None:
    cache = _Cache(n_slots=3)
    plan = PrefetchPlan(cache)  # type: ignore[arg-type]
    plan.enabled = False
    ahead = LayerAhead(plan, _Reuse(), duel=False)
    res = cache.residency
    for slot, e in enumerate((1, 2, 3)):
        res.assign(0, e, slot)
    res.layers[0].last_use[:] = [5, 1, 3]  # LRU would give up expert 2 (slot 1)
    ahead.on_input(0, _probs(e1=0.1, e2=0.9, e3=0.5))  # ... but the next tokens need it, and not expert 1
    assert res.victim(0, protected={7}) == 0
    ahead.on_input(0, _probs(e1=0.9, e2=0.9, e3=0.2))
    assert res.victim(0, protected={7}) == 2
    assert cache.tier.uploads == [] and ahead.calls == 2  # eviction only: nothing read ahead


class _Blended(_Reuse):
    """A predictor whose blend keeps whatever the previous call used (weight on the first recency feature)."""

    blend = np.array([[0.0, 1.0, 0, 0, 0, 0]])

    def __init__(self) -> None:
        self.seen: list[np.ndarray] = []

    def reuse(self, il: int, x: np.ndarray, recency=None) -> np.ndarray:
        self.seen.append(recency.features())
        return learned.blend_scores(self.blend[0], np.zeros(8, np.float32), recency.features())


def test_a_blend_sees_each_layers_own_past_calls() -> None:
    cache = _Cache(n_slots=3)
    plan = PrefetchPlan(cache)  # type: ignore[arg-type]
    plan.enabled = False
    pred = _Blended()
    ahead = LayerAhead(plan, pred, duel=False)
    res = cache.residency
    for slot, e in enumerate((1, 2, 3)):
        res.assign(0, e, slot)
    ahead.on_input(0, np.zeros(8))
    assert pred.seen == []  # scored only when something is evicted: most calls evict nothing
    res.victim(0, protected={7})
    res.victim(0, protected={7})
    assert len(pred.seen) == 1 and not pred.seen[0].any()  # once a call; no call yet: no past
    ahead.on_route(0, {2, 5}, 1)
    ahead.on_input(0, np.zeros(8))
    assert res.victim(0, protected={7}) != 1  # expert 2 (slot 1), used last call, is kept
    assert pred.seen[1][:, 0].tolist() == [0, 0, 1, 0, 0, 1, 0, 0]  # the previous call's experts


def test_the_duel_evicts_by_the_scores_only_once_they_miss_less_than_lru() -> None:
    rng = np.random.default_rng(0)
    for scores_know in (True, False):
        duel = EvictionDuel({0: 4}, decay=0.99)
        assert not duel.use_learned  # LRU until the scores have shown they miss less
        seq = [sorted(rng.choice(8, 2, replace=False).tolist()) for _ in range(600)]
        for t, needed in enumerate(seq):
            soon = {e for later in seq[t + 1:t + 4] for e in later}
            # scores that know what the next tokens use, or that prefer exactly what they do not
            scores = [float((e in soon) == scores_know) for e in range(8)]
            duel.observe(0, needed, scores)
        lru, learned = duel.totals
        assert duel.use_learned is scores_know and (learned < lru) is scores_know


def test_a_duel_that_trusts_the_scores_starts_on_them_and_still_leaves_bad_ones() -> None:
    rng = np.random.default_rng(1)
    for scores_know in (True, False):
        duel = EvictionDuel({0: 4}, decay=0.99, start_learned=True)
        assert duel.use_learned
        seq = [sorted(rng.choice(8, 2, replace=False).tolist()) for _ in range(600)]
        for t, needed in enumerate(seq):
            soon = {e for later in seq[t + 1:t + 4] for e in later}
            duel.observe(0, needed, [float((e in soon) == scores_know) for e in range(8)])
        assert duel.use_learned is scores_know
