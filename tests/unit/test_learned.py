"""Learned routing predictors on synthetic data: the fitting math (models/predictor_fit.py, models/reuse_fit.py)
and the runtime object (learned.py), with no llama.cpp.

The synthetic model: router inputs x_0 random; x_{j+1} = tanh(x_j M_j) + noise (a residual-stream-like chain);
routers random. Layer j+h's routing is then a noisy function of x_j, predictable but not exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyspecter import learned, predictor_hint
from pyspecter.errors import SpecterError
from pyspecter.learned import LearnedPredictor, model_key, selection_scores, sidecar_path
from pyspecter.models import predictor_fit as pf
from pyspecter.models import reuse_fit as rf
from pyspecter.study import simulate as sim


def _chain(n: int, L: int = 5, d: int = 24, E: int = 8, noise: float = 0.3, seed: int = 0):
    rng = np.random.default_rng(seed)
    Ms = [rng.normal(size=(d, d)) / np.sqrt(d) for _ in range(L)]
    W = [rng.normal(size=(E, d)).astype(np.float32) for _ in range(L)]
    data_rng = np.random.default_rng(seed + 100 + n)
    x = data_rng.normal(size=(n, d))
    X = []
    for j in range(L):
        X.append(x.astype(np.float32))
        x = np.tanh(x @ Ms[j]) * 2 + noise * data_rng.normal(size=(n, d))
    return X, pf.Routers(W, [None] * L, [None] * L, learned.GATING_SOFTMAX, 2)


@pytest.fixture(scope="module")
def fitted():
    X, R = _chain(3000)
    val = pf.validation_rows([300] * 10)
    return pf.fit_maps(X, R, 3, val), R


def test_ridge_recovers_an_exact_linear_map_with_intercept() -> None:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(500, 6))
    B_true, c_true = rng.normal(size=(6, 3)), rng.normal(size=3)
    r = pf.Ridge(X)
    B, c = r.solve(r.project(X @ B_true + c_true), 1e-9)
    assert np.allclose(B, B_true, atol=1e-6) and np.allclose(c, c_true, atol=1e-6)


def test_ridge_penalty_per_column_equals_separate_solves() -> None:
    rng = np.random.default_rng(2)
    X, Y = rng.normal(size=(80, 5)), rng.normal(size=(80, 2))
    r = pf.Ridge(X)
    proj = r.project(Y)
    B, c = r.solve(proj, np.array([0.01, 1.0]))
    for i, a in enumerate((0.01, 1.0)):
        Bi, ci = r.solve(proj, a)
        assert np.allclose(B[:, i], Bi[:, i]) and np.isclose(c[i], ci[i])
    # a larger penalty shrinks the map
    assert np.linalg.norm(r.solve(proj, 10.0)[0]) < np.linalg.norm(r.solve(proj, 0.01)[0])


def test_set_match_counts_recall_and_exact_sets() -> None:
    pred = np.array([[0, 1], [2, 3], [1, 0]])
    true = np.array([[1, 0], [2, 4], [5, 6]])
    rec, exact = pf.set_match(pred, true, 8)
    assert rec.tolist() == [1.0, 0.5, 0.0] and exact.tolist() == [True, False, False]


def test_rank_calibration_is_the_share_truly_selected_at_each_rank_per_confidence_bin() -> None:
    # 20 rows with a small gap between ranks 1 and 2 (true set: ranks 0 and 2), 20 with a large one (ranks 0, 1)
    small = np.tile([3.0, 2.0, 1.9, 0.0], (20, 1))
    large = np.tile([3.0, 2.0, 0.5, 0.0], (20, 1))
    true = np.concatenate([np.tile([0, 2], (20, 1)), np.tile([0, 1], (20, 1))])
    table, edges = pf.rank_calibration(np.concatenate([small, large]), true, 4)
    assert edges.shape == (3,) and table.shape == (4, 4)
    bins = learned.gap_bins(np.array([0.1, 1.5]), edges)
    assert table[bins[0]].tolist() == [1.0, 0.0, 1.0, 0.0]  # near-ties: rank 2 was the true one
    assert table[bins[1]].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_validation_rows_are_whole_trailing_sequences() -> None:
    val = pf.validation_rows([3, 3, 3, 3, 3])
    assert val.tolist() == [False] * 12 + [True] * 3
    assert pf.validation_rows([10]).tolist() == [False] * 8 + [True] * 2


def test_fit_h0_is_the_router_and_later_horizons_beat_chance(fitted) -> None:
    fit, R = fitted
    X, _ = _chain(1000, seed=0)  # same chain, new rows
    s = pf.summarize(pf.evaluate(fit, X, R))
    assert s["0"]["recall"] == 1.0 and s["0"]["exact"] == 1.0
    chance = 2 / 8
    assert s["1"]["recall"] > s["3"]["recall"] > chance + 0.1
    assert s["1"]["layers"] == 4 and s["3"]["layers"] == 2


def test_rank_tables_sum_to_top_k(fitted) -> None:
    fit, _ = fitted
    for (j, h) in fit.maps:  # each validation row has exactly k true experts, in every confidence bin
        assert fit.rank_prob[j, h].sum(-1) == pytest.approx(np.full(4, 2.0), abs=1e-5)
        assert (fit.rank_prob[j, h][:, 0] >= fit.rank_prob[j, h][:, -1]).all()
        assert fit.rank_prob[j, h][-1, :2].sum() >= fit.rank_prob[j, h][0, :2].sum()  # confident rows hit more


def test_runtime_predictor_matches_the_fitted_maps_and_round_trips(fitted, tmp_path: Path) -> None:
    fit, R = fitted
    layers = [1, 3, 4, 6, 9]  # llama.cpp indices need not be contiguous (dense layers between)
    pred = pf.to_runtime(fit, layers, R, {"n_expert": 8, "n_expert_used": 2})
    X, _ = _chain(50, seed=0)
    for j, il in enumerate(layers):
        lg = pred.logits(il, X[j])
        assert list(lg) == layers[j + 1: j + 4]
        for h, (layer, got) in enumerate(lg.items(), 1):
            assert np.allclose(got, fit.logits(j, h, X[j]), atol=1e-3)
            assert np.array_equal(pred.topk(il, X[j])[layer], learned.top_ids(got, 2))
        for p in pred.predict(il, X[j][0]).values():  # one token: [E]
            assert p.shape == (8,) and p.sum() == pytest.approx(2.0, abs=1e-4)
    assert pred.predict(9, X[4]) == {}
    assert pred.nbytes == (sum(a.nbytes for a in pred.A + pred.b if a is not None) + pred.rank_prob.nbytes
                           + pred.gap_edges.nbytes)
    back = LearnedPredictor.load(pred.save(tmp_path / "p.npz"))
    assert back.layers == layers and back.nbytes == pred.nbytes
    for j, il in enumerate(layers[:-1]):
        a, b = pred.predict(il, X[j]), back.predict(il, X[j])
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_probabilities_follow_the_predicted_ranking(fitted) -> None:
    fit, R = fitted
    pred = pf.to_runtime(fit, list(range(5)), R, {"n_expert": 8, "n_expert_used": 2})
    X, _ = _chain(20, seed=0)
    lg, pr = pred.logits(0, X[0])[1], pred.predict(0, X[0])[1]
    ranked = -np.sort(-lg, axis=1)
    bins = learned.gap_bins(ranked[:, 1] - ranked[:, 2], pred.gap_edges[1, 0])
    order = np.argsort(-lg, axis=1)
    assert np.array_equal(np.take_along_axis(pr, order, 1), pred.rank_prob[1, 0][bins])


def test_selection_bias_changes_the_ranking_like_llama_cpp() -> None:
    logits = np.array([[2.0, 1.0, 0.0]])
    assert np.array_equal(selection_scores(logits, learned.GATING_SOFTMAX, None), logits)
    biased = selection_scores(logits, learned.GATING_SIGMOID, np.array([0.0, 0.0, 1.0]))
    assert np.argmax(biased) == 2  # sigmoid(0) + 1 beats sigmoid(2)


def test_model_key_sees_content_not_just_size(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    data = bytearray(np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes())
    a.write_bytes(bytes(data))
    data[10] ^= 1  # a header byte
    b.write_bytes(bytes(data))
    assert model_key(a) != model_key(b) and len(model_key(a)) == 16
    b.write_bytes(a.read_bytes())
    assert model_key(a) == model_key(b)


def test_sidecar_is_found_by_content_and_refused_when_stale(tmp_path: Path, monkeypatch, fitted) -> None:
    monkeypatch.setenv("SPECTER_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(1000))
    assert LearnedPredictor.for_model(model) is None
    with pytest.raises(SpecterError, match="fit-predictor"):
        LearnedPredictor.load(model)
    fit, R = fitted
    key = model_key(model)
    pred = pf.to_runtime(fit, list(range(5)), R, {"n_expert": 8, "n_expert_used": 2, "model_key": key})
    pred.save(sidecar_path(model))
    assert LearnedPredictor.for_model(model).meta["model_key"] == key
    assert LearnedPredictor.load(model).nbytes == pred.nbytes
    model.write_bytes(b"GGUF" + bytes(999) + b"\1")  # same size, other content: another key, no predictor
    assert LearnedPredictor.for_model(model) is None


def test_the_missing_predictor_hint_is_said_once_per_model_file(tmp_path: Path, monkeypatch, fitted) -> None:
    monkeypatch.setenv("SPECTER_CACHE", str(tmp_path / "cache"))
    model, other = tmp_path / "m.gguf", tmp_path / "o.gguf"
    model.write_bytes(b"GGUF" + bytes(1000))
    other.write_bytes(b"GGUF" + bytes(999) + b"\1")
    line = predictor_hint.predictor_hint(model, "my-model", 600)
    assert line is not None and "`pyspecter fit-predictor my-model`" in line and "about 10 min" in line
    assert predictor_hint.predictor_hint(model, "my-model", 600) is None  # said already
    assert predictor_hint.predictor_hint(other, "o", 30) is not None  # another file: its own first time
    fit, R = fitted
    pf.to_runtime(fit, list(range(5)), R, {"n_expert": 8, "n_expert_used": 2,
                                           "model_key": model_key(other)}).save(sidecar_path(other))
    sidecar_path(other).with_suffix(".hinted").unlink()
    assert predictor_hint.predictor_hint(other, "o", 30) is None  # it has a predictor: nothing to say


def test_the_fit_estimate_matches_the_measured_fits() -> None:
    """The two fits the constants were measured on (1000 + 256 tokens; CPU seconds on the 2-core machine:
    smol-moe 68, bench-qwen3moe 52), within a factor 1.5; and the full default fit of smol-moe, 6-15 minutes."""
    est = predictor_hint.fit_seconds_estimate
    smol, bench = est(30, 147_449_088, 576, 16, True, 1000, 256), est(16, 295_841_792, 1024, 32, False, 1000, 256)
    assert 68 / 1.5 < smol < 68 * 1.5 and 52 / 1.5 < bench < 52 * 1.5, (smol, bench)
    assert 6 * 60 < est(30, 147_449_088, 576, 16, True) < 15 * 60


def test_a_damaged_file_is_a_clean_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(SpecterError, match="not a learned predictor"):
        LearnedPredictor.load(bad)


def test_one_token_paths_agree_with_the_batched_one(fitted) -> None:
    fit, R = fitted
    pred = pf.to_runtime(fit, list(range(5)), R, {"n_expert": 8, "n_expert_used": 2})
    X, _ = _chain(3, seed=0)
    batch = pred.predict(0, X[0])
    for t in range(3):
        one, row = pred.predict(0, X[0][t]), pred.predict(0, X[0][t: t + 1])
        for layer in batch:
            assert np.array_equal(one[layer], batch[layer][t]) and np.array_equal(row[layer][0], batch[layer][t])


def test_reduce_rank_keeps_full_rank_maps_and_shrinks_fitted_values_optimally() -> None:
    rng = np.random.default_rng(3)
    X = rng.normal(size=(400, 10))
    Y = X @ rng.normal(size=(10, 6)) + 0.1 * rng.normal(size=(400, 6))
    r = pf.Ridge(X)
    B, c = r.solve(r.project(Y), 1e-6)
    P, Vt, cr = r.reduce_rank(B, c, 6)
    assert np.allclose(P @ Vt, B) and np.allclose(cr, c)
    P, Vt, cr = r.reduce_rank(B, c, 2)
    assert P.shape == (10, 2) and Vt.shape == (2, 6)
    fitted_full, fitted_2 = X @ B + c, X @ P @ Vt + cr
    # the best rank-2 approximation of the fitted values, with the same column means
    u, s, vt = np.linalg.svd(fitted_full - fitted_full.mean(0), full_matrices=False)
    best = (u[:, :2] * s[:2]) @ vt[:2] + fitted_full.mean(0)
    assert np.allclose(fitted_2, best, atol=1e-8)


def test_a_reduced_rank_predictor_is_two_matmuls_with_the_same_answers(tmp_path: Path) -> None:
    X, R = _chain(2000)
    fit = pf.fit_maps(X, R, 3, pf.validation_rows([200] * 10), rank=4)
    assert set(fit.factors) == {0, 1, 2, 3}  # every source with a later layer: 4 * (24 + 8) < 24 * 8
    full = pf.to_runtime(pf.fit_maps(X, R, 3, pf.validation_rows([200] * 10)), list(range(5)), R,
                         {"n_expert": 8, "n_expert_used": 2})
    pred = pf.to_runtime(fit, list(range(5)), R, {"n_expert": 8, "n_expert_used": 2})
    assert pred.A[0].shape == (24, 4) and pred.A2[0].shape == (4, 24) and pred.nbytes < full.nbytes
    Xe, _ = _chain(30, seed=0)
    for h, got in enumerate(pred.logits(0, Xe[0]).values(), 1):
        assert np.allclose(got, fit.logits(0, h, Xe[0]), atol=1e-3)
    back = LearnedPredictor.load(pred.save(tmp_path / "r.npz"))
    assert back.A2[0].shape == (4, 24) and back.nbytes == pred.nbytes
    assert all(np.array_equal(a, b) for a, b in zip(back.predict(0, Xe[0]).values(), pred.predict(0, Xe[0]).values(),
                                                    strict=True))


def test_reuse_targets_look_ahead_within_a_sequence_only() -> None:
    ids = np.array([[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]], [[0, 2]]])  # [n=5, L=1, k=2]; sequences of 3 and 2
    Y, has = rf.reuse_targets(ids, [3, 2], 8, horizon=2)
    assert has.tolist() == [True, True, False, True, False]
    assert np.flatnonzero(Y[0, 0]).tolist() == [2, 3, 4, 5]  # the next two tokens of its sequence
    assert np.flatnonzero(Y[1, 0]).tolist() == [4, 5]  # the sequence ends after one
    assert not Y[2].any()  # last of its sequence: nothing after it counts, not the next sequence's
    assert np.flatnonzero(Y[3, 0]).tolist() == [0, 2]


def test_lru_miss_curve_is_a_direct_lru_simulation_for_every_size() -> None:
    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(8, 2, replace=False) for _ in range(400)])
    curve = sim.lru_miss_curve(ids, 8)
    assert curve[0] == curve[1] == pytest.approx(2.0)  # below top-k every access misses
    for s in range(2, 9):  # one token's experts are placed as a set: the stack model is off by a few at most
        assert curve[s] * len(ids) == pytest.approx(sim.eviction_misses(ids, s), rel=0.02)
    assert np.all(np.diff(curve) <= 1e-6)  # more slots never miss more (LRU's inclusion property)
    assert curve[8] * len(ids) == 8  # all slots: first uses only


def test_oracle_scores_rank_by_the_next_use_within_k_rows() -> None:
    ids = np.array([[0, 1], [2, 3], [0, 4], [5, 2]])
    sc = sim.oracle_scores(ids, 6, k=2)
    assert sc[0].tolist() == [1, 0, 2, 2, 1, 0]  # k + 1 - d: experts 2 and 3 come back 1 row ahead, 0 and 4 in 2
    assert sc[1].tolist() == [2, 0, 1, 0, 2, 1]
    assert not sc[3].any()  # nothing comes after the last row
    assert not sim.oracle_scores(ids, 6, k=0).any()


def test_knowing_more_of_the_future_never_evicts_worse_and_ends_at_belady() -> None:
    rng = np.random.default_rng(5)
    ids = np.stack([rng.choice(8, 2, replace=False, p=np.linspace(2, 1, 8) / 12) for _ in range(600)])
    distinct = 2 * len(ids)
    belady = distinct - sim.simulate_cache(ids, 4, "belady")
    by_k = [sim.eviction_misses(ids, 4, sim.oracle_scores(ids, 8, k)) for k in (1, 2, 4, 8, 64)]
    assert by_k[0] < sim.eviction_misses(ids, 4)  # even one token of the future beats recency
    assert all(a >= b - 2 for a, b in zip(by_k, by_k[1:], strict=False))  # ties may differ by a miss or two
    assert by_k[-1] == pytest.approx(belady, abs=3)


def _reuse_data(n: int, seed: int):
    """One layer whose next token's two experts are a linear function of this token's input."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    W = np.random.default_rng(99).normal(size=(16, 8))
    nxt = np.argsort(-(x @ W), axis=1)[:, :2]  # the experts row t + 1 uses
    ids = np.concatenate([rng.choice(8, (1, 2), replace=False), nxt[:-1]])[:, None, :]  # [n, 1, 2]
    return [x], ids


def test_reuse_maps_evict_what_the_next_tokens_do_not_need() -> None:
    X, ids = _reuse_data(4000, seed=0)
    R, rb, alphas, _ = rf.fit_reuse(X, ids, [400] * 10, 8, pf.validation_rows([400] * 10), horizon=1)
    assert R[0].shape == (16, 8) and rb[0].shape == (8,) and alphas[0] in rf.REUSE_ALPHAS
    Xe, ide = _reuse_data(1000, seed=1)
    scores = Xe[0] @ R[0] + rb[0]
    lru = sim.eviction_misses(ide[:, 0], 4)
    learned_ = sim.eviction_misses(ide[:, 0], 4, scores)
    assert learned_ < 0.85 * lru  # the future is in x: evicting by it beats recency by far


LAYERS = [1, 3, 4, 6, 9]


def _with_reuse(fitted):
    """A predictor with hand-set reuse maps (layer position j scores 24 j + e for x of ones) and miss curves."""
    fit, R = fitted
    reuse = ([np.full((24, 8), j, np.float32) for j in range(5)], [np.arange(8, dtype=np.float32)] * 5)
    curves = np.linspace(2, 0, 5 * 9, dtype=np.float32).reshape(5, 9)
    pred = pf.to_runtime(fit, LAYERS, R, {"n_expert": 8, "n_expert_used": 2, "reuse_horizon": 4}, reuse=reuse,
                         curves=curves)
    return pred, reuse, curves


def test_reuse_maps_and_miss_curves_round_trip(fitted, tmp_path: Path) -> None:
    pred, reuse, curves = _with_reuse(fitted)
    bare = pf.to_runtime(fitted[0], LAYERS, fitted[1], {"n_expert": 8, "n_expert_used": 2})
    assert pred.has_reuse and not bare.has_reuse and bare.reuse(1, np.zeros(24)) is None
    assert pred.nbytes == bare.nbytes + sum(a.nbytes for a in (*reuse[0], *reuse[1]))
    back = LearnedPredictor.load(pred.save(tmp_path / "p.npz"))
    assert back.reuse_horizon == 4 and np.array_equal(back.miss_curves, curves)
    x = np.ones((3, 24), np.float32)
    for j, il in enumerate(LAYERS):
        assert np.allclose(back.reuse(il, x), 24 * j + np.arange(8))  # a batch: its last row's next tokens


def test_reuse_only_keeps_what_eviction_reads_and_counts_only_that(fitted) -> None:
    pred, reuse, curves = _with_reuse(fitted)
    only = pred.reuse_only()
    assert only.nbytes == sum(a.nbytes for a in (*reuse[0], *reuse[1])) < pred.nbytes
    assert only.predict(1, np.ones(24, np.float32)) == {} and pred.predict(1, np.ones(24, np.float32))
    assert only.has_reuse and np.array_equal(only.miss_curves, curves) and only.reuse_horizon == 4
    x = np.random.default_rng(0).normal(size=24).astype(np.float32)
    for il in LAYERS:
        assert np.array_equal(only.reuse(il, x), pred.reuse(il, x))
    assert pred.A[0] is not None  # the original keeps its maps


def test_recency_features_kept_incrementally_equal_the_history_read_directly() -> None:
    rng = np.random.default_rng(2)
    ids = np.stack([rng.choice(8, 2, replace=False) for _ in range(60)])
    ids[7, 1] = -1  # a call that used one expert
    F = learned.Recency.features_of(ids, 8)
    used = np.zeros((60, 8))
    for t, row in enumerate(ids):
        used[t, row[row >= 0]] = 1
    for t in (0, 1, 5, 20, 59):
        past = used[:t]
        last = [max((i for i in range(t) if past[i, e]), default=None) for e in range(8)]
        want = np.stack([past[-1] if t else np.zeros(8), past[-4:].sum(0) / 4, past[-16:].sum(0) / 16,
                         [0 if i is None else 1 / (1 + t - i) for i in last]], axis=1)
        assert np.allclose(F[t], want), t
    rec, w = learned.Recency(8), np.array([0.5, 1.0, -2.0, 3.0, 0.7, 0.1])
    for t, row in enumerate(ids):  # the per-call path gives what the features give
        s = rng.normal(size=8).astype(np.float32)
        assert np.allclose(learned.blend_scores(w, s, rec.features()), learned.blend_scores(w, s, F[t]),
                           atol=1e-6), t
        rec.observe([int(e) for e in row if e >= 0])


def test_the_blend_weighs_the_past_where_the_hidden_state_says_nothing() -> None:
    rng = np.random.default_rng(4)
    n, E = 4000, 16
    ids, work = [], list(range(5))
    for _ in range(n):  # each token picks 2 of a slowly drifting working set of 5, whatever x is
        if rng.random() < 0.05:
            work[int(rng.integers(5))] = int(rng.choice([e for e in range(E) if e not in work]))
        ids.append(rng.choice(work, 2, replace=False))
    ids = np.array(ids)[:, None, :]
    X = [rng.normal(size=(n, 16)).astype(np.float32)]  # noise: the maps learn nothing
    lengths = [400] * 10
    R, rb, _, blend = rf.fit_reuse(X, ids, lengths, E, pf.validation_rows(lengths), horizon=4)
    assert blend.shape == (1, 6) and blend[0, 1:5].sum() > 3 * abs(blend[0, 0])
    rec = learned.Recency.features_of(ids[:, 0], E)
    plain = X[0] @ R[0] + rb[0]
    lru = sim.eviction_misses(ids[:, 0], 6)
    blended = sim.eviction_misses(ids[:, 0], 6, learned.blend_scores(blend[0], plain, rec))
    alone = sim.eviction_misses(ids[:, 0], 6, plain)
    assert blended <= 1.05 * lru and 3 * lru < alone, (blended, lru, alone)  # the map alone evicts at random


def test_a_blend_round_trips_and_is_applied_only_with_features(fitted, tmp_path: Path) -> None:
    fit, R = fitted
    layers = [1, 3, 4, 6, 9]
    reuse = ([np.ones((24, 8), np.float32)] * 5, [np.zeros(8, np.float32)] * 5)
    pred = pf.to_runtime(fit, layers, R, {"n_expert": 8, "n_expert_used": 2}, reuse=reuse)
    pred.blend = np.tile(np.array([2.0, 0, 0, 0, 1.0, 0.5], np.float32), (5, 1))
    back = LearnedPredictor.load(pred.save(tmp_path / "p.npz"))
    rec = learned.Recency(8)
    for needed in ({3, 5}, {5, 6}, {1, 2}):
        rec.observe(needed)
    x = np.ones(24, np.float32)
    assert np.allclose(back.reuse(4, x), 24)  # no recency: the map alone
    got = back.reuse(4, x, rec)
    assert np.allclose(got, learned.blend_scores(back.blend[2], np.full(8, 24.0), rec.features()))
    assert got[5] > got[3] > got[0]  # used 2 calls ago, 3 calls ago, never
    bad = tmp_path / "bad.npz"
    with np.load(tmp_path / "p.npz") as z:
        np.savez(bad, **{k: (z[k][:, :5] if k == "blend" else z[k]) for k in z.files})
    with pytest.raises(SpecterError, match="blend"):
        LearnedPredictor.load(bad)


def test_reuse_maps_fit_on_every_row_when_too_few_are_generated() -> None:
    X, ids = _reuse_data(800, seed=0)
    only_last = np.zeros(800, bool)
    only_last[399::400] = True  # a fixture's "generated" rows: the last of each sequence, with no next token
    val = pf.validation_rows([400, 400])
    R, rb, _, _ = rf.fit_reuse(X, ids, [400, 400], 8, val, horizon=1, rows=only_last)
    assert np.isfinite(R[0]).all() and np.isfinite(rb[0]).all()
