"""bench's device rows: host round trips as llama.cpp plans them (its split count) and as the scheduler takes them
(``native.sync_counts``), and the layer plan's predictions beside what was measured."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

from pyspecter.devcosts import calibrate, measure_mapped, plan_for, save_calibration
from pyspecter.errors import SpecterError
from pyspecter.hitrates import hot_hits
from pyspecter.layerplan import DeviceCosts, LayerPlan, predict_us, stock_plan
from pyspecter.layout import ModelLayout
from pyspecter.native.devices import Device


def device_columns(splits: int | None, n_moe_layers: int, on_device: bool, syncs: dict | None = None,
                   n_tokens: int = 0, counters: list[dict] | None = None) -> dict:
    """A device row's host round trips: llama.cpp's splits of the one-token graph, and the switches beyond the two
    every device graph has (the host's input split, then the device), per MoE layer; and, from ``syncs`` (the
    decode's ``native.sync_counts`` over ``n_tokens`` tokens), what the scheduler actually did per token: splits
    computed, switches between host and device taken, and the host's waits for the device (stream or event
    synchronisations), with the same two-per-graph floor taken out per MoE layer; and the time in those waits, in
    the host's splits and in launching the device's. Also the uploads' own rate, GB/s: bytes over the time some
    batch was in flight, from its first copy to its landing (a wait for the stream's earlier work included;
    overlapping batches counted once), to read beside the link's rate and the bytes a token moved over its own time
    (None where nothing moved); and the most batches a device stream held in flight at once."""
    if not on_device or splits is None:
        return {}
    out = {"splits_per_token": splits, "host_switches_per_moe_layer": (splits - 2) / n_moe_layers}
    upload_ns = sum(c.get("upload_ns", 0) for c in counters or [])
    out["upload_busy_gbps"] = sum(c.get("upload_bytes", 0) for c in counters or []) / upload_ns if upload_ns else None
    out["upload_inflight_peak"] = max((c.get("upload_inflight_peak", 0) for c in counters or []), default=0)
    out.update(spec_columns(counters or [], n_tokens))
    copies = [c["mapped_copy_bytes"] for c in counters or [] if "mapped_copy_bytes" in c]
    if copies:  # misses read from a device copy standing in for the host's (RPC): device memory beyond the budget
        out["mapped_copy_mb"] = max(copies) / 2**20
    if syncs and n_tokens > 0 and syncs.get("device_computes", 0) + syncs.get("host_computes", 0) > 0:
        per = {k: v / n_tokens for k, v in syncs.items()}
        out.update(splits_computed_per_token=per["device_computes"] + per["host_computes"],
                   # split boundaries crossed (a token's first split counts its switch from the token before's last)
                   switches_taken_per_token=per["switches"],
                   switches_taken_per_moe_layer=(per["switches"] - 2) / n_moe_layers,
                   # the host waiting for the device: stream synchronisations and event synchronisations
                   host_syncs_per_token=per["syncs"] + per["event_syncs"], sync_counts_per_token=per,
                   # where a token's time went, on the decoding thread: waiting for the device, computing the host's
                   # splits, launching the device's (the rest: the scheduler's copies, sampling, Python)
                   host_wait_ms_per_token=per.get("sync_ns", 0) / 1e6,
                   host_split_ms_per_token=per.get("host_compute_ns", 0) / 1e6,
                   device_launch_ms_per_token=per.get("device_compute_ns", 0) / 1e6,
                   # after a speculated ubatch, residency hearing each layer's routing from the log: host time
                   # between tokens, in which the device waits
                   host_settle_ms_per_token=per.get("settle_ns", 0) / 1e6,
                   # ggml-cuda's CUDA graphs (0 elsewhere): captures, and captured graphs dropped because a node
                   # changed; in steady decode both near 0 (each split launched as one captured graph)
                   cuda_graph_warmups_per_token=per.get("cuda_graph_warmups", 0),
                   cuda_graph_resets_per_token=per.get("cuda_graph_resets", 0))
    return out


def spec_columns(counters: list[dict], n_tokens: int) -> dict:
    """A slot row's ubatches per decode token that ran with no host path (csrc/speculate.cpp), those a missed
    row computed again, the rows the device read from the host copy instead (csrc/mapped.cpp), the bytes the
    fences pushed to the remap tables, and the upload batches that first waited for the device's queued compute,
    averaged over the repeats' ``counters`` (a slot row's cache counters, one per repeat); and the upload threads'
    waits for their batches to land, wall and their CPU time in it (where the two are near, the wait spun a core)."""
    if n_tokens <= 0 or not any("spec_ubatches" in c for c in counters):
        return {}
    return {f"{k}_per_token": statistics.mean(c.get(k, 0) for c in counters) / n_tokens
            for k in ("spec_ubatches", "spec_redos", "mapped_rows", "table_bytes", "compute_orders",
                      "landing_wait_ns", "landing_wait_cpu_ns")}


def syncs_over_device(policies: dict, n_moe_layers: int) -> None:
    """Each device row's host synchronisations per token beyond stock-device's (a graph with no host layer: its
    inputs and its logits cost the same few in every row), per MoE layer: what a row's host and slot layers add.
    Only where stock-device ran and counted them."""
    ref = policies.get("stock-device", {}).get("host_syncs_per_token")
    if ref is None:
        return
    for p in policies.values():
        if "host_syncs_per_token" in p:
            p["host_syncs_per_moe_layer"] = (p["host_syncs_per_token"] - ref) / n_moe_layers


def layer_plans(path: Path, layout: ModelLayout, device: Device | None, budget_bytes: int, n_threads: int,
                policies: list[str]) -> tuple[dict[str, LayerPlan], dict[str, dict], dict[str, str]]:
    """The layer plans the policies ask for, from measured costs (``devcosts.plan_for``): "plan", and "plan-mapped"
    priced with its slot layers' misses read from the host copy. Returns the plans, their infos (bench's
    "layer_plan" and "layer_plan_mapped") and, for a plan that could not be made, why (its row says so)."""
    plans, infos, why = {}, {}, {}
    for p in ("plan", "plan-mapped"):
        if device is not None and p in policies:
            try:
                plans[p], infos[p] = plan_for(path, layout, device, budget_bytes, n_threads, mapped=p == "plan-mapped")
            except SpecterError as e:  # a device that cannot read the host copy
                why[p] = str(e)
    return plans, infos, why


def predictions(out: dict, layout: ModelLayout, path: Path, device: Device, n_threads: int) -> None:
    """The cost model beside what bench measured: each device row whose placement the model knows (stock's three,
    the plan) gets the time it predicted; where stock --cpu-moe and --n-cpu-moe both ran, the costs are refitted
    to them (``devcosts.calibrate``), saved for the plan to read from now on, and each row gets the refitted
    prediction too. The mapped rows (``--miss mapped``, every layer slots) are priced with a row read from the host
    copy and the share of their uploads a token waits for, measured once (``devcosts.measure_mapped``). Adds
    ``out["layer_plan"]["calibrated"]`` (and ``["map_row_us"]``, ``["upload_share"]``: None where unmeasured)."""
    info = out.get("layer_plan")
    pol = out["policies"]
    if "tpot_ms" in pol.get("plan-mapped", {}):  # plan_for priced it so (measured costs, LRU's hit curve)
        pol["plan-mapped"]["predicted_ms"] = out["layer_plan_mapped"]["predicted_ms"]
    if info is None:
        return
    n_cpu = info["stock_n_cpu_moe"]
    plans = {"stock-cpu-moe": stock_plan(layout, None), "stock-n-cpu-moe": stock_plan(layout, n_cpu),
             "stock-device": stock_plan(layout, 0),
             "plan": LayerPlan({int(il): k for il, k in info["kinds"].items()}, info["n_slots"], info["n_zero"],
                               hot=info.get("hot", False))}
    costs = DeviceCosts(**info["costs"])
    curves = {"hits": info.get("lru_hits"), "hot_hits": info.get("hot_hits"), "hot_moves": info.get("hot_moves")}
    for name, plan in plans.items():
        if "tpot_ms" in pol.get(name, {}):
            pol[name]["predicted_ms"] = predict_us(plan, layout, costs, **curves) / 1e3
    # the mapped rows (every layer slots, misses read by the device from the host copy): a row read so, measured;
    # static-hot's slots hold the hot set of the plan's profile (hitrates.hot_profile), pinned; adaptive-hot's
    # start from it and move between decodes, as a hot plan's; on-demand's move inside a layer (LRU)
    every = LayerPlan({L.index: "slots" for L in layout.layers}, out["slots_per_layer"])
    mapped = {n: replace(every, hot=n != "on-demand-mapped")
              for n in ("on-demand-mapped", "static-hot-mapped", "adaptive-hot-mapped") if "tpot_ms" in pol.get(n, {})}
    pinned = {**curves, "hot_hits": hot_hits(path, layout, n_threads, static=True), "hot_moves": None}
    row_curves = {n: pinned if n == "static-hot-mapped" else curves for n in mapped}
    if mapped:
        measured = measure_mapped(path, layout, device, costs, n_threads=n_threads)
        info["map_row_us"], info["upload_share"] = measured.map_row_us, measured.upload_share
        for name, plan in mapped.items():
            pol[name]["predicted_ms"] = predict_us(plan, layout, measured, mapped=True, **row_curves[name]) / 1e3
    a, b = pol.get("stock-cpu-moe", {}), pol.get("stock-n-cpu-moe", {})
    if "tpot_ms" not in a:
        return
    fitted = calibrate(layout, costs, a["tpot_ms"], b.get("tpot_ms"), n_cpu, out.get("link_gbps", 0.0))
    save_calibration(path, device, n_threads, fitted,
                     f"bench {time.strftime('%Y-%m-%d')}: stock --cpu-moe {a['tpot_ms']:.2f} ms"
                     + (f", --n-cpu-moe {n_cpu} {b['tpot_ms']:.2f} ms" if "tpot_ms" in b else "")
                     + f", link {out.get('link_gbps', 0.0):.2f} GB/s")
    info["calibrated"] = fitted.as_dict()
    for name, plan in plans.items():
        if "tpot_ms" in pol.get(name, {}):
            pol[name]["predicted_calibrated_ms"] = predict_us(plan, layout, fitted, **curves) / 1e3
    if mapped:  # cached now: the row as measured, the share at the refitted link (devcosts.share_at)
        as_mapped = measure_mapped(path, layout, device, fitted, n_threads=n_threads)
    for name, plan in mapped.items():
        pol[name]["predicted_calibrated_ms"] = predict_us(plan, layout, as_mapped, mapped=True,
                                                          **row_curves[name]) / 1e3
