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


def _decode_with_reuse(fitted, reuse: bool, *, tier: str = "ram", ordered: bool = False, duel: bool = False):
    from pyspecter.cache import ExpertCache
    from pyspecter.tiers import make_tier

    pred, path = fitted["pred"], fitted["model"]
    lay = read_layout(path)
    text = "The reuse maps read each layer's router input and say which experts come back soon."
    with native.Model(path) as m:
        common = dict(miss="wait", lookahead=False, tier=make_tier(tier), ordered=ordered)
        if reuse:
            cache = ExpertCache(m, lay, lay.n_expert_used + 2, policy="predicted", reuse=pred, duel=duel, **common)
        else:
            cache = ExpertCache(m, lay, lay.n_expert_used + 2, policy="lru", **common)
        assert cache.hooks is None  # nothing of Python inside a layer
        with native.Context(m, n_threads=1) as ctx:
            logits = [ctx.decode(m.tokenize(text), logits_all=True)[-1]]
            for _ in range(12):
                logits.append(ctx.decode([int(logits[-1].argmax())]))
                cache.check()
        c = cache.counters()
        where = {il: st.where for il, st in cache.layers.items()}
        state = cache.duel_state()
        cache.close()
    return c, where, np.array(logits), state


@pytest.mark.parametrize("duel", [False, True], ids=["scores", "duel"])
def test_reuse_maps_in_c_evict_by_their_scores_and_stay_exact(fitted, duel: bool) -> None:
    """C applies the reuse maps and their recency blend to each layer's router input: with misses waited for on
    the RAM tier and no lookahead its decisions cannot race, so two runs decide alike; the logits are stock's,
    and the maps do decide (the slot tables differ from plain LRU's on the same text)."""
    assert fitted["pred"].has_reuse and fitted["pred"].blend is not None  # the blend takes part too
    path = fitted["model"]
    with native.Model(path) as m, native.Context(m, n_threads=1) as ctx:
        text = "The reuse maps read each layer's router input and say which experts come back soon."
        ref = [ctx.decode(m.tokenize(text), logits_all=True)[-1]]
        for _ in range(12):
            ref.append(ctx.decode([int(ref[-1].argmax())]))
    c_a, w_a, l_a, s_a = _decode_with_reuse(fitted, True, duel=duel)
    c_b, w_b, l_b, s_b = _decode_with_reuse(fitted, True, duel=duel)
    c_lru, w_lru, _, _ = _decode_with_reuse(fitted, False)
    for key in ("needed", "resident_at_need", "uploads", "hit_rows", "miss_rows"):
        assert c_a[key] == c_b[key], key
    assert w_a == w_b and s_a == s_b
    assert np.abs(np.array(ref) - l_a).max() == 0.0
    assert c_a["needed"] == c_lru["needed"] and w_a != w_lru


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


@pytest.mark.parametrize("duel", [False, True], ids=["scores", "duel"])
def test_reuse_maps_in_c_read_what_the_replay_of_their_scores_reads(fitted, duel: bool) -> None:
    """C's eviction by the reuse maps against the Python predictor's own scores (``LearnedPredictor.reuse`` over
    ``Recency``; with the duel, ``EvictionDuel`` choosing between them and LRU), replayed on the same routing
    (study/replay.py, which C's bench decisions already agree with for lru/lfu/prev-token): the same decode reads,
    on the RAM tier with misses waited for and no lookahead, where C's decisions do not depend on when reads
    land."""
    from pyspecter.cache import ExpertCache
    from pyspecter.study.replay import record_calls, replay

    pred, path = fitted["pred"], fitted["model"]
    lay = read_layout(path)
    E, n, n_slots = lay.n_expert, 12, lay.n_expert_used + 2
    with native.Model(path) as m:
        prompt = m.tokenize("The reuse maps read each layer's router input and say which experts come back soon.")
    calls, _ = record_calls(path, [prompt], n, n_threads=1, inputs=True)
    recency = {il: Recency(E) for il in pred.layers}
    judge = (EvictionDuel(dict.fromkeys(pred.layers, n_slots), E, start_learned=pred.blend is not None)
             if duel else None)
    done: list[tuple] = []  # the previous call: it joins the past before the next call is scored (C's order)

    def scores(c) -> np.ndarray | None:
        if done:
            il, needed, s, count = done.pop()
            if judge is not None and s is not None:
                judge.observe(il, needed, s, count=count)
            recency[il].observe(needed)
        s = pred.reuse(c.il, c.x, recency[c.il])
        done.append((c.il, sorted({int(e) for e in c.ids.ravel()}), s, len(c.ids) == 1))
        return s if judge is None or judge.use_learned else None

    slots = {L.index: n_slots for L in lay.layers}
    want = replay(calls, slots, E, "score", lookahead=False, scores=scores)
    lru = replay(calls, slots, E, "lru", lookahead=False)
    with native.Model(path) as m:
        cache = ExpertCache(m, lay, n_slots, policy="predicted", miss="wait", lookahead=False, reuse=pred,
                            duel=duel)
        try:
            with native.Context(m, n_threads=1, n_ctx=len(prompt) + n + 8) as ctx:
                logits = ctx.decode(prompt)
                cache.reset_counters()
                for _ in range(n):
                    logits = ctx.decode([int(np.argmax(logits))])
                cache.check()
            got = cache.counters()["uploads"]
            state = cache.duel_state()
        finally:
            cache.close()
    print(f"decode reads: C {got}, replay by the scores {want}, replay by LRU {lru}")
    assert got == want, (got, want, lru)
    if judge is not None:
        assert state == (judge.use_learned, judge.switches)
    else:
        assert want != lru  # the scores decide something on this text


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
