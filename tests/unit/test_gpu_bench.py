"""tools/gpu_bench.py without a GPU: its table's columns come from bench's JSON as bench defines them (host syncs
over the floor row, upload rate over the token, no hit rate for stock), and its time guard skips a budget that
does not fit, saying why, instead of running past the lease."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gb():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "tools" / "gpu_bench.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _bench(with_floor: bool) -> dict:
    pol = {
        "stock-n-cpu-moe": {"tpot_ms": 20.0, "n_cpu_moe": 24, "host_switches_per_moe_layer": 1.0,
                            "switches_taken_per_moe_layer": 1.0, "host_syncs_per_token": 104.0,
                            "bytes_per_token": 0, "hit_rate": 1.0, "predicted_ms": 19.0, "same_logits_as_stock": True},
        "plan": {"tpot_ms": 16.0, "host_switches_per_moe_layer": 1.0, "host_syncs_per_token": 128.0,
                 "host_wait_ms_per_token": 3.5, "host_split_ms_per_token": 6.25, "device_launch_ms_per_token": 0.5,
                 "host_settle_ms_per_token": 0.125, "spec_ubatches_per_token": 1.0, "spec_redos_per_token": 0.0,
                 "table_bytes_per_token": 16384.0,
                 "bytes_per_token": 40e6, "upload_busy_gbps": 20.0, "upload_inflight_peak": 3, "hit_rate": 0.8,
                 "compute_orders_per_token": 0.5, "predicted_ms": 15.0, "same_logits_as_stock": True,
                 "prefill_tok_s": 812.4},
        "engine": {"skipped": "no room"},
        "plan-mapped": {"tpot_ms": 12.0, "switches_taken_per_moe_layer": 0.25, "predicted_ms": 11.0},
    }
    if with_floor:
        pol["stock-device"] = {"tpot_ms": 5.0, "host_switches_per_moe_layer": 0.0, "host_syncs_per_token": 8.0,
                               "bytes_per_token": 0}
    return {"policies": pol, "link_gbps": 50.0, "n_moe_layers": 48,
            "layer_plan": {"plan": "24 full, 12 slots (64/128), 12 host"},
            "layer_plan_mapped": {"plan": "24 full, 24 slots (40/128)"}}


def test_rows_and_floor(gb) -> None:
    sets = [{"budget": "8GiB", "n_moe_layers": 48, "rows": gb.rows(_bench(True))},
            {"budget": "16GiB", "n_moe_layers": 48, "rows": gb.rows(_bench(False))}]
    gb.floor_syncs(sets)
    by = {r["policy"]: r for r in sets[1]["rows"]}
    assert by["stock-n-cpu-moe"]["row"] == "stock `--n-cpu-moe 24` (equal VRAM)"
    assert by["stock-n-cpu-moe"]["hit_rate"] is None and by["plan"]["hit_rate"] == 0.8
    # the floor ran at the first budget only and serves both
    assert by["stock-n-cpu-moe"]["host_syncs_per_moe_layer"] == pytest.approx((104 - 8) / 48)
    assert by["plan"]["host_syncs_per_moe_layer"] == pytest.approx((128 - 8) / 48)
    assert by["plan"]["upload_gbps"] == pytest.approx(40e6 / 16e6)  # bytes over the token's own time
    assert by["plan"]["vs_stock_n_cpu_moe"] == pytest.approx(0.8)
    assert "skipped" in by["engine"]
    # the plan priced and run with --miss mapped: its own plan in its label
    assert by["plan-mapped"]["row"] == ("ours, the layer plan priced and run with `--miss mapped` "
                                        "(24 full, 24 slots (40/128))")
    assert by["plan-mapped"]["vs_stock_n_cpu_moe"] == pytest.approx(0.6)
    md = gb.markdown({"model": "m", "device": "cuda0", "machine": "H200", "date": "d", "n_threads": 16, "n": 16,
                      "prompt_tokens": 64, "model_s": 30.0, "sets": sets, "notes": []})
    assert "| 16GiB | ours, the layer plan (24 full, 12 slots (64/128), 12 host) | 16.00 | 0.80 | 812 |" in md
    assert "| 8GiB | ours, the engine | skipped: no room |" in md
    # the engine's own choice of miss mode (mapped where its plan predicts that faster) is in its label
    ran = {**_bench(False), "policies": {"engine": {"tpot_ms": 9.0, "miss": "mapped"}}}
    assert gb.rows(ran)[0]["row"] == "ours, the engine (`--miss mapped`)"
    # where the time went: bench's three device times, per token; a row without them shows dashes
    assert "| 2.50 | 3.50 / 6.25 / 0.50 / 0.12 |" in md
    assert "| - / - / - / - |" in md
    # uploads: over the token's time / while copying (the link at start); the most batches in flight, and those a
    # token that waited for the device's queued compute; stock moves nothing
    assert "| 2.50 / 20.00 (50.0); 3, 0.5 |" in md and "| 0.00 / - (50.0); -, - |" in md
    # a speculated row: its ubatches with no host path, those redone, and the tables the fences pushed
    assert "| 80.0%, speculated 1.00/token, 0% redone, tables 16 KiB/token |" in md
    # every row has as many cells as the header
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert len({ln.count("|") for ln in table}) == 1, table


def test_the_time_guard_skips_what_does_not_fit(gb, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Too little time for the first budget: nothing is benched, each budget says so, exit 1 (no rows at all)."""
    rc = gb.main(["--model", "tiny-qwen3moe", "--device", "cpu", "--budgets", "25%,50%", "--until",
                  str(time.time() + 60), "--min-first-s", "3600", "--out", str(tmp_path)])
    assert rc == 1
    md = (tmp_path / "gpu_bench.md").read_text()
    assert md.count("skipped: out of time") == 2 and "3600s needed at least" in md


def test_bad_arguments_exit_2(gb, capsys: pytest.CaptureFixture) -> None:
    assert gb.main(["--budgets", ",", "--out", str(Path(sys.prefix) / "unused")]) == 2
    assert "--budgets" in capsys.readouterr().err


def test_the_floor_comes_from_a_bench_of_the_same_arch(gb, tmp_path: Path) -> None:
    f = tmp_path / "bench.json"
    f.write_text("some log line\n" + __import__("json").dumps(
        {"arch": "qwen3moe", "policies": {"stock-device": {"host_syncs_per_token": 8.0}}}) + "\n")
    assert gb.floor_from(f, "qwen3moe") == 8.0
    assert gb.floor_from(f, "llama") is None  # another architecture's graph inputs: not a floor for this one
    assert gb.floor_from(tmp_path / "missing.json", "qwen3moe") is None
    sets = [{"budget": "8GiB", "n_moe_layers": 48, "rows": gb.rows(_bench(False))}]
    gb.floor_syncs(sets, 8.0)
    assert sets[0]["rows"][0]["host_syncs_per_moe_layer"] == pytest.approx((104 - 8) / 48)


def test_each_budget_says_what_its_misses_read(gb) -> None:
    """A GPU table's slot rows mean something else with zero slots (patch 0008 failed there, or another device):
    each budget's note says which, from bench's JSON."""
    assert gb._zero({"zero_slots": 0}) == "misses as negative ids"
    assert gb._zero({"zero_slots": 8}) == "8 zero slots a slot layer"
    assert gb._zero({}) == "misses as ?"  # a bench from before the field
