"""Miss mode host: where the slots are host memory and the experts' home copy is host RAM (the RAM tier on the CPU)
a copy into a slot buys nothing, so the session computes every miss in place from the home copy and moves no
expert (C API MISS_HOST). Stock's greedy tokens, 0 bytes copied; the other tiers keep their miss modes."""

from __future__ import annotations

import pytest

from pyspecter import native
from pyspecter.engine import greedy
from pyspecter.misses import computes_in_place, default_miss
from pyspecter.models.tiny import TINY_MODELS, build_tiny
from pyspecter.session import Session, SessionConfig
from pyspecter.study.bench import run_bench
from pyspecter.study.verify import verify
from pyspecter.tiers import RamTier, make_tier

TEXT = "misses on the host are computed from the home copy, in place, and nothing is ever copied into a slot"


def _stock(path, n: int) -> tuple[list[int], list[int]]:
    with native.Model(path) as m, native.Context(m, n_threads=2) as ctx:
        toks = m.tokenize(TEXT)
        return toks, greedy(ctx, toks, n)[0]


def test_only_host_slots_over_ram_compute_in_place() -> None:
    assert computes_in_place(RamTier(), host_slots=True) and default_miss(RamTier(), host_slots=True) == "host"
    assert default_miss(RamTier(), host_slots=False) == "cpu"  # a device's slots: the copy moves the expert
    assert default_miss(make_tier("emulated:20"), host_slots=True) == "cpu"  # the link is what is emulated
    assert default_miss(make_tier("disk"), host_slots=True) == "wait"


@pytest.mark.parametrize("name", ["tiny-qwen3moe", "tiny-mixtral"])
def test_host_misses_are_exact_and_copy_nothing(name: str) -> None:
    spec = TINY_MODELS[name]
    for slots in (spec.n_expert_used, spec.n_expert // 2):
        r = verify(build_tiny(name), slots=slots, miss="host", tier="ram", n_tokens=10)
        assert r["native"]
        assert r["identical_tokens"], (slots, r["stock_tokens"], r["slot_tokens"])
        assert r["max_abs_logit_diff"] == 0.0, (slots, r["max_abs_logit_diff"])
        assert r["uploads"] == 0


def test_the_ram_session_on_the_cpu_moves_no_expert() -> None:
    """What generate runs on the RAM tier with CPU compute: misses computed in place, 0 bytes read or copied in
    prefill and decode (no background reads, no lookahead, no prefetch), and stock's greedy tokens."""
    path = build_tiny("tiny-qwen3moe")
    toks, ref = _stock(path, 24)
    with Session(SessionConfig(model=path, budget="25%", tier="ram", n_threads=2)) as s:
        assert s.miss == "host" and s.cache.native and s.predictor is None  # nothing to predict or rank
        assert s.n_slots == TINY_MODELS["tiny-qwen3moe"].n_expert_used  # the budget's slots would stay empty
        assert s.generate(toks, 24, stop_at_eog=False) == ref
        c = s.cache.counters()
        assert c["miss_rows"] > 0  # there were misses, and the home copy computed them
        for k in ("uploads", "upload_bytes", "read_bytes", "read_ops", "prefetches", "lookahead", "waited"):
            assert c[k] == 0, (k, c[k])
        for il in s.cache.layers:
            assert s.cache.prefetch(il, [0, 1]) == 0  # nothing queued: a slot buys nothing here


@pytest.mark.parametrize(("tier", "miss"), [("emulated:20", "cpu"), ("disk", "wait")])
def test_the_other_tiers_still_move_their_misses(tier: str, miss: str) -> None:
    """The emulated link and the disk tier keep their modes: misses are read into slots, the output stock's."""
    path = build_tiny("tiny-qwen3moe")
    toks, ref = _stock(path, 24)
    with Session(SessionConfig(model=path, budget="25%", tier=tier, n_threads=2)) as s:
        assert s.miss == miss and s.cache.native
        assert s.generate(toks, 24, stop_at_eog=False) == ref
        c = s.cache.counters()
        assert c["uploads"] > 0 and c["upload_bytes"] > 0


def test_the_bench_runs_what_the_session_runs() -> None:
    """On the RAM tier the engine row and on-demand-cpu compute their misses in place: 0 bytes per token."""
    r = run_bench(build_tiny("tiny-qwen3moe"), tier="ram", budget="25%", repeat=1, n=8, n_threads=2,
                  policies=["stock", "on-demand-cpu", "engine"])
    pol = r["policies"]
    assert pol["engine"]["miss"] == "host"
    for p in ("on-demand-cpu", "engine"):
        assert pol[p]["same_logits_as_stock"] is True, p
        assert pol[p]["bytes_per_token"] == 0, p
