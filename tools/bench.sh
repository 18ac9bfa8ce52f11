#!/usr/bin/env bash
# Sweep budgets x tiers x policies with `pyspecter bench`; write one CSV and a PNG (TPOT vs budget per policy).
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
POLICIES=${POLICIES:-"stock,all-resident,on-demand-lru,on-demand-lfu,on-demand-cpu"}
N=${N:-16}
REPEAT=${REPEAT:-2}
PROMPT_TOKENS=${PROMPT_TOKENS:-32}
OUT=${OUT:-out/bench}
PY=.venv/bin/python

[ -x "$PY" ] || make build
mkdir -p "$OUT"
csv="$OUT/bench.csv"
rm -f "$csv"
draft_args=()
if [ -n "$DRAFT" ]; then
    draft_args=(--draft "$DRAFT")
    POLICIES="$POLICIES,specter,specter-equal-slots"
fi
for tier in $TIERS; do
    for budget in $BUDGETS; do
        echo "bench: $MODEL tier=$tier budget=$budget" >&2
        "$PY" -m pyspecter bench "$MODEL" "${draft_args[@]}" --tier "$tier" --budget "$budget" \
            --policies "$POLICIES" -n "$N" --repeat "$REPEAT" --prompt-tokens "$PROMPT_TOKENS" --csv > "$OUT/part.csv"
        if [ -f "$csv" ]; then tail -n +2 "$OUT/part.csv" >> "$csv"; else cp "$OUT/part.csv" "$csv"; fi
    done
done
rm -f "$OUT/part.csv"
"$PY" -c "import matplotlib" 2>/dev/null || "$PY" -m pip install -q 'matplotlib>=3.8'
"$PY" tools/bench_plot.py "$csv" "$OUT/bench.png"
echo "wrote $csv and $OUT/bench.png" >&2
