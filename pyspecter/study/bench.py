"""Side-by-side speed of residency policies on one model, in one process, on the same prompts.

Machines here are shared and noisy, so every figure that matters is a ratio between policies measured in the same
run, with policies interleaved across repeats so drift hits all of them alike. This module prepares what every
run shares (the prompt tokens, static-hot's profile), orders and caps the runs, and turns them into figures;
``bench_runs.py`` is one run.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pyspecter import native
from pyspecter.budget import MemoryPlan, allocate_slots, check_slots, parse_budget, split_counts, zero_slots
from pyspecter.cache import ExpertCache
from pyspecter.errors import SpecterError
from pyspecter.hitrates import HIT_TOKENS, hot_profile
from pyspecter.layerplan import LayerPlan
from pyspecter.layout import ModelLayout, read_layout
from pyspecter.models.calibration import select_neurons
from pyspecter.native import Model
from pyspecter.native.devices import Device, open_device
from pyspecter.placement import SlotCount, budget_slot_text
from pyspecter.prompts import PACKAGED, load_prompts, render_prompt
from pyspecter.speed import decode_tok_s
from pyspecter.study.bench_csv import CSV_FIELDS, to_csv_rows  # noqa: F401 - bench's CSV, here too
from pyspecter.study.bench_device import device_columns, layer_plans, predictions, syncs_over_device
from pyspecter.study.bench_runs import (
    ENGINE_STATS,
    HOT_POLICIES,
    Run,
    disk_overlap,
    n_cpu_moe_for,
    run_policy,
    run_specter,
)
from pyspecter.study.capped import run_capped
from pyspecter.study.forced import FORCED, FREE, default_mode, forced_tokens, same_logits
from pyspecter.study.simulate import belady_misses
from pyspecter.surrogate import Surrogates
from pyspecter.tiers import make_tier

POLICIES = ("stock", "all-resident", "all-resident-hooked", "on-demand-lru", "on-demand-lfu", "on-demand-cpu",
            "on-demand-lru-ordered", "static-hot", "prev-token", "specter", "specter-equal-slots", "surrogate",
            "stock-cpu-moe", "stock-n-cpu-moe", "stock-device", "learned", "learned-evict", "engine", "plan",
            "default", "on-demand-mapped", "static-hot-mapped", "plan-mapped", "adaptive-hot", "adaptive-hot-mapped")
# need --device; "plan": the layer plan (full, host and slot layers) the cost model chooses at the budget;
# "plan-mapped": the plan priced and run as --miss mapped (slot layers whose misses the device reads from the host)
DEVICE_POLICIES = ("stock-cpu-moe", "stock-n-cpu-moe", "stock-device", "plan", "on-demand-mapped", "static-hot-mapped",
                   "plan-mapped", "adaptive-hot-mapped")
# with a device: llama.cpp's two ways of keeping experts on the host, beside ours at the same device memory
DEVICE_DEFAULTS = ("stock-cpu-moe", "stock-n-cpu-moe", "on-demand-lru", "on-demand-cpu", "prev-token", "static-hot")
APPROXIMATE = ("surrogate",)  # policies whose output is not the target's (their quality cost is measured apart)
# only policies that keep to the budget (all-resident holds every expert; ask for it to get the oracle bound)
DEFAULT_POLICIES = ("stock", "on-demand-lru", "on-demand-lru-ordered", "on-demand-lfu", "on-demand-cpu", "static-hot",
                    "prev-token")
DEFAULT_PROMPT_LEN = 64  # tokens of the packaged (or synthetic) prompt when no prompt file is given
Progress = Callable[[str, int, int], None]  # (what is starting, runs done, runs in all; 0 in all: preparing)


def _prompt_tokens(model: Model, n: int, seed: int = 0) -> list[int]:
    """The first n tokens of the packaged eval prompts, chat-rendered, for models with a chat template (real
    routing needs real text); synthetic ids for the random fixtures, whose text is noise anyway."""
    import llama_cpp

    if llama_cpp.llama_model_chat_template(model.ptr, None):
        toks: list[int] = []
        for p in load_prompts(split="eval"):
            toks += model.tokenize(render_prompt(model, p["messages"]), add_special=not toks)
            if len(toks) >= n:
                return toks[:n]
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(1, model.n_vocab, size=n)]


def prompt_sets(path: Path, items: list[dict] | None, prompt_len: int | None) -> list[list[int]]:
    """The token lists every policy decodes, tokenized once here so that every policy sees the same tokens.
    ``items`` (a prompt file, ``prompts.load_prompts``): each prompt rendered with the model's chat template as
    ``trace`` renders it (ChatML for models without one) and used whole, or cut to its first ``prompt_len``
    tokens when that is given. None: one prompt of ``prompt_len`` (default 64) tokens, see ``_prompt_tokens``."""
    with Model(path) as model:
        if items is None:
            return [_prompt_tokens(model, prompt_len or DEFAULT_PROMPT_LEN)]
        return [model.tokenize(render_prompt(model, p["messages"]))[:prompt_len] for p in items]


RUNTIME_HEADROOM = 256 * 2**20  # Python, llama.cpp buffers and KV cache on top of the weights


def _run_capped(call: dict, path: Path, cap_bytes: int) -> tuple[Run, dict]:
    """One policy on the disk tier in a capped child (``study/capped.py``): budget plus non-expert weights plus
    runtime, page cache included, starting cold."""
    result, how = run_capped("pyspecter.study.bench_child", call, path, cap_bytes)
    # how the cap pressed on this run, kept per run: one run of several that thrashes shows which one
    result["counters"].update(major_faults=result.pop("major_faults"), cap_hits=how.pop("cap_hits"))
    return Run(**result), how


def measure_link(path: Path, tier: str, n_uploads: int = 32, seed: int = 0, device: Device | None = None) -> float:
    """Upload throughput of a tier in GB/s: synchronous uploads of random experts into slots (the device's, with
    one: host RAM to device memory)."""
    layout = read_layout(path).require_moe()
    rng = np.random.default_rng(seed)
    with Model(path, device=device, pinned=True) as model:  # as the slots' uploads read it
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


def _interleave(path: Path, layout: ModelLayout, policies: list[str], sets: list[list[int]],
                hot: dict[int, list[int]] | None, inputs: Path, *, tier: str, slots: int, sur_slots: int,
                budget_bytes: int, n: int, repeat: int, n_threads: int, draft: str | Path | None, k: int,
                adaptive: bool, surrogate_width: float, device: Device | None = None,
                learned_slots: int | None = None, extra: dict[int, int] | None = None,
                plans: dict[str, LayerPlan] | None = None, forced: list[list[int]] | None = None,
                progress: Progress | None = None,
                ) -> tuple[dict[str, list[Run]], dict[str, str], dict[str, dict]]:
    """Every policy ``repeat`` times, interleaved so that drift hits every policy alike. Returns the runs, the
    policies skipped (and why: e.g. the draft alone is bigger than the budget) and how each capped run was held.
    ``forced``: teacher-forced decode (per prompt, the held-out tokens fed), for every policy but the speculative
    ones, which draft their own tokens and decode free."""
    runs: dict[str, list[Run]] = {p: [] for p in policies}
    skipped: dict[str, str] = {}
    caps: dict[str, dict] = {}
    cap = budget_bytes + layout.nonexpert_bytes + RUNTIME_HEADROOM
    common = {"inputs": str(inputs), "n": n, "n_threads": n_threads}
    done, total = 0, repeat * len(policies)
    for i in range(repeat):
        for p in policies:
            if progress is not None:
                progress(f"{p}, repeat {i + 1}/{repeat}", done, total)
            done += 1
            if p in skipped:
                continue
            p_slots = {"surrogate": sur_slots, "learned": learned_slots or slots,
                       "learned-evict": learned_slots or slots}.get(p, slots)
            try:
                # all-resident is the no-stall limit, default places itself: no cap
                if tier == "disk" and p not in ("all-resident", "default"):
                    if p.startswith("specter") or p == "engine":
                        on_top = 0 if p != "specter-equal-slots" else Path(draft).stat().st_size
                        call = {"fn": "specter", "draft": str(draft) if p != "engine" else None,
                                "budget_bytes": budget_bytes, "count_draft": p != "specter-equal-slots", "k": k,
                                "adaptive": adaptive, **common}
                        run, caps[p] = _run_capped(call, path, cap + on_top)
                    else:
                        run, caps[p] = _run_capped({"fn": "run", "policy": p, "slots": p_slots,
                                                    "surrogate_width": surrogate_width, "extra": extra or {},
                                                    "budget_bytes": budget_bytes, **common}, path, cap)
                    runs[p].append(run)
                elif p == "default":  # generate with no flags: placed as the CLI places it (stock when it fits)
                    runs[p].append(run_specter(path, None, None, True, None, sets, n, n_threads, k, forced=forced))
                elif p == "engine":  # what generate and chat run by default: no draft, the learned plan if fitted
                    runs[p].append(run_specter(path, None, budget_bytes, True, tier, sets, n, n_threads, k,
                                               device=device.spec if device else None, forced=forced))
                elif p.startswith("specter"):
                    # "specter": the draft's bytes come out of the same budget (equal total fast memory, the
                    # headline); "specter-equal-slots": same slots as the others, draft on top
                    runs[p].append(run_specter(path, Path(draft), budget_bytes, p == "specter", tier, sets, n,
                                               n_threads, k, adaptive,
                                               device=device.spec if device else None))
                else:
                    runs[p].append(run_policy(p, path, layout, p_slots, tier, sets, n, n_threads, surrogate_width,
                                              hot, device=device, budget_bytes=budget_bytes, extra=extra,
                                              plan=(plans or {}).get(p), forced=forced))
            except SpecterError as e:
                skipped[p] = str(e)
    return runs, skipped, caps


def run_bench(path: str | Path, *, tier: str = "ram", budget: str | None = None, slots: int | None = None,
              policies: list[str] | None = None, prompt_len: int | None = None, n: int = 32, repeat: int = 3,
              n_threads: int = 2, draft: str | Path | None = None, k: int = 4, adaptive: bool = True,
              surrogate_width: float = 0.25, prompts: str | Path | None = None, split: str | None = None,
              device: str | None = None, forced: bool | None = None, progress: Progress | None = None) -> dict:
    """Every policy over the same prompts, interleaved ``repeat`` times. ``prompts``: a prompt file (plain text,
    one prompt a line, or JSONL: ``prompts.load_prompts``), each prompt chat-rendered and used whole, or cut to
    ``prompt_len`` tokens when that is given; without one, a single prompt of ``prompt_len`` (64) tokens.
    ``split``: only that split's prompts ("eval": the held-out half; the packaged file when no ``prompts``, whose
    "tune" half is what ``fit-predictor`` fits the learned predictor on). Each
    run prefills every prompt in turn and decodes ``n`` tokens after each; figures cover all of them. ``forced``:
    each decode step fed the next token of a held-out text (``forced.py``) instead of the greedy one, identity
    checked on the logits; None: forced on the random-weight built-ins (whose greedy text cycles through two or
    three tokens, so every cache hits), free otherwise. ``progress(what, done, total)``: called before each step
    (``total`` 0 for the preparation steps)."""
    for name, value in (("--prompt-tokens", 1 if prompt_len is None else prompt_len), ("-n", n),
                        ("--repeat", repeat), ("--threads", n_threads)):
        if value < 1:
            raise SpecterError(f"{name} must be at least 1, got {value}")
    path = Path(path)
    # a bad file fails before any model loads
    items = load_prompts(prompts, split) if prompts is not None or split is not None else None
    layout = read_layout(path).require_moe()
    dev = open_device(device)
    if dev is not None and tier != "ram":
        raise SpecterError(f"bench --device keeps the experts' host copy in RAM: use --tier ram, not {tier}")
    defaults = DEVICE_DEFAULTS if dev is not None else DEFAULT_POLICIES
    policies = list(policies or (defaults + (("specter", "specter-equal-slots") if draft else ())))
    for p in policies:
        if p not in POLICIES:
            raise SpecterError(f"unknown policy {p!r}: use {', '.join(POLICIES)}")
        if p.startswith("specter") and not draft:
            raise SpecterError(f"policy {p} needs --draft")
        if p in DEVICE_POLICIES and dev is None:
            raise SpecterError(f"policy {p} needs --device")
    budget_bytes = parse_budget(budget or "50%", layout.expert_total_bytes)
    say = progress or (lambda *_: None)
    extra: dict[int, int] = {}  # the baselines' slots beyond whole rows, as the engine spends its budget
    if slots is None:
        if dev is None:
            slots, extra = split_counts(allocate_slots(layout, budget_bytes))
        else:  # uniform, after the device's zero slots (budget.zero_slots), as a session spends it
            slots = MemoryPlan.for_budget(layout, str(budget_bytes), device=dev).slots
    else:
        budget_bytes = (slots + zero_slots(layout, dev)) * sum(L.expert_bytes for L in layout.layers)
    check_slots(layout, slots)
    make_tier(tier)  # validate early
    sur_slots = slots
    if "surrogate" in policies:  # the surrogates live in fast memory too: fewer slots for the same budget
        say("surrogate: choosing each expert's neurons", 0, 0)
        sur_bytes = Surrogates(layout, select_neurons(path, surrogate_width)).nbytes
        sur_slots = MemoryPlan.for_budget(layout, str(budget_bytes), surrogate_bytes=sur_bytes).slots
    learned_slots = slots
    if {"learned", "learned-evict"} & set(policies):  # the predictor's tables live in fast memory too
        from pyspecter.learned import LearnedPredictor

        learned_bytes = LearnedPredictor.load(path).nbytes
        learned_slots = MemoryPlan.for_budget(layout, str(budget_bytes), predictor_bytes=learned_bytes,
                                              device=dev).slots  # refuses fewer than top-k
    sets = prompt_sets(path, items, prompt_len)
    mode = default_mode(path, forced)
    texts = None
    if mode == FORCED:
        with Model(path, lazy_experts=True) as m:  # tokenizing reads no experts
            texts = forced_tokens(m, len(sets), n)
    if wants_hot := any(p.startswith(HOT_POLICIES) for p in policies):
        say("static-hot: profiling the calibration prompts", 0, 0)
    hot = hot_profile(path, layout, n_threads) if wants_hot else None
    if dev is not None:  # what the scheduler actually does per token, beside its split count (device_columns)
        native.count_syncs(dev.ptr)
    say(f"measuring the {tier} tier's link", 0, 0)
    link_gbps = measure_link(path, tier, device=dev)
    plans, infos, unplanned = layer_plans(path, layout, dev, budget_bytes, n_threads, policies)
    # one untimed run first: page-cache the file and fault in code paths, so the first policy isn't the cold one
    say("an untimed warm-up run", 0, 0)
    run_policy("stock", path, layout, slots, tier, [sets[0][:8]], 2, n_threads)
    with tempfile.TemporaryDirectory(prefix="pyspecter-bench-") as tmp:
        # capped children read the shared inputs from a file: token lists can outgrow a command line
        inputs = Path(tmp) / "inputs.json"
        inputs.write_text(json.dumps({"prompts": sets, "hot": hot, "forced": texts}))
        runs, skipped, caps = _interleave(path, layout, policies, sets, hot, inputs, tier=tier, slots=slots,
                                          sur_slots=sur_slots, budget_bytes=budget_bytes, n=n, repeat=repeat,
                                          n_threads=n_threads, draft=draft, k=k, adaptive=adaptive,
                                          surrogate_width=surrogate_width, device=dev, learned_slots=learned_slots,
                                          extra=extra, plans=plans, forced=texts, progress=progress)
        skipped.update(unplanned)
    say("done", repeat * len(policies), repeat * len(policies))
    uncapped = {"memory_cap": f"not capped (page cache warm, {tier} tier)", "cap_bytes": 0, "capped": False,
                "cgroup": "none"}
    n_prompt_tokens, n_decode = sum(map(len, sets)), n * len(sets)
    out: dict = {"model": str(path), "draft": str(draft) if draft else None, "arch": layout.arch, "tier": tier,
                 "device": dev.name if dev else "CPU", "emulated": tier.startswith("emulated"),
                 "budget": budget, "slots_per_layer": slots, "zero_slots": zero_slots(layout, dev),
                 "n_expert": layout.n_expert,
                 "slots": str(SlotCount(tuple(slots + extra.get(L.index, 0) for L in layout.layers), layout.n_expert)),
                 "engine_slots": budget_slot_text(  # generate's slots beside the baselines', which take it whole
                     layout, str(budget_bytes), path, tier=tier, device=device),
                 "n_expert_used": layout.n_expert_used, "n_moe_layers": len(layout.layers),
                 "prompts": str(prompts) if prompts is not None else PACKAGED if split else None, "split": split,
                 "n_prompts": len(sets), "prompt_tokens": n_prompt_tokens, "decode_tokens": n, "decode": mode,
                 "repeat": repeat, "n_threads": n_threads, "link_gbps": link_gbps,
                 "memory_cap": next(iter(caps.values()), uncapped)["memory_cap"],
                 "budget_bytes": budget_bytes, "budget_pct": 100 * budget_bytes / layout.expert_total_bytes,
                 "build": native.build_key(), "policies": {}}
    out.update({"layer_plan" if p == "plan" else "layer_plan_mapped": info for p, info in infos.items()})
    layer_bytes = sum(L.expert_bytes for L in layout.layers) / len(layout.layers)
    ref = "stock-cpu-moe" if dev is not None and runs.get("stock-cpu-moe") else "stock"
    stock_tokens = runs[ref][0].tokens if runs.get(ref) else None
    stock_digests = runs[ref][0].digests if runs.get(ref) else None
    for p, why in skipped.items():
        out["policies"][p] = {"skipped": why}
    for p, rs in runs.items():
        if not rs:
            continue
        tp = [t for r in rs for t in r.tpots]
        tpot = statistics.median(tp)
        c = (cs := [r.counters for r in rs])[-1]
        ups = [r.counters.get("upload_bytes", 0) for r in rs]
        hook_ms = [r.counters.get("hook_ms", 0.0) for r in rs]
        out["policies"][p] = {
            "tpot_ms": 1e3 * tpot,
            "tpot_p10_ms": 1e3 * float(np.percentile(tp, 10)), "tpot_p90_ms": 1e3 * float(np.percentile(tp, 90)),
            # speed.py's definition: decode tokens over decode time (generate's tok/s), not 1 / the median
            "decode_tok_s": decode_tok_s(len(tp), sum(tp)),
            # what throughput sees: a disk stall now and then moves the mean, not the median
            "tpot_mean_ms": 1e3 * statistics.mean(tp),
            "prefill_tok_s": n_prompt_tokens / statistics.median(r.prefill_s for r in rs),
            "load_s": statistics.median(r.load_s for r in rs),
            # from a cold start to the first prompt's first token: load + that prefill (see Run.load_s)
            "cold_ttft_s": statistics.median(r.load_s + r.first_prefill_s for r in rs),
            "hit_rate": c.get("hit_rate", 1.0), "coverage": c.get("slot_row_rate", 1.0),
            **device_columns(rs[-1].splits, len(layout.layers), dev is not None, rs[-1].syncs, n_decode, cs),
            "bytes_per_token": statistics.mean(ups) / n_decode,
            "stall_ms_per_token": statistics.mean(hook_ms) / n_decode,
            "disk_overlap": disk_overlap(cs),
            "route_us_per_call": c.get("route_us_per_call", 0.0), "hook_us_per_call": c.get("hook_us_per_call", 0.0),
            # native residency only (None otherwise): decision time per MoE layer, read waits left out; mean
            # reads outstanding while a token waited (on the disk tier a read is one chunk of one kind of an
            # expert, 256 KiB at most), and how they were issued (io_uring or pread threads)
            "route_us_per_layer": c.get("route_us_per_layer"),
            # ... and the CPU that took (read waits left out too): far below route_us_per_layer, the op's thread
            # waited for a core; the CPU of going to sleep for reads and waking again, apart
            "route_cpu_us_per_layer": c.get("route_cpu_us_per_layer"),
            "wait_cpu_us_per_layer": c.get("wait_cpu_us_per_layer"),
            # the median decode layer's routing CPU, every needed expert resident / some not (the mean above also
            # holds the interrupts the kernel charged the op's thread: native_residency.layer_cpu_p50_us)
            "route_cpu_us_p50_resident": c.get("route_cpu_us_p50_resident"),
            "route_cpu_us_p50_miss": c.get("route_cpu_us_p50_miss"),
            "reads_in_flight": c.get("reads_in_flight"), "native": bool(c.get("native")),
            "read_io": ("io_uring" if c.get("io_uring") else "pread") if c.get("read_ops") else None,
            "peak_rss_mb": max(r.peak_rss for r in rs) / 2**20,
            "slots_mean": c.get("slots_mean"),  # usable slots per layer, on average (layers may differ)
            "host_experts": c.get("host_experts"),  # the buffer type slots upload from (CUDA_Host_experts: pinned)
            # per run, capped children only: pages read back from the file, and times the cgroup hit its cap
            "major_faults": [r.counters["major_faults"] for r in rs if "major_faults" in r.counters] or None,
            "cap_hits": [r.counters["cap_hits"] for r in rs if "cap_hits" in r.counters] or None,
            # free: exact policies must decode stock's greedy tokens (on repacked quant types, stock's own kernels
            # may round differently: `verify` is the exactness check against an unrepacked stock); teacher-forced:
            # every step's logits bit for bit stock's on the same fed tokens
            "decode": rs[0].decode,
            "same_tokens_as_stock": (all(r.tokens == stock_tokens for r in rs)
                                     if stock_tokens is not None and rs[0].decode == runs[ref][0].decode == FREE
                                     else None),
            "same_logits_as_stock": (all(same_logits(stock_digests, r.digests) for r in rs)
                                     if stock_digests is not None and rs[0].digests is not None else None),
            **caps.get(p, uncapped),
        }
        if p == "engine":
            out["policies"][p].update({k: c[k] for k in ("slots", "slots_mean", *ENGINE_STATS) if k in c})
        if p in ("learned", "learned-evict"):
            out["policies"][p].update(slots_per_layer=learned_slots, slots_mean=c.get("slots_mean"),
                                      prefetches=c.get("prefetches", 0))
        if p == "stock-n-cpu-moe":
            out["policies"][p]["n_cpu_moe"] = n_cpu_moe_for(layout, budget_bytes)
        if p.startswith(HOT_POLICIES):
            out["policies"][p]["profile"] = (f"routing of the first {HIT_TOKENS} tokens of the packaged "
                                             "calibration text")
        if p == "surrogate":
            out["policies"][p].update(slots_per_layer=sur_slots, surrogate_width=surrogate_width, approximate=True,
                                      surrogate_uses=c["surrogate_uses"])
        if p.startswith("specter"):
            out["policies"][p].update(acceptance=c["acceptance"], mean_k=c["mean_k"], slots_per_layer=c["slots"],
                                      draft_off=c["draft_off"], k_start=k,
                                      draft_dropped_at=[r.counters.get("draft_dropped_at") for r in rs],
                                      # per repeat: drafted/accepted tokens, the draft's prefetches (queued, checked
                                      # against their pass, used by it, bytes) and the step they were cut off at
                                      **{key: [r.counters.get(key) for r in rs] for key in (
                                          "drafted", "accepted", "draft_prefetches", "draft_prefetches_scored",
                                          "draft_prefetches_used", "draft_prefetch_bytes",
                                          "draft_prefetch_stopped_at")},
                                      adaptive=adaptive, miss="wait" if tier == "disk" else "cpu")
    # oracle bound: Belady-optimal uploads for the routing the recording runs (on-demand, prev-token) saw, perfectly
    # overlapped; exact policies decode the same greedy tokens, so any one of their traces will do
    trace = next((r.trace for p in policies for r in runs[p] if r.trace), None)
    if trace is not None and "all-resident" in out["policies"]:
        mn = belady_misses(trace, slots, extra)
        t_link = mn * layer_bytes / n_decode / (link_gbps * 1e9)
        ar = out["policies"]["all-resident"]["tpot_ms"] / 1e3
        tpot = max(ar, t_link)
        out["policies"]["oracle-bound"] = {"tpot_ms": 1e3 * tpot, "tpot_mean_ms": 1e3 * tpot, "decode_tok_s": 1 / tpot,
                                           "bytes_per_token": mn * layer_bytes / n_decode, "computed": True}
    syncs_over_device(out["policies"], len(layout.layers))
    if dev is not None:
        predictions(out, layout, path, dev, n_threads)
    if {"all-resident", "stock-device"} <= out["policies"].keys() and "tpot_ms" in out["policies"]["stock-device"]:
        # every expert in device memory both ways: what our per-layer routing round trip (device -> host ids ->
        # device remap, and the slot/host matmul pair) costs on top of stock
        gap_ms = out["policies"]["all-resident"]["tpot_ms"] - out["policies"]["stock-device"]["tpot_ms"]
        out["round_trip_us_per_layer"] = 1e3 * gap_ms / len(layout.layers)
    for r in out["policies"].values():
        for ref in ("on-demand-lru", "all-resident", "oracle-bound"):
            if ref in out["policies"] and "tpot_ms" in r and "tpot_ms" in out["policies"][ref]:
                r["vs_" + ref.replace("-", "_")] = out["policies"][ref]["tpot_ms"] / r["tpot_ms"]
    return out
