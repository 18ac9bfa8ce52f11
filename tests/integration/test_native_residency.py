"""Native residency (csrc/residency.cpp), the one residency engine: the routing op looks up residency, evicts and
reads in C, with no Python call inside a layer. Exact against stock for every policy and miss mode, on every tier;
deterministic where reads cannot race; failed reads leave experts to the host path."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest

from pyspecter import native
from pyspecter.cache import MISS_MODES, POLICIES, ExpertCache
from pyspecter.layout import read_layout
from pyspecter.models.tiny import TINY_MODELS, build_tiny
from pyspecter.study.verify import verify
from pyspecter.tiers import make_tier

TOL = 1e-4
PROMPT = "Once upon a time there was a tiny mixture of experts, and it routed every token somewhere."


@pytest.mark.parametrize("tier", ["ram", "disk", "emulated:20"])
@pytest.mark.parametrize("policy", ["lru", "lfu", "prev-token"])
@pytest.mark.parametrize("miss", ["wait", "cpu"])
@pytest.mark.parametrize("name", ["tiny-qwen3moe", "tiny-mixtral"])
def test_native_is_exact(name: str, miss: str, policy: str, tier: str) -> None:
    spec = TINY_MODELS[name]
    for slots in (spec.n_expert_used, spec.n_expert // 2):
        r = verify(build_tiny(name), slots=slots, miss=miss, tier=tier, policy=policy, n_tokens=10)
        assert r["native"]
        assert r["identical_tokens"], (slots, r["stock_tokens"], r["slot_tokens"])
        assert r["max_abs_logit_diff"] <= TOL, (slots, r["max_abs_logit_diff"])
        assert r["uploads"] > 0


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_native_ordered_is_exact(tier: str) -> None:
    """Ordered misses in C: the layer's resident experts compute while the misses' reads land; the wait op
    blocks for them before the late matmul. Bit-identical to stock, and the late path really taken."""
    for name in ("tiny-qwen3moe", "tiny-gptoss"):
        spec = TINY_MODELS[name]
        for slots in (spec.n_expert_used, spec.n_expert // 2, spec.n_expert):
            r = verify(build_tiny(name), slots=slots, miss="wait", tier=tier, n_tokens=10, ordered=True)
            assert r["native"] and r["identical_tokens"], (name, slots, r["stock_tokens"], r["slot_tokens"])
            assert r["max_abs_logit_diff"] == 0.0, (name, slots, r["max_abs_logit_diff"])
            assert r["late"] > 0


def _decode(path, slots: int | None, policy: str, n: int = 8):
    """A prompt and n greedy tokens, with slots (None: stock): the logits, and the counters, trace and final
    slot tables of the slot path."""
    lay = read_layout(path)
    with native.Model(path) as m:
        cache = None
        if slots is not None:
            cache = ExpertCache(m, lay, slots, policy=policy, miss="wait", lookahead=False, record=True)
            assert cache.native and cache.hooks is None  # no Python on the path
        with native.Context(m, n_threads=2) as ctx:
            logits = [ctx.decode(m.tokenize(PROMPT))]
            for _ in range(n):
                logits.append(ctx.decode([int(logits[-1].argmax())]))
                if cache is not None:
                    cache.check()
        if cache is None:
            return np.array(logits), {}, [], {}
        c = cache.counters()
        trace = list(cache.trace)
        resident = {il: st.where for il, st in cache.layers.items()}
        cache.close()
    return np.array(logits), c, trace, resident


@pytest.mark.parametrize("policy", ["lru", "lfu", "prev-token"])
def test_native_decisions_are_exact_and_deterministic(policy: str) -> None:
    """With misses waited for on the RAM tier (no reads in the background, no lookahead) the engine's decisions
    cannot race: two runs give the same routing trace, misses, uploads and final slot tables, and the logits
    are stock's."""
    path = build_tiny("tiny-qwen3moe")
    k = TINY_MODELS["tiny-qwen3moe"].n_expert_used
    ref, _, _, _ = _decode(path, None, policy)
    l_a, c_a, t_a, w_a = _decode(path, k + 2, policy)
    l_b, c_b, t_b, w_b = _decode(path, k + 2, policy)
    assert np.abs(l_a - ref).max() == 0.0 and np.abs(l_b - ref).max() == 0.0
    assert t_a == t_b and len(t_a) > 0
    for key in ("needed", "resident_at_need", "uploads", "hit_rows", "miss_rows"):
        assert c_a[key] == c_b[key], key
    assert c_a["needed"] > c_a["resident_at_need"] > 0 and c_a["uploads"] > 0
    assert w_a == w_b


def _prompt_on_disk(name: str, prepare: Callable[[ExpertCache], None]) -> tuple[float, dict]:
    """A prompt through a native disk-tier cache with half the experts' slots, ``prepare``d before the context
    exists: how far its logits are from stock's, and its counters."""
    path = build_tiny(name)
    with native.Model(path) as stock, native.Context(stock, n_threads=2) as ctx:
        ref = ctx.decode(stock.tokenize(PROMPT), logits_all=True)
    lay = read_layout(path)
    with native.Model(path) as m:
        cache = ExpertCache(m, lay, lay.n_expert // 2, miss="wait", tier=make_tier("disk"))
        try:
            prepare(cache)
            with native.Context(m, n_threads=2) as ctx:
                got = ctx.decode(m.tokenize(PROMPT), logits_all=True)
            cache.check()
            return float(abs(ref - got).max()), cache.counters()
        finally:
            cache.close()


def test_native_prefetch_protect_and_link_counters() -> None:
    lay = read_layout(build_tiny("tiny-mixtral"))

    def prefetch_and_protect(cache: ExpertCache) -> None:
        for L in lay.layers:
            assert cache.prefetch(L.index, [0, 1]) == 2
            cache.protect(L.index, [0, 1])
        cache.drain()
        assert all(st.where[0] >= 0 and st.where[1] >= 0 for st in cache.layers.values())

    diff, c = _prompt_on_disk("tiny-mixtral", prefetch_and_protect)
    assert diff <= TOL
    assert c["prefetches"] >= 2 * len(lay.layers) and c["route_us_per_layer"] > 0
    # reads in flight while waiting: at most the readers (a read may land before the wait starts, so no floor)
    assert c["read_bytes"] > 0 and c["wait_ms"] > 0 and 0.0 <= c["reads_in_flight"] <= 8.0


def test_failed_native_reads_leave_experts_to_the_host() -> None:
    """Every read comes back short (the file swapped for /dev/null under the readers): nothing is mapped, the
    failures are counted, and the output is still stock's."""

    def swap_the_file(cache: ExpertCache) -> None:
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, cache.tier.fd)
        os.close(null)

    diff, c = _prompt_on_disk("tiny-qwen3moe", swap_the_file)
    assert diff <= TOL
    assert c["failed_uploads"] > 0 and c["slot_row_rate"] == 0.0


def test_every_policy_and_miss_mode_runs_in_c() -> None:
    """One engine: every policy and miss mode the CLI accepts is decided in C, with no routing hook; only static
    residency (hook=False) runs none, and it holds no draft's slots."""
    from pyspecter.models.calibration import select_neurons
    from pyspecter.surrogate import Surrogates

    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    sur = Surrogates(lay, select_neurons(path, 0.5, n_calib=64, progress=False))
    for policy in POLICIES:
        for miss in (m for m in MISS_MODES if m != "mapped"):  # mapped needs a device: test_mapped.py
            for tier in ("ram", "disk"):
                with native.Model(path) as m:
                    cache = ExpertCache(m, lay, 2 * lay.n_expert_used, policy=policy, miss=miss, tier=make_tier(tier),
                                        surrogates=sur if miss == "surrogate" else None)
                    assert cache.native and cache.hooks is None, (policy, miss, tier)
                    cache.close()
    with native.Model(path) as m, pytest.raises(Exception, match="held slots .* need the residency engine"):
        ExpertCache(m, lay, lay.n_expert_used + 2, held=1, hook=False)


@pytest.mark.parametrize(("tier", "ordered"), [("ram", False), ("disk", True)])
def test_held_slots_are_native_and_released_in_c(tier: str, ordered: bool) -> None:
    """A draft's held slots are C's from the first token: the routing hook is never entered, C hands out only
    the usable slots while they are held, and releasing them between decodes (the drop) hands out every slot,
    with no table handed over. Exact across the switch."""
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    k = lay.n_expert_used

    def run(cache_args: dict | None) -> tuple[np.ndarray, dict, list, list]:
        owners = []
        with native.Model(path) as m:
            cache = ExpertCache(m, lay, k + 2, **cache_args) if cache_args else None
            with native.Context(m, n_threads=2) as ctx:
                out = [ctx.decode(m.tokenize(PROMPT), logits_all=True)[-1]]
                for i in range(12):
                    if cache is not None and i == 4:
                        assert cache.native and cache.hooks is None
                        assert [cache.nat.held(il) for il in cache.layer_pos] == [2] * len(lay.layers)
                        owners.append(max(s for st in cache.layers.values() for s, e in enumerate(st.owner) if e >= 0))
                        cache.release_held()
                        assert [cache.nat.held(il) for il in cache.layer_pos] == [0] * len(lay.layers)
                        assert set(cache.usable_per_layer().values()) == {k + 2}
                    out.append(ctx.decode([int(out[-1].argmax())]))
                    if cache is not None:
                        cache.check()
                if cache is not None:
                    owners.append(max(s for st in cache.layers.values() for s, e in enumerate(st.owner) if e >= 0))
            c, trace = (cache.counters(), list(cache.trace)) if cache else ({}, [])
            if cache is not None:
                assert cache.hooks is None and cache.api.stats(m.ptr).hook_ns == 0  # no Python in a layer
                cache.close()
        return np.array(out), c, trace, owners

    ref, _, _, _ = run(None)
    got, c, trace, owners = run(dict(miss="wait", ordered=ordered, tier=make_tier(tier), held=2, record=True))
    assert np.abs(ref - got).max() <= TOL
    assert c["native"] and c["needed"] >= c["resident_at_need"] > 0
    assert len(trace) == c["route_calls"]
    assert owners[0] < k and owners[1] >= k  # the held slots were filled only after the release


@pytest.mark.parametrize("policy", ["lru", "lfu", "prev-token"])
def test_the_replay_reads_what_native_residency_reads(policy: str) -> None:
    """study/replay.py, the offline judge of eviction rules in the bench's bytes, against C on the bench's run
    (each prompt prefilled, then decoded; the slots live through every prompt): the same decode reads. RAM tier,
    misses waited for and no read-ahead, where C's decisions do not depend on when reads land."""
    from pyspecter.study.replay import record_calls, replay

    path = build_tiny("tiny-qwen3moe")
    spec = TINY_MODELS["tiny-qwen3moe"]
    lay = read_layout(path)
    with native.Model(path) as m:
        prompts = [m.tokenize(PROMPT), m.tokenize("Two plus two is four, and the sky is blue over the sea.")]
    calls, _ = record_calls(path, prompts, 8, n_threads=2)
    assert any(len(c.ids) > 1 for c in calls) and any(c.step >= 0 for c in calls)
    for slots in (spec.n_expert_used + 1, spec.n_expert // 2):
        uploads = 0
        with native.Model(path) as m:
            cache = ExpertCache(m, lay, slots, policy=policy, miss="wait", lookahead=False)
            with native.Context(m, n_threads=2, n_ctx=max(map(len, prompts)) + 16) as ctx:
                for prompt in prompts:
                    ctx.clear()
                    logits = ctx.decode(prompt)
                    cache.reset_counters()
                    for _ in range(8):
                        logits = ctx.decode([int(logits.argmax())])
                    cache.check()
                    uploads += cache.counters()["uploads"]
            cache.close()
        got = replay(calls, {L.index: slots for L in lay.layers}, spec.n_expert, policy, lookahead=False)
        assert uploads > 0 and got == uploads, (slots, got, uploads)
