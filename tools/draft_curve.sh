#!/usr/bin/env bash
# The draft-size trade-off (README, draft-size curve): at a fixed total fast-memory budget, TPOT of
# the speculative engine against the draft's size, next to on-demand LRU spending the whole budget on slots.
#
#   tools/draft_curve.sh                                   # smol-moe, disk tier, budgets 50% and 30%
#   BUDGETS=50% DRAFTS="smol-moe-draft-Q4_0-w0.25" tools/draft_curve.sh
#
# Every line is one `pyspecter bench` run (its policies side by side, interleaved, on the same prompt):
#   specter             the draft's file counted inside the budget (fewer slots)
#   specter-equal-slots the same slots as on-demand-lru, the draft on top: what its predictions are worth
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-smol-moe}
DRAFTS=${DRAFTS:-"smol-moe-draft smol-moe-draft-Q4_0-w0.5 smol-moe-draft-Q4_0-w0.25 smol-moe-draft-Q4_0-w0.125"}
BUDGETS=${BUDGETS:-"50% 30%"}
TIER=${TIER:-disk}
N=${N:-32}
REPEAT=${REPEAT:-2}
PROMPT_TOKENS=${PROMPT_TOKENS:-64}
EXTRA=${EXTRA:-}
OUT=${OUT:-out/bench}
PY=.venv/bin/python

[ -x "$PY" ] || make build
mkdir -p "$OUT"
csv="$OUT/draft_curve.csv"
rm -f "$csv"
for budget in $BUDGETS; do
    for draft in $DRAFTS; do
        echo "draft curve: $MODEL tier=$TIER budget=$budget draft=$draft" >&2
        # shellcheck disable=SC2086
        "$PY" -m pyspecter bench "$MODEL" --draft "$draft" --tier "$TIER" --budget "$budget" $EXTRA \
            --policies on-demand-lru,specter,specter-equal-slots -n "$N" --repeat "$REPEAT" \
            --prompt-tokens "$PROMPT_TOKENS" --csv > "$OUT/part.csv"
        if [ -f "$csv" ]; then tail -n +2 "$OUT/part.csv" >> "$csv"; else cp "$OUT/part.csv" "$csv"; fi
    done
done
rm -f "$OUT/part.csv"
"$PY" - "$csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print(f"{'budget':<7}{'policy':<21}{'draft':<48}{'slots':>6}{'TPOT ms':>9}{'hit %':>7}{'K':>6}{'off %':>7}{'vs lru':>8}")
for r in rows:
    f = lambda k, s=1.0: f"{float(r[k]) * s:.2f}" if r.get(k) else "-"
    print(f"{r['budget']:<7}{r['policy']:<21}{r['draft']:<48}{r['slots_per_layer']:>6}{f('tpot_ms'):>9}"
          f"{f('hit_rate', 100):>7}{f('mean_k'):>6}{f('draft_off', 100):>7}{f('vs_on_demand_lru'):>8}")
PY
echo "wrote $csv" >&2
