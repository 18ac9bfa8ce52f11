"""Exactness check: the same prompt through stock llama.cpp and through the expert-slot path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from pyspecter.cache import ExpertCache
from pyspecter.engine import generate_step
from pyspecter.hitrates import hot_profile
from pyspecter.layerplan import LayerPlan
from pyspecter.layout import read_layout
from pyspecter.native import Context, Model, device_stats, graph_splits
from pyspecter.native.devices import open_device
from pyspecter.sampling import Sampler
from pyspecter.study.forced import ForcedSampler, forced_tokens
from pyspecter.tiers import make_tier

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Explain why the sky is blue, step by step."


def _decode(ctx: Context, toks: list[int], n_tokens: int, fed: list[int] | None,
            between: Callable[[], object] = lambda: None) -> tuple[list[int], np.ndarray]:
    """Greedy, or teacher-forced with the tokens ``fed``: (tokens, the logits each came after). ``between`` runs
    between decodes (an adaptive hot set's moves)."""
    out, rows = [], []
    for tok, logits in generate_step(ctx, toks, Sampler() if fed is None else ForcedSampler(fed)):
        out.append(tok)
        rows.append(logits)
        if len(out) >= n_tokens:
            break
        between()
    return out, np.stack(rows)


def _stock_ref(path: str | Path, dev, host_layers, toks: list[int] | None, prompt: str, n_tokens: int,
               n_threads: int, n_batch: int, forced: bool,
               fed: list[int] | None = None) -> tuple[list[int], list[int] | None, list[int], np.ndarray, tuple]:
    """Stock llama.cpp's run with a placement: (prompt tokens, tokens fed or None, tokens, logits, splits)."""
    with (Model(path, device=dev, host_layers=host_layers) as model,
          Context(model, n_threads=n_threads, n_batch=n_batch, op_offload=False) as ctx):
        splits = graph_splits()
        toks = toks if toks is not None else model.tokenize(prompt)
        if forced and fed is None:
            fed = forced_tokens(model, 1, n_tokens)[0]
        tokens, logits = _decode(ctx, toks, n_tokens, fed)
    return toks, fed, tokens, logits, splits


def logit_gap(a_tokens: list[int], a_logits: np.ndarray, b_tokens: list[int], b_logits: np.ndarray) -> float:
    """max |Δlogit| of two greedy runs while both saw the same context (up to and including their first
    differing token)."""
    n = min(len(a_tokens), len(b_tokens))
    same_prefix = next((i for i in range(n) if a_tokens[i] != b_tokens[i]), n)
    k = min(same_prefix + 1, n)
    return float(np.max(np.abs(a_logits[:k] - b_logits[:k]))) if k else 0.0


def device_contract(ours: np.ndarray, d_ours_device: float, stock_gap: float, all_resident: bool) -> dict:
    """The exactness contract on a device, where no bit-exact reference exists once misses run on the CPU (stock
    with the same placement computes the experts on the CPU, the slots compute them on the device):
    - never a NaN or an inf;
    - every expert in a slot: stock's logits with every expert on the device, bit for bit;
    - with misses: no further from stock-device than stock's own --cpu-moe run is (measured in the same run)."""
    finite = bool(np.all(np.isfinite(ours)))
    bound = 0.0 if all_resident else stock_gap
    return {"finite": finite, "reference": "stock-device", "max_abs_logit_diff_vs_device": d_ours_device,
            "bound": bound, "bound_is": "0 (every expert in a slot)" if all_resident else
            "stock --cpu-moe vs stock-device, same tokens", "ok": finite and d_ours_device <= bound}


def verify(path: str | Path, *, slots: int, miss: str = "wait", tier: str = "ram", policy: str = "lru",
           prompt: str = DEFAULT_PROMPT, n_tokens: int = 16, n_threads: int = 2, n_batch: int = 512,
           ordered: bool = False, device: str | None = None, plan: LayerPlan | None = None,
           forced: bool = False, hot: bool = False) -> dict:
    """Greedy tokens and logits of stock vs slot path. Attention and batching settings are identical in both
    (docs/DESIGN.md, exactness: routing near-ties make any difference there look like a slot bug). With a device,
    stock gets the same placement (layers on the device, experts in host memory, no op offload); with a layer
    plan too (its full layers' experts on the device, its host and slot layers' in host memory).

    On a device (no layer plan) the result also holds ``contract`` (device_contract): stock with every expert on
    the device is run too, and with slots for every expert they are all uploaded before the prompt.

    ``forced``: every run is fed the same held-out text after the prompt (study/forced.py) instead of its own
    greedy picks, so the logits are compared at every step even where a near-tie would make greedy runs part
    (random-weight models: their greedy text cycles, real text makes the routing move). ``hot``: the slots hold
    the model's hot set (``hitrates.hot_profile``), no residency engine, re-chosen from the text's own routing
    between decodes (``hotset``): what a layer plan's hot slot layers run (``hot_moves``: experts it loaded)."""
    layout = read_layout(path).require_moe()
    the_tier = make_tier(tier)  # validate before the expensive part
    dev = open_device(device)
    host_layers = plan.host_layers if plan is not None and dev is not None else None
    toks, fed, ref_tokens, ref_logits, stock_splits = _stock_ref(path, dev, host_layers, None, prompt, n_tokens,
                                                                 n_threads, n_batch, forced)
    contract_run = dev is not None and plan is None
    all_resident = contract_run and slots >= layout.n_expert
    if contract_run:
        _, _, dev_tokens, dev_logits, _ = _stock_ref(path, dev, [], toks, prompt, n_tokens, n_threads, n_batch,
                                                     forced, fed)

    with Model(path, device=dev, host_layers=host_layers, pinned=True) as model:
        cache = ExpertCache(model, layout, slots, policy=policy, miss=miss, tier=the_tier, ordered=ordered,
                            kinds=plan.native_kinds() if plan is not None else None, hook=not hot)
        try:
            if all_resident:
                cache.warm({L.index: list(range(layout.n_expert)) for L in layout.layers})
            elif hot:  # as a hot plan runs it: re-chosen from the text's own routing between decodes
                cache.warm_hot(hot_profile(path, layout, n_threads), adapt=True)
            moved = []
            with Context(model, n_threads=n_threads, n_batch=n_batch) as ctx:
                splits = graph_splits()
                got_tokens, got_logits = _decode(ctx, toks, n_tokens, fed, lambda: moved.append(cache.adapt()))
                cache.check()
            counters = cache.counters()
            dev_stats = device_stats(model.ptr).as_dict()
            host_experts = model.host_experts()
        finally:
            cache.close()

    out = {
        "model": str(path), "arch": layout.arch, "device": dev.name if dev else "CPU", "tier": the_tier.name,
        "emulated": the_tier.emulated,
        "slots": cache.n_slots, "n_expert": layout.n_expert, "n_expert_used": layout.n_expert_used,
        "miss": miss, "policy": "hot" if hot else policy, "native": cache.native,
        "decode": "teacher-forced" if forced else "greedy",
        "identical_tokens": ref_tokens == got_tokens,
        "max_abs_logit_diff": logit_gap(ref_tokens, ref_logits, got_tokens, got_logits), "n_tokens": len(got_tokens),
        "n_prompt_tokens": len(toks), "hit_rate": counters["hit_rate"],
        "slot_row_rate": counters["slot_row_rate"], "uploads": counters["uploads"],
        "upload_bytes": counters["upload_bytes"], "overflow_rows": counters["overflow_rows"], "late": counters["late"],
        "hook_us_per_call": counters["hook_us_per_call"], "route_us_per_call": counters["route_us_per_call"],
        "hot_moves": sum(moved), "stock_tokens": ref_tokens, "slot_tokens": got_tokens,
        "stock_splits": stock_splits, "splits": splits, "device_tables": dev_stats, "host_experts": host_experts,
    }
    if contract_run:
        stock_gap = logit_gap(ref_tokens, ref_logits, dev_tokens, dev_logits)
        out["stock_device_tokens"] = dev_tokens
        out["stock_gap_cpu_moe_vs_device"] = stock_gap
        out["contract"] = device_contract(got_logits, logit_gap(dev_tokens, dev_logits, got_tokens, got_logits),
                                          stock_gap, all_resident)
        out["contract_ok"] = out["contract"]["ok"]
    return out
