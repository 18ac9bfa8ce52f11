"""Slots per layer need not be uniform: the budget spread over layers (budget.allocate_slots, MemoryPlan's
spread) and the residency that hands out each layer's own count. No llama.cpp here: stand-in layouts and C API."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pyspecter.budget import (
    CURVE_MIN_GAIN,
    MemoryPlan,
    allocate_slots,
    slot_bytes,
    slots_for_budget,
    split_counts,
    zero_slots,
)
from pyspecter.cache import ExpertCache
from pyspecter.errors import SpecterError
from pyspecter.layout import ExpertTensor, ModelLayout, MoELayer

MB = 10**6


def _layout(sizes: list[int], n_expert: int = 16, k: int = 2, first: int = 0) -> ModelLayout:
    """MoE layers first, first+1, ... whose experts take ``sizes[j]`` bytes each."""
    layers = [MoELayer(first + j, {"up": ExpertTensor(f"blk.{first + j}.ffn_up_exps.weight", "up", "F16",
                                                      (n_expert, 4, 4), 0, b)})
              for j, b in enumerate(sizes)]
    total = sum(sizes) * n_expert
    return ModelLayout(path=None, arch="test", name="t", n_layer=len(sizes) + first,  # type: ignore[arg-type]
                       n_expert=n_expert, n_expert_used=k, n_shared_expert_layers=0, file_bytes=total,
                       tensor_bytes=total, layers=layers)


def _lru_like(n_expert: int, skew: float) -> list[float]:
    """A convex miss curve: misses fall fast for a concentrated layer (high skew), slowly for a flat one."""
    p = np.arange(1, n_expert + 1, dtype=float) ** -skew
    p /= p.sum()
    return [1000 * (1 - p[:s].sum()) for s in range(n_expert + 1)]


# --- allocate_slots ---------------------------------------------------------------------------------------------

def test_uniform_rows_then_remainder_one_slot_per_layer_in_forward_order() -> None:
    lay = _layout([100] * 4)
    counts = allocate_slots(lay, 5 * 400 + 250)  # 5 whole rows, then 250 bytes: two more slots
    assert counts == {0: 6, 1: 6, 2: 5, 3: 5}
    assert slot_bytes(lay, counts) == 2200  # 50 bytes left: less than a slot


def test_a_predictor_costs_its_bytes_not_a_whole_row() -> None:
    # 8 rows of 49.8 MB less a 5 MiB predictor buy 7 whole rows; the ~45 MB left must become slots, not go unspent
    lay = _layout([498 * 10**4] * 10, n_expert=64, k=4)  # 49.8 MB per row
    budget = 398 * MB - 5 * 2**20
    assert slots_for_budget(lay, budget) == 7
    counts = allocate_slots(lay, budget)
    assert set(counts.values()) == {7, 8}
    assert budget - slot_bytes(lay, counts) < 4.98 * MB  # less than one slot left over


def test_layers_of_different_sizes_pay_their_own_bytes() -> None:
    lay = _layout([100, 300, 50])
    counts = allocate_slots(lay, 4 * 450 + 160)  # 160 left: layer 0 (100) fits, layer 1 (300) not, layer 2 (50)
    assert counts == {0: 5, 1: 4, 2: 5}


def test_floor_is_top_k_and_a_budget_below_it_is_refused() -> None:
    lay = _layout([100] * 3, k=4)
    assert min(allocate_slots(lay, 4 * 300).values()) == 4
    with pytest.raises(SpecterError, match="fewer than 4"):
        allocate_slots(lay, 4 * 300 - 1)
    with pytest.raises(SpecterError, match="fewer than 4"):
        allocate_slots(lay, 4 * 300 - 1, curves=[_lru_like(16, 1.0)] * 3)
    with pytest.raises(SpecterError, match="base"):
        allocate_slots(lay, 10**9, base=3)  # below top-k: one token's experts would not fit


def test_counts_are_capped_at_n_expert() -> None:
    lay = _layout([100, 200], n_expert=8)
    assert allocate_slots(lay, 10**9) == {0: 8, 1: 8}
    assert allocate_slots(lay, 10**9, curves=[_lru_like(8, 2.0), _lru_like(8, 0.1)]) == {0: 8, 1: 8}
    # one layer's curve pays far better: it fills to n_expert, never past it, before the other gets more
    counts = allocate_slots(lay, 8 * 100 + 2 * 200, curves=[_lru_like(8, 0.1), [0.0] * 9])
    assert counts == {0: 8, 1: 2}


def test_flat_curves_spread_evenly() -> None:
    lay = _layout([100] * 4)
    flat = [[7.0] * 17 for _ in range(4)]
    for budget in (800, 1000, 1234, 2750, 6400):
        counts = allocate_slots(lay, budget, curves=flat)
        assert max(counts.values()) - min(counts.values()) <= 1, (budget, counts)
        assert counts == allocate_slots(lay, budget), budget  # the same as without curves


def test_follows_the_curves() -> None:
    lay = _layout([100] * 4, n_expert=32, k=2)
    curves = [_lru_like(32, s) for s in (2.0, 0.3, 1.0, 0.6)]
    counts = allocate_slots(lay, 40 * 100, curves=curves)
    uniform = allocate_slots(lay, 40 * 100)
    assert sum(counts.values()) == 40
    assert counts != uniform
    assert sum(curves[j][counts[j]] for j in range(4)) < sum(curves[j][uniform[j]] for j in range(4))
    # the concentrated layer (skew 2) needs few slots; the flat ones (0.3, 0.6) get the most
    assert counts[0] < counts[2] and counts[0] < counts[3]
    # greedy per byte on convex curves is optimal: no single move of a slot between layers lowers the misses
    total = sum(curves[j][counts[j]] for j in range(4))
    for a in range(4):
        for b in range(4):
            if a != b and counts[a] > 2 and counts[b] < 32:
                moved = dict(counts)
                moved[a] -= 1
                moved[b] += 1
                assert sum(curves[j][moved[j]] for j in range(4)) >= total - 1e-9


def test_per_byte_a_cheap_layer_wins_an_equal_gain() -> None:
    lay = _layout([100, 400], n_expert=8)
    line = [float(8 - s) for s in range(9)]  # one miss fewer per slot in both layers
    counts = allocate_slots(lay, 2 * 500 + 400, curves=[line, line])
    assert counts == {0: 6, 1: 2}  # 400 bytes: four slots of layer 0 beat one of layer 1


def test_looks_past_a_flat_stretch() -> None:
    # layer 0 gains nothing from slot 3 but a lot from slot 4; layer 1 gains a little per slot: a greedy on single
    # steps would starve layer 0
    lay = _layout([100, 100], n_expert=8)
    c0 = [100.0, 90, 80, 80, 0, 0, 0, 0, 0]
    c1 = [100.0 - 2 * s for s in range(9)]
    counts = allocate_slots(lay, 6 * 100, curves=[c0, c1])
    assert counts == {0: 4, 1: 2}


def test_curves_as_mapping_or_array_and_bad_curves() -> None:
    lay = _layout([100] * 3, n_expert=8)
    curves = [_lru_like(8, s) for s in (1.5, 0.2, 0.8)]
    want = allocate_slots(lay, 1500, curves=curves)
    assert allocate_slots(lay, 1500, curves=dict(enumerate(curves))) == want
    assert allocate_slots(lay, 1500, curves=np.array(curves)) == want
    with pytest.raises(SpecterError, match="3 MoE layers"):
        allocate_slots(lay, 1500, curves=curves[:2])
    with pytest.raises(SpecterError, match="points"):
        allocate_slots(lay, 1500, curves=[c[:5] for c in curves])


def test_device_keeps_counts_uniform() -> None:
    lay = _layout([100] * 4)
    curves = [_lru_like(16, s) for s in (2.0, 0.3, 1.0, 0.6)]
    for budget in (800, 1234, 2750):
        want = {il: slots_for_budget(lay, budget) for il in range(4)}
        assert allocate_slots(lay, budget, device=True) == want
        assert allocate_slots(lay, budget, curves=curves, device=True) == want


def test_never_exceeds_the_budget_and_spends_the_remainder() -> None:
    rng = random.Random(20261001)
    for _ in range(300):
        n_layers, E = rng.randint(1, 6), rng.choice([4, 8, 16, 32])
        k = rng.randint(1, min(4, E))
        sizes = [rng.choice([64, 100, 100, 130, 500]) for _ in range(n_layers)]
        lay = _layout(sizes, n_expert=E, k=k, first=rng.randint(0, 3))
        budget = rng.randint(k * sum(sizes), E * sum(sizes) + 1000)
        curves = None
        if rng.random() < 0.7:
            curves = [sorted((rng.random() * 100 for _ in range(E + 1)), reverse=True) for _ in range(n_layers)]
            if rng.random() < 0.3:  # measured curves are noisy: not always monotone
                curves = [[rng.random() * 100 for _ in range(E + 1)] for _ in range(n_layers)]
        counts = allocate_slots(lay, budget, curves=curves)
        spent = slot_bytes(lay, counts)
        assert spent <= budget, (sizes, budget, counts)
        assert all(k <= c <= E for c in counts.values()), counts
        assert set(counts) == {L.index for L in lay.layers}
        left = budget - spent
        open_ = [L for L in lay.layers if counts[L.index] < E]
        if counts != allocate_slots(lay, budget):  # by the curves: greedy stops only when no layer fits one more
            assert curves is not None
            assert all(L.expert_bytes > left for L in open_), (sizes, budget, counts)
        else:  # whole rows, and a remainder smaller than a row (also where the curves promised too little)
            assert left < sum(sizes) or not open_


def test_split_counts() -> None:
    assert split_counts({0: 5, 3: 7, 4: 5}) == (5, {3: 2})
    assert split_counts({1: 4, 2: 4}) == (4, {})


# --- MemoryPlan -------------------------------------------------------------------------------------------------

def test_plan_spread_spends_the_remainder_and_default_is_unchanged() -> None:
    lay = _layout([100] * 4, n_expert=16, k=2)
    plain = MemoryPlan.for_budget(lay, "2250")
    assert plain == MemoryPlan(slots=5, budget_bytes=2250) and plain.extra == {}
    plan = MemoryPlan.for_budget(lay, "2250", spread=True)
    assert plan.slots == 5 and plan.extra == {0: 1, 1: 1}
    assert [plan.usable_in(il) for il in range(4)] == [6, 6, 5, 5]
    assert plan.slots * 400 + slot_bytes(lay, plan.extra) <= 2250
    # a device keeps uniform counts
    assert MemoryPlan.for_budget(lay, "2250", spread=True, device=_Dev(0)) == plain
    # and its zero slots (top-2 a layer: 800 bytes), where it has them, come out of the budget first
    assert MemoryPlan.for_budget(lay, "2250", spread=True, device=_Dev(2)) == MemoryPlan(slots=3, budget_bytes=1450)


class _Dev:
    """A device as a budget sees it: how many zero slots its slot layers hold (csrc decides; 0 or top-k)."""

    def __init__(self, zero: int) -> None:
        self.zero = zero

    def zero_slots(self, n_used: int) -> int:
        return self.zero


def test_a_devices_zero_slots_are_in_its_budget() -> None:
    """Where a device's kernel takes no negative id, its slot layers hold top-k zero slots besides their slots:
    device memory like any other, so the smallest budget names them and the slots are what is left (stock
    --n-cpu-moe gets every byte at equal memory). Where it takes them (CPU, CUDA, RPC), a miss costs nothing."""
    lay = _layout([100] * 4, n_expert=16, k=2)
    assert zero_slots(lay, _Dev(2)) == 2 and zero_slots(lay, None) == 0
    assert MemoryPlan.for_budget(lay, "1600", device=_Dev(2)).slots == 2  # 2 slots + 2 zero slots a layer
    assert MemoryPlan.for_budget(lay, "1600", device=_Dev(0)).slots == 4
    assert MemoryPlan.for_budget(lay, "1600").slots == 4
    with pytest.raises(SpecterError, match="zero slots"):
        MemoryPlan.for_budget(lay, "1599", device=_Dev(2))


def test_plan_spread_by_curves() -> None:
    lay = _layout([100] * 4, n_expert=32, k=2)
    curves = [_lru_like(32, s) for s in (2.0, 0.3, 1.0, 0.6)]
    plan = MemoryPlan.for_budget(lay, "4000", curves=curves)
    counts = {il: plan.usable_in(il) for il in range(4)}
    assert counts == allocate_slots(lay, 4000, curves=curves)
    assert plan.slots == min(counts.values())


@pytest.mark.parametrize("with_curves", [False, True])
def test_plan_spread_with_a_draft_gives_the_draftless_spread_once_released(with_curves: bool) -> None:
    """Once the draft is dropped each layer has the slots the budget without the draft spreads to it (what the
    engine's session gets), within the full budget: the held slots are per layer, not whole rows."""
    lay = _layout([100] * 4, n_expert=16, k=2)
    curves = [_lru_like(16, s) for s in (2.0, 0.3, 1.0, 0.6)] if with_curves else None
    for full, draft in ((4000, 1050), (4000, 950), (2600, 330), (6300, 100)):
        plan = MemoryPlan.for_budget(lay, str(full), draft_bytes=draft, spread=True, curves=curves)
        assert plan.usable * 400 + slot_bytes(lay, plan.extra) <= full - draft
        after = {il: plan.usable_in(il) + plan.held + plan.held_extra.get(il, 0) for il in range(4)}
        assert after == allocate_slots(lay, full, curves=curves), (full, draft, plan)
        assert slot_bytes(lay, after) <= full and max(after.values()) <= lay.n_expert
        assert plan.held == min(after[il] - plan.usable_in(il) for il in range(4))
        assert sum(after.values()) > sum(plan.usable_in(il) for il in range(4))  # the draft's memory comes back


def test_plan_spread_with_surrogates_keeps_reserved_uniform() -> None:
    lay = _layout([100] * 4, n_expert=16, k=2)
    plan = MemoryPlan.for_budget(lay, "2450", surrogate_bytes=50, spread=True)  # 2400 left: 6 rows exactly
    assert plan.reserved == 2 and plan.slots == 6 and plan.usable == 4 and plan.extra == {}
    plan = MemoryPlan.for_budget(lay, "2650", surrogate_bytes=50, spread=True)
    assert plan.slots == 6 and plan.extra == {0: 1, 1: 1}
    with pytest.raises(SpecterError, match=r"too small: .* = 4 slots per layer \(top-2 for full experts, as many "
                                           r"for surrogates\)"):
        MemoryPlan.for_budget(lay, "1500", surrogate_bytes=50, spread=True)


def test_cache_checks_extra_and_keeps_a_device_uniform() -> None:
    lay = _layout([100] * 3, n_expert=16, k=2)
    cpu = type("M", (), {"ptr": 1, "device": None})()
    dev = type("M", (), {"ptr": 1, "device": object()})()
    assert ExpertCache._check_extra(cpu, lay, 4, {0: 0, 2: 5}) == {2: 5}
    assert ExpertCache._check_extra(dev, lay, 4, {2: 5}) == {}  # device slots are real memory: the floor
    assert ExpertCache._check_extra(cpu, lay, 4, None) == {}
    with pytest.raises(SpecterError, match="n_expert"):
        ExpertCache._check_extra(cpu, lay, 4, {1: 13})
    with pytest.raises(SpecterError, match="n_expert"):
        ExpertCache._check_extra(dev, lay, 4, {1: -1})
    with pytest.raises(SpecterError, match="not a MoE layer"):
        ExpertCache._check_extra(cpu, lay, 4, {5: 1})


def test_curves_are_followed_only_where_they_promise_clearly_fewer_misses() -> None:
    lay = _layout([100, 100])
    E = lay.n_expert
    # both layers alike: the curves promise nothing over an even split, which is kept
    same = [[float(E - s) for s in range(E + 1)]] * 2
    assert allocate_slots(lay, 1000, curves=same) == allocate_slots(lay, 1000)
    # layer 0 gains nothing from slots past 2, layer 1 from each: its curve is followed
    steep = [[1.0] * (E + 1), [float(E - s) for s in range(E + 1)]]
    counts = allocate_slots(lay, 1000, curves=steep)
    assert counts[lay.layers[1].index] > counts[lay.layers[0].index]
    # a promise just under the threshold is not enough
    a = [float(E - s) for s in range(E + 1)]
    b = [x * (1 + 0.5 * CURVE_MIN_GAIN) if s < 5 else x for s, x in enumerate(a)]
    assert allocate_slots(lay, 1000, curves=[a, b]) == allocate_slots(lay, 1000)
