"""trace, analyze and fit-predictor: the offline study of expert routing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pyspecter.cli.app import app
from pyspecter.cli.options import DEFAULT_MODEL, DEFAULT_THREADS, JsonOpt, ModelArg, ThreadsOpt
from pyspecter.errors import SpecterError
from pyspecter.models.catalog import resolve_model
from pyspecter.units import fmt_size


@app.command()
def trace(
    out: Annotated[Path, typer.Option("--out", "-o", help="trace file to write (.npz)")],
    model: ModelArg = DEFAULT_MODEL,
    draft: Annotated[str | None, typer.Option(help="draft GGUF: also record its routing")] = None,
    prompts: Annotated[Path | None, typer.Option(help="your prompts: a text file, one prompt a line, or JSONL "
                                                       "(objects with \"prompt\", \"text\" or \"messages\", or "
                                                       "JSON strings; chosen per file). Default: the packaged eval "
                                                       "set", show_default=False)] = None,
    n: Annotated[int, typer.Option("-n", help="tokens generated per prompt")] = 32,
    k: Annotated[int, typer.Option("-k", help="draft lookahead (tokens drafted ahead)")] = 4,
    threads: ThreadsOpt = DEFAULT_THREADS,
    json_out: JsonOpt = False,
) -> None:
    """Record per-token, per-layer routing of the target (and of the draft, on the same and on its own tokens)."""
    from pyspecter.study.trace import record_trace

    summary = record_trace(resolve_model(model), out, draft_path=resolve_model(draft) if draft else None,
                           prompts=prompts, n=n, k=k, n_threads=threads)
    print(json.dumps(summary, indent=1) if json_out else trace_summary(summary))


def trace_summary(s: dict) -> str:
    """What `trace` recorded, in a few lines (the whole summary, with the router check's details, is --json's)."""
    out = Path(s["out"])
    lines = [f"trace: {s['rows']} rows from {s['prompts']} prompts, {s['moe_layers']} MoE layers, top-"
             f"{s['n_expert_used']} of {s['n_expert']} experts, in {s['seconds']:.1f} s: {out} "
             f"({fmt_size(s['bytes'])})"]
    if s.get("draft"):
        acc = s.get("acceptance_at") or {}
        at = ", ".join("n/a" if v is None else f"{v:.0%}" for v in acc.values())
        lines.append(f"draft: {Path(s['draft']).name}, k={s['k']}; acceptance at 1..{len(acc)} tokens ahead: {at}")
    gate = s.get("gate_lookahead") or {}
    if gate.get("layers"):
        lines.append(f"router look-ahead: {gate['layers']} MoE layers")
    elif gate.get("note"):
        lines.append(f"router look-ahead: none ({gate['note']})")
    lines.append(f"next: pyspecter analyze {out}")
    return "\n".join(lines)


@app.command()
def analyze(
    trace_file: Annotated[Path, typer.Argument(help="trace written by `pyspecter trace`")],
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    plot: Annotated[Path | None, typer.Option(help="directory for PNG plots (heatmap, hit-rate curves)")] = None,
    predictor: Annotated[Path | None, typer.Option(help="learned predictor file to score (default: the sidecar "
                                                        "fitted for the trace's model, when there is one)")] = None,
) -> None:
    """How predictable is expert use: frequencies, reuse, LRU/LFU/MIN hit rates vs slots, predictor recall."""
    from pyspecter.study import analyze as an

    if not trace_file.exists():
        raise SpecterError(f"{trace_file}: no such file")
    if predictor is not None and not predictor.is_file():
        raise SpecterError(f"{predictor}: no such file")
    result = an.analyze(trace_file, plot_dir=plot, predictor=predictor)
    print(an.dumps(result) if json_out else an.format_analysis(result))


@app.command("fit-predictor")
def fit_predictor(
    model: ModelArg = DEFAULT_MODEL,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="predictor file to write (default: the model's "
                                                                 "sidecar in the cache, which the runtime loads "
                                                                 "automatically)")] = None,
    horizons: Annotated[int, typer.Option(help="MoE layers ahead to predict (1..H)")] = 4,
    tokens: Annotated[int, typer.Option(help="tokens of calibration text (the model's own continuations of the "
                                             "calibration prompts) to fit on; held-out recall still grows "
                                             "about a point per doubling at 12000 on smol-moe")] = 12000,
    eval_tokens: Annotated[int, typer.Option("--eval-tokens", help="held-out tokens (other text) to score on")]
    = 2048,
    rank: Annotated[int, typer.Option(help="0: full-rank maps; r > 0: each layer's maps to its next H layers "
                                           "share a rank-r factor (two matmuls d->r->H*experts: fewer bytes and "
                                           "microseconds on wide models, a little recall)")] = 0,
    threads: ThreadsOpt = 1,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Fit learned routing predictors: from each MoE layer's router input, ridge maps to the router logits of the
    next H MoE layers (prefetch), and to how soon each of the layer's own experts is used again (eviction),
    recorded through llama.cpp on calibration text and fitted in numpy; scored on held-out text (recall, and
    misses of eviction by the maps against LRU and Belady's MIN). Recording runs the model token by token (one
    thread by default: the hooks call Python at every layer, and more threads spin meanwhile)."""
    from pyspecter.study.predictor_fit import describe, fit_model

    r = fit_model(resolve_model(model, predictor=False), out, horizons=horizons, n_tokens=tokens,
                  eval_tokens=eval_tokens, n_threads=threads, progress=True, rank=rank)
    print(json.dumps(r, indent=1) if json_out else describe(r))
