"""The benchmark's pure parts: Belady MIN and the JSON contract scripts depend on (no timings are asserted)."""

from __future__ import annotations

import json

from conftest import run_cli

from pyspecter.bench import belady_misses


def test_belady_is_optimal_on_a_known_trace() -> None:
    # one layer, 2 slots: a b c a b c ... LRU misses every time; MIN keeps one of the pair and misses 1 in 2
    trace = [(0, (x,)) for x in "abcabcabc"]
    trace = [(il, tuple(ord(c) for c in t)) for il, t in trace]
    assert belady_misses(trace, 3) == 3
    assert belady_misses(trace, 2) == 6
    assert belady_misses(trace, 1) == 9


def test_belady_per_layer_and_multi_expert_steps() -> None:
    trace = [(0, (1, 2)), (1, (1, 2)), (0, (1, 2)), (1, (3, 4))]
    assert belady_misses(trace, 2) == 2 + 4


def test_bench_json_keys() -> None:
    r = run_cli("bench", "tiny-mixtral", "--repeat", "1", "-n", "4", "--prompt-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("model", "tier", "budget", "policies"):
        assert key in out
    for name in ("stock", "all-resident", "on-demand-lru", "on-demand-lfu"):
        p = out["policies"][name]
        for key in ("tpot_ms", "decode_tok_s", "prefill_tok_s", "hit_rate", "coverage", "bytes_per_token",
                    "stall_ms_per_token", "peak_rss_mb", "vs_on_demand_lru", "vs_all_resident", "vs_oracle_bound"):
            assert key in p, (name, key)
    assert out["policies"]["all-resident"]["hit_rate"] == 1.0
    assert "oracle-bound" in out["policies"]


def test_bench_engine_and_surrogate_policies_on_the_disk_tier(tmp_path) -> None:
    """The capped child-process path, the speculative policies and the approximate one, end to end."""
    draft = tmp_path / "draft.gguf"
    r = run_cli("draft", "tiny-mixtral", "-o", str(draft), "--experts", "Q4_0", "--ffn-keep", "0.5")
    assert r.returncode == 0, r.stderr
    r = run_cli("bench", "tiny-mixtral", "--tier", "disk", "--budget", "75%", "--draft", str(draft),
                "--policies", "on-demand-lru,specter,specter-equal-slots,surrogate", "--surrogate-width", "0.5",
                "--fixed-k", "-k", "0", "--no-cutoff", "--repeat", "1", "-n", "6", "--prompt-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    lru, spec, sur = (out["policies"][p] for p in ("on-demand-lru", "specter-equal-slots", "surrogate"))
    assert spec["slots_per_layer"] == out["slots_per_layer"] == 12 and lru["hit_rate"] < 1
    assert spec["mean_k"] == 0 and spec["draft_off"] == 0 and spec["cutoff"] is False and spec["adaptive"] is False
    assert spec["miss"] == "wait"
    assert sur["approximate"] is True and sur["surrogate_uses"] > 0 and sur["slots_per_layer"] == 4
    assert "tpot_ms" in out["policies"]["specter"] or "skipped" in out["policies"]["specter"]
