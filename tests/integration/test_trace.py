"""Routing traces and the analyzer: a real trace on tiny-qwen3moe with a Q4_0 self-draft, checked against a separate
hooked run, and the metrics checked on hand-made traces. One llama.cpp thread: the test machines have 2 shared
cores, and spinning threads of two processes on them slow everything down a hundredfold."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from pyspecter import native
from pyspecter.errors import SpecterError
from pyspecter.layout import read_layout
from pyspecter.models.tiny import TINY_MODELS, build_tiny
from pyspecter.prompts import load_prompts, render_chatml
from pyspecter.study.analyze import (
    PREDICTORS,
    analyze,
    cache_curves,
    format_analysis,
    onehot,
    prev_token_prediction,
    set_scores,
)
from pyspecter.study.simulate import simulate_cache
from pyspecter.study.trace import record_trace
from pyspecter.tracefile import load_trace

N, K = 8, 3


def _q4_draft(src: Path, out: Path) -> Path:
    import llama_cpp

    native.llama_lib()
    native.quiet_logs()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0  # n_embd 64: 256-blocks of K-quants don't fit
    params.allow_requantize = True
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("trace")
    target = build_tiny("tiny-qwen3moe")
    draft = _q4_draft(target, d / "draft-q4_0.gguf")
    prompts = load_prompts()[:3]  # tune, eval, tune
    summary = record_trace(target, d / "t.npz", draft_path=draft, prompts=prompts, n=N, k=K, progress=False,
                           n_threads=1, stop_at_eog=False)
    return {"dir": d, "target": target, "draft": draft, "prompts": prompts, "summary": summary,
            "trace": load_trace(d / "t.npz")}


def test_prompt_set() -> None:
    ps = load_prompts()
    assert 20 <= len(ps) <= 30
    assert len(load_prompts(split="tune")) == len(load_prompts(split="eval")) == len(ps) // 2
    assert {"chat", "code", "math", "summary", "multi-turn"} <= {p["kind"] for p in ps}
    assert any(len(p["messages"]) > 2 for p in ps)
    assert len({p["id"] for p in ps}) == len(ps)
    assert render_chatml([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_trace_arrays(recorded: dict) -> None:
    tr, spec = recorded["trace"], TINY_MODELS["tiny-qwen3moe"]
    T, L, U, E = 3 * N, spec.n_layer, spec.n_expert_used, spec.n_expert
    shapes = {"token_ids": ((T,), np.int32), "output_ids": ((T,), np.int32), "prompt_index": ((T,), np.int16),
              "position": ((T,), np.int32), "target_ids": ((T, L, U), np.int16), "target_w": ((T, L, U), np.float16),
              "gate_ahead_ids": ((T, 3, L, U), np.int16), "draft_same_ids": ((T, L, U), np.int16),
              "draft_own_ids": ((T, K, L, U), np.int16), "draft_own_w": ((T, K, L, U), np.float16),
              "draft_tokens": ((T, K), np.int32), "draft_match": ((T, K), np.int8),
              "verify_ids": ((T, K, L, U), np.int16)}
    for name, (shape, dtype) in shapes.items():
        assert tr[name].shape == shape and tr[name].dtype == dtype, (name, tr[name].shape, tr[name].dtype)
    for name in ("target_ids", "draft_same_ids", "draft_own_ids", "verify_ids"):
        ids = tr[name]
        assert ids.min() >= 0 and ids.max() < E
        srt = np.sort(ids, axis=-1)
        assert (srt[..., 1:] != srt[..., :-1]).all(), name  # a token's experts are distinct
    assert np.array_equal(tr["prompt_index"], np.repeat(np.arange(3), N))
    assert set(np.unique(tr["draft_match"])) <= {-1, 0, 1}
    # within a prompt, each row's input is the previous row's greedy output
    same = tr["prompt_index"][1:] == tr["prompt_index"][:-1]
    assert np.array_equal(tr["token_ids"][1:][same], tr["output_ids"][:-1][same])
    m = tr.meta
    assert m["n_expert"] == E and m["moe_layers"] == list(range(L)) and m["k"] == K
    assert m["expert_bytes"] == [x.expert_bytes for x in read_layout(recorded["target"]).layers]
    assert [p["split"] for p in m["prompts"]] == [p["split"] for p in recorded["prompts"]]
    g = m["gate_lookahead"]
    assert g["layers"] == 3 and g["note"] is None
    assert g["router_reproduction"] == 1.0 and g["router_logit_max_abs_err"] < 1e-3
    assert recorded["summary"]["rows"] == T and set(recorded["summary"]["acceptance_at"]) == {"1", "2", "3"}


def test_trace_matches_a_separate_hooked_run(recorded: dict) -> None:
    """Replay the trace's tokens through a fresh model with only the routing hook (no eval callback, no draft):
    same experts in every row and layer, and the same greedy tokens."""
    tr = recorded["trace"]
    seen: list[np.ndarray] = []
    with native.Model(recorded["target"]) as model:
        api = native.slots()
        # all slots, none filled: the host path, as in stock llama.cpp (the trace used one slot)
        assert api.slots_init(model.ptr, tr.n_expert) == 0

        def on_route(_ud, il, n_tokens, n_used, ids, _w) -> None:
            seen.append(np.ctypeslib.as_array(ids, shape=(n_tokens * n_used,)).reshape(n_tokens, n_used).copy())

        cb = native.ROUTE_CB(on_route)
        api.set_route_cb(model.ptr, cb, None)
        starts = tr["prompt_starts"]
        with native.Context(model, n_ctx=512, n_threads=1) as ctx:
            for p in range(len(tr.meta["prompts"])):
                rows = np.flatnonzero(tr["prompt_index"] == p)
                logits = ctx.decode(tr["prompt_tokens"][starts[p]:starts[p + 1]].tolist())
                assert int(np.argmax(logits)) == tr["token_ids"][rows[0]]
                for r in rows:
                    seen.clear()
                    logits = ctx.decode([int(tr["token_ids"][r])])
                    got = np.stack([s[0] for s in seen])  # [L, U]: one hook call per MoE layer
                    assert np.array_equal(got, tr["target_ids"][r]), (p, r)
                    assert int(np.argmax(logits)) == tr["output_ids"][r]
                ctx.clear()
        api.set_route_cb(model.ptr, native.ROUTE_CB(), None)


def test_analyze_recorded(recorded: dict, tmp_path: Path) -> None:
    r = analyze(recorded["dir"] / "t.npz", plot_dir=tmp_path)
    json.dumps(r, allow_nan=False)
    assert set(r["predictors"]) == set(PREDICTORS)
    for name, p in r["predictors"].items():
        assert p["available"], name
        for key in ("recall_at", "precision_at"):
            vals = [v for v in p[key].values() if v is not None]
            assert vals and all(0.0 <= v <= 1.0 for v in vals), (name, key)
        assert len(p["per_layer_recall_at_1"]) == 4
    assert all(v == 1.0 for v in r["predictors"]["oracle"]["recall_at"].values())
    assert r["predictors"]["draft-own-tokens"]["recall_at"]["4"] is None  # only k=3 drafted
    assert r["predictors"]["next-layer-gate"]["lookahead_unit"] == "layers"
    assert r["trace"]["scored_rows"] == "eval split"

    c = r["cache"]
    lru, bel = c["lru"]["hit_rate_warm"], c["belady"]["hit_rate_warm"]
    assert c["slots"][0] == 4 and c["slots"][-1] == 32
    assert all(a <= b + 1e-12 for a, b in zip(lru, lru[1:], strict=False))
    assert lru[-1] == 1.0 and c["lfu"]["hit_rate_warm"][-1] == 1.0 and bel[-1] == 1.0
    assert all(b >= a - 1e-12 for a, b in zip(lru, bel, strict=True))

    conf = r["confidence"]["draft-own-tokens"]["1"]
    assert conf["recall"][0] == pytest.approx(r["predictors"]["draft-own-tokens"]["recall_at"]["1"])
    assert all(a >= b for a, b in zip(conf["recall"], conf["recall"][1:], strict=False))
    assert all(a >= b for a, b in zip(conf["upload_bytes_per_token"], conf["upload_bytes_per_token"][1:],
                                      strict=False))
    assert conf["upload_bytes_per_token"][0] == pytest.approx(r["confidence"]["needed_bytes_per_token"])
    assert set(r["speculative"]["acceptance_at"]) == {"1", "2", "3"}
    assert (tmp_path / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "oracle" in format_analysis(r)


def test_trace_without_draft(tmp_path: Path) -> None:
    out = tmp_path / "plain.npz"
    s = record_trace(build_tiny("tiny-qwen3moe"), out, prompts=["hello there"], n=4, k=2, progress=False,
                     n_threads=1, gate_lookahead=0, stop_at_eog=False)
    assert s["rows"] == 4 and s["k"] == 0
    tr = load_trace(out)
    assert tr.get("draft_own_ids") is None and tr.get("gate_ahead_ids") is None
    r = analyze(out)
    for name in ("draft-same-tokens", "draft-own-tokens", "next-layer-gate"):
        assert not r["predictors"][name]["available"]
        assert all(v is None for v in r["predictors"][name]["recall_at"].values())
    assert r["trace"]["scored_rows"] == "all rows"
    assert r["predictors"]["frequency"]["profile"].startswith("online")


def test_trace_command_prints_a_summary_or_json(tmp_path: Path) -> None:
    out = tmp_path / "cli.npz"
    args = ("trace", "tiny-qwen3moe", "-o", str(out), "-n", "2", "-t", "1", "--prompts")
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\n")
    r = run_cli(*args, str(prompts))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("trace: 2 rows from 1 prompts") and "{" not in r.stdout, r.stdout  # not raw JSON
    assert f"pyspecter analyze {out}" in r.stdout and out.is_file()
    r = run_cli(*args, str(prompts), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rows"] == 2


def test_self_draft_predicts_perfectly(tmp_path: Path) -> None:
    """The target as its own draft drafts the target's tokens, so draft-own routing at lookahead h must be exactly
    row t+h's: this pins the alignment of drafted rows to the rows they predict."""
    target = build_tiny("tiny-qwen3moe")
    out = tmp_path / "self.npz"
    s = record_trace(target, out, draft_path=target, prompts=load_prompts()[:2], n=5, k=3, progress=False,
                     n_threads=1, gate_lookahead=1, stop_at_eog=False)
    assert all(v == 1.0 for v in s["acceptance_at"].values())
    tr = load_trace(out)
    assert np.array_equal(tr["draft_same_ids"], tr["target_ids"])
    r = analyze(out)
    for name in ("draft-same-tokens", "draft-own-tokens"):
        assert all(v == 1.0 for v in r["predictors"][name]["recall_at"].values() if v is not None), name
    # verify runs the drafts as one batch, which may flip a near-tie now and then (docs/DESIGN.md, exactness)
    assert all(v >= 0.95 for v in r["speculative"]["draft_own_recall_vs_verify_at"].values())


def test_foreign_draft_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecterError, match="differ"):
        record_trace(build_tiny("tiny-qwen3moe"), tmp_path / "x.npz", draft_path=build_tiny("tiny-mixtral"),
                     prompts=["hi"], n=2, progress=False, n_threads=1)


# --- metrics on hand-made traces -------------------------------------------------------------------------------

def test_prev_token_recall_by_hand() -> None:
    # 1 layer, top-2 of 4 experts; prompts [0,0,0] and [1,1]. At lookahead 1 rows 1, 2 and 4 are scored:
    # {0,1}->{1,2}: 1 hit, {1,2}->{2,3}: 1 hit, {0,1}->{0,1}: 2 hits; 4 of 6 needed, 4 of 6 predicted.
    ids = np.array([[[0, 1]], [[1, 2]], [[2, 3]], [[0, 1]], [[1, 0]]], np.int16)
    pi = np.array([0, 0, 0, 1, 1])
    pred, valid = prev_token_prediction(ids, pi, 1)
    assert valid.tolist() == [False, True, True, False, True]
    sc = set_scores(onehot(pred, 4), onehot(ids, 4), valid)
    assert sc["recall"] == pytest.approx(4 / 6) and sc["precision"] == pytest.approx(4 / 6)
    assert sc["full_cover"] == pytest.approx(1 / 3) and sc["samples"] == 3
    # lookahead 2 only scores row 2 ({0,1} -> {2,3}): nothing in common
    pred, valid = prev_token_prediction(ids, pi, 2)
    assert valid.tolist() == [False, False, True, False, False]
    assert set_scores(onehot(pred, 4), onehot(ids, 4), valid)["recall"] == 0.0


def test_cache_curves_on_random_stream() -> None:
    rng = np.random.default_rng(7)
    E, U, T = 12, 3, 200
    # skewed popularity with some repetition, so the curves have shape
    p = rng.dirichlet(np.full(E, 0.5))
    ids = np.stack([rng.choice(E, size=U, replace=False, p=p) for _ in range(T)])[:, None, :].astype(np.int16)
    c = cache_curves(ids, E)
    assert c["slots"] == list(range(U, E + 1))
    lru, bel, lfu = c["lru"]["hit_rate_warm"], c["belady"]["hit_rate_warm"], c["lfu"]["hit_rate_warm"]
    assert all(a <= b for a, b in zip(lru, lru[1:], strict=False))
    assert lru[-1] == bel[-1] == lfu[-1] == 1.0
    assert all(b >= a for a, b in zip(lru, bel, strict=True))
    assert all(b >= a for a, b in zip(lfu, bel, strict=True))
    cold = c["compulsory_misses"]
    assert cold == len(np.unique(ids))
    assert simulate_cache(ids[:, 0], E, "belady") == c["accesses"] - cold
    assert sum(c["reuse_distance_tokens"]["count"]) == c["accesses"] - cold
