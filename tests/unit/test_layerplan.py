"""The layer plan's cost model: stock --n-cpu-moe at the same device memory is one of its candidates, so the plan it
chooses is never predicted slower, and always fits."""

from __future__ import annotations

import pytest

from pyspecter.errors import SpecterError
from pyspecter.layerplan import DeviceCosts, LayerPlan, choose_plan, n_cpu_moe_for, predict_us, stock_plan
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
    from pyspecter.native.lib import _SPLITS

    same = _SPLITS.search(b"graph_reserve: graph: nodes = 1234, splits = 62, input objects = 3, input tensors = 5\n")
    assert same is not None and same.group(1) == b"62" and same.group(2) is None
    both = _SPLITS.search(b"llama_context: graph (pp bs=512, tg bs=1): nodes = 1500 / 1234, splits = 64 / 62, "
                          b"input objects = 3 / 3, input tensors = 5 / 5\n")
    assert both is not None and (both.group(1), both.group(2)) == (b"64", b"62")
