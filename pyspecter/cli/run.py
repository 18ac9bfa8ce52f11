"""generate and chat: a session over the library's placement, printed as text."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from pyspecter.cli.app import app
from pyspecter.cli.options import (
    DEFAULT_MODEL,
    DEFAULT_THREADS,
    AutoTierOpt,
    BudgetOpt,
    CtxOpt,
    DeviceOpt,
    DraftOpt,
    ForceOpt,
    LayerPlanOpt,
    MinPOpt,
    MissOpt,
    ModelArg,
    ProfileOpt,
    RepeatOpt,
    SurrogateOpt,
    ThreadsOpt,
    TopKOpt,
    TopPOpt,
    native_errors_exit,
)
from pyspecter.errors import SpecterError

if TYPE_CHECKING:
    from pyspecter.session import Session

NPredictHelp = "max tokens to generate; 0: none (llama.cpp's 0); -1: until the context is full (llama.cpp's -1)"


def check_n_predict(n: int) -> None:
    if n < -1:
        raise SpecterError(f"-n must be >= 0, or -1 for \"until the context is full\"; got {n}")


def open_session(model: str, *, device: str | None = None, **options: Any) -> Session:
    """``pyspecter.load`` with the session's lines (placement, layer plan, predictor hint, an approximate mode's
    measured cost) printed on stderr as they are decided; bad input is its one-line error."""
    from pyspecter.api import load
    from pyspecter.placement import is_host

    if not is_host(device):
        native_errors_exit()  # an RPC server gone mid-answer: one line and exit code 2, not a core dump
    return load(model, device=device, notify=lambda line: print(f"pyspecter: {line}", file=sys.stderr), **options)


@app.command()
def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="what to ask: sent as one user message through "
                                                               "the model's chat template (see --raw)")],
    model: ModelArg = DEFAULT_MODEL,
    raw: Annotated[bool, typer.Option("--raw", help="continue the prompt as plain text instead (also what a model "
                                                    "without a chat template does)")] = False,
    draft: DraftOpt = None,
    budget: BudgetOpt = None,
    tier: AutoTierOpt = None,
    device: DeviceOpt = None,
    layer_plan: LayerPlanOpt = None,
    miss: MissOpt = None,
    k: Annotated[int, typer.Option("-k", help="draft tokens per step (the start value when adaptive)")] = 4,
    fixed_k: Annotated[bool, typer.Option("--fixed-k", help="do not adapt K")] = False,
    n: Annotated[int, typer.Option("-n", "--n-predict", help=NPredictHelp)] = 128,
    temp: Annotated[float, typer.Option(help="sampling temperature; 0 = greedy")] = 0.0,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    min_p: MinPOpt = None,
    repeat_penalty: RepeatOpt = None,
    seed: Annotated[int, typer.Option(help="sampling seed")] = 0,
    threads: ThreadsOpt = DEFAULT_THREADS,
    ctx_size: CtxOpt = 2048,
    profile: ProfileOpt = None,
    surrogate_width: SurrogateOpt = 0.25,
    force: ForceOpt = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the text and stats as JSON")] = False,
) -> None:
    """Answer a prompt (through expert slots when the model does not fit, speculatively with a draft)."""
    from pyspecter.chat import Streamer
    from pyspecter.prompts import has_chat_template, render_prompt

    check_n_predict(n)
    s = open_session(model, draft=draft, budget=budget, tier=tier, device=device, layer_plan=layer_plan, miss=miss,
                     surrogate_width=surrogate_width, k=k, adaptive=not fixed_k, temperature=temp, top_k=top_k,
                     top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, n_threads=threads,
                     n_ctx=ctx_size, profile=profile, force=force)
    try:
        if raw or not has_chat_template(s.target):
            toks = s.tokenize(prompt)
        else:
            toks = s.tokenize(render_prompt(s.target, [{"role": "user", "content": prompt}]), add_special=False)
        limit = max(ctx_size - len(toks), 0) if n == -1 else n
        stream = None if json_out else Streamer(s.target)
        out = s.generate(toks, limit, on_token=stream)
        st = s.stats()
        if json_out:
            print(json.dumps({"text": s.target.detokenize(out), "tokens": out, "stats": st}, indent=1))
        else:
            print()
            print(stats_line(st), file=sys.stderr)
    finally:
        s.close()


def stats_line(st: dict) -> str:
    """generate's last line and chat's /stats: decode speed, prefill apart (``speed.py``), then the slots
    (``placement.SlotCount``) and what they did."""
    from pyspecter.speed import speed_text

    speed = speed_text(st)
    if st.get("stock"):
        line = f"[{speed} | stock llama.cpp: all {st['n_expert']} experts resident, tier {st['tier']}, no slots"
    elif not st.get("has_slots", True):  # a layer plan of full and host layers: stock's own placement
        line = f"[{speed} | {st['slots_text']}: no slots, nothing moves"
    else:
        line = (f"[{speed} | {st['slots_text']}, tier {st['tier']}, miss {st['miss']} | hit "
                f"{100 * st['hit_rate']:.1f}%, from slots {100 * st['coverage']:.1f}%, uploads {st['uploads']} "
                f"({st['upload_mib']:.1f} MiB), stall {st['stall_ms']:.1f} ms")
    if st.get("surrogate_uses"):
        line += f", {st['surrogate_uses']} misses served by surrogates (approximate)"
    if "acceptance" in st:
        line += (f" | acceptance {100 * st['acceptance']:.0f}%, mean K {st['mean_k']:.2f}, "
                 f"draft off {100 * st['draft_off']:.0f}% of steps")
        if st.get("draft_dropped_at") is not None:
            line += f"; draft dropped at step {st['draft_dropped_at']} (it did not pay), its memory is slots now"
    return line + "]"


@app.command()
def chat(
    model: ModelArg = DEFAULT_MODEL,
    draft: DraftOpt = None,
    budget: BudgetOpt = None,
    tier: AutoTierOpt = None,
    device: DeviceOpt = None,
    layer_plan: LayerPlanOpt = None,
    miss: MissOpt = None,
    k: Annotated[int, typer.Option("-k", help="draft tokens per step (start value)")] = 4,
    n: Annotated[int, typer.Option("-n", "--n-predict", help="max tokens per answer; -1: until the context is "
                                                             "full (llama.cpp's -1)")] = 256,
    temp: Annotated[float, typer.Option(help="sampling temperature; 0 = greedy")] = 0.0,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    min_p: MinPOpt = None,
    repeat_penalty: RepeatOpt = None,
    seed: Annotated[int, typer.Option(help="sampling seed")] = 0,
    system: Annotated[str | None, typer.Option("--system", "-s", help="system prompt")] = None,
    threads: ThreadsOpt = DEFAULT_THREADS,
    ctx_size: CtxOpt = 2048,
    profile: ProfileOpt = None,
    surrogate_width: SurrogateOpt = 0.25,
    force: ForceOpt = False,
) -> None:
    """Chat with a model. /help lists the commands (/stats, /reset, /quit); Ctrl-C stops the current answer."""
    from pyspecter.chat import repl

    check_n_predict(n)
    s = open_session(model, draft=draft, budget=budget, tier=tier, device=device, layer_plan=layer_plan, miss=miss,
                     surrogate_width=surrogate_width, k=k, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                     repeat_penalty=repeat_penalty, seed=seed, n_threads=threads, n_ctx=ctx_size, profile=profile,
                     force=force)
    try:
        repl(s, n=ctx_size if n == -1 else n, system=system, stats_line=stats_line)
    finally:
        s.close()
