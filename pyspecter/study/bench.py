"""Side-by-side speed of residency policies on one model, in one process, on the same prompt.

Machines here are shared and noisy, so every figure that matters is a ratio between policies measured in the same
run, with policies interleaved across repeats so drift hits all of them alike.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from pyspecter import native
from pyspecter.budget import MemoryPlan, check_slots, parse_budget, slots_for_budget
from pyspecter.cache import ExpertCache
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout, read_layout
from pyspecter.models.calibration import select_neurons
from pyspecter.native import Context, Model
from pyspecter.session import Session, SessionConfig
from pyspecter.study.analyze import simulate_cache
from pyspecter.study.capped import run_capped
from pyspecter.surrogate import Surrogates
from pyspecter.tiers import make_tier

POLICIES = ("stock", "all-resident", "all-resident-hooked", "on-demand-lru", "on-demand-lfu", "on-demand-cpu",
            "on-demand-lru-ordered", "specter", "specter-equal-slots", "surrogate")
APPROXIMATE = ("surrogate",)  # policies whose output is not the target's (their quality cost is measured apart)
# only policies that keep to the budget (all-resident holds every expert; ask for it to get the oracle bound)
DEFAULT_POLICIES = ("stock", "on-demand-lru", "on-demand-lru-ordered", "on-demand-lfu", "on-demand-cpu")


@dataclass
class Run:
    prefill_s: float
    tpots: list[float]
    counters: dict
    peak_rss: int
    trace: list | None = None


def _prompt_tokens(model: Model, n: int, seed: int = 0) -> list[int]:
    """The first n tokens of the packaged eval prompts, chat-rendered, for models with a chat template (real
    routing needs real text); synthetic ids for the random fixtures, whose text is noise anyway. Every policy
    sees the same tokens."""
    import llama_cpp

    if llama_cpp.llama_model_chat_template(model.ptr, None):
        from pyspecter.prompts import load_prompts, render_prompt

        toks: list[int] = []
        for p in load_prompts(split="eval"):
            toks += model.tokenize(render_prompt(model, p["messages"]), add_special=not toks)
            if len(toks) >= n:
                return toks[:n]
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(1, model.n_vocab, size=n)]


def _run_specter(path: Path, draft: Path, budget_bytes: int, count_draft: bool, tier: str, prompt_len: int,
                 n: int, n_threads: int, k: int, adaptive: bool = True, cutoff: bool = True) -> Run:
    proc = psutil.Process()
    s = Session(SessionConfig(model=path, draft=draft, budget=str(budget_bytes), tier=tier, k=k, adaptive=adaptive,
                              n_ctx=prompt_len + n + 16, n_threads=n_threads, draft_counts_in_budget=count_draft,
                              prefetch_cutoff=cutoff))
    try:
        prompt = _prompt_tokens(s.target, prompt_len)
        stamps: list[float] = []

        def on_token(_t: int) -> None:
            stamps.append(time.perf_counter())
            if len(stamps) == 1:  # decode counters only, as for the other policies
                s.cache.reset_counters()

        t0 = time.perf_counter()
        # the first token comes straight from the target's prefill; the rest are decode
        out = s.generate(prompt, n + 1, stop_at_eog=False, on_token=on_token)
        prefill = stamps[0] - t0
        tpot = (stamps[-1] - stamps[0]) / max(len(out) - 1, 1)
        c = s.cache.counters()
        ds = s.decoder.stats
        c.update(acceptance=ds.acceptance, mean_k=ds.mean_k, draft_off=ds.draft_off, slots=s.n_slots,
                 draft_dropped_at=ds.dropped_at,
                 skipped_late=s.decoder.prefetcher.skipped_late if s.decoder.prefetcher else 0)
        return Run(prefill, [tpot] * (len(out) - 1), c, proc.memory_info().rss)
    finally:
        s.close()


def _run(policy: str, path: Path, layout: ModelLayout, slots: int, tier: str, prompt_len: int, n: int,
         n_threads: int, surrogate_width: float = 0.25) -> Run:
    proc = psutil.Process()
    stock = policy == "stock"
    # stock is llama.cpp as users run it (repacked weights where the CPU has kernels for them)
    model = Model(path, extra_bufts=stock)
    cache = None
    try:
        if policy.startswith("all-resident"):
            # -hooked keeps the Python routing hook on with nothing to do: the hook's own cost per layer
            cache = ExpertCache(model, layout, layout.n_expert, tier=make_tier("ram"),
                                hook=policy.endswith("hooked"))
            cache.warm({L.index: list(range(layout.n_expert)) for L in layout.layers})
        elif policy == "on-demand-lru-ordered":
            # wait mode, but a layer's misses are computed after its resident experts, while they land (0005)
            cache = ExpertCache(model, layout, slots, policy="lru", miss="wait", tier=make_tier(tier), record=True,
                                ordered=True)
        elif policy.startswith("on-demand-"):
            kind = policy.removeprefix("on-demand-")
            cache = ExpertCache(model, layout, slots, policy="lru" if kind == "cpu" else kind,
                                miss="cpu" if kind == "cpu" else "wait", tier=make_tier(tier), record=True)
        elif policy == "surrogate":
            # approximate: single-token misses computed by the expert's surrogate; `slots` already paid for them
            sur = Surrogates(layout, select_neurons(path, surrogate_width, progress=False))
            cache = ExpertCache(model, layout, slots, miss="surrogate", surrogates=sur, tier=make_tier(tier))
        elif not stock:
            raise SpecterError(f"unknown policy {policy!r}: use {', '.join(POLICIES)}")
        with Context(model, n_threads=n_threads, n_ctx=prompt_len + n + 8) as ctx:
            prompt = _prompt_tokens(model, prompt_len)
            ctx.warmup()
            t0 = time.perf_counter()
            logits = ctx.decode(prompt)
            prefill = time.perf_counter() - t0
            if cache:
                cache.check()
                cache.reset_counters()
                if cache.trace is not None:
                    cache.trace.clear()
            tpots, peak = [], proc.memory_info().rss
            for _ in range(n):
                t0 = time.perf_counter()
                logits = ctx.decode([int(np.argmax(logits))])
                tpots.append(time.perf_counter() - t0)
                peak = max(peak, proc.memory_info().rss)
            counters = cache.counters() if cache else {}
            if cache:
                cache.check()
            return Run(prefill, tpots, counters, peak, cache.trace if cache else None)
    finally:
        if cache:
            cache.close()
        model.close()


RUNTIME_HEADROOM = 256 * 2**20  # Python, llama.cpp buffers and KV cache on top of the weights


def _run_capped(call: dict, path: Path, cap_bytes: int) -> tuple[Run, dict]:
    """One policy on the disk tier in a capped child (``study/capped.py``): budget plus non-expert weights plus
    runtime, page cache included, starting cold."""
    result, how = run_capped("pyspecter.study.bench_child", call, path, cap_bytes)
    return Run(**result), how


def measure_link(path: Path, tier: str, n_uploads: int = 32, seed: int = 0) -> float:
    """Upload throughput of a tier in GB/s: synchronous uploads of random experts into slots."""
    layout = read_layout(path).require_moe()
    rng = np.random.default_rng(seed)
    with Model(path) as model:
        cache = ExpertCache(model, layout, layout.n_expert_used, tier=make_tier(tier), hook=False)
        picks = [(layout.layers[rng.integers(len(layout.layers))].index, int(rng.integers(layout.n_expert)))
                 for _ in range(n_uploads)]
        t0 = time.perf_counter()
        nbytes = 0
        for i, (il, e) in enumerate(picks):
            cache.tier.upload(il, e, i % cache.n_slots)
            nbytes += cache.expert_bytes[il]
        dt = time.perf_counter() - t0
        cache.close()
    return nbytes / dt / 1e9


def belady_misses(trace: list[tuple[int, tuple[int, ...]]], slots: int) -> int:
    """Uploads an optimal (MIN) cache of `slots` per layer needs for this routing trace [(layer, experts)]."""
    per_layer: dict[int, list[tuple[int, ...]]] = {}
    for il, needed in trace:
        per_layer.setdefault(il, []).append(needed)
    return sum(sum(len(set(s)) for s in steps) - simulate_cache(steps, slots, "belady")
               for steps in per_layer.values())


def run_bench(path: str | Path, *, tier: str = "ram", budget: str | None = None, slots: int | None = None,
              policies: list[str] | None = None, prompt_len: int = 64, n: int = 32, repeat: int = 3,
              n_threads: int = 2, draft: str | Path | None = None, k: int = 4, adaptive: bool = True,
              cutoff: bool = True, surrogate_width: float = 0.25) -> dict:
    for name, value in (("--prompt-tokens", prompt_len), ("-n", n), ("--repeat", repeat), ("--threads", n_threads)):
        if value < 1:
            raise SpecterError(f"{name} must be at least 1, got {value}")
    path = Path(path)
    layout = read_layout(path).require_moe()
    policies = list(policies or (DEFAULT_POLICIES + (("specter", "specter-equal-slots") if draft else ())))
    for p in policies:
        if p not in POLICIES:
            raise SpecterError(f"unknown policy {p!r}: use {', '.join(POLICIES)}")
        if p.startswith("specter") and not draft:
            raise SpecterError(f"policy {p} needs --draft")
    budget_bytes = parse_budget(budget or "50%", layout.expert_total_bytes)
    if slots is None:
        slots = slots_for_budget(layout, budget_bytes)
    else:
        budget_bytes = slots * sum(L.expert_bytes for L in layout.layers)
    check_slots(layout, slots)
    make_tier(tier)  # validate early
    sur_slots = slots
    if "surrogate" in policies:  # the surrogates live in fast memory too: fewer slots for the same budget
        sur_bytes = Surrogates(layout, select_neurons(path, surrogate_width)).nbytes
        sur_slots = MemoryPlan.for_budget(layout, str(budget_bytes), surrogate_bytes=sur_bytes).slots
    link_gbps = measure_link(path, tier)
    # one untimed run first: page-cache the file and fault in code paths, so the first policy isn't the cold one
    _run("stock", path, layout, slots, tier, min(prompt_len, 8), 2, n_threads)
    runs: dict[str, list[Run]] = {p: [] for p in policies}
    skipped: dict[str, str] = {}  # policy -> why it could not run at this budget
    uncapped = {"memory_cap": f"not capped (page cache warm, {tier} tier)", "cap_bytes": 0, "capped": False,
                "cgroup": "none"}
    caps: dict[str, dict] = {}
    for _ in range(repeat):
        for p in policies:  # interleaved: drift hits every policy alike
            if p in skipped:
                continue
            cap = budget_bytes + layout.nonexpert_bytes + RUNTIME_HEADROOM
            common = {"prompt_len": prompt_len, "n": n, "n_threads": n_threads}
            p_slots = sur_slots if p == "surrogate" else slots
            try:
                if tier == "disk" and p != "all-resident":  # all-resident is the no-stall limit: no cap
                    if p.startswith("specter"):
                        extra = 0 if p == "specter" else Path(draft).stat().st_size
                        call = {"fn": "specter", "draft": str(draft), "budget_bytes": budget_bytes,
                                "count_draft": p == "specter", "k": k, "adaptive": adaptive, "cutoff": cutoff,
                                **common}
                        run, caps[p] = _run_capped(call, path, cap + extra)
                    else:
                        run, caps[p] = _run_capped({"fn": "run", "policy": p, "slots": p_slots,
                                                    "surrogate_width": surrogate_width, **common}, path, cap)
                    runs[p].append(run)
                elif p.startswith("specter"):
                    # "specter": the draft's bytes come out of the same budget (equal total fast memory, the
                    # headline); "specter-equal-slots": same slots as the others, draft on top
                    runs[p].append(_run_specter(path, Path(draft), budget_bytes, p == "specter", tier, prompt_len,
                                                n, n_threads, k, adaptive, cutoff))
                else:
                    runs[p].append(_run(p, path, layout, p_slots, tier, prompt_len, n, n_threads, surrogate_width))
            except SpecterError as e:  # e.g. the draft alone is bigger than the budget
                skipped[p] = str(e)

    out: dict = {"model": str(path), "draft": str(draft) if draft else None, "arch": layout.arch, "tier": tier,
                 "emulated": tier.startswith("emulated"),
                 "budget": budget, "slots_per_layer": slots, "n_expert": layout.n_expert,
                 "n_expert_used": layout.n_expert_used, "prompt_tokens": prompt_len, "decode_tokens": n,
                 "repeat": repeat, "n_threads": n_threads, "link_gbps": link_gbps,
                 "memory_cap": next(iter(caps.values()), uncapped)["memory_cap"],
                 "budget_bytes": budget_bytes, "budget_pct": 100 * budget_bytes / layout.expert_total_bytes,
                 "build": native.build_key(), "policies": {}}
    layer_bytes = sum(L.expert_bytes for L in layout.layers) / len(layout.layers)
    for p, why in skipped.items():
        out["policies"][p] = {"skipped": why}
    for p, rs in runs.items():
        if not rs:
            continue
        tp = [t for r in rs for t in r.tpots]
        tpot = statistics.median(tp)
        c = rs[-1].counters
        ups = [r.counters.get("upload_bytes", 0) for r in rs]
        hook_ms = [r.counters.get("hook_ms", 0.0) for r in rs]
        out["policies"][p] = {
            "tpot_ms": 1e3 * tpot,
            "tpot_p10_ms": 1e3 * float(np.percentile(tp, 10)), "tpot_p90_ms": 1e3 * float(np.percentile(tp, 90)),
            "decode_tok_s": 1 / tpot,
            "prefill_tok_s": prompt_len / statistics.median(r.prefill_s for r in rs),
            "hit_rate": c.get("hit_rate", 1.0), "coverage": c.get("slot_row_rate", 1.0),
            "bytes_per_token": statistics.mean(ups) / n,
            "stall_ms_per_token": statistics.mean(hook_ms) / n,
            "route_us_per_call": c.get("route_us_per_call", 0.0),
            "hook_us_per_call": c.get("hook_us_per_call", 0.0),
            "peak_rss_mb": max(r.peak_rss for r in rs) / 2**20,
            **caps.get(p, uncapped),
        }
        if p == "surrogate":
            out["policies"][p].update(slots_per_layer=sur_slots, surrogate_width=surrogate_width, approximate=True,
                                      surrogate_uses=c["surrogate_uses"])
        if p.startswith("specter"):
            out["policies"][p].update(acceptance=c["acceptance"], mean_k=c["mean_k"], slots_per_layer=c["slots"],
                                      draft_off=c["draft_off"], skipped_late=c["skipped_late"], k_start=k,
                                      draft_dropped_at=[r.counters.get("draft_dropped_at") for r in rs],
                                      adaptive=adaptive, cutoff=cutoff, miss="wait" if tier == "disk" else "cpu")
    # oracle bound: Belady-optimal uploads for the routing the on-demand runs saw, perfectly overlapped
    trace = next((r.trace for p in policies if p.startswith("on-demand") for r in runs[p] if r.trace), None)
    if trace is not None and "all-resident" in out["policies"]:
        mn = belady_misses(trace, slots)
        t_link = mn * layer_bytes / n / (link_gbps * 1e9)
        ar = out["policies"]["all-resident"]["tpot_ms"] / 1e3
        tpot = max(ar, t_link)
        out["policies"]["oracle-bound"] = {"tpot_ms": 1e3 * tpot, "decode_tok_s": 1 / tpot,
                                           "bytes_per_token": mn * layer_bytes / n, "computed": True}
    for r in out["policies"].values():
        for ref in ("on-demand-lru", "all-resident", "oracle-bound"):
            if ref in out["policies"] and "tpot_ms" in r and "tpot_ms" in out["policies"][ref]:
                r["vs_" + ref.replace("-", "_")] = out["policies"][ref]["tpot_ms"] / r["tpot_ms"]
    return out


# every row carries its whole setting: a CSV line read alone says what was run, on what, under which cap
RUN_FIELDS = ("model", "tier", "emulated", "budget", "budget_bytes", "budget_pct", "slots_per_layer", "link_gbps",
              "n_threads", "prompt_tokens", "decode_tokens", "repeat", "build")
CSV_FIELDS = ("model", "draft", "tier", "emulated", "budget", "budget_bytes", "budget_pct", "slots_per_layer",
              "memory_cap", "cap_bytes", "capped", "cgroup", "link_gbps", "n_threads", "prompt_tokens",
              "decode_tokens", "repeat", "build", "policy", "tpot_ms",
              "tpot_p10_ms", "tpot_p90_ms", "decode_tok_s", "prefill_tok_s", "hit_rate", "coverage",
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
        row["draft"] = Path(result["draft"]).name if result.get("draft") and name.startswith("specter") else ""
        row["policy"] = name
        row.update({k: p.get(k) for k in CSV_FIELDS if k in p})
        rows.append({k: row.get(k, "") for k in CSV_FIELDS})
    return rows
