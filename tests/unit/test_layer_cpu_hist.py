"""The decode layers' routing CPU histogram (llama_pyspecter_get_layer_cpu_hist): its median, and merging the
counters of several decode phases bin by bin."""

from pyspecter import native
from pyspecter.native_residency import layer_cpu_p50_us
from pyspecter.study.bench_runs import merge_counters

BIN_US = native.HIST_NS / 1e3


def _row(**bins: int) -> list[int]:
    row = [0] * 257
    for b, n in bins.items():
        row[int(b.removeprefix("b"))] = n
    return row


def test_the_median_is_interpolated_within_its_bin() -> None:
    assert layer_cpu_p50_us([0] * 257) is None
    # four layers in bin 2 ([0.5, 0.75) us): the median is half way into it
    assert layer_cpu_p50_us(_row(b2=4)) == 2.5 * BIN_US
    # a tail does not move it: 9 layers at ~10 us, one of 64 us or more (the last bin)
    assert layer_cpu_p50_us(_row(b40=9, b256=1)) == (40 + 5 / 9) * BIN_US


def test_phases_merge_bin_by_bin() -> None:
    a = {"route_calls": 10, "layer_cpu_hist": (_row(b4=3), _row(b40=1)), "route_cpu_us_p50_miss": 10.1}
    b = {"route_calls": 10, "layer_cpu_hist": (_row(b4=1), _row(b8=3)), "route_cpu_us_p50_miss": 2.1}
    out = merge_counters([a, b])
    assert out["route_calls"] == 20
    assert out["layer_cpu_hist"][0][4] == 4 and out["layer_cpu_hist"][1][8] == 3
    assert out["route_cpu_us_p50_resident"] == (4 + 2 / 4) * BIN_US
    assert out["route_cpu_us_p50_miss"] == (8 + 2 / 3) * BIN_US  # of the summed bins, not a mean of medians
