#!/usr/bin/env bash
# Sweep budgets x tiers x policies with `pyspecter bench`; write a new CSV (and a PNG: TPOT vs budget per policy).
#
#   tools/bench.sh                       # smol-moe + its default draft, tiers ram and disk, three budgets
#   MODEL=bench-qwen3moe DRAFT= BUDGETS="25% 50%" TIERS=ram tools/bench.sh
#
# Every point is one `pyspecter bench` run: its policies side by side, interleaved, on the same prompt.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-smol-moe}
DRAFT=${DRAFT-smol-moe-draft}
BUDGETS=${BUDGETS:-"25% 50% 75%"}
TIERS=${TIERS:-"ram disk"}
POLICIES=${POLICIES:-"stock,all-resident,on-demand-lru,on-demand-lru-ordered,on-demand-lfu,on-demand-cpu"}
N=${N:-16}
REPEAT=${REPEAT:-2}
PROMPT_TOKENS=${PROMPT_TOKENS:-32}
OUT=${OUT:-out/bench}
PY=.venv/bin/python

[ -x "$PY" ] || make build
mkdir -p "$OUT"
# one file per sweep, never overwriting an earlier one; every row carries its whole setting (see --csv)
csv="$OUT/bench-$(date +%Y%m%d-%H%M%S).csv"
draft_args=()
if [ -n "$DRAFT" ]; then
    draft_args=(--draft "$DRAFT")
    POLICIES="$POLICIES,specter,specter-equal-slots"
fi
failed=()
for tier in $TIERS; do
    for budget in $BUDGETS; do
        echo "bench: $MODEL tier=$tier budget=$budget" >&2
        part="$OUT/.part-$$.csv"
        # a point that fails is reported and skipped; the sweep goes on
        if "$PY" -m pyspecter bench "$MODEL" "${draft_args[@]}" --tier "$tier" --budget "$budget" \
            --policies "$POLICIES" -n "$N" --repeat "$REPEAT" --prompt-tokens "$PROMPT_TOKENS" --csv > "$part"; then
            if [ -f "$csv" ]; then tail -n +2 "$part" >> "$csv"; else cp "$part" "$csv"; fi
        else
            failed+=("tier=$tier budget=$budget")
        fi
        rm -f "$part"
    done
done
if [ ! -f "$csv" ]; then
    echo "bench: every point failed: ${failed[*]}" >&2
    exit 1
fi
# matplotlib comes with the plot extra (make installs it)
if "$PY" -c "import matplotlib" 2>/dev/null; then
    "$PY" tools/bench_plot.py "$csv" "${csv%.csv}.png"
    echo "wrote $csv and ${csv%.csv}.png" >&2
else
    echo "wrote $csv (no plot: matplotlib missing; pip install '.[plot]')" >&2
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "bench: failed points: ${failed[*]}" >&2
    exit 1
fi
