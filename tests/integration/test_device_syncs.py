"""Synchronisations the scheduler actually takes per token on a device (native.count_syncs), beside llama.cpp's
split count, on the RPC device: counts, not times, so they are the same on every run. Every placement is loaded
the way bench loads it; the layer plan's counts are never above stock --n-cpu-moe's at the same device memory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_device import rpc_device

from pyspecter import native
from pyspecter.cache import ExpertCache
from pyspecter.layerplan import DeviceCosts, LayerPlan, choose_plan, n_cpu_moe_for, stock_plan
from pyspecter.layout import ModelLayout, read_layout
from pyspecter.models.tiny import build_tiny
from pyspecter.native import graph_splits
from pyspecter.native.devices import Device
from pyspecter.native.hooks import Hooks

N_TOKENS = 4
# a GPU-like device (switches dear, device rows fast, a quick link): the plan then mixes full, slot and host layers
GPU = DeviceCosts(split_us=40.0, link_gbps=25.0, cpu_row_us=40.0, dev_row_us=2.0, base_us=500.0)
RPC = DeviceCosts(split_us=700.0, link_gbps=2.0, cpu_row_us=40.0, dev_row_us=40.0, base_us=3000.0)


@pytest.fixture(scope="module")
def dev() -> Iterator[Device]:
    yield from rpc_device(count_syncs=True)


def counts(path, lay: ModelLayout, dev: Device, plan: LayerPlan, *, resident: bool = False,
           weights: list | None = None, speculate: bool = False, mapped: bool = False) -> tuple[int, dict]:
    """(splits of the one-token graph, synchronisation counts per decode token) of a placement: full layers on the
    device, host ones on the host, slot layers with slots (every expert loaded first where ``resident``). With a
    ``weights`` list, a routing hook that reads the router weights appends each decode token's call's [n_used]
    floats; ``mapped``: miss mode mapped (the device reads misses from the host copy), else cpu."""
    with native.Model(path, device=dev, host_layers=plan.host_layers) as m:
        cache = (ExpertCache(m, lay, plan.n_slots, miss="mapped" if mapped else "cpu", kinds=plan.native_kinds(),
                             speculate=speculate)
                 if plan.layers("slots") else None)
        hooks = None
        try:
            if weights is not None:
                def on_route(_il: int, _n_tokens: int, n_used: int, _ids, w) -> None:
                    weights.append([w[j] for j in range(n_used)] if w else None)
                hooks = Hooks(m, on_route, weights=True)
            if cache is not None and resident:
                cache.warm({il: list(range(lay.n_expert)) for il in plan.layers("slots")})
            with native.Context(m) as ctx:
                splits = graph_splits()
                ctx.decode(m.tokenize("the scheduler counts what it does"))
                native.sync_counts(reset=True)
                if weights is not None:
                    weights.clear()  # the decode tokens' calls only
                for t in range(N_TOKENS):
                    ctx.decode([t + 5])
                c = native.sync_counts().as_dict()
                if hooks is not None:
                    hooks.check()
                if cache is not None:
                    cache.check()
                    if resident:
                        assert cache.counters()["hit_rate"] == 1.0
        finally:
            if hooks is not None:
                hooks.close()
            if cache is not None:
                cache.close()
    assert splits is not None
    return splits[1], {k: v / N_TOKENS for k, v in c.items()}


def test_counted_synchronisations_follow_the_placement(dev: Device) -> None:
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    L = len(lay.layers)
    device = counts(path, lay, dev, stock_plan(lay, 0))
    cpu_moe = counts(path, lay, dev, stock_plan(lay, None))
    half = counts(path, lay, dev, stock_plan(lay, L // 2))
    every = LayerPlan({L_.index: "slots" for L_ in lay.layers}, lay.n_expert)
    resident = counts(path, lay, dev, every, resident=True)
    for splits, c in (device, cpu_moe, half, resident):
        # every split of the graph is computed once a token, and each boundary is a switch taken
        assert c["device_computes"] + c["host_computes"] == splits
        assert c["switches"] == splits
        # and the time each kind took is counted where it happened (times, for bench: only their presence here)
        assert (c["host_compute_ns"] > 0) == (c["host_computes"] > 0)
        assert (c["device_compute_ns"] > 0) == (c["device_computes"] > 0)
        assert (c["sync_ns"] > 0) == (c["syncs"] + c["event_syncs"] > 0)
    assert device[0] == 2 and cpu_moe[0] == 2 + 2 * L and half[0] == 2 + L
    # the host waits for the device more the more host layers there are
    assert device[1]["syncs"] < half[1]["syncs"] < cpu_moe[1]["syncs"]
    # a slot layer whose experts all hit still visits the host: its two switches (the goal of the GPU issue is
    # none: this is where it shows), but with one host wait fewer than a stock host layer: stock's reads back its
    # input and its expert ids, two tensors; a slot layer reads back one, its input with the looked-up (slot, expert)
    # pairs packed behind it (the router weights stay on the device: nothing on the host reads them)
    assert resident[0] == cpu_moe[0]
    assert resident[1]["syncs"] == cpu_moe[1]["syncs"] - L
    # speculating that the token hits (csrc/speculate.cpp, on by default) takes the host path out: the graph
    # computes as stock-device's does, in one device split, with the same switches; the host waits once more a
    # token, reading the device's log of the pairs each slot path looked up, and once when the graph changed form
    spec_splits, spec = counts(path, lay, dev, every, resident=True, speculate=True)
    assert spec_splits == resident[0]  # the context's first graph (a reserve) keeps its host paths
    assert spec["device_computes"] + spec["host_computes"] == device[0]
    assert spec["switches"] == device[1]["switches"]
    assert spec["syncs"] == device[1]["syncs"] + 1 + 1 / N_TOKENS


def test_misses_read_from_the_host_copy_take_no_host_split(dev: Device) -> None:
    """Half the experts in slots, LRU, misses in every token: with the misses read by the device from the host copy
    (csrc/mapped.cpp; a device copy stands in on RPC) the graph computes as stock-device's does, in one device
    split a token, with the host waiting once more, for the log: what every-expert-resident speculation takes,
    whatever the token hits."""
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    device = counts(path, lay, dev, stock_plan(lay, 0))
    half = LayerPlan({L_.index: "slots" for L_ in lay.layers}, lay.n_expert // 2)
    _, mapped = counts(path, lay, dev, half, speculate=True, mapped=True)
    _, unmapped = counts(path, lay, dev, half, speculate=True)
    assert mapped["device_computes"] + mapped["host_computes"] == device[0]
    assert mapped["switches"] == device[1]["switches"]
    assert mapped["syncs"] == device[1]["syncs"] + 1
    # residency heard each token's routing from the log between tokens (timed: the device idles meanwhile); stock
    # has nothing to settle
    assert mapped["settle_ns"] > 0 and device[1]["settle_ns"] == 0
    # without the host copy the misses keep the host paths: a CPU split and two switches a slot layer
    assert unmapped["switches"] == device[1]["switches"] + 2 * len(lay.layers)


def test_router_weights_cross_to_the_host_only_for_a_reader(dev: Device) -> None:
    """A routing hook that asks for the router weights gets them on a device, at one more host wait per slot layer
    and token (the weights' read back); without one they stay on the device."""
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    every = LayerPlan({L_.index: "slots" for L_ in lay.layers}, lay.n_expert)
    _, without = counts(path, lay, dev, every, resident=True)
    got: list = []
    _, with_w = counts(path, lay, dev, every, resident=True, weights=got)
    assert with_w["syncs"] == without["syncs"] + len(lay.layers)
    # every decode call's weights arrived: the normalised top-k probabilities of the token (qwen3moe), so each
    # call's are positive and sum to 1
    assert len(got) == len(lay.layers) * N_TOKENS
    for w in got:
        assert w is not None and min(w) > 0 and sum(w) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("costs", [GPU, RPC], ids=["gpu-like", "rpc-like"])
@pytest.mark.parametrize("share", [0.2, 0.4, 0.6, 0.9])  # leftovers the GPU-like plan makes slot layers of
def test_the_plans_counts_are_never_above_stock_n_cpu_moes(dev: Device, costs: DeviceCosts, share: float) -> None:
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    budget = int(share * lay.expert_total_bytes)
    plan = choose_plan(lay, budget, costs)
    stock = stock_plan(lay, n_cpu_moe_for(lay, budget))
    assert plan.device_bytes(lay) <= budget
    if costs is GPU:
        assert plan.layers("slots"), plan.describe(lay)  # the case that matters: slot layers in the plan
    p_splits, p = counts(path, lay, dev, plan)
    s_splits, s = counts(path, lay, dev, stock)
    assert p_splits <= s_splits, plan.describe(lay)
    assert p["switches"] <= s["switches"], plan.describe(lay)


def test_ggml_cudas_graph_lines_are_counted_with_the_synchronisations() -> None:
    """ggml-cuda says when it captures a split's CUDA graph and when it drops one whose nodes changed only in debug
    log lines, on the thread computing the graph. Fed the pinned source's own lines through ggml's logger (the call
    ggml-cuda makes), the sync counts follow; other lines count nothing, and a reset zeroes them. On a GPU bench
    reports them per token (``cuda_graph_*_per_token``): a form that drops its graph every token shows there."""
    import ctypes
    import re
    import tarfile

    from llama_cpp import _ggml
    from test_build import _build_module

    b = _build_module()
    pin = b.read_pin()
    with tarfile.open(b.local_sdist(pin) or b.fetch_sdist(pin)) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith("ggml/src/ggml-cuda/ggml-cuda.cu"))
        src = tf.extractfile(member).read().decode()
    fmts = dict(re.findall(r'GGML_LOG_DEBUG\("(%s: CUDA graph warmup (complete|reset)\\n)", __func__\)', src))
    assert set(fmts.values()) == {"complete", "reset"}, "the pinned ggml-cuda's graph lines changed"
    log = _ggml.libggml.ggml_log_internal  # exported by ggml-base, found through libggml's dependencies
    log.restype = None
    debug, info = 1, 2  # GGML_LOG_LEVEL_DEBUG, _INFO

    native.quiet_logs()
    native.sync_counts(reset=True)
    for fmt, what in fmts.items():
        for _ in range(2 if what == "complete" else 1):
            log(ctypes.c_int(debug), fmt.replace("\\n", "\n").encode(), b"ggml_backend_cuda_graph_compute")
    log(ctypes.c_int(debug), b"CUDA Graph id %zu reused\n", ctypes.c_size_t(7))
    log(ctypes.c_int(info), b"%s: CUDA graph warmup complete\n", b"not ggml-cuda's level")
    c = native.sync_counts(reset=True)
    assert (c.cuda_graph_warmups, c.cuda_graph_resets) == (2, 1)
    c = native.sync_counts()
    assert (c.cuda_graph_warmups, c.cuda_graph_resets) == (0, 0)
