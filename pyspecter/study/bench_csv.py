"""bench's results as CSV rows: one flat row per policy and sweep point."""

from __future__ import annotations

from pathlib import Path

# every row carries its whole setting: a CSV line read alone says what was run, on what, under which cap
RUN_FIELDS = ("model", "tier", "emulated", "budget", "budget_bytes", "budget_pct", "slots_per_layer", "link_gbps",
              "n_threads", "prompts", "n_prompts", "prompt_tokens", "decode_tokens", "repeat", "build", "decode")
CSV_FIELDS = ("model", "draft", "tier", "emulated", "budget", "budget_bytes", "budget_pct", "slots_per_layer",
              "memory_cap", "cap_bytes", "capped", "cgroup", "link_gbps", "n_threads", "prompts", "n_prompts",
              "prompt_tokens", "decode_tokens", "repeat", "build", "policy", "decode", "same_logits_as_stock",
              "same_tokens_as_stock", "tpot_ms",
              "tpot_p10_ms", "tpot_p90_ms", "tpot_mean_ms", "decode_tok_s", "prefill_tok_s", "load_s", "cold_ttft_s",
              "hit_rate", "coverage",
              "bytes_per_token", "stall_ms_per_token", "peak_rss_mb", "acceptance", "mean_k", "draft_off",
              "vs_on_demand_lru", "vs_all_resident", "vs_oracle_bound")


def to_csv_rows(result: dict) -> list[dict]:
    """One flat row per policy, for spreadsheets and tools/bench.sh."""
    rows = []
    for name, p in result["policies"].items():
        if "skipped" in p:
            continue
        row = {k: result.get(k) for k in RUN_FIELDS}
        row["model"] = Path(row["model"]).name
        row["prompts"] = Path(row["prompts"]).name if row["prompts"] else ""
        row["draft"] = Path(result["draft"]).name if result.get("draft") and name.startswith("specter") else ""
        row["policy"] = name
        row.update({k: p.get(k) for k in CSV_FIELDS if k in p})
        rows.append({k: row.get(k, "") for k in CSV_FIELDS})
    return rows
