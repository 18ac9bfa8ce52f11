"""The GPU speed benchmark of issue 42, in one command sized for a 15-minute device lease (tools/gpu_check.sh runs it
as its last step; it runs alone as well).

    python tools/gpu_bench.py                      # big-qwen3moe-q4 on cuda0 at 8 GiB and 16 GiB of experts in VRAM
    python tools/gpu_bench.py --model bench-qwen3moe --device rpc:127.0.0.1:50052 --budgets 25%,50%   # the dry run

What it does, each step bounded by --until (an epoch second: the lease's end, less the time to bring results back):
  1. builds the model (``pyspecter models build``: big-qwen3moe-q4 is Qwen3-30B-A3B's shapes with random Q4_0
     experts, about 17 GB, streamed to the model cache; a cached build is reused);
  2. per budget, one ``pyspecter bench --device --json`` of the rows: stock --n-cpu-moe N at equal VRAM (N chosen
     by bench to match, shown), stock --cpu-moe, the layer plan, the layer plan priced and run with --miss mapped,
     the engine, on-demand-mapped (and stock-device once, the floor of host synchronisations every graph has),
     teacher-forced on real text, one run each;
  3. a markdown table (ms per token, host switches per MoE layer from llama.cpp's split count and the
     synchronisations counted as the scheduler ran, upload GB/s over the token and while copying beside the
     link measured at start, hit rate, the cost model's prediction) to OUT/gpu_bench.md, ready for
     docs/BENCHMARKS.md, and everything to
     OUT/gpu_bench.json (--json: printed too).

The time guard: the first budget runs if --min-first-s are left; each later one only if what is left exceeds the
first one's own measured time (model load, link, cost measurement and rows) by a margin, else its rows are a
skip that says how long the first took and how long was left. Bench saves the cost model's costs refitted to its
stock rows (devcosts.json), so a later budget's plan is chosen from the first one's measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

POLICIES = ("stock-n-cpu-moe", "stock-cpu-moe", "plan", "plan-mapped", "engine", "on-demand-mapped")
FLOOR = "stock-device"  # every layer on the device: the host synchronisations any graph has; run once
MARGIN = 1.15  # a later budget's rows must fit in what is left with this much to spare over the first's time


def last_json(text: str) -> dict:
    """The last JSON object a command printed at the start of a line, among whatever else it wrote."""
    dec, found = json.JSONDecoder(), None
    for i in [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]:
        if text.startswith("{", i):
            try:
                found = dec.raw_decode(text, i)[0]
            except ValueError:
                continue
    if found is None:
        raise ValueError("no JSON object in the output")
    return found


def run(cmd: list[str], until: float, cap: float) -> tuple[int, str, float]:
    """(exit code, output, seconds) of cmd, killed at min(cap, until - now) seconds (exit 124 then)."""
    left = min(cap, until - time.time())
    if left < 5:
        return 125, "not run: out of time", 0.0
    t0 = time.time()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=left)
        return p.returncode, p.stdout, time.time() - t0
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\ntimed out after {left:.0f}s", time.time() - t0


def cause(out: str) -> str:
    """A failed step's cause in a line: a traceback's exception line, else the last non-empty line."""
    lines = [ln for ln in out.splitlines() if ln.strip()]
    tb = [i for i, ln in enumerate(lines) if ln.startswith("Traceback")]
    if tb:
        exc = next((ln for ln in lines[tb[-1] + 1:] if not ln.startswith(" ")), None)
        if exc:
            return exc[:240]
    return lines[-1][:240] if lines else "(no output)"


def _spec(r: dict) -> str:
    """A slot row's speculated ubatches per token and the share redone, after its hit rate (where any ran)."""
    spec = r.get("speculated_per_token")
    if not spec:
        return ""
    out = f", speculated {spec:.2f}/token, {(r.get('redone_per_token') or 0.0) / spec:.0%} redone"
    if r.get("table_kb_per_token"):  # the fence's synchronous copy of the remap tables, before each ubatch
        out += f", tables {r['table_kb_per_token']:.0f} KiB/token"
    return out


def _zero(bench: dict) -> str:
    """What a slot row's misses read: negative ids (CUDA: patch 0008), or zero slots beside the slots."""
    z = bench.get("zero_slots")
    return "misses as ?" if z is None else "misses as negative ids" if z == 0 else f"{z} zero slots a slot layer"


def _ms(ns: float | None) -> float | None:
    return ns / 1e6 if ns is not None else None


def _f(x: object, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


ROW_NAMES = {"stock-n-cpu-moe": "stock `--n-cpu-moe {n}` (equal VRAM)", "stock-cpu-moe": "stock `--cpu-moe`",
             "plan": "ours, the layer plan ({plan})", "engine": "ours, the engine{miss}", "stock-device":
             "stock, every expert on the device (the floor)",
             "on-demand-mapped": "ours, LRU, misses read by the GPU from pinned host memory (`--miss mapped`)",
             "plan-mapped": "ours, the layer plan priced and run with `--miss mapped` ({mapped_plan})"}


def rows(bench: dict) -> list[dict]:
    """One row per policy of one bench JSON, with the columns of the table."""
    pol, lp = bench["policies"], bench.get("layer_plan") or {}
    ref = pol.get("stock-n-cpu-moe", {}).get("tpot_ms")
    link = bench.get("link_gbps")
    out = []
    for name in (*POLICIES, FLOOR):
        p = pol.get(name)
        if p is None:
            continue
        # the engine's miss mode: its own choice given no --miss (mapped where the plan predicts it faster)
        miss = f" (`--miss {p['miss']}`)" if p.get("miss") else ""
        label = ROW_NAMES[name].format(n=p.get("n_cpu_moe", "?"), plan=lp.get("plan", "?"), miss=miss,
                                       mapped_plan=(bench.get("layer_plan_mapped") or {}).get("plan", "?"))
        if p.get("mapped_copy_mb"):  # not a GPU's pinned memory: a copy on the device (RPC) stood in for it
            label += f", a {p['mapped_copy_mb']:.0f} MiB device copy standing in"
        if "tpot_ms" not in p:
            out.append({"policy": name, "row": label, "skipped": str(p.get("skipped", "no result"))})
            continue
        tpot = p["tpot_ms"]
        out.append({
            "policy": name, "row": label, "ms_per_token": tpot, "vs_stock_n_cpu_moe": tpot / ref if ref else None,
            # the prompts' prefill (with --miss mapped a prompt ubatch's misses are read from the host copy too)
            "prefill_tok_s": p.get("prefill_tok_s"),
            "switches_per_moe_layer": p.get("host_switches_per_moe_layer"),
            "switches_taken_per_moe_layer": p.get("switches_taken_per_moe_layer"),
            "host_syncs_per_token": p.get("host_syncs_per_token"),
            "host_syncs_per_moe_layer": p.get("host_syncs_per_moe_layer"),
            # where the token's time went on the decoding thread (bench's device columns): waiting for the device,
            # computing the host's splits, launching the device's
            "host_wait_ms": p.get("host_wait_ms_per_token"), "host_split_ms": p.get("host_split_ms_per_token"),
            "device_launch_ms": p.get("device_launch_ms_per_token"),
            # ... and after a speculated ubatch, residency's bookkeeping from the log (the device idle meanwhile)
            "host_settle_ms": p.get("host_settle_ms_per_token"),
            # ggml-cuda's CUDA graphs a token: captured, and dropped because a node changed (then launched op by op)
            "cuda_graph_warmups_per_token": p.get("cuda_graph_warmups_per_token"),
            "cuda_graph_resets_per_token": p.get("cuda_graph_resets_per_token"),
            # what a token moved over its own time: the issue's "effective" rate (58.8 MB in an 11.8 ms token)
            "upload_gbps": p["bytes_per_token"] / (tpot * 1e6) if p.get("bytes_per_token") else 0.0,
            # ... and the copies' own rate (bytes over the time some batch was in flight, first copy to landing): near
            # the link's, the uploads are fine and the token's time went elsewhere; far below it, the copies
            # themselves are slow; and the most batches one stream held in flight at once (1: no overlap)
            "upload_busy_gbps": p.get("upload_busy_gbps"), "upload_inflight_peak": p.get("upload_inflight_peak"),
            # the upload threads waiting for batches to land, ms a token, and their CPU time in it: near the wall
            # time, a core spun (CUDA's default events) that the CPU's compute threads may have wanted
            "landing_wait_ms": _ms(p.get("landing_wait_ns_per_token")),
            "landing_wait_cpu_ms": _ms(p.get("landing_wait_cpu_ns_per_token")),
            # upload batches a token that first waited for the device's queued compute (a slot queued work may
            # still read): each may wait for a whole ubatch queued meanwhile
            "ordered_per_token": p.get("compute_orders_per_token"),
            # stock's rows have no slots: a hit rate would say nothing
            "link_gbps": link, "hit_rate": None if name.startswith("stock") else p.get("hit_rate"),
            # ubatches per token run with no host visit at all (speculated to hit), and those a miss ran again
            "speculated_per_token": p.get("spec_ubatches_per_token"), "redone_per_token": p.get("spec_redos_per_token"),
            # rows the device read from the host copy (--miss mapped), and device memory a copy of it took (0 on CUDA)
            "mapped_rows_per_token": p.get("mapped_rows_per_token"), "mapped_copy_mb": p.get("mapped_copy_mb"),
            # the remap tables' bytes a token, pushed by the fence before a ubatch (one synchronous copy)
            "table_kb_per_token": (p["table_bytes_per_token"] / 1024 if p.get("table_bytes_per_token") is not None
                                   else None),
            "predicted_ms": p.get("predicted_ms"), "predicted_calibrated_ms": p.get("predicted_calibrated_ms"),
            "same_logits_as_stock": p.get("same_logits_as_stock"),
        })
    return out


def floor_from(path: Path | None, arch: str | None = None) -> float | None:
    """stock-device's host synchronisations per token from another bench's JSON (gpu_check's bench of
    bench-qwen3moe), where it ran on the same architecture: a graph with every layer on the device has two splits
    whatever its size, and its waits come from its inputs and its logits, which the architecture fixes."""
    if path is None or not path.exists():
        return None
    try:
        b = last_json(path.read_text())
    except ValueError:
        return None
    if arch is not None and b.get("arch") != arch:
        return None
    return b.get("policies", {}).get(FLOOR, {}).get("host_syncs_per_token")


def floor_syncs(sets: list[dict], ref: float | None = None) -> None:
    """Every budget's rows get their host synchronisations per MoE layer over the floor: ``ref`` (another run's
    stock-device) or the floor row this run benched once, at its first budget (bench does this within a run)."""
    if ref is None:
        ref = next((r["host_syncs_per_token"] for s in sets for r in s.get("rows", [])
                    if r["policy"] == FLOOR and r.get("host_syncs_per_token") is not None), None)
    if ref is None:
        return
    for s in sets:
        n_moe = s.get("n_moe_layers") or 0
        for r in s.get("rows", []):
            if r.get("host_syncs_per_token") is not None and n_moe:
                r["host_syncs_per_moe_layer"] = (r["host_syncs_per_token"] - ref) / n_moe


def markdown(report: dict) -> str:
    lines = [f"**{report['model']}** on {report['device']} ({report['machine']}), {report['date']}; "
             f"{report['n_threads']} host threads, teacher-forced real text, {report['n']} tokens after a "
             f"{report['prompt_tokens']}-token prompt, one run per row; model built in {report['model_s']:.0f} s.",
             "",
             "| VRAM for experts | placement | ms per token | ÷ stock `--n-cpu-moe` | prefill tok/s "
             "| host switches per MoE layer "
             "(splits / taken) | host syncs per MoE layer (counted, over the floor) | ms per token: host waits / "
             "CPU splits / device launches / settling | upload GB/s: over the token / while copying (link); most "
             "batches in flight, batches a token behind the device's compute | hit rate "
             "| predicted ms (measured costs / refitted) "
             "| logits bit-equal to stock `--cpu-moe`'s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["sets"]:
        if "skipped" in s:
            lines.append(f"| {s['budget']} | skipped: {s['skipped']} | | | | | | | | | | |")
            continue
        for r in s["rows"]:
            if "skipped" in r:
                lines.append(f"| {s['budget']} | {r['row']} | skipped: {r['skipped'][:80]} | | | | | | | | | |")
                continue
            same = r["same_logits_as_stock"]
            lines.append(
                f"| {s['budget']} | {r['row']} | {r['ms_per_token']:.2f} | {_f(r['vs_stock_n_cpu_moe'], '.2f')} "
                f"| {_f(r.get('prefill_tok_s'), '.0f')} "
                f"| {_f(r['switches_per_moe_layer'], '.2f')} / {_f(r['switches_taken_per_moe_layer'], '.2f')} "
                f"| {_f(r['host_syncs_per_moe_layer'], '.2f')} "
                f"| {_f(r.get('host_wait_ms'), '.2f')} / {_f(r.get('host_split_ms'), '.2f')} / "
                f"{_f(r.get('device_launch_ms'), '.2f')} / {_f(r.get('host_settle_ms'), '.2f')} "
                f"| {r['upload_gbps']:.2f} / {_f(r.get('upload_busy_gbps'), '.2f')} ({_f(r['link_gbps'], '.1f')}); "
                f"{r.get('upload_inflight_peak') or '-'}, {_f(r.get('ordered_per_token'), '.1f')} "
                f"| {_f(r['hit_rate'], '.1%')}{_spec(r)} "
                f"| {_f(r['predicted_ms'], '.2f')} / {_f(r['predicted_calibrated_ms'], '.2f')} "
                f"| {'-' if same is None else 'yes' if same else 'NO'} |")
    lines += ["", "- on a GPU, placements that compute a layer's experts on different sides differ in the last bits "
              "(stock's own do): exactness there is verify's contract (gpu_check steps 4 and 5), not this column"]
    if report.get("notes"):
        lines += [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def machine() -> str:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        gpu = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else "no GPU"
    except (OSError, subprocess.TimeoutExpired):
        gpu = "no GPU"
    return f"{gpu}; {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="big-qwen3moe-q4", help="a built-in model name (default %(default)s)")
    ap.add_argument("--device", default="cuda0", help="the device bench puts layers and slots on (%(default)s)")
    ap.add_argument("--budgets", default="8GiB,16GiB",
                    help="device memory for experts, comma-separated, in the order they run (%(default)s)")
    ap.add_argument("--until", type=float, default=None,
                    help="epoch second by which everything must be done (default: now + 600)")
    ap.add_argument("--min-first-s", type=float, default=90.0,
                    help="seconds the first budget needs at least, or nothing is benched (%(default)s)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/gpu_check")),
                    help="folder for gpu_bench.md, gpu_bench.json and each bench's output (%(default)s)")
    ap.add_argument("-n", type=int, default=16, help="decode tokens per row (%(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens (%(default)s)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="host threads (%(default)s)")
    ap.add_argument("--floor-from", type=Path, default=None,
                    help="a bench JSON of the same architecture whose stock-device row gives the floor of host "
                         "syncs (gpu_check passes its bench of bench-qwen3moe); else stock-device is benched once")
    ap.add_argument("--no-mapped", action="store_true",
                    help="leave out the on-demand-mapped row (gpu_check: its verify cases failed on this GPU)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON too")
    a = ap.parse_args(argv)
    budgets = [b.strip() for b in a.budgets.split(",") if b.strip()]
    if not budgets or a.n < 1 or a.prompt_tokens < 1 or a.threads < 1:
        print("gpu_bench: --budgets needs one budget at least; -n, --prompt-tokens and --threads at least 1",
              file=sys.stderr)
        return 2
    until = a.until if a.until is not None else time.time() + 600
    a.out.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m", "pyspecter"]
    report: dict = {"model": a.model, "device": a.device, "machine": machine(), "date": time.strftime("%Y-%m-%d"),
                    "n_threads": a.threads, "n": a.n, "prompt_tokens": a.prompt_tokens, "sets": [], "notes": []}

    def say(msg: str) -> None:
        print(f"[gpu_bench {time.strftime('%H:%M:%S')}, {until - time.time():.0f}s left] {msg}", file=sys.stderr,
              flush=True)

    left = until - time.time()
    if left < a.min_first_s:  # not even the first budget would fit after the model: build nothing
        rc, out, secs = 125, f"{left:.0f}s left, {a.min_first_s:.0f}s needed at least", 0.0
        report["sets"] = [{"budget": b, "skipped": f"out of time ({out})"} for b in budgets]
    else:
        say(f"building {a.model}")
        rc, out, secs = run([*py, "models", "build", a.model], until, left - a.min_first_s)
        (a.out / "gpu_bench_model.txt").write_text(out)
    report["model_s"] = secs
    if rc not in (0, 125):
        report["notes"].append(f"{a.model} not built (exit {rc} after {secs:.0f}s): {cause(out)}")
        report["sets"] = [{"budget": b, "skipped": "no model"} for b in budgets]
    from pyspecter.models.big import BIG_MODELS
    from pyspecter.models.tiny import BENCH_MODELS, TINY_MODELS
    spec = (BIG_MODELS | BENCH_MODELS | TINY_MODELS).get(a.model)
    floor = floor_from(a.floor_from, spec.arch if spec else None)
    if floor is not None:
        report["notes"].append(f"floor of host syncs: {floor:.1f} per token, stock-device's in {a.floor_from} "
                               "(same architecture)")
    first_s = None
    for i, budget in enumerate(budgets):
        if rc != 0:
            break
        left = until - time.time()
        need = a.min_first_s if first_s is None else MARGIN * first_s
        if left < need:
            why = (f"{left:.0f}s left, the first budget's rows took {first_s:.0f}s" if first_s is not None
                   else f"{left:.0f}s left, {a.min_first_s:.0f}s needed at least")
            report["sets"].append({"budget": budget, "skipped": f"out of time ({why})"})
            say(f"{budget}: skipped ({why})")
            continue
        pols = [*(p for p in POLICIES if not (a.no_mapped and p.endswith("-mapped"))),
                *([FLOOR] if i == 0 and floor is None else [])]
        say(f"{budget}: bench {','.join(pols)}")
        brc, bout, bsecs = run([*py, "bench", a.model, "--device", a.device, "--budget", budget, "--policies",
                                ",".join(pols), "--repeat", "1", "-n", str(a.n), "--prompt-tokens",
                                str(a.prompt_tokens), "--threads", str(a.threads), "--teacher-forced", "--json"],
                               until, left)
        (a.out / f"gpu_bench_{budget.replace('%', 'pct')}.txt").write_text(bout)
        first_s = bsecs if first_s is None else first_s
        try:
            b = last_json(bout)
        except ValueError:
            report["sets"].append({"budget": budget, "skipped": f"bench failed (exit {brc} after {bsecs:.0f}s): "
                                                                 f"{cause(bout)}"})
            continue
        report["sets"].append({"budget": budget, "seconds": bsecs, "budget_bytes": b.get("budget_bytes"),
                               "budget_pct": b.get("budget_pct"), "link_gbps": b.get("link_gbps"),
                               "n_moe_layers": b.get("n_moe_layers"), "layer_plan": b.get("layer_plan"),
                               "rows": rows(b), "bench": b})
        lp, lpm = b.get("layer_plan") or {}, b.get("layer_plan_mapped") or {}
        report["notes"].append(
            f"{budget} ({_f(b.get('budget_pct'), '.0f')}% of the experts): link {_f(b.get('link_gbps'), '.1f')} GB/s "
            f"measured at start; {b.get('slots', '-')}, {_zero(b)}; plan {lp.get('plan', '-')} from costs "
            f"{lp.get('cost_source', '-')}; mapped plan {lpm.get('plan', '-')}, its slots predicted to hit "
            f"{_f(lpm.get('hit_rate'), '.0%')} (calibration text); "
            f"refitted {json.dumps({k: round(v, 2) for k, v in (lp.get('calibrated') or {}).items()})}; "
            f"a row read from the host copy {_f(lp.get('map_row_us'), '.1f')} us, share of an upload's time a mapped "
            f"token waits for {_f(lp.get('upload_share'), '.2f')}; "
            f"bench took {bsecs:.0f}s")
    floor_syncs(report["sets"], floor)
    text = markdown(report)
    (a.out / "gpu_bench.md").write_text(text)
    (a.out / "gpu_bench.json").write_text(json.dumps(report, indent=1))
    print(text)
    if a.json:
        print(json.dumps(report, indent=1))
    # a budget the time guard skipped is not a failure; a run with no rows at all is
    return 0 if any("rows" in s for s in report["sets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
