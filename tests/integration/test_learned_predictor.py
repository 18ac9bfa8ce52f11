"""Learned routing predictors end to end on tiny-qwen3moe: record router inputs through the input hook, fit, score
on held-out tokens against llama.cpp's own routing, save as the model's sidecar, and score from a trace in
analyze. At h = 0 a map reproduces the router itself, so its recall must be 100%: that fails if the recorded
tensor is not what the router reads, if rows or layers are misaligned, or if the fit is wrong. One llama.cpp
thread (2 shared cores on the test machines)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyspecter import native
from pyspecter.layout import read_layout
from pyspecter.learned import LearnedPredictor, Recency, model_key, sidecar_path
from pyspecter.models.tiny import build_tiny
from pyspecter.native.hooks import Hooks
from pyspecter.prompts import load_prompts
from pyspecter.study.analyze import analyze, format_analysis
from pyspecter.study.predictor_fit import fit_model
from pyspecter.study.simulate import EvictionDuel
from pyspecter.study.trace import record_trace


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cache = tmp_path_factory.mktemp("cache")
    model = build_tiny("tiny-qwen3moe")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECTER_CACHE", str(cache))  # the sidecar goes to a fresh cache
    try:
        r = fit_model(model, horizons=3, n_tokens=2000, eval_tokens=600, n_threads=1, progress=False)
        pred = LearnedPredictor.for_model(model)
    finally:
        mp.undo()
    return {"model": model, "summary": r, "pred": pred, "cache": cache}


def test_h0_reproduces_llama_cpp_routing_on_held_out_tokens(fitted) -> None:
    r = fitted["summary"]
    assert r["router_reproduction"] == 1.0  # numpy router on the recorded inputs = llama.cpp's choice
    assert r["held_out"]["0"] == {"recall": 1.0, "exact": 1.0, "layers": 4}
    chance = 4 / 32
    assert r["held_out"]["1"]["recall"] > chance + 0.3  # random weights: predictable, not exactly
    assert r["held_out"]["1"]["recall"] > r["held_out"]["3"]["recall"]
    assert r["fit_tokens"] == 2000 and r["held_out_tokens"] == 600 and r["horizons"] == 3


def test_sidecar_is_keyed_by_content_and_loaded_for_the_model(fitted) -> None:
    pred, model = fitted["pred"], fitted["model"]
    assert pred is not None
    assert Path(fitted["summary"]["out"]) == fitted["cache"] / "predictors" / sidecar_path(model).name
    assert pred.meta["model_key"] == model_key(model) and pred.nbytes == fitted["summary"]["nbytes"]
    assert pred.layers == [L.index for L in read_layout(model).layers] and pred.horizons == 3


def test_predictions_inside_the_input_hook(fitted) -> None:
    """The runtime use: the input hook hands each layer's router input to predict(); its top-k for the next
    layer overlaps what the route hook then reports for that layer far above chance."""
    pred, model = fitted["pred"], fitted["model"]
    predicted: dict[int, list] = {}
    routed: dict[int, list] = {}

    def on_input(il: int, x: np.ndarray) -> None:
        for layer, ids in pred.topk(il, x[-1]).items():
            predicted.setdefault(layer, []).append(set(ids.tolist()))

    def on_route(il, n_tokens, n_used, ids_p, _w) -> None:
        ids = np.ctypeslib.as_array(ids_p, shape=(n_tokens * n_used,)).reshape(n_tokens, n_used)
        routed.setdefault(il, []).append(set(ids[-1].tolist()))

    rng = np.random.default_rng(7)
    with native.Model(model) as m:
        hooks = Hooks(m, on_route, n_slots=1, on_input=on_input)
        try:
            with native.Context(m, n_ctx=128, n_batch=64, n_threads=1) as ctx:
                for t in rng.integers(1, m.n_vocab, 60):
                    ctx.decode([int(t)])
                    hooks.check()
        finally:
            hooks.close()
    layer = pred.layers[1]
    hits = [len(p & t) / 4 for p, t in zip(predicted[layer], routed[layer], strict=True)]
    assert len(hits) == 60 and np.mean(hits) > 0.45
    probs = pred.predict(pred.layers[0], np.zeros(64, np.float32))
    assert set(probs) == set(pred.layers[1:4]) and all(p.shape == (32,) for p in probs.values())


def test_analyze_scores_the_learned_predictor_from_a_trace(fitted, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPECTER_CACHE", str(fitted["cache"]))
    record_trace(fitted["model"], tmp_path / "t.npz", prompts=load_prompts()[:4], n=8, progress=False, n_threads=1,
                 stop_at_eog=False)
    res = analyze(tmp_path / "t.npz")  # the sidecar, found from the trace's target
    entry, detail = res["predictors"]["learned"], res["learned"]
    assert entry["available"] and entry["lookahead_unit"] == "layers"
    assert set(detail["by_horizon"]) == {"1", "2", "3"}
    assert entry["recall_at"]["1"] == detail["by_horizon"]["1"]["recall"] > 0.4
    assert entry["recall_at"]["4"] is None  # fitted for 3 layers ahead
    assert len(detail["per_layer"]["1"]["exact"]) == 4 and detail["per_layer"]["1"]["exact"][0] is None
    assert "learned predictor" in format_analysis(res)
    assert not analyze(tmp_path / "t.npz", predictor=False)["learned"]["available"]


class _ReuseOnTheHook:
    """The Python reference of C's eviction by the reuse maps, on the Python routing hook: at each layer's router
    input, the layer's reuse scores (its map and blend, ``LearnedPredictor.reuse``, over the layer's past calls,
    ``Recency``) become the scores policy 'predicted' evicts by in that call; with ``duel``, only while
    ``EvictionDuel`` (the rule C runs) has them ahead of LRU. Only layers with a map take part, as in C."""

    def __init__(self, cache, pred, *, duel: bool) -> None:
        self.cache, self.pred = cache, pred
        self.recency = {il: Recency(pred.n_expert) for il in cache.layers} if pred.blend is not None else {}
        self.duel = (EvictionDuel({il: cache.usable(il) for il in cache.layers}, start_learned=pred.blend is not None)
                     if duel else None)
        self._scores: dict[int, list[float]] = {}

    def on_input(self, il: int, x: np.ndarray) -> None:
        s = self.pred.reuse(il, x, self.recency.get(il))  # x lives only for this call: scored now
        if s is None:
            return
        self._scores[il] = s.tolist()
        use = self.duel is None or self.duel.use_learned
        self.cache.residency.set_scores(il, self._scores[il] if use else [])

    def on_route(self, il: int, needed, n_tokens: int) -> None:
        scores = self._scores.pop(il, None)
        if scores is None:
            return
        if self.duel is not None:  # with this call's scores, before the call joins the layer's past
            self.duel.observe(il, needed, scores, count=n_tokens == 1)
        if il in self.recency:
            self.recency[il].observe(needed)


def _decode_with_reuse(fitted, in_c: bool, *, tier: str = "ram", ordered: bool = False, duel: bool = False):
    from pyspecter.cache import ExpertCache
    from pyspecter.tiers import make_tier

    pred, path = fitted["pred"], fitted["model"]
    lay = read_layout(path)
    text = "The reuse maps read each layer's router input and say which experts come back soon."
    with native.Model(path) as m:
        common = dict(policy="predicted", miss="wait", lookahead=False, tier=make_tier(tier), ordered=ordered)
        ref = None
        if in_c:
            cache = ExpertCache(m, lay, lay.n_expert_used + 2, reuse=pred, duel=duel, native=True, **common)
            assert cache.hooks is None  # nothing of Python inside a layer
        else:
            box: list[_ReuseOnTheHook] = []
            cache = ExpertCache(m, lay, lay.n_expert_used + 2, native=False,
                                on_input=lambda il, x: box[0].on_input(il, x), **common)
            ref = _ReuseOnTheHook(cache, pred, duel=duel)
            box.append(ref)
            cache.route_observer = ref
        with native.Context(m, n_threads=1) as ctx:
            logits = [ctx.decode(m.tokenize(text), logits_all=True)[-1]]
            for _ in range(12):
                logits.append(ctx.decode([int(logits[-1].argmax())]))
                cache.check()
        c = cache.counters()
        where = {il: st.where for il, st in cache.layers.items()}
        state = cache.duel_state() if ref is None else (
            (ref.duel.use_learned, ref.duel.switches) if ref.duel is not None else None)
        cache.close()
    return c, where, np.array(logits), state


@pytest.mark.parametrize("duel", [False, True], ids=["scores", "duel"])
def test_reuse_maps_in_c_evict_as_python_does(fitted, duel: bool) -> None:
    """C applies the reuse maps and their recency blend to each layer's router input: with misses waited for on
    the RAM tier and no lookahead, the same misses and the same slot tables as the Python hook evicting by the
    same scores; with the duel on, C's duel also chooses as its Python reference does."""
    assert fitted["pred"].has_reuse and fitted["pred"].blend is not None  # the blend is compared too
    c_nat, w_nat, l_nat, s_nat = _decode_with_reuse(fitted, True, duel=duel)
    c_py, w_py, l_py, s_py = _decode_with_reuse(fitted, False, duel=duel)
    for key in ("needed", "resident_at_need", "uploads", "hit_rows", "miss_rows"):
        assert c_nat[key] == c_py[key], key
    assert w_nat == w_py
    assert np.array_equal(l_nat, l_py)
    if duel:
        assert s_nat == s_py


def test_reuse_maps_in_c_are_exact_with_the_duel_on_disk(fitted) -> None:
    path = fitted["model"]
    with native.Model(path) as m, native.Context(m, n_threads=1) as ctx:
        text = "The reuse maps read each layer's router input and say which experts come back soon."
        ref = [ctx.decode(m.tokenize(text), logits_all=True)[-1]]
        for _ in range(12):
            ref.append(ctx.decode([int(ref[-1].argmax())]))
    c, _, got, state = _decode_with_reuse(fitted, True, tier="disk", ordered=True, duel=True)
    assert np.abs(np.array(ref) - got).max() == 0.0
    assert state is not None and c["late"] > 0 and c["route_us_per_layer"] > 0


def test_the_embedded_model_ships_with_its_predictor() -> None:
    """`models build smol-moe` fits smol-moe's predictor (once; `make test` runs it first, so this finds it cached)
    and generate uses it without being asked: no hint, the learned plan on."""
    from conftest import run_cli

    r = run_cli("models", "build", "smol-moe", timeout=1800)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip().splitlines()[-1])
    pred = LearnedPredictor.for_model(path)
    assert pred is not None and pred.meta["model_key"] == model_key(path) and pred.has_reuse
    # fitted on the embedded fit text (~10k rows; models/embedded.py), not the earlier 1,000 recorded tokens
    assert pred.meta["fit"]["tokens"] > 5000 and pred.meta["fit"]["held_out"]["1"]["recall"] >= 0.75
    # the disk tier: on the RAM tier the CPU computes misses from the home copy and nothing moves (miss mode host)
    r = run_cli("generate", "smol-moe", "--tier", "disk", "--budget", "50%", "-p", "Hi", "-n", "2", "--json",
                timeout=600)
    assert r.returncode == 0, r.stderr
    assert "fit-predictor" not in r.stderr
    import json

    # no planner on smol-moe's disk tier (link-bound): the session holds the reuse maps alone
    assert json.loads(r.stdout)["stats"]["predictor_mib"] == pytest.approx(pred.reuse_only().nbytes / 2**20)


def test_a_model_without_a_predictor_says_so_once(tmp_path: Path) -> None:
    """The first session that would prefetch says, in one line, what fit-predictor would add and about how long
    it takes; the second says nothing."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "SPECTER_CACHE": str(tmp_path / "cache")}
    args = [sys.executable, "-m", "pyspecter", "generate", "tiny-qwen3moe", "--budget", "50%", "-p", "hi", "-n",
            "2", "--raw", "--miss", "cpu"]  # the RAM tier's copying mode (its default, host, prefetches nothing)
    first, second = (subprocess.run(args, capture_output=True, text=True, env=env, timeout=600) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    hint = [line for line in first.stderr.splitlines() if "fit-predictor" in line]
    assert len(hint) == 1 and "`pyspecter fit-predictor tiny-qwen3moe` would add prefetching" in hint[0]
    assert "about" in hint[0], hint
    assert "fit-predictor" not in second.stderr
    every = subprocess.run([*args[:5], "--budget", "100%", *args[7:]], capture_output=True, text=True,
                           env={**env, "SPECTER_CACHE": str(tmp_path / "other")}, timeout=600)
    assert every.returncode == 0 and "fit-predictor" not in every.stderr  # all resident: nothing to prefetch


def test_record_sequences_reads_given_text_in_batches() -> None:
    """The embedded fit's recording: given sequences decoded in one batch each, rows deduplicated by prefix, the
    numpy router on the recorded inputs picking llama.cpp's experts, generated rows flagged after the prompt."""
    from pyspecter.models.predictor_data import load_routers, record_sequences
    from pyspecter.models.predictor_fit import _reproduction

    model = build_tiny("tiny-qwen3moe")
    rng = np.random.default_rng(7)
    with native.Model(model) as m:
        n_vocab = m.n_vocab
    a, b = ([int(t) for t in rng.integers(1, n_vocab, n)] for n in (40, 30))
    r = record_sequences(model, [(a, 10), (a[:25] + b, 25), (a, 10)], n_threads=1, progress=False)
    # the second shares a's first 25 tokens and the third is a again: only b's 30 rows are new
    assert r["lengths"] == [40, 30] and len(r["ids"]) == 70 and all(len(x) == 70 for x in r["X"])
    assert r["generated"][:40].tolist() == [False] * 9 + [True] * 31 and r["generated"][40:].all()
    assert _reproduction(load_routers(model), r["X"], r["ids"]) >= 0.99
