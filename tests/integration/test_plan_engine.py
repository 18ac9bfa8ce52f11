"""The learned predictor on the real path: fitted for tiny-qwen3moe, its maps applied in C (the native planner
prefetches, the reuse maps evict); greedy output stays stock's, on the ram and disk tiers, in the session (what
generate and chat run) and in bench's `learned`, `learned-evict` and `engine` policies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pyspecter import native
from pyspecter.budget import parse_budget
from pyspecter.engine import greedy
from pyspecter.layout import read_layout
from pyspecter.models.tiny import build_tiny
from pyspecter.session import Session, SessionConfig
from pyspecter.study.bench import run_bench
from pyspecter.study.bench_runs import run_specter
from pyspecter.study.predictor_fit import fit_model


@pytest.fixture(scope="module")
def fitted_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECTER_CACHE", str(tmp_path_factory.mktemp("cache")))  # the sidecar goes to a fresh cache
    try:
        fit_model(build_tiny("tiny-qwen3moe"), horizons=2, n_tokens=1500, eval_tokens=300, n_threads=1,
                  progress=False)
        yield
    finally:
        mp.undo()


@pytest.mark.parametrize("tier", ["ram", "disk", "emulated:2"])
def test_session_with_the_planner_decodes_stocks_tokens(tier: str, fitted_cache: None) -> None:
    model = build_tiny("tiny-qwen3moe")
    with native.Model(model) as m, native.Context(m) as ctx:
        toks = m.tokenize("the plan never changes the output, only how fast it comes")
        ref = greedy(ctx, toks, 40)[0]
    # the learned predictor runs in C: the reuse maps evict, the layer-ahead maps feed the native planner
    with Session(SessionConfig(model=model, budget="25%", tier=tier, n_threads=1)) as s:
        assert s.predictor is not None and s.cache.native and s.cache.hooks is None
        assert s.generate(toks, 40, stop_at_eog=False) == ref
        st = s.stats()
        assert st["evict"] in ("learned", "lru")
        if tier in ("ram", "disk"):  # the CPU tiers: the session runs no planner there (Session._build_cache)
            assert st["plan_maps"] == 0 and st["plan_prefetches"] == 0
        else:
            assert st["plan_prefetches"] > 0 and st["plan_maps"] > 0
        # the whole budget is spent, by layer: the predictor's bytes and slots, to within one expert
        lay = s.layout
        spent = sum(s.cache.usable(L.index) * L.expert_bytes for L in lay.layers) + s.predictor.nbytes
        assert parse_budget("25%", lay.expert_total_bytes) - max(L.expert_bytes for L in lay.layers) < spent
        assert spent <= parse_budget("25%", lay.expert_total_bytes)
    with Session(SessionConfig(model=model, budget="25%", tier=tier, n_threads=1, predictor="off")) as s:
        assert s.predictor is None and s.stats().get("plan_prefetches") is None


def test_bench_learned_and_engine_policies_are_exact(fitted_cache: None) -> None:
    r = run_bench(build_tiny("tiny-qwen3moe"), tier="ram", budget="25%", repeat=1, n=12, n_threads=1,
                  policies=["stock", "on-demand-lru", "learned", "learned-evict", "engine"])
    pol = r["policies"]
    for p in ("on-demand-lru", "learned", "learned-evict", "engine"):
        # teacher-forced (a random-weight fixture): stock's logits at every step of the held-out text
        assert pol[p]["decode"] == "teacher-forced" and pol[p]["same_logits_as_stock"] is True, p
    assert pol["learned"]["prefetches"] > 0 and pol["learned-evict"]["prefetches"] == 0
    assert pol["learned"]["slots_per_layer"] <= r["slots_per_layer"]  # the predictor's bytes came out of it


def test_the_engine_row_times_each_token_as_the_others_do(fitted_cache: None) -> None:
    """Without a draft the engine decodes one token per step: its row holds per-token times, as every other
    policy's does, not one mean repeated (a mean beside the others' medians made it look slower on a disk whose
    stalls come now and then)."""
    model = build_tiny("tiny-qwen3moe")
    budget = parse_budget("25%", read_layout(model).expert_total_bytes)
    with native.Model(model) as m:
        prompts = [m.tokenize("one prompt"), m.tokenize("and another one, a little longer")]
    r = run_specter(model, None, budget, True, "ram", prompts, 10, 1, 4)
    assert len(r.tpots) == 20 and len(set(r.tpots)) > 10
    assert 0 < r.load_s and 0 < r.first_prefill_s <= r.prefill_s
