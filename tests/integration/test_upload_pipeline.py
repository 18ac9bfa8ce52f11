"""Uploads with several batches in flight on one device stream (csrc/uploads.cpp), on the RPC device with
NaN-poisoned slots: each batch awaits its own event, readers issue while another's batch is on the wire, a layer's
waited misses go out as one batch, and whatever overlaps, a slot is mapped only once its own copies have landed: the
tokens stay stock's."""

from __future__ import annotations

import pytest
from test_device import (
    LONG_PROMPT,
    _stock_greedy,
    native_greedy_steps,
    poisoned_slots,  # noqa: F401 (an autouse fixture: device slots start as NaN)
    rpc,  # noqa: F401 (a fixture: the strict server)
)

from pyspecter import native
from pyspecter.cache import ExpertCache
from pyspecter.layout import read_layout
from pyspecter.models.tiny import build_tiny
from pyspecter.native.devices import open_device
from pyspecter.tiers import EmulatedTier

IN_FLIGHT = 4  # PYSPECTER_UPLOADS_IN_FLIGHT: the events an upload stream has


def prompt_tokens(path) -> list[int]:
    with native.Model(path, lazy_experts=True) as m:
        return m.tokenize(LONG_PROMPT)


@pytest.mark.parametrize("sync", [False, True])
def test_prefetches_from_ram_keep_several_batches_in_flight(sync: bool, rpc: str,  # noqa: F811
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefetches of every layer's experts, read from RAM by the readers over an emulated link slow enough that each
    batch is on the wire for milliseconds: the stream holds more than one batch at once and never more than its
    events, every prefetch lands, the busy rate is the link's, and the decode after them gives stock's tokens.
    Without a stream (SPECTER_SYNC_UPLOADS=1) each copy is synchronous and none is counted in flight."""
    if sync:
        monkeypatch.setenv("SPECTER_SYNC_UPLOADS", "1")
    dev = open_device(rpc)
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    toks = prompt_tokens(path)
    ref, _ = _stock_greedy(path, dev, toks, 6)
    gbps = lay.layers[0].expert_bytes / 5e6  # 5 ms an expert on the emulated link
    with native.Model(path, device=dev) as m:
        cache = ExpertCache(m, lay, lay.n_expert, miss="wait", tier=EmulatedTier(gbps))
        try:
            queued = sum(cache.prefetch(L.index, range(lay.n_expert)) for L in lay.layers)
            cache.drain()
            stats = native.device_stats(m.ptr)
            assert queued == lay.n_expert * len(lay.layers)
            assert cache.counters()["uploads"] == queued
            c = cache.counters()
            # the busy rate counts overlapping batches once: bytes over link time, the emulated link's own rate
            # (summing each batch's time, a batch waiting behind three others would read as a quarter of it)
            assert 0.5 * gbps <= c["upload_bytes"] / c["upload_ns"] <= 1.1 * gbps
            if sync:
                assert stats.upload_streams == 0 and stats.inflight_peak == 0
            else:
                assert stats.async_batches == queued
                assert 2 <= stats.inflight_peak <= IN_FLIGHT, stats.as_dict()
                # the upload threads' waits for those events, and their CPU time in them (bench's spin reading)
                assert 0 < stats.landing_wait_ns and 0 <= stats.landing_wait_cpu_ns <= stats.landing_wait_ns
            with native.Context(m) as ctx:
                out = [tok for tok, _ in native_greedy_steps(ctx, toks, 6)]
            cache.check()
            assert out == ref
            assert cache.counters()["uploads"] == queued  # all resident: the decode moved nothing
        finally:
            cache.close()


def test_a_layers_waited_misses_land_as_one_batch(rpc: str) -> None:  # noqa: F811
    """Misses awaited in the routing op (miss mode wait, top-k slots, so the prompt misses several experts a
    layer): the call's copies go out as one batch awaited by one event, so there are fewer batches than uploads,
    and the tokens are stock's."""
    dev = open_device(rpc)
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    toks = prompt_tokens(path)
    ref, _ = _stock_greedy(path, dev, toks, 8)
    with native.Model(path, device=dev) as m:
        cache = ExpertCache(m, lay, lay.n_expert_used, miss="wait")
        try:
            with native.Context(m) as ctx:
                out = [tok for tok, _ in native_greedy_steps(ctx, toks, 8)]
            cache.check()
            cache.drain()
            stats = native.device_stats(m.ptr)
            uploads = cache.counters()["uploads"]
            assert out == ref
            assert uploads > 0 and 0 < stats.async_batches < uploads, (uploads, stats.as_dict())
        finally:
            cache.close()
