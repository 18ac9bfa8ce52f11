"""The native planner on the real path: the learned layer-ahead maps applied inside the routing op (csrc/planner.cpp)
give LearnedPredictor.predict's probabilities, queue prefetches that are found resident at need more often than
without them, and leave greedy output as stock's, on the ram and disk tiers, with no Python inside a layer; so do
the session (what generate and chat run) and bench's `learned`, `learned-evict` and `engine` policies. A predictor
fitted for tiny-qwen3moe; one llama.cpp thread (2 shared cores on the test machines)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from pyspecter import native
from pyspecter.budget import parse_budget
from pyspecter.cache import ExpertCache
from pyspecter.engine import greedy
from pyspecter.layout import read_layout
from pyspecter.learned import LearnedPredictor
from pyspecter.models.predictor_fit import fit_model
from pyspecter.models.tiny import build_tiny
from pyspecter.session import Session, SessionConfig
from pyspecter.study.bench import run_bench
from pyspecter.study.bench_runs import run_specter
from pyspecter.tiers import make_tier

TEXT = "the planner prefetches the next layers of this token, and never changes the output"


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LearnedPredictor]:
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECTER_CACHE", str(tmp_path_factory.mktemp("cache")))  # the sidecar goes to a fresh cache
    try:
        model = build_tiny("tiny-qwen3moe")
        fit_model(model, horizons=2, n_tokens=1500, eval_tokens=300, n_threads=1, progress=False)
        pred = LearnedPredictor.for_model(model)
        assert pred is not None
        yield pred
    finally:
        mp.undo()


def _near_boundary(pred: LearnedPredictor, j: int, h: int, x: np.ndarray, eps: float = 1e-4) -> bool:
    """Whether float rounding may reorder this prediction: two scores or the gap and a bin edge within eps."""
    y = np.sort(pred._scores(j, x)[h - 1])[::-1]
    k = pred.n_used
    gap = y[k - 1] - y[k]
    return bool(np.min(np.abs(np.diff(y))) < eps or np.min(np.abs(pred.gap_edges[j + h, h - 1] - gap)) < eps)


def test_native_maps_give_the_predictors_probabilities(fitted: LearnedPredictor) -> None:
    pred, model = fitted, build_tiny("tiny-qwen3moe")
    lay = read_layout(model)
    rng = np.random.default_rng(3)
    with native.Model(model) as m:
        cache = ExpertCache(m, lay, lay.n_expert_used + 2, policy="predicted", miss="wait", reuse=pred, ahead=pred,
                            native=True)
        try:
            same = pairs = 0
            for j, il in enumerate(pred.layers):
                for h in range(1, pred.n_targets(j) + 1):
                    dst = pred.layers[j + h]
                    for _ in range(40):
                        x = rng.normal(0, 1, pred.A[0].shape[0]).astype(np.float32)
                        want, got = pred.predict(il, x)[dst], cache.nat.ahead_probs(il, dst, x)
                        pairs += 1
                        if np.array_equal(want, got):
                            same += 1
                        else:  # only where rounding may reorder two scores or move the gap across a bin edge
                            assert _near_boundary(pred, j, h, x), (il, dst)
            with pytest.raises(Exception, match="no layer-ahead map"):
                cache.nat.ahead_probs(pred.layers[-1], pred.layers[0], np.zeros(pred.A[0].shape[0], np.float32))
        finally:
            cache.close()
    assert pairs == 40 * sum(pred.n_targets(j) for j in range(len(pred.layers))) and same >= 0.95 * pairs


def _decode(model, pred: LearnedPredictor, tier: str, ahead: bool, n: int = 40,
            max_stall: float = 1.0) -> tuple[list[int], dict]:
    lay = read_layout(model)
    with native.Model(model, lazy_experts=tier == "disk") as m:
        cache = ExpertCache(m, lay, lay.n_expert_used + 4, policy="predicted", miss="wait", tier=make_tier(tier),
                            ordered=True, reuse=pred, duel=False, ahead=pred if ahead else None, native=True)
        try:
            assert cache.hooks is None  # no Python inside a layer
            if ahead:  # 1: never link-bound (the rule has a test of its own)
                cache.nat.set_planner(True, 0.5, max_stall)
            with native.Context(m, n_threads=1) as ctx:
                toks = greedy(ctx, m.tokenize(TEXT), n)[0]
                cache.check()
            c = cache.counters()
        finally:
            cache.close()
    return toks, c


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_planner_prefetches_and_is_exact(tier: str, fitted: LearnedPredictor) -> None:
    model = build_tiny("tiny-qwen3moe")
    with native.Model(model) as m, native.Context(m, n_threads=1) as ctx:
        ref = greedy(ctx, m.tokenize(TEXT), 40)[0]
    on, c_on = _decode(model, fitted, tier, True)
    off, c_off = _decode(model, fitted, tier, False)
    assert on == ref and off == ref
    assert c_on["ahead_maps"] > 0 and c_on["ahead_prefetches"] > 0 and c_on["prefetches"] >= c_on["ahead_prefetches"]
    assert c_off["ahead_maps"] == 0 and c_off["ahead_prefetches"] == 0
    assert c_on["needed"] == c_off["needed"]  # the same routing: only what was resident differs
    # prefetched experts are found resident at need: more hits than the same cache without the planner
    assert c_on["resident_at_need"] > c_off["resident_at_need"], (c_on, c_off)


def test_the_planner_stands_aside_while_the_link_is_the_bottleneck(fitted: LearnedPredictor) -> None:
    """max_stall 0: once any read was waited for, the link counts as the bottleneck and the maps stop (the
    first decoded token's misses on the disk tier wait); the output stays stock's."""
    model = build_tiny("tiny-qwen3moe")
    free, c_free = _decode(model, fitted, "disk", True, max_stall=1.0)
    bound, c_bound = _decode(model, fitted, "disk", True, max_stall=0.0)
    assert free == bound and c_bound["wait_ms"] > 0
    assert c_bound["ahead_maps"] * 4 < c_free["ahead_maps"], (c_bound, c_free)


@pytest.mark.parametrize("tier", ["ram", "disk", "emulated:2"])
def test_session_runs_the_predictor_natively(tier: str, fitted: LearnedPredictor) -> None:
    """What generate and chat run: the reuse maps evict in C, the layer-ahead maps feed the native planner where the
    link has time to spare; stock's tokens, the whole budget spent. Without the predictor, or on the Python hook
    (which runs none: it runs in C only), the same tokens."""
    model = build_tiny("tiny-qwen3moe")
    miss = "cpu" if tier == "ram" else None  # the RAM tier's copying mode (its default, host, moves nothing)
    with native.Model(model) as m, native.Context(m) as ctx:
        toks = m.tokenize(TEXT)
        ref = greedy(ctx, toks, 40)[0]
    with Session(SessionConfig(model=model, budget="25%", tier=tier, miss=miss, n_threads=1)) as s:
        assert s.predictor is not None and s.cache.native and s.cache.hooks is None
        assert s.generate(toks, 40, stop_at_eog=False) == ref
        st = s.stats()
        assert st["evict"] in ("learned", "lru")
        full = fitted
        if tier in ("ram", "disk"):  # the CPU tiers: the session runs no planner there (Session._build_cache)
            assert st["plan_maps"] == 0 and st["plan_prefetches"] == 0
            # ... so it holds, and its budget counts, the reuse maps alone
            assert all(a is None for a in s.predictor.A) and s.predictor.nbytes == full.reuse_only().nbytes
            assert s.predictor.nbytes < full.nbytes
        else:
            assert st["plan_prefetches"] > 0 and st["plan_maps"] > 0
            assert s.predictor.nbytes == full.nbytes
        # the whole budget is spent, by layer: the predictor's bytes and slots, to within one expert
        lay = s.layout
        spent = sum(s.cache.usable(L.index) * L.expert_bytes for L in lay.layers) + s.predictor.nbytes
        assert parse_budget("25%", lay.expert_total_bytes) - max(L.expert_bytes for L in lay.layers) < spent
        assert spent <= parse_budget("25%", lay.expert_total_bytes)
    with Session(SessionConfig(model=model, budget="25%", tier=tier, miss=miss, n_threads=1, predictor="off")) as s:
        assert s.predictor is None and s.stats().get("plan_prefetches") is None
        assert s.generate(toks, 40, stop_at_eog=False) == ref
    with Session(SessionConfig(model=model, budget="25%", tier=tier, miss=miss, n_threads=1, native=False)) as s:
        assert s.predictor is None and not s.cache.native
        assert s.generate(toks, 40, stop_at_eog=False) == ref


def test_bench_learned_and_engine_policies_are_exact(fitted: LearnedPredictor) -> None:
    r = run_bench(build_tiny("tiny-qwen3moe"), tier="ram", budget="25%", repeat=1, n=12, n_threads=1,
                  policies=["stock", "on-demand-lru", "learned", "learned-evict", "engine"])
    pol = r["policies"]
    for p in ("on-demand-lru", "learned", "learned-evict", "engine"):
        # teacher-forced (a random-weight fixture): stock's logits at every step of the held-out text
        assert pol[p]["decode"] == "teacher-forced" and pol[p]["same_logits_as_stock"] is True, p
    assert pol["learned"]["prefetches"] > 0 and pol["learned-evict"]["prefetches"] == 0
    assert pol["learned"]["slots_per_layer"] <= r["slots_per_layer"]  # the predictor's bytes came out of it


def test_the_engine_row_times_each_token_as_the_others_do(fitted: LearnedPredictor) -> None:
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


def test_the_drafts_routing_feeds_the_same_queue(tmp_path) -> None:
    """The draft's routing of drafted tokens reaches C between tokens as schedule(layer, expert, confidence,
    position in the verification pass) and protect: prefetches the native queue serves, exactly."""
    from pyspecter.engine import SpeculativeDecoder
    from pyspecter.models.draft import make_draft
    from pyspecter.predict import DraftRouting

    model = build_tiny("tiny-qwen3moe")
    draft = make_draft(model, tmp_path / "draft.gguf", experts_type="Q4_0", ffn_keep=1.0, progress=False)
    lay = read_layout(model)
    with native.Model(model) as m, native.Context(m, n_threads=1) as ctx:
        toks = m.tokenize(TEXT)
        ref = greedy(ctx, toks, 24)[0]
    with native.Model(model) as tm, native.Model(draft) as dm:
        cache = ExpertCache(tm, lay, lay.n_expert_used + 4, miss="wait", ordered=True)
        routing = DraftRouting(dm, read_layout(draft))
        try:
            assert cache.native and cache.hooks is None
            with native.Context(tm, n_threads=1) as tctx, native.Context(dm, n_threads=1) as dctx:
                eng = SpeculativeDecoder(tctx, dctx, k=2, adaptive=False, routing=routing, slots=cache)
                assert eng.generate(toks, 24, stop_at_eog=False) == ref
                cache.check()
            c = cache.counters()
        finally:
            routing.close()
            cache.close()
    # the draft's: neither the maps' nor the prefill lookahead's
    assert c["prefetches"] > c["lookahead"] and c["ahead_prefetches"] == 0
