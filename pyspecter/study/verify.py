"""Exactness check: the same prompt through stock llama.cpp and through the expert-slot path."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pyspecter.cache import ExpertCache
from pyspecter.engine import greedy
from pyspecter.layerplan import LayerPlan
from pyspecter.layout import read_layout
from pyspecter.native import Context, Model, device_stats, graph_splits
from pyspecter.native.devices import open_device
from pyspecter.tiers import make_tier

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Explain why the sky is blue, step by step."


def verify(path: str | Path, *, slots: int, miss: str = "wait", tier: str = "ram", policy: str = "lru",
           prompt: str = DEFAULT_PROMPT, n_tokens: int = 16, n_threads: int = 2, n_batch: int = 512,
           ordered: bool = False, device: str | None = None, plan: LayerPlan | None = None,
           native: bool | None = None) -> dict:
    """Greedy tokens and logits of stock vs slot path. Attention and batching settings are identical in both
    (docs/DESIGN.md, exactness: routing near-ties make any difference there look like a slot bug). With a device,
    stock gets the same placement (layers on the device, experts in host memory, no op offload); with a layer
    plan too (its full layers' experts on the device, its host and slot layers' in host memory). native: as
    ``ExpertCache``'s (None: C decides wherever it can)."""
    layout = read_layout(path).require_moe()
    the_tier = make_tier(tier)  # validate before the expensive part
    dev = open_device(device)
    host_layers = plan.host_layers if plan is not None and dev is not None else None
    with (Model(path, device=dev, host_layers=host_layers) as stock_model,
          Context(stock_model, n_threads=n_threads, n_batch=n_batch, op_offload=False) as ctx):
        stock_splits = graph_splits()
        toks = stock_model.tokenize(prompt)
        ref_tokens, ref_logits = greedy(ctx, toks, n_tokens)

    with Model(path, device=dev, host_layers=host_layers) as model:
        cache = ExpertCache(model, layout, slots, policy=policy, miss=miss, tier=the_tier, ordered=ordered,
                            kinds=plan.native_kinds() if plan is not None else None, native=native)
        try:
            with Context(model, n_threads=n_threads, n_batch=n_batch) as ctx:
                splits = graph_splits()
                got_tokens, got_logits = greedy(ctx, toks, n_tokens)
                cache.check()
            counters = cache.counters()
            dev_stats = device_stats(model.ptr).as_dict()
        finally:
            cache.close()

    n = min(len(ref_tokens), len(got_tokens))
    # compare logits only while both sides saw the same context
    same_prefix = next((i for i in range(n) if ref_tokens[i] != got_tokens[i]), n)
    k = min(same_prefix + 1, n)
    diff = float(np.max(np.abs(ref_logits[:k] - got_logits[:k]))) if k else 0.0
    return {
        "model": str(path), "arch": layout.arch, "device": dev.name if dev else "CPU", "tier": the_tier.name,
        "emulated": the_tier.emulated,
        "slots": cache.n_slots, "n_expert": layout.n_expert, "n_expert_used": layout.n_expert_used,
        "miss": miss, "policy": policy, "native": cache.native,
        "identical_tokens": ref_tokens == got_tokens, "max_abs_logit_diff": diff, "n_tokens": len(got_tokens),
        "n_prompt_tokens": len(toks), "hit_rate": counters["hit_rate"],
        "slot_row_rate": counters["slot_row_rate"], "uploads": counters["uploads"],
        "upload_bytes": counters["upload_bytes"], "overflow_rows": counters["overflow_rows"], "late": counters["late"],
        "hook_us_per_call": counters["hook_us_per_call"], "route_us_per_call": counters["route_us_per_call"],
        "stock_tokens": ref_tokens, "slot_tokens": got_tokens,
        "stock_splits": stock_splits, "splits": splits, "device_tables": dev_stats,
    }
