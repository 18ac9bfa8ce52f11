"""The benchmark end to end: the JSON contract scripts depend on, the capped child path (no timings asserted)."""

from __future__ import annotations

import json

from conftest import run_cli


def test_bench_json_keys() -> None:
    r = run_cli("bench", "tiny-mixtral", "--repeat", "1", "-n", "4", "--prompt-tokens", "8", "--json",
                "--policies", "stock,all-resident,on-demand-lru,on-demand-lfu")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("model", "tier", "budget", "policies"):
        assert key in out
    for name in ("stock", "all-resident", "on-demand-lru", "on-demand-lfu"):
        p = out["policies"][name]
        for key in ("tpot_ms", "decode_tok_s", "prefill_tok_s", "hit_rate", "coverage", "bytes_per_token",
                    "stall_ms_per_token", "peak_rss_mb", "vs_on_demand_lru", "vs_all_resident", "vs_oracle_bound",
                    "load_s", "cold_ttft_s"):
            assert key in p, (name, key)
        assert 0 < p["load_s"] < p["cold_ttft_s"], name  # load, then the prompt's prefill
    assert out["policies"]["all-resident"]["hit_rate"] == 1.0
    assert "oracle-bound" in out["policies"]
    assert out["decode"] == "teacher-forced"  # a random-weight fixture: held-out text by default
    r = run_cli("bench", "tiny-mixtral", "--repeat", "1", "-n", "4", "--prompt-tokens", "8", "--json", "--free",
                "--policies", "stock,on-demand-lru")
    assert r.returncode == 0, r.stderr
    free = json.loads(r.stdout)
    lru = free["policies"]["on-demand-lru"]
    assert free["decode"] == lru["decode"] == "free"
    assert lru["same_tokens_as_stock"] is True and lru["same_logits_as_stock"] is None


def test_bench_engine_and_surrogate_policies_on_the_disk_tier(tmp_path) -> None:
    """The capped child-process path, the speculative policies and the approximate one, end to end."""
    draft = tmp_path / "draft.gguf"
    r = run_cli("draft", "tiny-mixtral", "-o", str(draft), "--experts", "Q4_0", "--ffn-keep", "0.5")
    assert r.returncode == 0, r.stderr
    r = run_cli("bench", "tiny-mixtral", "--tier", "disk", "--budget", "75%", "--draft", str(draft),
                "--policies", "on-demand-lru,specter,specter-equal-slots,surrogate", "--surrogate-width", "0.5",
                "--fixed-k", "-k", "0", "--repeat", "1", "-n", "6", "--prompt-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    lru, spec, sur = (out["policies"][p] for p in ("on-demand-lru", "specter-equal-slots", "surrogate"))
    assert spec["slots_per_layer"] == out["slots_per_layer"] == 12 and lru["hit_rate"] < 1
    assert spec["mean_k"] == 0 and spec["draft_off"] == 0 and spec["adaptive"] is False
    assert spec["miss"] == "wait"
    # teacher-forced by default on the fixture, but the speculative decoder drafts its own tokens: free, and says so
    assert lru["decode"] == "teacher-forced" and spec["decode"] == "free"
    assert sur["approximate"] is True and sur["surrogate_uses"] > 0 and sur["slots_per_layer"] == 4
    specter = out["policies"]["specter"]
    # the draft counted in the budget may leave no room; that is the one acceptable reason to skip it
    assert "tpot_ms" in specter or "fit" in specter["skipped"], specter


def test_bench_sweeps_and_every_csv_row_describes_itself() -> None:
    import csv
    import io

    from pyspecter.study.bench import CSV_FIELDS

    r = run_cli("bench", "tiny-mixtral", "--budget", "50%,75%", "--threads", "1,2", "--policies",
                "on-demand-lru,stock", "--repeat", "1", "-n", "2", "--prompt-tokens", "4", "--csv")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert len(rows) == 2 * 2 * 2  # budgets x threads x policies
    assert {(x["budget"], x["n_threads"], x["policy"]) for x in rows} == {
        (b, t, p) for b in ("50%", "75%") for t in ("1", "2") for p in ("on-demand-lru", "stock")}
    setting = ("model", "tier", "budget", "budget_bytes", "budget_pct", "slots_per_layer", "memory_cap", "capped",
               "cgroup", "link_gbps", "n_threads", "prompt_tokens", "decode_tokens", "repeat", "build", "tpot_ms")
    assert set(setting) <= set(CSV_FIELDS)
    for row in rows:
        assert all(row[k] != "" for k in setting), row
        assert row["capped"] == "False" and row["cgroup"] == "none"  # the ram tier runs uncapped, and says so
