"""The layer plan's inputs, measured on the model itself on its device in a few seconds, and cached per machine,
device and model (``~/.cache/pyspecter/devcosts.json``).

Two stock placements of the same model are timed, each at one and at two tokens per decode:
  A  every layer's experts on the host (--cpu-moe): a token costs base + L (2 split + k cpu_row);
  B  the last m layers' experts on the device:       base + (L - m)(2 split + k cpu_row) + m k dev_row.
A one-token step more adds k rows per layer and no switch, so A's and B's differences give k (cpu_row - dev_row)
and then the switch cost; A's own difference bounds cpu_row from above (it also holds the device's extra work for
a token, taken as nothing). The link is timed on a few uploads into slots of one layer.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import time
from pathlib import Path

from pyspecter import native
from pyspecter.layerplan import DeviceCosts, LayerPlan, choose_plan, n_cpu_moe_for, predict_us, stock_plan
from pyspecter.layout import ModelLayout
from pyspecter.native.devices import Device


def _cache_file() -> Path:
    return Path(os.environ.get("SPECTER_CACHE", Path.home() / ".cache" / "pyspecter")) / "devcosts.json"


def cache_key(path: str | Path, device: Device) -> str:
    st = Path(path).stat()
    return f"{socket.gethostname()}|{device.description}|{Path(path).resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _decode_times(model: native.Model, width: int, reps: int, n_threads: int) -> float:
    """Seconds of one decode of ``width`` tokens, after a warm-up: the fastest of ``reps`` (other work on the
    machine only ever adds time, and the differences below must not drown in it)."""
    out = []
    with native.Context(model, n_ctx=16 + width * (reps + 2), n_threads=n_threads) as ctx:
        ctx.decode([1] * width, logits=True)
        for _ in range(reps):
            t0 = time.perf_counter()
            ctx.decode([1] * width, logits=True)
            out.append(time.perf_counter() - t0)
    return min(out)


def _link_gbps(model: native.Model, layout: ModelLayout, reps: int = 4) -> float:
    """Uploads into one slot layer's slots (the model's other layers get none), timed one by one."""
    api = native.slots()
    il = layout.layers[0].index
    kinds = (ctypes.c_int32 * model.n_layer)(*[native.LAYER_SLOTS if i == il else native.LAYER_HOST
                                               for i in range(model.n_layer)])
    if api.slots_init_layers(model.ptr, 1, kinds, model.n_layer) != 0:
        return 0.0
    t0 = time.perf_counter()
    for e in range(reps):
        api.load_expert(model.ptr, il, e % layout.n_expert, 0)
    dt = time.perf_counter() - t0
    return reps * layout.layer(il).expert_bytes / dt / 1e9 if dt > 0 else 0.0


def measure(path: str | Path, layout: ModelLayout, device: Device, *, reps: int = 5, n_threads: int = 2,
            use_cache: bool = True) -> DeviceCosts:
    """The costs of ``layout``'s model on ``device`` (cached; ``use_cache=False`` measures again)."""
    key = cache_key(path, device)
    f = _cache_file()
    try:
        known = json.loads(f.read_text()) if f.exists() else {}
    except ValueError:
        known = {}
    if use_cache and key in known:
        return DeviceCosts(**known[key])
    L, k = len(layout.layers), layout.n_expert_used
    moe = sorted(L_.index for L_ in layout.layers)
    free, _ = device.memory()
    per_layer = max(L_.expert_bytes for L_ in layout.layers) * layout.n_expert
    m = max(1, min(L, (free // 2 - layout.nonexpert_bytes) // per_layer if per_layer else L, 4))
    with native.Model(path, device=device) as a:
        a1 = _decode_times(a, 1, reps, n_threads)
        a2 = _decode_times(a, 2, reps, n_threads)
        link = _link_gbps(a, layout)
    with native.Model(path, device=device, host_layers=moe[: L - m]) as b:
        b1 = _decode_times(b, 1, reps, n_threads)
        b2 = _decode_times(b, 2, reps, n_threads)
    us = 1e6
    k_gap = max(((a2 - a1) - (b2 - b1)) / m * us, 0.0)  # k (cpu_row - dev_row)
    per_host_layer = max((a1 - b1) / m * us, k_gap)  # 2 split + k (cpu_row - dev_row)
    split = (per_host_layer - k_gap) / 2
    cpu_row = max((a2 - a1) * us / (L * k), k_gap / k)
    dev_row = max(cpu_row - k_gap / k, 0.0)
    base = max(a1 * us - L * (2 * split + k * cpu_row), 0.0)
    costs = DeviceCosts(split_us=split, link_gbps=link, cpu_row_us=cpu_row, dev_row_us=dev_row, base_us=base)
    known[key] = costs.as_dict()
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(f)
    except OSError:
        pass  # a cache that cannot be written costs a measurement next time, nothing else
    return costs


def plan_for(path: str | Path, layout: ModelLayout, device: Device, device_bytes: int) -> tuple[LayerPlan, dict]:
    """The plan the cost model chooses for ``device_bytes`` of experts on the device, and what it predicts per
    token beside stock's --cpu-moe and --n-cpu-moe at that memory."""
    costs = measure(path, layout, device)
    plan = choose_plan(layout, device_bytes, costs)
    n_cpu = n_cpu_moe_for(layout, device_bytes)
    return plan, {"plan": plan.describe(layout), "kinds": {str(il): k for il, k in sorted(plan.kinds.items())},
                  "n_slots": plan.n_slots, "device_bytes": plan.device_bytes(layout), "costs": costs.as_dict(),
                  "predicted_ms": predict_us(plan, layout, costs) / 1e3, "stock_n_cpu_moe": n_cpu,
                  "predicted_stock_n_cpu_moe_ms": predict_us(stock_plan(layout, n_cpu), layout, costs) / 1e3,
                  "predicted_stock_cpu_moe_ms": predict_us(stock_plan(layout, None), layout, costs) / 1e3}
