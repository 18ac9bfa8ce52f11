"""The bench's two simple baselines, without llama.cpp: previous-token reuse (an eviction policy) and the static
hot set (a choice made once from a routing profile)."""

from __future__ import annotations

import numpy as np

from pyspecter.layout import ExpertTensor, ModelLayout, MoELayer
from pyspecter.policies import LRU, Policy, PrevToken, hot_experts, make_policy
from pyspecter.residency import Residency


class _Api:
    def set_slot(self, _model, il: int, expert: int, slot: int) -> int:
        return 0


def _residency(policy: Policy, n_slots: int, n_expert: int = 8) -> Residency:
    layers = [MoELayer(0, {"up": ExpertTensor("blk.0.ffn_up_exps.weight", "up", "F16", (n_expert, 4, 4), 0, 100)})]
    layout = ModelLayout(path=None, arch="test", name="t", n_layer=1, n_expert=n_expert,  # type: ignore[arg-type]
                         n_expert_used=2, n_shared_expert_layers=0, file_bytes=0, tensor_bytes=0, layers=layers)
    model = type("M", (), {"ptr": 1})()
    return Residency(model=model, layout=layout, n_slots=n_slots, n_usable=n_slots, policy=policy, api=_Api())


def _step(res: Residency, needed: set[int]) -> list[int]:
    """One decode token through layer 0 as the routing hook runs it with misses waited for (cache._on_route +
    misses.WaitMisses): hits stamped, each miss into the policy's victim. Returns the experts evicted."""
    st = res.begin_call(0)
    assert st is not None
    evicted, taken = [], set()
    for e in needed:
        if st.where[e] >= 0:
            st.last_use[st.where[e]] = res.clock
    for e in sorted(needed):
        if st.where[e] >= 0:
            continue
        slot = res.victim(0, needed, taken, need=True)
        if st.owner[slot] >= 0:
            evicted.append(st.owner[slot])
        res.evict(0, slot)
        res.assign(0, e, slot)
        taken.add(slot)
    return evicted


def test_prev_token_keeps_the_previous_tokens_experts_and_otherwise_goes_first_in_first_out() -> None:
    seq = [{0, 1}, {2, 3}, {0, 4}, {4, 2}, {7}]
    prev, lru = _residency(PrevToken(), 4), _residency(LRU(), 4)
    got = [(_step(prev, s), _step(lru, s)) for s in seq]
    # token 3: expert 1 is both the oldest loaded and the least recently used
    assert got[2] == ([1], [1])
    # token 5: the previous token used 4 and 2. Of the others, 0 was loaded first (token 1) but used at token 3,
    # 3 loaded later (token 2) and never used again: LRU drops 3, previous-token reuse drops the oldest load, 0
    assert got[4] == ([0], [3])
    assert make_policy("prev-token").name == "prev-token"


def test_prev_token_never_evicts_what_the_previous_token_used_while_anything_else_can_go() -> None:
    rng = np.random.default_rng(0)
    res = _residency(PrevToken(), 5, n_expert=10)
    before: set[int] = set()
    for _ in range(300):
        needed = {int(x) for x in rng.choice(10, size=2, replace=False)}
        held = {e for e in res.layers[0].owner if e >= 0}
        spare = held - needed - before  # resident, not needed now, not the previous token's
        evicted = _step(res, needed)
        for e in evicted:
            assert e not in before or not spare, (e, before, spare)
        before = needed


def test_prev_token_still_frees_a_slot_when_only_previous_token_experts_are_left() -> None:
    res = _residency(PrevToken(), 2)
    _step(res, {0, 1})
    assert _step(res, {2}) == [0]  # both were the previous token's: the first loaded goes


def test_the_static_hot_set_is_the_most_used_experts_of_the_profile() -> None:
    counts = [3, 9, 9, 0, 5]
    assert hot_experts(counts, 3) == [1, 2, 4]  # ties keep the lower id: one profile, one answer
    assert hot_experts(counts, 0) == []
    assert hot_experts(counts, 9) == [1, 2, 4, 0, 3]
    assert hot_experts(np.array([0, 0, 7]), 1) == [2]
