"""The layer plan's cost model: stock --n-cpu-moe at the same device memory is one of its candidates, so the plan it
chooses is never predicted slower, and always fits."""

from __future__ import annotations

import pytest

from pyspecter.errors import SpecterError
from pyspecter.layerplan import (
    DeviceCosts,
    LayerPlan,
    choose_plan,
    hit_rate,
    n_cpu_moe_for,
    predict_us,
    stock_plan,
)
from pyspecter.layout import ExpertTensor, ModelLayout, MoELayer

EB = 1000  # one expert's bytes


def _layout(n_expert: int = 16, n_used: int = 2, n_layers: int = 8) -> ModelLayout:
    layers = [MoELayer(i, {"up": ExpertTensor(f"blk.{i}.ffn_up_exps.weight", "up", "F16", (n_expert, 4, 4), 0, EB)})
              for i in range(n_layers)]
    return ModelLayout(path=None, arch="test", name="t", n_layer=n_layers, n_expert=n_expert,  # type: ignore[arg-type]
                       n_expert_used=n_used, n_shared_expert_layers=0, file_bytes=0,
                       tensor_bytes=n_layers * n_expert * EB + 500, layers=layers)


# an RPC-like device (a switch costs much, the device computes as slowly as the host) and a GPU-like one
RPC = DeviceCosts(split_us=700.0, link_gbps=2.0, cpu_row_us=40.0, dev_row_us=40.0, base_us=3000.0)
GPU = DeviceCosts(split_us=60.0, link_gbps=25.0, cpu_row_us=40.0, dev_row_us=2.0, base_us=500.0)


def test_stock_plans_are_stocks_placements() -> None:
    lay = _layout()
    assert set(stock_plan(lay, None).kinds.values()) == {"host"}
    half = stock_plan(lay, 4)
    assert half.layers("host") == [0, 1, 2, 3] and half.layers("full") == [4, 5, 6, 7]
    assert half.device_bytes(lay) == 4 * 16 * EB and half.switches_per_token() == 8
    assert n_cpu_moe_for(lay, half.device_bytes(lay)) == 4


@pytest.mark.parametrize("costs", [RPC, GPU], ids=["rpc", "gpu"])
@pytest.mark.parametrize("share", [0.0, 0.1, 0.3, 0.5, 0.75, 1.0])
def test_the_plan_is_never_predicted_slower_than_stock_at_equal_memory(costs: DeviceCosts, share: float) -> None:
    lay = _layout()
    budget = int(share * lay.expert_total_bytes)
    plan = choose_plan(lay, budget, costs)
    assert plan.device_bytes(lay) <= budget
    stock = stock_plan(lay, n_cpu_moe_for(lay, budget))
    assert predict_us(plan, lay, costs) <= predict_us(stock, lay, costs) + 1e-6
    assert predict_us(plan, lay, costs) <= predict_us(stock_plan(lay, None), lay, costs) + 1e-6
    assert sorted(plan.kinds) == [L.index for L in lay.layers]


def test_a_fast_device_puts_misses_behind_slots_and_rpc_keeps_stocks_layers() -> None:
    lay = _layout()
    budget = int(0.3 * lay.expert_total_bytes)
    # on a GPU a slot layer beats a host layer (its hits run on the device): the leftover memory becomes slots
    assert choose_plan(lay, budget, GPU).layers("slots")
    # on RPC the device is this CPU: a slot saves nothing, so what stock does is what the plan does
    rpc = choose_plan(lay, budget, RPC)
    assert not rpc.layers("slots") and rpc.layers("full") == stock_plan(lay, n_cpu_moe_for(lay, budget)).layers("full")


def test_bad_plans_are_refused() -> None:
    with pytest.raises(SpecterError):
        LayerPlan({0: "gpu"})
    with pytest.raises(SpecterError):
        LayerPlan({0: "slots"}, 0)
    assert LayerPlan({0: "full", 1: "slots", 2: "host"}, 4).describe(_layout(n_layers=3)) == \
        "1 full, 1 slots (4/16), 1 host"
    assert stock_plan(_layout(n_layers=4), 2).describe(_layout(n_layers=4)) == "2 full, 2 host"


def test_the_split_counts_are_read_from_llama_cpps_line() -> None:
    from pyspecter.native.logs import _SPLITS

    same = _SPLITS.search("graph_reserve: graph: nodes = 1234, splits = 62, input objects = 3, input tensors = 5\n")
    assert same is not None and same.group(1) == "62" and same.group(2) is None
    both = _SPLITS.search("llama_context: graph (pp bs=512, tg bs=1): nodes = 1500 / 1234, splits = 64 / 62, "
                          "input objects = 3 / 3, input tensors = 5 / 5\n")
    assert both is not None and (both.group(1), both.group(2)) == ("64", "62")


def _uneven_layout() -> ModelLayout:
    """The last layer's experts twice the others' (planning by the largest layer alone would not reach stock's
    --n-cpu-moe at stock's own memory)."""
    lay = _layout()
    last = lay.layers[-1]
    t = last.tensors["up"]
    big = MoELayer(last.index, {"up": ExpertTensor(t.name, t.kind, t.ggml_type, t.shape, 0, 2 * EB)})
    return ModelLayout(path=None, arch="test", name="t", n_layer=lay.n_layer, n_expert=lay.n_expert,  # type: ignore[arg-type]
                       n_expert_used=lay.n_expert_used, n_shared_expert_layers=0, file_bytes=0,
                       tensor_bytes=lay.tensor_bytes + 16 * EB, layers=[*lay.layers[:-1], big])


def _grid() -> list[DeviceCosts]:
    """Costs over the corners that matter: switches cheap or dear, the device's rows faster, as fast or slower than
    the host's, a slow or fast link."""
    return [DeviceCosts(split_us=s, link_gbps=g, cpu_row_us=40.0, dev_row_us=d, base_us=1000.0)
            for s in (0.0, 50.0, 700.0, 5000.0) for d in (0.0, 2.0, 40.0, 200.0, 2000.0) for g in (0.1, 2.0, 25.0)]


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_the_plan_is_never_predicted_slower_than_either_stock_placement(uneven: bool) -> None:
    lay = _uneven_layout() if uneven else _layout()
    for costs in _grid():
        for share in (0.0, 0.1, 0.3, 0.5, 0.75, 0.99, 1.0):
            budget = int(share * lay.expert_total_bytes)
            plan = choose_plan(lay, budget, costs)
            t = predict_us(plan, lay, costs)
            assert plan.device_bytes(lay) <= budget, (costs, share)
            assert t <= predict_us(stock_plan(lay, None), lay, costs) + 1e-6, (costs, share)
            assert t <= predict_us(stock_plan(lay, n_cpu_moe_for(lay, budget)), lay, costs) + 1e-6, (costs, share)


def test_stocks_n_cpu_moe_is_a_candidate_where_layers_differ_in_size() -> None:
    """Full layers beat host ones (no switch): at the memory of stock's last two full layers (one of them twice the
    others) the plan has both, as stock does."""
    lay = _uneven_layout()
    stock = stock_plan(lay, 6)
    plan = choose_plan(lay, stock.device_bytes(lay), RPC)
    assert plan.layers("full") == [6, 7] and predict_us(plan, lay, RPC) <= predict_us(stock, lay, RPC) + 1e-6


@pytest.mark.parametrize("share", [0.3, 0.5, 1.0])
def test_all_host_is_chosen_where_the_device_computes_slower_than_a_switch_saves(share: float) -> None:
    """A device whose expert rows cost more than the host's by more than two switches per layer (as the RPC
    server's CPU can, beside this process's threads): stock --cpu-moe's placement, every layer host, at any
    memory, and nothing predicted slower than it."""
    lay = _layout()
    slow = DeviceCosts(split_us=500.0, link_gbps=2.0, cpu_row_us=400.0, dev_row_us=1500.0, base_us=3000.0)
    plan = choose_plan(lay, int(share * lay.expert_total_bytes), slow)
    assert plan == stock_plan(lay, None)


def test_equal_rows_and_dear_switches_put_every_layer_that_fits_on_the_device() -> None:
    """Host and device rows alike, switches dear: a full layer saves its two switches and a slot layer saves
    nothing (its misses still go to the host and over the link), so the plan is stock's --n-cpu-moe."""
    lay = _layout()
    dear = DeviceCosts(split_us=5000.0, link_gbps=2.0, cpu_row_us=400.0, dev_row_us=400.0, base_us=3000.0)
    for share in (0.3, 0.5):
        budget = int(share * lay.expert_total_bytes)
        assert choose_plan(lay, budget, dear) == stock_plan(lay, n_cpu_moe_for(lay, budget))


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_the_plan_never_switches_more_than_stock_n_cpu_moe_where_the_device_is_no_slower(uneven: bool) -> None:
    """Counts, not times: wherever the device computes a row no slower than the host, the plan's host switches per
    token are never above stock --n-cpu-moe's at the same memory (a full layer saves both its switches and its
    rows; ties go to fewer switches). Where the device is slower per row, all-host may rightly win."""
    lay = _uneven_layout() if uneven else _layout()
    for costs in _grid():
        if costs.dev_row_us > costs.cpu_row_us:
            continue
        for share in (0.0, 0.1, 0.3, 0.5, 0.75, 0.99, 1.0):
            budget = int(share * lay.expert_total_bytes)
            plan = choose_plan(lay, budget, costs)
            stock = stock_plan(lay, n_cpu_moe_for(lay, budget))
            assert plan.switches_per_token() <= stock.switches_per_token(), (costs, share, plan.describe(lay))


def test_a_tie_goes_to_fewer_switches() -> None:
    """Switches free and the device as fast as the host: every placement is predicted alike, and the plan is stock
    --n-cpu-moe's (the old rule, --cpu-moe first, put every layer on the host)."""
    lay = _layout()
    flat = DeviceCosts(split_us=0.0, link_gbps=2.0, cpu_row_us=40.0, dev_row_us=40.0, base_us=1000.0)
    budget = lay.expert_total_bytes // 2
    assert choose_plan(lay, budget, flat).kinds == stock_plan(lay, n_cpu_moe_for(lay, budget)).kinds


def test_a_mapped_slot_layer_takes_no_switch_and_reads_its_misses_from_the_host_copy() -> None:
    """--miss mapped: a slot layer's hits are device rows, its misses rows read from the host copy, no switch;
    uploads (LRU) priced as for any slot layer, and a hot set's moves the same way."""
    lay = _layout()  # 16 experts, top-2, 8 layers
    every = LayerPlan({L.index: "slots" for L in lay.layers}, 8)  # half the experts: hit rate 1/2, a miss a token
    costs = DeviceCosts(split_us=60.0, link_gbps=1.0, cpu_row_us=40.0, dev_row_us=2.0, base_us=500.0, map_row_us=10.0)
    upload = EB / 1e3  # one expert over a 1 GB/s link, µs
    hot = LayerPlan(every.kinds, 8, hot=True)
    assert predict_us(hot, lay, costs, mapped=True) == pytest.approx(500 + 8 * (1 * 2.0 + 1 * 10.0))
    moves = [0.0] * 8 + [0.25] + [0.0] * 8  # a quarter of an expert a layer a token with 8 slots
    assert predict_us(hot, lay, costs, mapped=True, hot_moves=moves) == pytest.approx(
        500 + 8 * (1 * 2.0 + 1 * 10.0 + 0.25 * upload))
    assert predict_us(every, lay, costs, mapped=True) == pytest.approx(500 + 8 * (2.0 + 10.0 + upload))
    # the same layers with host paths: two switches, every row on the device, the misses on the host too
    assert predict_us(every, lay, costs) == pytest.approx(500 + 8 * (2 * 60 + 2 * 2.0 + 40.0 + upload))
    # full and host layers are priced as ever
    assert predict_us(stock_plan(lay, 4), lay, costs, mapped=True) == predict_us(stock_plan(lay, 4), lay, costs)
    with pytest.raises(SpecterError, match="no measured row read from the host copy"):
        predict_us(every, lay, GPU, mapped=True)
    assert "map_row_us" not in GPU.as_dict() and costs.as_dict()["map_row_us"] == 10.0


def test_a_mapped_slot_layer_pays_the_measured_share_of_its_uploads() -> None:
    """upload_share (devcosts.measure_mapped): what a token waits for of uploads beside it under --miss mapped.
    Only mapped slot layers use it; the host-path slot layers' uploads stay counted in full."""
    lay = _layout()
    every = LayerPlan({L.index: "slots" for L in lay.layers}, 8)
    upload = EB / 1e3
    costs = DeviceCosts(split_us=60.0, link_gbps=1.0, cpu_row_us=40.0, dev_row_us=2.0, base_us=500.0,
                        map_row_us=10.0, upload_share=0.25)
    assert predict_us(every, lay, costs, mapped=True) == pytest.approx(500 + 8 * (2.0 + 10.0 + 0.25 * upload))
    assert predict_us(every, lay, costs) == pytest.approx(500 + 8 * (2 * 60 + 2 * 2.0 + 40.0 + upload))
    hidden = DeviceCosts(**{**costs.as_dict(), "upload_share": 0.0})
    assert predict_us(every, lay, hidden, mapped=True) == predict_us(LayerPlan(every.kinds, 8, hot=True), lay, hidden,
                                                                    mapped=True)
    assert costs.as_dict()["upload_share"] == 0.25 and "upload_share" not in GPU.as_dict()


def test_a_measured_lru_hit_rate_prices_slot_layers_that_move_experts() -> None:
    """hits (hitrates.lru_hits: LRU on the model's own routing, by slot count) replace the floor n / E for slot
    layers whose residency moves experts; a hot plan reads hot_hits instead (the floor where unmeasured), and a
    curve of the wrong length is not read."""
    lay = _layout()  # 16 experts, top-2, 8 layers
    every = LayerPlan({L.index: "slots" for L in lay.layers}, 8)
    hits = [min(1.0, 0.1 * n) for n in range(lay.n_expert + 1)]  # 0.8 at 8 slots, against the floor's 0.5
    assert hit_rate(8, lay.n_expert) == 0.5 and hit_rate(8, lay.n_expert, hits) == pytest.approx(0.8)
    assert hit_rate(8, lay.n_expert, hits[:-1]) == 0.5
    costs = DeviceCosts(split_us=60.0, link_gbps=1.0, cpu_row_us=40.0, dev_row_us=2.0, base_us=500.0,
                        map_row_us=10.0, upload_share=1.0)
    upload = EB / 1e3
    miss = 2 * (1 - 0.8)  # rows a token that miss, of top-2
    assert predict_us(every, lay, costs, mapped=True, hits=hits) == pytest.approx(
        500 + 8 * (2 * 0.8 * 2.0 + miss * 10.0 + miss * upload))
    assert predict_us(every, lay, costs, hits=hits) == pytest.approx(
        500 + 8 * (2 * 60 + 2 * 2.0 + miss * 40.0 + miss * upload))
    hot = LayerPlan(every.kinds, 8, hot=True)
    static = predict_us(hot, lay, costs, mapped=True)
    assert predict_us(hot, lay, costs, mapped=True, hits=hits) == static == pytest.approx(500 + 8 * (2.0 + 10.0))
    assert predict_us(hot, lay, costs, mapped=True, hits=[0.0] * 17, hot_hits=hits) == pytest.approx(
        500 + 8 * (2 * 0.8 * 2.0 + miss * 10.0))


def test_uploads_hidden_beside_the_token_let_the_plan_choose_slot_layers() -> None:
    """A link so slow that an upload costs more than a host layer: counted in full, the mapped plan is stock's
    placement; measured as hidden beside the token (share 0, their own stream), the same memory is slot layers."""
    lay = _layout()
    full = DeviceCosts(split_us=60.0, link_gbps=0.001, cpu_row_us=40.0, dev_row_us=2.0, base_us=500.0,
                       map_row_us=30.0)
    hidden = DeviceCosts(**{**full.as_dict(), "upload_share": 0.0})
    budget = int(0.4 * lay.expert_total_bytes)
    stock = stock_plan(lay, n_cpu_moe_for(lay, budget))
    assert choose_plan(lay, budget, full, mapped=True) == stock
    plan = choose_plan(lay, budget, hidden, mapped=True)
    assert plan.layers("slots") and plan.device_bytes(lay) <= budget
    assert predict_us(plan, lay, hidden, mapped=True) < predict_us(stock, lay, hidden)


@pytest.mark.parametrize("map_row", [1.0, 10.0, 400.0])
@pytest.mark.parametrize("share", [0.1, 0.3, 0.6])
def test_the_mapped_plan_is_never_predicted_slower_than_stock_and_reads_cheap_misses(map_row: float,
                                                                                      share: float) -> None:
    lay = _layout()
    costs = DeviceCosts(split_us=60.0, link_gbps=25.0, cpu_row_us=40.0, dev_row_us=2.0, base_us=500.0,
                        map_row_us=map_row)
    budget = int(share * lay.expert_total_bytes)
    plan = choose_plan(lay, budget, costs, mapped=True)
    assert plan.device_bytes(lay) <= budget
    stock = stock_plan(lay, n_cpu_moe_for(lay, budget))
    assert predict_us(plan, lay, costs, mapped=True) <= predict_us(stock, lay, costs) + 1e-6
    if map_row < costs.cpu_row_us:  # a miss read by the device beats a host visit: the leftover memory is slots
        assert plan.layers("slots") and plan.switches_per_token(mapped=True) < stock.switches_per_token()


def test_a_hot_set_is_chosen_where_it_hits_nearly_as_well_as_lru_without_its_uploads() -> None:
    """hot_hits (hitrates.hot_hits) make hot slot layers candidates: where the hot set hits as often as LRU they
    win by the uploads they never make; where it hits much less, LRU's slot layers stay; a tie goes to LRU; without
    hot_hits there is no hot plan. Either way the plan is never predicted slower than stock and fits."""
    lay = _layout()  # 16 experts, top-2, 8 layers
    costs = DeviceCosts(split_us=60.0, link_gbps=0.1, cpu_row_us=40.0, dev_row_us=2.0, base_us=500.0,
                        map_row_us=10.0, upload_share=1.0)
    budget = int(0.5 * lay.expert_total_bytes)
    stock = stock_plan(lay, n_cpu_moe_for(lay, budget))
    lru = [min(1.0, 0.1 * n) for n in range(lay.n_expert + 1)]
    assert not choose_plan(lay, budget, costs, mapped=True, hits=lru).hot
    plan = choose_plan(lay, budget, costs, mapped=True, hits=lru, hot_hits=[h * 0.95 for h in lru])
    assert plan.hot and plan.layers("slots") and plan.device_bytes(lay) <= budget
    assert predict_us(plan, lay, costs, mapped=True, hits=lru, hot_hits=[h * 0.95 for h in lru]) < predict_us(
        stock, lay, costs)
    assert "hot slots" in plan.describe(lay)
    assert not choose_plan(lay, budget, costs, mapped=True, hits=lru, hot_hits=[h * 0.3 for h in lru]).hot
    free = DeviceCosts(**{**costs.as_dict(), "upload_share": 0.0})  # uploads cost nothing: the two tie
    assert not choose_plan(lay, budget, free, mapped=True, hits=lru, hot_hits=lru).hot
    # a hot set that hits as LRU does but loads as many experts between decodes as LRU uploads misses loses
    assert not choose_plan(lay, budget, costs, mapped=True, hits=lru, hot_hits=[h * 0.95 for h in lru],
                           hot_moves=[2 * (1 - h) for h in lru]).hot


class _Device:
    """What priced_plan asks of a device: a host buffer type (pinned host memory, CUDA's; None on RPC) and the
    zero slots its kernel needs."""

    def __init__(self, host_buffer: int | None, zero: int = 0) -> None:
        self._host, self._zero = host_buffer, zero

    def host_buffer_type(self) -> int | None:
        return self._host

    def zero_slots(self, n_used: int) -> int:
        return self._zero


@pytest.mark.parametrize(("host_buffer", "zero", "mapped_ms", "want_mapped"), [
    (1, 0, 8.0, True),  # pinned host memory, negative ids, predicted faster: the mapped plan
    (1, 0, 12.0, False),  # predicted slower: the plain plan
    (None, 0, 8.0, False),  # no host buffer type (RPC): its stand-in copy would be memory beyond the budget
    (1, 2, 8.0, False),  # a kernel that takes no negative id: mapped misses cannot point anywhere
])
def test_without_a_miss_mode_the_plan_is_priced_both_ways_where_the_device_reads_the_host_copy(
        monkeypatch: pytest.MonkeyPatch, host_buffer: int | None, zero: int, mapped_ms: float,
        want_mapped: bool) -> None:
    """placement.priced_plan(mapped=None), what a session given no --miss runs: the mapped plan where it is
    predicted faster and the device reads pinned host memory in place; asked for either, that one alone."""
    from pyspecter import devcosts
    from pyspecter.placement import priced_plan

    lay = _layout()
    plain = stock_plan(lay, 4)
    slots = LayerPlan({L.index: "slots" for L in lay.layers}, 8, hot=True)
    asked: list[bool] = []

    def plan_for(_path, _lay, _dev, _bytes, _threads=2, mapped=False):
        asked.append(mapped)
        return (slots, {"predicted_ms": mapped_ms, "mapped": True}) if mapped else (
            plain, {"predicted_ms": 10.0, "mapped": False})

    monkeypatch.setattr(devcosts, "plan_for", plan_for)
    dev = _Device(host_buffer, zero)
    plan, info = priced_plan(lay, dev, lay.expert_total_bytes // 2, mapped=None)
    assert (plan, info["mapped"]) == ((slots, True) if want_mapped else (plain, False))
    assert asked == ([False, True] if host_buffer is not None and not zero else [False])
    asked.clear()
    assert priced_plan(lay, dev, lay.expert_total_bytes // 2, mapped=False)[0] == plain and asked == [False]
    asked.clear()
    assert priced_plan(lay, dev, lay.expert_total_bytes // 2, mapped=True)[0] == slots and asked == [True]
    monkeypatch.setenv("SPECTER_NO_MAPPED", "1")  # gpu_check, where the GPU's mapped cases failed
    asked.clear()
    assert priced_plan(lay, dev, lay.expert_total_bytes // 2, mapped=None)[0] == plain and asked == [False]
