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
