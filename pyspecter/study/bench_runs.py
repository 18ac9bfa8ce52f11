"""One timed run of one bench policy: load the model, set its experts up as the policy says, then for every prompt
of the set prefill it and decode ``n`` tokens, counting decode only: greedy ("free"), or teacher-forced, each
step fed the next token of a held-out text (``forced.py``), with a digest of each step's logits kept.

The residency outlives each prompt (the KV cache does not): a cache serves one request after another, as a server
would. ``bench.py`` decides what runs, in which order and under which memory cap; this module only runs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import numpy as np
import psutil

from pyspecter.budget import MemoryPlan
from pyspecter.cache import ExpertCache
from pyspecter.errors import SpecterError
from pyspecter.hitrates import hot_profile
from pyspecter.layerplan import LayerPlan, n_cpu_moe_for
from pyspecter.layout import ModelLayout
from pyspecter.misses import computes_in_place
from pyspecter.models.calibration import select_neurons
from pyspecter.native import Context, Model, graph_splits, sync_counts
from pyspecter.native.devices import Device
from pyspecter.native_residency import DRAFT_RATES, draft_rates, layer_cpu_p50_us
from pyspecter.session import Session, SessionConfig
from pyspecter.study.forced import FORCED, FREE, ForcedSampler, digest
from pyspecter.surrogate import Surrogates
from pyspecter.tiers import make_tier

# what the engine's session reports of its native planner and eviction duel (Session.stats), per bench row
# the rows whose slots hold the profile's hot set: pinned (static-hot) or re-chosen between decodes (adaptive-hot,
# hotset.py: what a hot plan's slot layers run); -mapped: misses read by the device from the host copy
HOT_POLICIES = ("static-hot", "adaptive-hot")
ENGINE_STATS = ("miss", "plan_prefetches", "plan_skipped_late", "plan_refused", "plan_maps", "predictor_mib",
                "predictor", "evict", "evict_switches")


@dataclass
class Run:
    prefill_s: float  # every prompt's prefill, summed
    tpots: list[float]  # every decode token of every prompt
    counters: dict  # the cache's counters over decode only, summed over the prompts
    peak_rss: int
    trace: list | None = None  # routing of decode [(layer, experts)], prompts one after another
    tokens: list[int] | None = None  # the greedy tokens decoded after each prompt, one prompt after another
    # loading the model, its slots and context, and their warm-up; with the first prompt's prefill, the time to
    # the first token from a cold start (stock's load reads the experts its prefill then finds in the page cache;
    # our disk tier's load reads none of them, so prefill alone compares unlike work)
    load_s: float = 0.0
    first_prefill_s: float = 0.0
    # llama.cpp's scheduler: splits of the decode context's one-token graph (native.graph_splits)
    splits: int | None = None
    decode: str = FREE  # or FORCED: every step fed the held-out text's next token
    digests: list[str] | None = None  # teacher-forced: each fed token's logits row (forced.digest), in order
    # synchronisations the scheduler actually took over decode (native.sync_counts, summed over the prompts; zeros
    # unless bench asked native.count_syncs to count the device)
    syncs: dict | None = None


def _add_syncs(total: dict | None) -> dict:
    """``total`` plus this thread's synchronisation counts since the last reset."""
    now = sync_counts().as_dict()
    return {k: (total or {}).get(k, 0) + v for k, v in now.items()}


def step_token_times(stamps: list[float], steps: list[int]) -> list[float]:
    """Per-token decode times from each token's arrival (``stamps``; the first is the prefill's token) and the
    decode step that emitted it (``steps``). Accepted drafts come out in bursts, so a token's own gap means
    nothing: each token of a step gets the step's time (from the step before's last token to its own last)
    over the tokens it emitted. A step of one token is its gap, as the other policies count it, so medians
    compare; the sum is the decode's wall time either way."""
    out: list[float] = []
    prev = stamps[0] if stamps else 0.0
    for _, group in groupby(zip(steps[1:], stamps[1:], strict=True), key=lambda st: st[0]):
        ts = [t for _, t in group]
        out += [(ts[-1] - prev) / len(ts)] * len(ts)
        prev = ts[-1]
    return out


# per-call times: merged weighted by routing calls
_PER_CALL = ("route_us_per_call", "hook_us_per_call", "route_us_per_layer", "route_cpu_us_per_layer",
             "wait_cpu_us_per_layer")
# counters that are ratios: recomputed from the summed counts, never summed themselves
_RATIOS = ("hit_rate", "slot_row_rate", *_PER_CALL, "reads_in_flight", "layer_cpu_hist", "route_cpu_us_p50_resident",
           "route_cpu_us_p50_miss", *DRAFT_RATES)


def merge_counters(parts: list[dict]) -> dict:
    """The cache's counters (``ExpertCache.counters``) of several decode phases as one: counts summed, rates
    recomputed from them (per-call times weighted by calls)."""
    if len(parts) <= 1:
        return dict(parts[0]) if parts else {}
    out = {k: sum(p.get(k, 0) for p in parts) for k in parts[0] if k not in _RATIOS}
    rows = out.get("hit_rows", 0) + out.get("miss_rows", 0)
    out["slot_row_rate"] = out.get("hit_rows", 0) / rows if rows else 0.0
    out["hit_rate"] = (out["resident_at_need"] / out["needed"] if out.get("needed")
                       else out["slot_row_rate"])
    calls = out.get("route_calls", 0)
    for k in _PER_CALL:
        if any(k in p for p in parts):
            out[k] = sum(p.get(k, 0.0) * p.get("route_calls", 0) for p in parts) / calls if calls else 0.0
    if any("layer_cpu_hist" in p for p in parts):  # histograms: summed bin by bin, medians read from the sums
        rows = [p["layer_cpu_hist"] for p in parts if "layer_cpu_hist" in p]
        out["layer_cpu_hist"] = tuple(np.sum([r[i] for r in rows], axis=0).tolist() for i in range(2))
        out["route_cpu_us_p50_resident"] = layer_cpu_p50_us(out["layer_cpu_hist"][0])
        out["route_cpu_us_p50_miss"] = layer_cpu_p50_us(out["layer_cpu_hist"][1])
    if "draft_scored" in out:
        out.update(draft_rates(out))
    if "io_uring" in out:  # a flag, not a count
        out["io_uring"] = max(p.get("io_uring", 0) for p in parts)
    wait = out.get("wait_ms", 0.0)
    if any("reads_in_flight" in p for p in parts):  # weighted by the time waited
        out["reads_in_flight"] = sum(p.get("reads_in_flight", 0.0) * p.get("wait_ms", 0.0) for p in parts) / wait \
            if wait else 0.0
    return out


def disk_overlap(parts: list[dict]) -> float | None:
    """The share of the disk's busy time (a read on the wire) that overlapped compute, over runs' decode counters:
    busy time less the routing op's waits for reads, which lie inside it (what the op waits for is in flight).
    None where nothing was read (the RAM tier, all resident)."""
    busy = sum(p.get("read_busy_ms", 0.0) for p in parts)
    wait = sum(p.get("wait_ms", 0.0) for p in parts)
    return max(0.0, 1.0 - wait / busy) if busy > 0 else None


def _cache_for(policy: str, model: Model, layout: ModelLayout, slots: int, tier: str, path: Path,
               surrogate_width: float, hot: dict[int, list[int]] | None, budget_bytes: int = 0,
               extra: dict[int, int] | None = None) -> ExpertCache | None:
    """The residency a policy runs with (None: stock, llama.cpp alone). ``extra``: the baselines' slots beyond
    ``slots`` by layer (what whole rows leave of the budget, ``budget.allocate_slots``), so they spend the same
    memory as the engine; the learned policies spend theirs as the engine does."""
    extra = extra or {}
    if policy.startswith("all-resident"):
        # -hooked keeps the residency engine on with nothing to do: its own cost per layer when every expert hits
        cache = ExpertCache(model, layout, layout.n_expert, tier=make_tier("ram"), hook=policy.endswith("hooked"))
        cache.warm({L.index: list(range(layout.n_expert)) for L in layout.layers})
        return cache
    if policy.startswith(HOT_POLICIES):
        # the profile's hottest experts, loaded once; no hook, so nothing moves inside a layer and every miss is
        # computed on the host (as on-demand-cpu computes its misses, without the uploads); -mapped: by the device,
        # from the host copy (each miss crosses the link once, never uploaded). adaptive-hot re-chooses the set
        # between decodes, and its uploads are timed with the decode before them
        if hot is None:
            raise SpecterError(f"{policy} needs a routing profile")
        cache = ExpertCache(model, layout, slots, tier=make_tier(tier), hook=False, extra=extra,
                            miss="mapped" if policy.endswith("-mapped") else "wait")
        cache.warm_hot(hot, adapt=policy.startswith("adaptive-hot"))
        return cache
    if policy in ("learned", "learned-evict"):
        # on-demand waits as in on-demand-lru-ordered, with eviction by the learned reuse maps (no duel: what they
        # alone do); "learned" adds the native planner's prefetches from the layer-ahead maps. All in C.
        from pyspecter.learned import LearnedPredictor

        predictor = LearnedPredictor.load(path)
        if policy == "learned-evict":  # no planner: it holds, and the budget counts, the reuse maps alone
            predictor = predictor.reuse_only()
        if budget_bytes:  # as the engine spends its budget: the predictor's bytes out, the rest by layer
            mp = MemoryPlan.for_budget(layout, str(budget_bytes), predictor_bytes=predictor.nbytes, spread=True,
                                       curves=predictor.miss_curves, device=model.device)
            slots, extra = mp.slots, mp.extra
        return ExpertCache(model, layout, slots, policy="predicted", miss="wait", tier=make_tier(tier),
                           record=True, ordered=True, extra=extra, reuse=predictor, duel=False,
                           ahead=predictor if policy == "learned" else None)
    if policy == "prev-token":
        # misses waited for, as on-demand-lru and -lfu do: only the eviction order differs
        return ExpertCache(model, layout, slots, policy="prev-token", miss="wait", tier=make_tier(tier), record=True,
                           extra=extra)
    if policy == "on-demand-lru-ordered":
        # wait mode, but a layer's misses are computed after its resident experts, while they land (0005)
        return ExpertCache(model, layout, slots, policy="lru", miss="wait", tier=make_tier(tier), record=True,
                           ordered=True, extra=extra)
    if policy == "on-demand-mapped":
        # on-demand-cpu's LRU, its misses read by the device from the host copy in place (CUDA, pinned host
        # experts), or from a device copy standing in (RPC: over the budget, reported as mapped_copy_mb)
        return ExpertCache(model, layout, slots, policy="lru", miss="mapped", tier=make_tier(tier), record=True,
                           extra=extra)
    if policy.startswith("on-demand-"):
        kind = policy.removeprefix("on-demand-")
        t = make_tier(tier)
        # cpu: in place where a copy into a slot buys nothing (host slots over RAM), as the session runs it
        cpu = "host" if computes_in_place(t, host_slots=model.device is None) else "cpu"
        return ExpertCache(model, layout, slots, policy="lru" if kind == "cpu" else kind,
                           miss=cpu if kind == "cpu" else "wait", tier=t, record=True, extra=extra)
    if policy == "surrogate":
        # approximate: single-token misses computed by the expert's surrogate; `slots` already paid for them
        sur = Surrogates(layout, select_neurons(path, surrogate_width, progress=False))
        return ExpertCache(model, layout, slots, miss="surrogate", surrogates=sur, tier=make_tier(tier))
    if not policy.startswith("stock"):
        raise SpecterError(f"unknown policy {policy!r}")
    return None


def _model_for(policy: str, path: Path, layout: ModelLayout, device: Device | None, budget_bytes: int,
               lazy_experts: bool = False) -> Model:
    """Stock is llama.cpp as users run it (repacked weights where the CPU has kernels for them); with a device,
    stock-cpu-moe keeps every expert on the host (--cpu-moe), stock-n-cpu-moe the first N blocks' (--n-cpu-moe N
    at our budget), stock-device none (every weight on the device: the no-stall limit, over budget)."""
    if device is None or policy == "stock":
        # our policies on the disk tier load without pre-faulting the experts, as the session does (patch 0005)
        return Model(path, extra_bufts=policy == "stock", lazy_experts=lazy_experts and policy != "stock")
    if policy == "stock-cpu-moe":
        return Model(path, device=device, extra_bufts=True)
    if policy == "stock-n-cpu-moe":
        return Model(path, device=device, extra_bufts=True, n_cpu_moe=n_cpu_moe_for(layout, budget_bytes))
    if policy == "stock-device":
        return Model(path, device=device, extra_bufts=True, n_cpu_moe=0)
    return Model(path, device=device, pinned=True)  # our slots: uploads and mapped misses read pinned memory


def run_policy(policy: str, path: Path, layout: ModelLayout, slots: int, tier: str, prompts: list[list[int]],
               n: int, n_threads: int, surrogate_width: float = 0.25,
               hot: dict[int, list[int]] | None = None, device: Device | None = None, budget_bytes: int = 0,
               extra: dict[int, int] | None = None, plan: LayerPlan | None = None,
               forced: list[list[int]] | None = None) -> Run:
    """One run of a non-speculative policy over every prompt. ``hot``: static-hot's profile, per MoE layer the
    times each expert was selected (``hitrates.hot_profile``: the model reading the packaged calibration text,
    never what bench measures); its slots get the most selected, once (a hot plan's slot layers too).
    ``device``: layers (and our slots) on that device, experts' host copy in RAM. ``forced``: per prompt, the
    held-out tokens its decode is fed (``forced.forced_tokens``) instead of the greedy ones."""
    proc = psutil.Process()
    t_load = time.perf_counter()
    if policy in ("plan", "plan-mapped"):
        if plan is None or device is None:
            raise SpecterError(f"policy {policy} needs --device (and a layer plan)")
        model = Model(path, device=device, host_layers=plan.host_layers, pinned=bool(plan.layers("slots")))
    else:
        model = _model_for(policy, path, layout, device, budget_bytes, lazy_experts=tier == "disk")
    cache = None
    try:
        if policy in ("plan", "plan-mapped"):  # plan-mapped: its slot layers' misses read from the host copy
            cache = ExpertCache(model, layout, plan.n_slots, miss="mapped" if policy == "plan-mapped" else "cpu",
                                tier=make_tier("ram"), kinds=plan.native_kinds(),
                                hook=not plan.hot) if plan.layers("slots") else None
            if plan.hot and cache is not None:  # a hot set, re-chosen between decodes as the session's is
                cache.warm_hot(hot_profile(path, layout, n_threads), adapt=True)
        else:
            cache = _cache_for(policy, model, layout, slots, tier, path, surrogate_width, hot, budget_bytes, extra)
        prefill, tpots, parts, tokens, peak = 0.0, [], [], [], proc.memory_info().rss
        first_prefill, digests = None, [] if forced is not None else None
        syncs: dict | None = None
        with Context(model, n_threads=n_threads, n_ctx=max(map(len, prompts)) + n + 8) as ctx:
            splits = graph_splits()
            ctx.warmup()
            load_s = time.perf_counter() - t_load
            for i, prompt in enumerate(prompts):
                ctx.clear()
                mark = len(cache.trace) if cache and cache.trace is not None else 0
                t0 = time.perf_counter()
                logits = ctx.decode(prompt)
                prefill += time.perf_counter() - t0
                first_prefill = prefill if first_prefill is None else first_prefill
                if cache:
                    cache.check()
                    cache.reset_counters()
                    if cache.trace is not None:
                        del cache.trace[mark:]  # prefill's routing is a batch, not what decode must predict
                sync_counts(reset=True)  # decode's synchronisations only
                for t in range(n):
                    if forced is None:
                        tokens.append(int(np.argmax(logits)))
                    else:  # the digest before the timer starts: the timed step is the decode alone, as free
                        digests.append(digest(logits))
                        tokens.append(forced[i][t])
                    t0 = time.perf_counter()
                    logits = ctx.decode([tokens[-1]])
                    if cache:
                        cache.adapt()  # an adaptive hot set's moves, as the session makes them between decodes
                    tpots.append(time.perf_counter() - t0)
                    peak = max(peak, proc.memory_info().rss)
                syncs = _add_syncs(syncs)
                if cache:
                    parts.append(cache.counters())
                    cache.check()
        c = merge_counters(parts)
        if cache:
            c["slots_mean"] = cache.usable_mean()
            c["host_experts"] = model.host_experts()  # what uploads and mapped misses read: pinned or pageable
            if cache.mapped_copy_bytes:
                c["mapped_copy_bytes"] = cache.mapped_copy_bytes
        return Run(prefill, tpots, c, peak, cache.trace if cache else None, tokens, load_s, first_prefill or 0.0,
                   splits[1] if splits else None, FREE if forced is None else FORCED, digests, syncs)
    finally:
        if cache:
            cache.close()
        model.close()


def run_specter(path: Path, draft: Path | None, budget_bytes: int | None, count_draft: bool, tier: str | None,
                prompts: list[list[int]], n: int, n_threads: int, k: int, adaptive: bool = True,
                device: str | None = None, forced: list[list[int]] | None = None) -> Run:
    """One run of the engine over every prompt, as generate and chat run it; the session and its slots persist.
    With a draft: speculative decoding with draft-driven prefetch and the K governor; without one ("engine"): the
    learned predictor in C (when one is fitted for the model): the native planner's prefetches, the reuse maps'
    eviction. ``budget_bytes`` and
    ``tier`` None: placed as generate places a model given no flags (stock llama.cpp when it fits). ``forced`` (no
    draft only): the session's sampler picks the held-out text's tokens (``forced.ForcedSampler``)."""
    if forced is not None and draft is not None:
        raise SpecterError("teacher-forced decoding runs without a draft (the speculative decoder drafts its own)")
    proc = psutil.Process()
    t_load = time.perf_counter()
    # force: the bench placed its budget, and its capped children see the host's memory, not their cap
    budget = str(budget_bytes) if budget_bytes is not None else None
    s = Session(SessionConfig(model=path, draft=draft, budget=budget, tier=tier, force=budget is not None, k=k,
                              adaptive=adaptive, n_ctx=max(map(len, prompts)) + n + 16, n_threads=n_threads,
                              draft_counts_in_budget=count_draft, device=device))
    load_s = time.perf_counter() - t_load  # the session warms its contexts up
    try:
        prefill, tpots, parts, tokens = 0.0, [], [], []
        first_prefill, digests = None, [] if forced is not None else None
        syncs: dict | None = None
        for i, prompt in enumerate(prompts):
            stamps: list[float] = []
            if forced is not None:
                s.sampler = ForcedSampler(forced[i])

            steps: list[int] = []

            def on_token(_t: int, stamps: list[float] = stamps, steps: list[int] = steps) -> None:
                stamps.append(time.perf_counter())
                steps.append(s.decoder.stats.steps if draft is not None else len(stamps))  # no draft: a token a step
                if len(stamps) == 1:  # decode counters only, as for the other policies
                    s.reset_stats()
                    sync_counts(reset=True)

            t0 = time.perf_counter()
            # the first token comes straight from the target's prefill; the rest are decode
            out = s.generate(prompt, n + 1, stop_at_eog=False, on_token=on_token)
            prefill += stamps[0] - t0
            first_prefill = prefill if first_prefill is None else first_prefill
            tpots += step_token_times(stamps, steps)
            syncs = _add_syncs(syncs)
            parts.append(s.cache.counters() if s.cache is not None else {})
            tokens += out[:n]  # as the other policies count them: the first n, the prefill's own included
            if forced is not None:
                digests += s.sampler.digests()[:n]
        c = merge_counters(parts) if s.cache is not None else {}
        c["slots"] = s.n_slots
        c["slots_mean"] = s.cache.usable_mean() if s.cache is not None else None
        if s.decoder is not None:
            ds = s.decoder.stats
            c.update(acceptance=ds.acceptance, mean_k=ds.mean_k, draft_off=ds.draft_off,
                     draft_dropped_at=ds.dropped_at, drafted=ds.drafted, accepted=ds.accepted,
                     draft_prefetches=ds.prefetches, draft_prefetches_used=ds.prefetches_used,
                     draft_prefetches_scored=ds.prefetches_scored, draft_prefetch_bytes=ds.prefetch_bytes,
                     draft_prefetch_stopped_at=ds.prefetch_stopped_at)
        st = s.stats()
        c.update({k: st[k] for k in ENGINE_STATS if k in st})
        return Run(prefill, tpots, c, proc.memory_info().rss, tokens=tokens, load_s=load_s,
                   first_prefill_s=first_prefill or 0.0, splits=s.target_splits[1] if s.target_splits else None,
                   decode=FREE if forced is None else FORCED, digests=digests, syncs=syncs)
    finally:
        s.close()
