"""devcosts.solve: the layer plan's inputs from the medians devcosts.measure times. Fed the times the cost model
itself predicts, it gives the costs back; fed noise that no costs could produce, it keeps the measured
host-over-full difference and never a negative cost."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_layerplan import _layout

from pyspecter.devcosts import VERSION, WARM, _reversed, _steps, cache_key, solve
from pyspecter.errors import SpecterError
from pyspecter.layerplan import DeviceCosts


def _times(costs: DeviceCosts, n_layers: int, k: int, m: int, extra: float) -> tuple[float, float, float, float]:
    """What placements A (every layer host) and B (the last m full) take, as the model says: A - B at one token,
    A's and B's wide step over their one-token step, A's one-token step (seconds). ``extra`` distinct experts per
    wide step in every layer but the last (llama.cpp runs its FFN on the output row alone)."""
    host = 2 * costs.split_us + k * costs.cpu_row_us
    full = k * costs.dev_row_us
    step_a = costs.base_us + n_layers * host
    wide_a = (n_layers - 1) * extra * costs.cpu_row_us
    wide_b = (n_layers - m) * extra * costs.cpu_row_us + (m - 1) * extra * costs.dev_row_us
    return m * (host - full) / 1e6, wide_a / 1e6, wide_b / 1e6, step_a / 1e6


@pytest.mark.parametrize("costs", [
    DeviceCosts(split_us=1500.0, link_gbps=1.5, cpu_row_us=450.0, dev_row_us=450.0, base_us=2000.0),  # RPC-like
    DeviceCosts(split_us=60.0, link_gbps=25.0, cpu_row_us=40.0, dev_row_us=2.0, base_us=500.0),  # GPU-like
    DeviceCosts(split_us=300.0, link_gbps=1.0, cpu_row_us=100.0, dev_row_us=900.0, base_us=1000.0),  # slow device
], ids=["rpc", "gpu", "slow-device"])
def test_solve_gives_back_the_costs_it_is_fed(costs: DeviceCosts) -> None:
    lay = _layout()
    L, k, m = len(lay.layers), lay.n_expert_used, 4
    one, wa, wb, step = _times(costs, L, k, m, extra=3.0)
    extra = {L_.index: 3.0 for L_ in lay.layers[:-1]} | {lay.layers[-1].index: 0.0}
    got = solve(lay, m, one, wa, wb, extra, costs.link_gbps, step)
    for name, want in costs.as_dict().items():
        assert math.isclose(getattr(got, name), want, rel_tol=1e-9, abs_tol=1e-6), name


@pytest.mark.parametrize("wide_a,wide_b,one", [
    (0.0, 0.0, 0.010),  # the wide steps cost nothing more: rows free, every microsecond a split
    (0.002, 0.0, 0.001),  # rows dear, the difference small: the split would be negative
    (0.002, 0.009, -0.004),  # B slower than A: the device's rows dearer than the host's
    (-0.001, -0.002, 0.0),  # noise below zero everywhere
])
def test_noise_gives_way_to_the_measured_host_over_full_difference(wide_a: float, wide_b: float, one: float) -> None:
    lay = _layout()
    k, m = lay.n_expert_used, 4
    extra = {L_.index: 3.0 for L_ in lay.layers}
    got = solve(lay, m, one, wide_a, wide_b, extra, 1.0, 0.05)
    assert all(v >= 0 and math.isfinite(v) for v in got.as_dict().values())
    host_over_full = 2 * got.split_us + k * (got.cpu_row_us - got.dev_row_us)
    assert math.isclose(host_over_full, one * 1e6 / m, rel_tol=1e-9, abs_tol=1e-6)


def test_the_steps_pair_one_token_with_distinct_wide_ones_and_the_key_carries_version_and_threads(tmp_path) -> None:
    """After a warm-up prompt (an mmap'd model's first read of an expert is page faults: they fell on the first
    timed steps of the placement that went first), pairs of a one-token and a wide step, each kind run first by
    either placement alike."""
    steps = _steps(6, 4, 32000)
    assert [len(s) for s in steps] == [WARM] + [1, 4] * 6
    flat = [t for s in steps for t in s]
    assert len(set(flat)) == len(flat)  # distinct tokens route to other experts: a wide step adds rows
    assert not _reversed(0)
    for first in (1, 2):  # the one-token steps, the wide ones
        turned = [_reversed(i) for i in range(first, len(steps), 2)]
        assert turned.count(True) == turned.count(False) == 3 and turned != sorted(turned)
        assert all(_reversed(i) == _reversed(i + 1) for i in range(1, len(steps), 2))  # a pair in one order

    class Dev:
        description = "dev"

    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    assert cache_key(f, Dev()).startswith(f"v{VERSION}|")  # type: ignore[arg-type]
    assert cache_key(f, Dev(), 4) != cache_key(f, Dev(), 2)  # type: ignore[arg-type]  # a host row's cost


def test_differences_bigger_than_the_step_are_scaled_into_it() -> None:
    """Load that came and went made the paired differences bigger than A's step itself: the host layers are scaled
    down to fill the step (base 0), their split and rows in the same proportions."""
    lay = _layout()
    extra = {L_.index: 3.0 for L_ in lay.layers}
    big = solve(lay, 4, 0.8, 0.1, 0.05, extra, 1.0, 100.0)  # a step long enough: as measured
    got = solve(lay, 4, 0.8, 0.1, 0.05, extra, 1.0, 0.05)
    k, L = lay.n_expert_used, len(lay.layers)
    assert got.base_us == 0.0 and math.isclose(L * (2 * got.split_us + k * got.cpu_row_us), 0.05e6)
    f = got.split_us / big.split_us
    assert 0 < f < 1 and math.isclose(got.cpu_row_us, big.cpu_row_us * f) and \
        math.isclose(got.dev_row_us, big.dev_row_us * f)


@pytest.mark.parametrize("true", [
    DeviceCosts(split_us=37.0, link_gbps=50.0, cpu_row_us=40.0, dev_row_us=2.0, base_us=400.0),  # H200-like
    DeviceCosts(split_us=1500.0, link_gbps=1.5, cpu_row_us=450.0, dev_row_us=450.0, base_us=2000.0),  # RPC-like
], ids=["gpu", "rpc"])
def test_calibrate_recovers_the_split_and_base_from_benchs_two_stock_rows(true: DeviceCosts) -> None:
    """bench's stock --cpu-moe and --n-cpu-moe times, as the model says they would be with the true costs, refit
    a first measurement whose split and base were wrong: the rows (measured apart) stay, the split and base come
    back, and the link is bench's."""
    from pyspecter.devcosts import calibrate
    from pyspecter.layerplan import predict_us, stock_plan

    lay = _layout()
    first = DeviceCosts(split_us=5 * true.split_us, link_gbps=1.0, cpu_row_us=true.cpu_row_us,
                        dev_row_us=true.dev_row_us, base_us=0.1 * true.base_us)
    n_cpu = 3
    a = predict_us(stock_plan(lay, None), lay, true) / 1e3
    b = predict_us(stock_plan(lay, n_cpu), lay, true) / 1e3
    got = calibrate(lay, first, a, b, n_cpu, true.link_gbps)
    for field in ("split_us", "base_us", "cpu_row_us", "dev_row_us", "link_gbps"):
        assert math.isclose(getattr(got, field), getattr(true, field), rel_tol=1e-9, abs_tol=1e-6), field


def test_calibrate_keeps_the_difference_when_the_split_would_go_negative() -> None:
    from pyspecter.devcosts import calibrate

    lay = _layout()
    k = lay.n_expert_used
    first = DeviceCosts(split_us=50.0, link_gbps=5.0, cpu_row_us=40.0, dev_row_us=2.0, base_us=500.0)
    # --n-cpu-moe 4's full layers save only 10 us each, less than k (cpu - dev): the split is 0, the host row gives
    got = calibrate(lay, first, 5.0, 5.0 - 4 * 10.0 / 1e3, 4, 0.0)
    assert got.split_us == 0.0 and math.isclose(k * (got.cpu_row_us - got.dev_row_us), 10.0)
    assert got.link_gbps == 5.0 and got.base_us >= 0.0  # no link measured: the first one stays


@pytest.mark.parametrize("with_difference", [True, False], ids=["both-rows", "cpu-moe-only"])
def test_calibrate_scales_rows_measured_on_a_busier_machine(with_difference: bool) -> None:
    """Rows measured while the machine was 1.6x slower leave bench's --cpu-moe less than nothing for the base: the
    refit scales the base and rows as measured by one factor, so that bench's stock rows come back exactly with a
    base above 0 (before: a base of 0 and both rows predicted slow)."""
    from pyspecter.devcosts import calibrate
    from pyspecter.layerplan import predict_us, stock_plan

    lay = _layout()
    true = DeviceCosts(split_us=1500.0, link_gbps=1.5, cpu_row_us=450.0, dev_row_us=450.0, base_us=2000.0)
    first = DeviceCosts(split_us=true.split_us, link_gbps=1.0, cpu_row_us=1.6 * true.cpu_row_us,
                        dev_row_us=1.6 * true.dev_row_us, base_us=1.6 * true.base_us)
    n_cpu = 3
    a = predict_us(stock_plan(lay, None), lay, true) / 1e3
    b = predict_us(stock_plan(lay, n_cpu), lay, true) / 1e3 if with_difference else None
    k, L = lay.n_expert_used, len(lay.layers)
    assert 1e3 * a - L * (2 * first.split_us + k * first.cpu_row_us) < 0  # the rows alone outgrow the token
    got = calibrate(lay, first, a, b, n_cpu, true.link_gbps)
    assert got.base_us > 0
    assert math.isclose(predict_us(stock_plan(lay, None), lay, got) / 1e3, a, rel_tol=1e-9)
    if with_difference:
        assert math.isclose(predict_us(stock_plan(lay, n_cpu), lay, got) / 1e3, b, rel_tol=1e-9)
        for field in ("split_us", "base_us", "cpu_row_us", "dev_row_us"):
            assert math.isclose(getattr(got, field), getattr(true, field), rel_tol=1e-9), field


class _Dev:
    description = "dev"


def _cached_model(tmp_path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, type, DeviceCosts]:
    """A model file, a device and costs, with the cost cache in tmp_path."""
    monkeypatch.setenv("SPECTER_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECTER_MEASUREMENTS", raising=False)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    return f, _Dev, DeviceCosts(split_us=12.0, link_gbps=30.0, cpu_row_us=40.0, dev_row_us=3.0, base_us=700.0)


def test_the_plan_reads_a_saved_calibration(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What bench saves is what measure (and so plan_for, the session's plan and inspect --device) returns next."""
    from pyspecter.devcosts import cost_source, measure, save_calibration

    f, Dev, costs = _cached_model(tmp_path, monkeypatch)
    assert cost_source(f, Dev()) == "none"  # type: ignore[arg-type]
    save_calibration(f, Dev(), 2, costs, "bench 2026-12-04")  # type: ignore[arg-type]
    assert measure(f, _layout(), Dev()) == costs  # type: ignore[arg-type]  # cached: nothing is measured
    assert cost_source(f, Dev()) == "bench 2026-12-04"  # type: ignore[arg-type]


def test_a_cached_mapped_measurement_is_read_back_and_an_older_one_measured_again(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """measure_mapped's cache entry keeps what it measured, stock --cpu-moe's time less every row read from the host
    copy (A - C), the upload share (null where an upload was refused: then None, counted in full) and the link it was
    measured against. The row is solved from A - C with the costs it is read with, so costs refitted since (bench's)
    get a row that agrees with them, and the share that charges the same bytes the same time. An entry from before
    any of these is not reused."""
    from pyspecter import devcosts

    f, Dev, costs = _cached_model(tmp_path, monkeypatch)
    key = cache_key(f, Dev()) + "|mapped"  # type: ignore[arg-type]
    for share in (0.25, None):
        # 8 layers, top-2: A - C = 8 (2 split + 2 cpu_row) - 16 map_row, so 688 us is a row of 9 us with these costs
        devcosts._STORE.save(key, {"a_over_c_us": 688.0, "upload_share": share, "share_link_gbps": costs.link_gbps,
                             "source": "measured"})
        got = devcosts.measure_mapped(f, _layout(), Dev(), costs)  # type: ignore[arg-type]
        assert got == DeviceCosts(**{**costs.as_dict(), "map_row_us": 9.0}, upload_share=share)
        refit = DeviceCosts(**{**costs.as_dict(), "link_gbps": costs.link_gbps * 2})  # bench's faster link
        again = devcosts.measure_mapped(f, _layout(), Dev(), refit)  # type: ignore[arg-type]
        assert again.upload_share == (None if share is None else 0.5)
        dearer = DeviceCosts(**{**costs.as_dict(), "split_us": 20.0})  # a refit that made the split dearer
        assert devcosts.measure_mapped(f, _layout(), Dev(), dearer).map_row_us == 17.0  # type: ignore[arg-type]
        # kept with the A it was measured beside: measured on a machine twice as slow, A - C is read at half
        a = costs.base_us + 8 * (2 * costs.split_us + 2 * costs.cpu_row_us)
        devcosts._STORE.save(key, {"a_over_c_us": 2 * 688.0, "a_us": 2 * a, "upload_share": share,
                             "share_link_gbps": costs.link_gbps, "source": "measured"})
        assert devcosts.measure_mapped(f, _layout(), Dev(), costs).map_row_us == pytest.approx(9.0)  # type: ignore

    def loads(*_a, **_k):
        raise SpecterError("measured again")

    monkeypatch.setattr(devcosts.native, "Model", loads)
    for old in ({}, {"upload_share": 0.25}, {"upload_share": 0.25, "share_link_gbps": 30.0}):  # solved rows
        devcosts._STORE.save(key, {"map_row_us": 9.0, "source": "measured", **old})
        with pytest.raises(SpecterError, match="measured again"):
            devcosts.measure_mapped(f, _layout(), Dev(), costs)  # type: ignore[arg-type]


def test_the_upload_share_charges_the_measured_uploads_what_they_added() -> None:
    """upload_share_of is relative to the link time predict_us charges (the costs' link_gbps), so the plan's charge
    for the bytes measured is the time they added to the steps, whatever rate several uploads in flight reached;
    beyond their time in full it is charged in full, and below nothing, nothing."""
    from pyspecter.devcosts import upload_share_of
    from pyspecter.layerplan import LayerPlan, predict_us

    lay = _layout()  # 8 layers, top-2 of 16, EB bytes an expert
    eb = lay.layers[0].expert_bytes
    plan = LayerPlan({L.index: "slots" for L in lay.layers}, 8)  # a row in two misses at the floor: 8 a token
    nbytes, link, extra_s = 8 * eb, 2.0, 0.3 * 8 * eb / 2e9
    costs = DeviceCosts(split_us=0.0, link_gbps=link, cpu_row_us=0.0, dev_row_us=0.0, base_us=0.0, map_row_us=0.0,
                        upload_share=upload_share_of(extra_s, nbytes, link))
    assert costs.upload_share == pytest.approx(0.3)
    assert predict_us(plan, lay, costs, mapped=True) == pytest.approx(extra_s * 1e6)
    assert upload_share_of(2 * nbytes / 2e9, nbytes, link) == 1.0 and upload_share_of(-1e-3, nbytes, link) == 0.0
    assert upload_share_of(1e-3, nbytes, 0.0) == 1.0  # no link measured: in full, as predict_us counts it


def test_a_share_moves_with_the_link_it_is_charged_at() -> None:
    """share_at: the time a share charges for the same bytes is kept when the link it multiplies changes, within
    [0, 1]; unmeasured stays unmeasured."""
    from pyspecter.devcosts import share_at

    nbytes, link, share = 10**9, 4.0, 0.5
    for other in (2.0, 6.0):
        assert share_at(share, link, other) * nbytes / (other * 1e9) == pytest.approx(share * nbytes / (link * 1e9))
    assert share_at(share, link, 16.0) == 1.0 and share_at(None, link, 2.0) is None and share_at(0.3, 0.0, 2.0) == 0.3


def test_measurements_go_where_specter_measurements_says_else_to_the_cache(tmp_path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The test session keeps its measurements in a folder of its own (conftest: its RPC servers on random ports
    left an entry each in the user's devcosts.json); a user's go to the cache's root, as before."""
    import os

    from pyspecter.paths import Measurements, cache_dir

    assert os.environ.get("SPECTER_MEASUREMENTS") and Path(os.environ["SPECTER_MEASUREMENTS"]) != cache_dir()
    store = Measurements("probe", 1)
    monkeypatch.setenv("SPECTER_MEASUREMENTS", str(tmp_path / "m"))
    store.save(store.key("a"), {"x": 1.0})
    assert store.file == tmp_path / "m" / "probe.json" and store.entries() == {"v1|a": {"x": 1.0}}
    monkeypatch.delenv("SPECTER_MEASUREMENTS")
    monkeypatch.setenv("SPECTER_CACHE", str(tmp_path / "c"))
    assert store.file == tmp_path / "c" / "probe.json" and store.entries() == {}
