"""verify, scale, surrogate and demo: measurements that compare against stock llama.cpp."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from pyspecter.cli.app import app
from pyspecter.cli.options import (
    DEFAULT_MODEL,
    DEFAULT_THREADS,
    DeviceOpt,
    ForcedOpt,
    MissOpt,
    ModelArg,
    ThreadsOpt,
    TierOpt,
    fmt_bytes,
    native_errors_exit,
)
from pyspecter.errors import SpecterError
from pyspecter.models.catalog import is_builtin, resolve_model


@app.command()
def surrogate(
    model: ModelArg = DEFAULT_MODEL,
    width: Annotated[float, typer.Option(help="fraction of each expert's neurons its surrogate keeps")] = 0.25,
    budget: Annotated[str, typer.Option(help="fast-tier bytes (slots + surrogates), e.g. 50% or 256MiB")] = "50%",
    tier: TierOpt = "ram",
    eval_tokens: Annotated[int, typer.Option("--eval-tokens", help="held-out tokens to score")] = 256,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Measure what --miss surrogate costs in quality: perplexity on held-out text, exact misses vs surrogate
    misses, at the slots a budget leaves once the surrogates are paid for."""
    from pyspecter.quality import describe
    from pyspecter.study.quality import measure

    if not 0 < width <= 1:
        raise SpecterError(f"--width must be in (0, 1], got {width}")
    r = measure(resolve_model(model), width, budget, tier, n_tokens=eval_tokens)
    print(json.dumps(r, indent=1) if json_out else describe(r))


@app.command()
def verify(
    model: ModelArg = DEFAULT_MODEL,
    slots: Annotated[int | None, typer.Option(help="expert slots per MoE layer (>= top-k); this or --budget",
                                              show_default=False)] = None,
    budget: Annotated[str | None, typer.Option(help="instead of --slots: fast-tier bytes, e.g. 64MiB or 40%")] = None,
    miss: MissOpt = None,
    tier: Annotated[str, typer.Option(help="slow tier: ram, disk, emulated:GBPS")] = "ram",
    device: DeviceOpt = None,
    policy: Annotated[str, typer.Option(help="eviction policy: lru, lfu or prev-token")] = "lru",
    n: Annotated[int, typer.Option("-n", "--n-predict", help="tokens to generate")] = 16,
    prompt: Annotated[str | None, typer.Option(help="prompt text")] = None,
    forced: Annotated[bool, typer.Option("--forced", help="feed every run the same held-out text after the prompt "
                                         "(teacher forcing) instead of its greedy picks, and compare the logits "
                                         "at every step: for random-weight models, whose greedy text cycles")]
    = False,
    hot: Annotated[bool, typer.Option("--hot", help="instead of --policy: the slots hold the model's hot set (its "
                                      "most used experts on packaged chat prompts), no residency engine, "
                                      "re-chosen from the text's own routing every 16 tokens, as a layer plan's "
                                      "hot slot layers run")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Run one prompt through stock llama.cpp and through expert slots; compare greedy tokens and logits.

    On the CPU, stock with the same placement is the reference: exits 1 if the tokens differ or logits move by
    more than 1e-4. On a device no bit-exact reference exists once misses run on the CPU, so the contract is:
    never a NaN or an inf; with a slot for every expert (all uploaded before the prompt), stock with every expert
    on the device to the bit; with misses, no further from stock-device than stock's own --cpu-moe run is, measured
    in the same run. Exits 1 if it is broken."""
    from pyspecter.layout import read_layout
    from pyspecter.placement import uniform_slots
    from pyspecter.study.verify import DEFAULT_PROMPT
    from pyspecter.study.verify import verify as run_verify

    path = resolve_model(model)
    lay = read_layout(path).require_moe()
    if budget is not None:
        slots = uniform_slots(lay, budget)
    if slots is None or slots <= 0:
        raise SpecterError("give --slots N or --budget SIZE")
    miss = miss or ("wait" if tier == "disk" else "cpu")  # as generate and chat choose it
    native_errors_exit()
    r = run_verify(path, slots=slots, miss=miss, tier=tier, policy=policy, n_tokens=n,
                   prompt=prompt or DEFAULT_PROMPT, device=device, forced=forced, hot=hot)
    c = r.get("contract")
    ok = c["ok"] if c else r["identical_tokens"] and r["max_abs_logit_diff"] <= 1e-4
    if json_out:
        print(json.dumps(r, indent=1))
    else:
        print(f"{r['arch']} on {r['device']} slots={r['slots']}/{r['n_expert']} miss={miss} tier={r['tier']} "
              f"policy={r['policy']}: "
              f"{'IDENTICAL' if r['identical_tokens'] else 'DIFFERENT'} tokens ({r['n_tokens']}), "
              f"max |dlogit| {r['max_abs_logit_diff']:.2e}, hit rate {100 * r['hit_rate']:.1f}%, "
              f"{r['uploads']} uploads ({fmt_bytes(r['upload_bytes'])})")
        if c:
            print(f"  against stock with every expert on the device: max |dlogit| "
                  f"{c['max_abs_logit_diff_vs_device']:.2e}, bound {c['bound']:.2e} ({c['bound_is']}), "
                  f"{'finite' if c['finite'] else 'NaN/inf in the logits'}: contract "
                  f"{'met' if c['ok'] else 'BROKEN'}")
    if not ok:
        raise typer.Exit(1)


@app.command()
def demo(
    model: Annotated[str, typer.Argument(help="GGUF path or built-in name, positional like every command")]
    = "smol-moe",
    budget: Annotated[str, typer.Option(help="fast-tier budget for expert slots")] = "50%",
    n: Annotated[int, typer.Option("-n", "--n-predict", help="tokens to generate")] = 24,
    question: Annotated[str, typer.Option(help="chat prompt")] = "What are three good habits for staying healthy?",
) -> None:
    """The point of the project in one run: smol-moe with half of its expert bytes as memory and the experts on
    disk. Stock llama.cpp and pyspecter answer the same chat prompt, each in a process held to the same memory
    (page cache included); tokens per second side by side, and the greedy tokens must be identical (exit 1 if
    not)."""
    from pyspecter import native
    from pyspecter.cli.info import inspect
    from pyspecter.study.demo import demo as run_demo
    from pyspecter.study.demo import prefill_tok_s, tok_s

    path = resolve_model(model)
    print(f"patched llama.cpp with pyspecter C API v{native.patch_series_version()}")
    inspect(str(path), json_out=False, budget=budget, device=None, tier="disk")  # the tier the demo runs
    r = run_demo(path, budget=budget, n=n, question=question, n_threads=DEFAULT_THREADS)
    st, ours, mem = r["stock"], r["specter"], r["memory"]
    b, nonexp = r["budget_bytes"], r["nonexpert_bytes"]
    cap = (f"{fmt_bytes(mem['cap_bytes'])} each, page cache included (cgroup {mem['cgroup']})" if mem["capped"]
           else "NOT capped (no writable memory cgroup here): stock's page cache may grow past the budget")
    print(f"\nmemory: {cap}\n        = budget {fmt_bytes(b)} + non-expert weights {fmt_bytes(nonexp)} + runtime "
          f"{fmt_bytes(mem['cap_bytes'] - b - nonexp)};\n        the other {fmt_bytes(r['expert_bytes'] - b)} of "
          f"experts stay on disk (its page cache dropped before each run)")
    print(f"\nuser: {question}\n{model if is_builtin(model) else path.stem}: {ours['text'].strip()}\n")
    s = ours["stats"]
    per_token = s["upload_mib"] / max(len(ours["tokens"]), 1)
    rows = [("stock llama.cpp (mmap, same memory)", st, ""),
            (f"pyspecter ({ours['slots']}/{ours['n_expert']} expert slots, disk)", ours,
             f"hit {100 * s['hit_rate']:.0f}%, {per_token:.1f} MiB read/token (prefill included)")]
    # decode tok/s after the first token; prefill apart: the prompt's tokens per second up to the first token
    print(f"{'':<42}{'first token':>12}{'prefill/s':>10}{'tok/s':>9}")
    for name, run, extra in rows:
        print(f"{name:<42}{run['ttft_s']:>10.2f} s{prefill_tok_s(run):>10.1f}{tok_s(run):>9.1f}   {extra}".rstrip())
    print(f"pyspecter's slots: {s['slots_text']}")
    print(f"pyspecter decodes {tok_s(ours) / tok_s(st):.1f}x as fast as stock llama.cpp in the same memory")
    if r["identical"]:
        print(f"greedy tokens identical ({len(ours['tokens'])} tokens)")
        return
    first = next((i for i, (a, b) in enumerate(zip(st["tokens"], ours["tokens"], strict=False)) if a != b),
                 min(len(st["tokens"]), len(ours["tokens"])))
    print(f"ERROR: greedy tokens differ from stock llama.cpp's from token {first}")
    raise typer.Exit(1)


def _same_as_stock(x: dict) -> str:
    if x.get("decode") == "teacher-forced":
        return f"forced, logits {x.get('same_logits_as_stock')}"
    return f"free, tokens {x.get('same_tokens_as_stock')}"


@app.command()
def scale(
    model: ModelArg = DEFAULT_MODEL,
    budgets: Annotated[str, typer.Option(help="disk-tier budgets to measure, comma-separated; 'auto' is what "
                                              "generate/chat would fit to this machine")] = "10%,25%,50%,auto",
    n: Annotated[int, typer.Option("-n", "--n-predict", help="decode tokens per configuration")] = 8,
    prompt_tokens: Annotated[int, typer.Option(help="prompt length")] = 16,
    threads: ThreadsOpt = DEFAULT_THREADS,
    no_stock: Annotated[bool, typer.Option("--no-stock", help="skip stock llama.cpp (slow on a model bigger "
                                                               "than RAM)")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    forced: ForcedOpt = None,
) -> None:
    """How cost grows with the model: load time, peak RSS, bytes read per token, prefill and TPOT of stock
    llama.cpp (mmap) and of the disk tier at each budget, each in a fresh process starting from a cold page cache,
    nothing capped. Made for models bigger than RAM (big-qwen3moe); also runs on small ones for the scale curve."""
    from pyspecter.layout import read_layout
    from pyspecter.placement import place
    from pyspecter.study.scale import run_scale

    path = resolve_model(model)
    lay = read_layout(path).require_moe()
    chosen = []
    for b in (x.strip() for x in budgets.split(",") if x.strip()):
        if b == "auto":
            fit = place(lay)
            print(f"pyspecter: auto = {fit.why}", file=sys.stderr)
            b = fit.budget or "100%"
        chosen.append(b)
    r = run_scale(path, chosen, n=n, prompt_len=prompt_tokens, threads=threads, stock=not no_stock, forced=forced,
                  progress=None if json_out else lambda c: print(f"measuring {c} ...", file=sys.stderr, flush=True))
    if json_out:
        print(json.dumps(r, indent=1))
        return
    gb = 1e9
    print(f"{Path(r['model']).name}: {r['file_bytes'] / gb:.1f} GB file ({r['nonexpert_bytes'] / gb:.2f} GB "
          f"non-expert), {r['ram_bytes'] / gb:.1f} GB RAM, {r['prompt_tokens']}-token prompt, "
          f"{r['decode_tokens']} decode tokens ({r['decode']}), {r['threads']} threads, cold page cache")
    print(f"{'config':<14}{'load s':>8}{'load GB':>9}{'peak RSS GB':>12}{'prefill/s':>10}{'TPOT ms':>10}"
          f"{'GB/tok':>8}{'hit%':>6}{'hook us':>8}{'stall ms':>9}  decode, same as stock")
    for x in r["runs"]:
        if "error" in x:
            print(f"{x['config']:<14} failed: {x['error']}")
            continue
        print(f"{x['config']:<14}{x['load_s']:>8.1f}{x['load_read_bytes'] / gb:>9.2f}{x['peak_rss'] / gb:>12.2f}"
              f"{r['prompt_tokens'] / x['prefill_s']:>10.1f}{1e3 * x['tpot_s']:>10.0f}"
              f"{x['decode_read_bytes_per_token'] / gb:>8.2f}{100 * x.get('hit_rate', 1):>6.0f}"
              f"{x.get('hook_us_per_call', 0):>8.0f}{x.get('hook_ms_per_token', 0):>9.0f}  "
              f"{_same_as_stock(x)}")
