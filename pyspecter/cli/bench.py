"""bench: residency policies timed side by side."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from pyspecter.cli.app import app
from pyspecter.cli.options import (
    BENCH_DEFAULTS,
    BENCH_POLICIES,
    DEFAULT_MODEL,
    DEFAULT_THREADS,
    THREADS_HELP,
    DeviceOpt,
    DraftOpt,
    ForcedOpt,
    ForceOpt,
    ModelArg,
    PromptsOpt,
    SurrogateOpt,
    native_errors_exit,
)
from pyspecter.errors import SpecterError
from pyspecter.models.catalog import resolve_model


@app.command()
def bench(
    model: ModelArg = DEFAULT_MODEL,
    tier: Annotated[str | None, typer.Option(help="slow tier: ram, disk, emulated:GBPS; comma-separated to sweep. "
                                                  "Default: with --budget, chosen from the model's size and the "
                                                  "memory available (one line says what and why)")] = None,
    budget: Annotated[str | None, typer.Option(help="fast-tier bytes for expert slots: 64MiB, 1.5GB or 40%; "
                                                    "comma-separated to sweep (30%,50%). Default: what the memory "
                                                    "available holds beside the non-expert weights when the model "
                                                    "does not fit, else 50%")] = None,
    policies: Annotated[str | None, typer.Option(help="comma-separated, from: " + ", ".join(BENCH_POLICIES) +
                                                      " (surrogate is approximate; all-resident holds every "
                                                      "expert and gives the oracle bound; static-hot pins the "
                                                      "experts most used on the packaged calibration prompts, "
                                                      "misses on the CPU; prev-token keeps what the previous token "
                                                      "used, first-in first-out otherwise, misses waited for; "
                                                      "learned-evict evicts by the learned reuse maps, learned "
                                                      "adds the prefetch plan, always on; engine is what "
                                                      "generate runs at this budget; default is what it runs "
                                                      "given no flags: stock llama.cpp when the model fits; "
                                                      "with --device, plan is the layer plan of full, host and "
                                                      "slot layers, plan-mapped the same priced and run with "
                                                      "--miss mapped). "
                                                      "Default: " +
                                                      ", ".join(BENCH_DEFAULTS) + " (+ specter, specter-equal-slots "
                                                      "with --draft)", show_default=False)] = None,
    prompts: PromptsOpt = None,
    prompt_split: Annotated[str | None, typer.Option(
        "--split", help="only the prompts of this split (tune or eval) of --prompts, or of the packaged prompts "
                        "without it: eval is the held-out half, tune the half fit-predictor fits on",
        show_default=False)] = None,
    prompt_tokens: Annotated[int | None, typer.Option(help="prompt length for prefill (default 64 tokens of the "
                                                           "packaged prompts); with --prompts, each prompt is used "
                                                           "whole unless this cuts it to its first N tokens",
                                                      show_default=False)] = None,
    n: Annotated[int, typer.Option("-n", "--n-predict", help="decode tokens after each prompt")] = 32,
    repeat: Annotated[int, typer.Option(help="interleaved repeats of every policy")] = 3,
    threads: Annotated[str, typer.Option("--threads", "-t", help=THREADS_HELP + "; comma-separated to sweep")]
    = str(DEFAULT_THREADS),
    draft: DraftOpt = None,
    k: Annotated[int, typer.Option("-k", help="specter: draft tokens per step (start value)")] = 4,
    fixed_k: Annotated[bool, typer.Option("--fixed-k", help="specter: do not adapt K (e.g. -k 0 --fixed-k: "
                                                            "the draft only predicts experts)")] = False,
    surrogate_width: SurrogateOpt = 0.25,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output (a list when sweeping)")] = False,
    csv_out: Annotated[bool, typer.Option("--csv", help="one CSV row per policy and sweep point, with a header; "
                                                        "each row carries its whole setting")] = False,
    force: ForceOpt = False,
    device: DeviceOpt = None,
    forced: ForcedOpt = None,
) -> None:
    """Time residency policies side by side on one model: same prompts, interleaved repeats, ratios.

    On the disk tier every capped policy runs in a child process whose memory, page cache included, a cgroup
    (v1 or v2) holds to budget + non-expert weights + runtime, starting cold; rows say whether the cap held.
    "ttft s" is load plus the first prompt's prefill: stock's load reads the experts that its prefill then finds
    in the page cache, while the disk tier's load reads none, so prefill alone compares unlike work."""
    import itertools

    from pyspecter.placement import is_host, place
    from pyspecter.study.bench import CSV_FIELDS, run_bench, to_csv_rows

    def split(text: str) -> list[str]:
        return [x.strip() for x in text.split(",") if x.strip()]

    try:
        thread_counts = [int(x) for x in split(threads)]
    except ValueError:
        raise SpecterError(f"--threads takes integers, got {threads!r}") from None
    if prompts is not None or prompt_split is not None:  # a bad prompt file is one line, before any loading
        from pyspecter.prompts import load_prompts

        load_prompts(prompts, prompt_split)
    unknown = [p for p in split(policies or "") if p not in BENCH_POLICIES]
    if unknown:
        raise SpecterError(f"unknown policy {unknown[0]!r}: use {', '.join(BENCH_POLICIES)}")
    for name, value in (("-n", n), ("--repeat", repeat), ("--prompt-tokens", prompt_tokens or 1),
                        *(("--threads", t) for t in thread_counts)):
        if value < 1:
            raise SpecterError(f"{name} must be at least 1, got {value}")
    path, dpath = resolve_model(model), resolve_model(draft) if draft else None
    if not is_host(device):
        native_errors_exit()
    # every point of a sweep placed (and checked) before the first one runs
    points = [place(path, tier=t, budget=b, device=device, force=force, partial="50%")
              for t in (split(tier) if tier else [None]) for b in (split(budget) if budget else [None])]
    for p in points:
        if p.why:
            print(f"pyspecter: {p.why}", file=sys.stderr)
    results = []
    for p, th in itertools.product(points, thread_counts):
        results.append(run_bench(path, tier=p.tier, budget=p.budget, policies=split(policies or "") or None,
                                 prompt_len=prompt_tokens, n=n, repeat=repeat, n_threads=th, draft=dpath, k=k,
                                 adaptive=not fixed_k, surrogate_width=surrogate_width,
                                 prompts=prompts, split=prompt_split, device=p.device, forced=forced,
                                 progress=progress_printer()))
        if not (json_out or csv_out):
            _print_bench(results[-1])
    if json_out:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=1))
    elif csv_out:
        import csv

        w = csv.DictWriter(sys.stdout, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in results:
            w.writerows(to_csv_rows(r))


def progress_printer(stream=None, width: int = 24):
    """Progress on stderr: a bar rewritten in place on a terminal, a plain line per step when piped."""
    stream = stream or sys.stderr
    tty = stream.isatty()

    def show(what: str, done: int, total: int) -> None:
        if total == 0:
            line = f"bench: {what} ..."
        else:
            fill = width * done // total
            line = f"bench: [{'#' * fill}{'.' * (width - fill)}] {done}/{total} " + (
                "runs done" if done == total else f"running {what}")
        if tty:
            end = "\n" if total and done == total else ""
            stream.write("\r\033[K" + line + end)
        else:
            stream.write(line + "\n")
        stream.flush()

    return show


_COLUMNS = {"tpot_mean_ms": "mean ms", "prefill_tok_s": "prefill/s", "cold_ttft_s": "ttft s", "hit_rate": "hit%",
            "vs_on_demand_lru": "vs lru", "vs_all_resident": "vs all", "slots_mean": "slots"}


def _why_na(name: str, p: dict, key: str) -> str:
    col = _COLUMNS.get(key, key)
    if p.get("computed"):
        return f"{name}: {col} — a bound computed from the recorded routing, not a run"
    if key == "vs_on_demand_lru":
        return "vs lru — on-demand-lru was not among the policies"
    if key == "vs_all_resident":
        return "vs all — all-resident was not among the policies (--policies ...,all-resident)"
    if key == "slots_mean" and name.startswith("stock"):
        return "slots — stock llama.cpp runs without slots"
    return f"{name}: {col} — not measured by this policy"


def _prompt_desc(r: dict) -> str:
    if not r.get("prompts"):
        return f"{r['prompt_tokens']}-token prompt"
    of = f"the {r['split']} split of " if r.get("split") else ""
    return f"{r['n_prompts']} prompts of {of}{Path(r['prompts']).name} ({r['prompt_tokens']} tokens)"


def _mode(p: dict) -> str:
    """A row's decode mode, and whether it kept to stock's output (tokens free, logits teacher-forced)."""
    if p.get("computed"):
        return ""
    mode = "forced" if p.get("decode") == "teacher-forced" else "free"
    same = p.get("same_logits_as_stock") if mode == "forced" else p.get("same_tokens_as_stock")
    return mode + {True: "", False: " (differs from stock)", None: ""}[same]


def _draft_desc(p: dict) -> str:
    """What the draft did in each repeat: its tokens, its drop, its routing's prefetches."""
    out = []
    for i in range(len(p["drafted"])):
        v = {key: p[key][i] for key in ("drafted", "accepted", "draft_dropped_at", "draft_prefetches",
                                       "draft_prefetch_bytes", "draft_prefetches_used", "draft_prefetches_scored",
                                       "draft_prefetch_stopped_at")}
        used, scored = v["draft_prefetches_used"], v["draft_prefetches_scored"]
        out.append(f"{v['accepted']}/{v['drafted']} drafts accepted, "
                   + (f"dropped at step {v['draft_dropped_at']}" if v["draft_dropped_at"] is not None
                      else "not dropped")
                   + f"; prefetches {v['draft_prefetches']} ({v['draft_prefetch_bytes'] / 2**20:.0f} MiB), used "
                   + (f"{used} ({100 * used / scored:.0f}% of {scored} checked)" if scored else "unchecked")
                   + (f", cut off at step {v['draft_prefetch_stopped_at']}"
                      if v["draft_prefetch_stopped_at"] is not None else ""))
    return "; ".join(f"repeat {i + 1}: {d}" for i, d in enumerate(out)) if len(out) > 1 else out[0]


def _slots_desc(r: dict) -> str:
    """What the budget buys: the baselines' slots, and generate's (the engine's) where they differ."""
    base = r.get("slots") or f"{r['slots_per_layer']}/{r['n_expert']} slots per layer"
    engine = r.get("engine_slots")
    return base if engine in (None, base) else f"the baselines {base}, generate (the engine) {engine}"


def _print_bench(r: dict) -> None:
    on = f" on {r['device']}" if r.get("device", "CPU") != "CPU" else ""
    print(f"{Path(r['model']).name}: {r['arch']}{on}, tier {r['tier']}{' (emulated)' if r['emulated'] else ''}, "
          f"budget {r['budget']}: {_slots_desc(r)}; link "
          f"{r['link_gbps']:.2f} GB/s, {r['n_threads']} threads, {_prompt_desc(r)}, "
          f"{r['decode_tokens']} decode tokens x {r['repeat']} ({r.get('decode', 'free')}); "
          f"memory: {r['memory_cap']}")
    # tok/s: decode tokens over decode time (speed.py), TPOT its median token; prefill/s and ttft apart
    print(f"{'policy':<22}{'TPOT ms':>9}{'mean ms':>9}{'tok/s':>9}{'prefill/s':>10}{'ttft s':>8}{'hit%':>7}"
          f"{'KiB/tok':>9}{'stall ms':>9}{'hook us':>8}{'vs lru':>8}{'vs all':>8}{'slots':>7}  decode")
    notes: dict[str, str] = {}

    def cell(name: str, p: dict, key: str, fmt: str, width: int, scale: float = 1.0) -> str:
        v = p.get(key)
        if v is None or v != v:  # missing, or NaN: say n/a, and why under the table
            notes.setdefault(key, _why_na(name, p, key))
            return f"{'n/a':>{width}}"
        return f"{scale * v:>{width}{fmt}}"

    for name, p in r["policies"].items():
        if "skipped" in p:
            print(f"{name:<22} skipped: {p['skipped']}")
            continue
        print(f"{name:<22}" + "".join(cell(name, p, *c) for c in (
            ("tpot_ms", ".2f", 9), ("tpot_mean_ms", ".2f", 9), ("decode_tok_s", ".1f", 9),
            ("prefill_tok_s", ".1f", 10), ("cold_ttft_s", ".2f", 8), ("hit_rate", ".1f", 7, 100),
            ("bytes_per_token", ".1f", 9, 1 / 1024), ("stall_ms_per_token", ".2f", 9), ("hook_us_per_call", ".1f", 8),
            ("vs_on_demand_lru", ".2f", 8), ("vs_all_resident", ".2f", 8), ("slots_mean", ".2f", 7))) + f"  {_mode(p)}")
    for why in dict.fromkeys(notes.values()):
        print(f"  n/a: {why}")
    for name, p in r["policies"].items():
        if name.startswith("specter") and "drafted" in p:
            print(f"{name}: {_draft_desc(p)}")
    if "round_trip_us_per_layer" in r:
        print(f"routing round trip (all-resident vs stock-device, per MoE layer): "
              f"{r['round_trip_us_per_layer']:.1f} us")
