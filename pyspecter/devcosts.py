"""The layer plan's inputs, measured on the model itself on its device in a few seconds, and cached per machine,
device and model (``~/.cache/pyspecter/devcosts.json``).

Two stock placements of the same model are decoded side by side, a round of each in turn (so that other work on
the machine falls on both alike), each step a new token as decode runs them:
  A  every layer's experts on the host (--cpu-moe):  a token costs base + L (2 split + k cpu_row);
  B  the last m layers' experts on the device:        base + (L - m)(2 split + k cpu_row) + m k dev_row.
Their difference at one token a step is what a host layer costs over a full one, measured as such: the plan's
main trade. Each one-token step is paired with a step of W distinct tokens: the distinct experts those route to
beyond k, counted per layer on the CPU with the same tokens, give cpu_row (A's extra time over A's extra rows) and
dev_row (B's, its host layers' share taken out), and the split is what the host-over-full difference leaves
(never below 0: the difference is kept exact, the rows give way). Each figure is a median of paired differences
(load that comes and goes falls on both sides), which placement goes first turns every pair, and nothing is timed
before a warm-up prompt (``_warm_up``). The link is timed on a few uploads into slots of one layer.
"""

from __future__ import annotations

import ctypes
import socket
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from pyspecter import native
from pyspecter.budget import zero_slots
from pyspecter.hitrates import hot_hits, hot_moves, lru_hits
from pyspecter.layerplan import (
    DeviceCosts,
    LayerPlan,
    choose_plan,
    hit_rate,
    n_cpu_moe_for,
    predict_us,
    stock_plan,
)
from pyspecter.layout import ModelLayout
from pyspecter.native.devices import Device
from pyspecter.native.hooks import Hooks
from pyspecter.paths import Measurements

# in the cache key: a measurement made another way is measured again, never reused
VERSION = 5  # 5: the warm-up prompt and the turning order (2026-12-07)
WIDTH = 4  # tokens per step of the wide rounds
WARM = 64  # the warm-up's tokens: each expert selected with chance 1 - (1 - k/E)^64, > 98% from k/E = 1/16
_STORE = Measurements("devcosts", VERSION)


def cache_key(path: str | Path, device: Device, n_threads: int = 2) -> str:
    """Machine, device, model file and the host's threads (a host row's cost depends on them)."""
    st = Path(path).stat()
    return _STORE.key(socket.gethostname(), device.description, f"t{n_threads}", Path(path).resolve(), st.st_size,
                      st.st_mtime_ns)


def _tokens(n_vocab: int, n: int) -> list[int]:
    """n distinct token ids spread over the vocabulary (ids that follow each other would route alike)."""
    return [(1 + 7919 * i) % n_vocab for i in range(n)]


def _warm_up(n_vocab: int, n: int) -> list[int]:
    """The untimed first step of every timed model: WARM distinct tokens after ``n`` measured ones. An expert's
    first read in a process is page faults on an mmap'd model: with one warm-up token they fell on the first timed
    steps of the placement that went first (81 ms against 22 on the RPC device: BENCHMARKS.md, 2026-12-07)."""
    return _tokens(n_vocab, n + WARM)[n:]


def _steps(reps: int, width: int, n_vocab: int) -> list[list[int]]:
    """The decode steps every timed placement and the routing count run, in order: the warm-up, then ``reps``
    pairs of a one-token step and a ``width``-token step (side by side, so that a change in the machine's load
    falls on both of a pair)."""
    n = reps * (1 + width)
    toks = _tokens(n_vocab, n)
    out, at = [_warm_up(n_vocab, n)], 0
    for _ in range(reps):
        out += [toks[at:at + 1], toks[at + 1:at + 1 + width]]
        at += 1 + width
    return out


def _reversed(i: int) -> bool:
    """Whether step ``i`` of ``_steps`` runs the models in reverse order: every other pair (the warm-up, 0, not)."""
    return (i + 1) // 2 % 2 == 1


def _timed_rounds(models: list[native.Model], steps: list[list[int]], n_threads: int) -> list[list[float]]:
    """Seconds of each step (the warm-up's left out) on each model, the models taking turns step by step, in the
    order ``_reversed`` says: the second of two run back to back may find what the first warmed."""
    n_ctx = sum(map(len, steps)) + 16
    ctxs = [native.Context(m, n_ctx=n_ctx, n_threads=n_threads) for m in models]
    try:
        out: list[list[float]] = [[] for _ in models]
        for i, step in enumerate(steps):
            turns = list(zip(ctxs, out, strict=True))
            for ctx, times in (turns[::-1] if _reversed(i) else turns):
                t0 = time.perf_counter()
                ctx.decode(step, logits=True)
                if i:
                    times.append(time.perf_counter() - t0)
        return out
    finally:
        for ctx in ctxs:
            ctx.close()


def _extra_rows(path: str | Path, layout: ModelLayout, steps: list[list[int]], n_threads: int) -> dict[int, float]:
    """Per MoE layer, the distinct experts a wide step routes to beyond a one-token step's k, on average: counted
    on the CPU with the same steps (llama.cpp skips the last layer's FFN for rows that are not outputs: counted
    as it runs)."""
    k = layout.n_expert_used
    distinct: dict[int, list[int]] = {L.index: [] for L in layout.layers}

    def on_route(il: int, n_tokens: int, n_used: int, ids_p, _w_p) -> None:
        if wide[0] and il in distinct:
            ids = np.ctypeslib.as_array(ids_p, shape=(n_tokens * n_used,))
            distinct[il].append(len(set(ids[ids >= 0].tolist())))

    wide = [False]
    with native.Model(path) as model:
        hooks = Hooks(model, on_route, n_slots=1)  # one slot, never filled: every row on the host path
        try:
            with native.Context(model, n_ctx=sum(map(len, steps)) + 16, n_threads=n_threads) as ctx:
                for i, step in enumerate(steps):
                    wide[0] = i > 0 and len(step) > 1  # the warm-up is not a measured step
                    ctx.decode(step, logits=True)
                    hooks.check()
        finally:
            hooks.close()
    return {il: (sum(v) / len(v) - k if v else 0.0) for il, v in distinct.items()}


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


def solve(layout: ModelLayout, m: int, host_over_full_s: float, wide_a_s: float, wide_b_s: float,
          extra: dict[int, float], link_gbps: float, step_a_s: float) -> DeviceCosts:
    """The costs from the measured medians (seconds): A's one-token step less B's (B: the last ``m`` MoE layers
    full), A's and B's wide step less their one-token step, ``extra`` the distinct experts a wide step adds per
    layer, and A's one-token step. The host-over-full difference is kept exactly; what noise makes impossible (a
    negative row or split) gives way to it. Host layers that would cost more than A's whole step are scaled down
    to fit in it."""
    us, k, L = 1e6, layout.n_expert_used, len(layout.layers)
    moe = sorted(L_.index for L_ in layout.layers)
    x_all = sum(extra.get(il, 0.0) for il in moe)
    x_full = sum(extra.get(il, 0.0) for il in moe[L - m:])
    cpu = max(wide_a_s * us, 0.0) / x_all if x_all > 0 else 0.0
    dev = max(wide_b_s * us - cpu * (x_all - x_full), 0.0) / x_full if x_full > 0 else cpu
    host_over_full = host_over_full_s * us / m  # 2 split + k (cpu_row - dev_row)
    split = (host_over_full - k * (cpu - dev)) / 2
    if split < 0:
        split, dev = 0.0, cpu - host_over_full / k
        if dev < 0:
            dev, cpu = 0.0, host_over_full / k
    host_layers = L * (2 * split + k * cpu)
    if host_layers > step_a_s * us > 0:  # rows outgrew their step: load, or wide steps over-pricing a row (RPC)
        # scaled down together, what is put where stays as measured (only the link's share of a slot grows)
        f = step_a_s * us / host_layers
        split, cpu, dev, host_layers = split * f, cpu * f, dev * f, step_a_s * us
    base = step_a_s * us - host_layers if step_a_s > 0 else 0.0
    return DeviceCosts(split_us=split, link_gbps=link_gbps, cpu_row_us=cpu, dev_row_us=dev, base_us=base)


def measure(path: str | Path, layout: ModelLayout, device: Device, *, reps: int = 6, n_threads: int = 2,
            use_cache: bool = True) -> DeviceCosts:
    """The costs of ``layout``'s model on ``device`` (cached; ``use_cache=False`` measures again)."""
    key = cache_key(path, device, n_threads)
    known = _STORE.entries()
    if use_cache and key in known:
        return _costs(known[key])
    L = len(layout.layers)
    moe = sorted(L_.index for L_ in layout.layers)
    free, _ = device.memory()
    per_layer = max(L_.expert_bytes for L_ in layout.layers) * layout.n_expert
    room = free // 2 - 2 * layout.nonexpert_bytes  # both placements at once, and half the device to spare
    m = max(1, min(L, room // per_layer if per_layer else L, 4))
    # A as a slot session loads it (its link is what uploads get), B as stock
    with (native.Model(path, device=device, pinned=True) as a,
          native.Model(path, device=device, host_layers=moe[: L - m]) as b):
        steps = _steps(reps, WIDTH, a.n_vocab)
        ta, tb = _timed_rounds([a, b], steps, n_threads)
        link = _link_gbps(a, layout)
    extra = _extra_rows(path, layout, steps, n_threads)

    def med(x: list[float], y: list[float]) -> float:
        return statistics.median(p - q for p, q in zip(x, y, strict=True))

    one_a, wide_a, one_b, wide_b = ta[0::2], ta[1::2], tb[0::2], tb[1::2]
    costs = solve(layout, m, med(one_a, one_b), med(wide_a, one_a), med(wide_b, one_b), extra, link,
                  statistics.median(one_a))
    _STORE.save(key, {**costs.as_dict(), "source": "measured"})
    return costs


def upload_share_of(extra_s: float, nbytes: int, link_gbps: float) -> float:
    """The share ``predict_us`` charges a mapped token for uploads beside it: the time ``nbytes`` of uploads added
    to the steps they ran beside (``extra_s``) over their time at the link rate the plan charges them at (the costs'
    ``link_gbps``, one synchronous upload at a time), so that the plan charges those bytes what they cost; in [0, 1]
    (1: in full, none hidden). Against the uploads' own time queued alone it would be charged at the wrong rate:
    several in flight run faster than one at a time."""
    full = nbytes / (link_gbps * 1e9) if link_gbps > 0 else 0.0
    return min(max(extra_s / full, 0.0), 1.0) if full > 0 else 1.0


def _upload_share(model: native.Model, layout: ModelLayout, n_slots: int, link_gbps: float, step_s: float,
                  n_threads: int, rounds: int = 5, per_round: int = 3) -> float | None:
    """The share of an upload's link time a token waits for when the upload runs beside it, in steady state.
    Rounds of ``per_round`` one-token steps alone (C) and the same steps with uploads queued before each (D: the
    last awaited at the end, so that an upload a token's compute held back still counts): ``upload_share_of`` the
    extra D - C for those uploads' bytes, the median of the rounds. Each step's uploads are worth half a step at
    the measured link, into slots nothing maps (what the kernels read stays as it was). None where an upload is
    refused or failed."""
    api = native.slots()
    layers = [L.index for L in layout.layers]
    eb = {L.index: L.expert_bytes for L in layout.layers}
    n_up = int(min(max(round(0.5 * step_s * link_gbps * 1e9 / max(eb.values())), 1), 4 * len(layers)))
    jobs = [(layers[i % len(layers)], (i // len(layers)) % layout.n_expert, (i // len(layers)) % n_slots)
            for i in range(4 * len(layers) * n_slots)]
    at = [0]

    def queue(n: int) -> tuple[int, int]:
        """n uploads queued: the last one's ticket (or a negative status: refused) and their bytes."""
        ticket = nbytes = 0
        for _ in range(n):
            il, e, slot = jobs[at[0] % len(jobs)]
            at[0] += 1
            ticket, nbytes = api.load_expert_async(model.ptr, il, e, slot), nbytes + eb[il]
            if ticket < 0:
                break
        return ticket, nbytes

    toks = iter(_tokens(model.n_vocab, 1 + 2 * rounds * per_round))
    shares = []
    with native.Context(model, n_ctx=2 + 2 * rounds * per_round + 16, n_threads=n_threads) as ctx:
        ctx.decode([next(toks)], logits=True)  # warm-up
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(per_round):
                ctx.decode([next(toks)], logits=True)
            c = time.perf_counter() - t0
            t0, moved = time.perf_counter(), 0
            for _ in range(per_round):
                ticket, nbytes = queue(n_up)
                if ticket < 0:
                    return None
                moved += nbytes
                ctx.decode([next(toks)], logits=True)
            if api.upload_wait(model.ptr, ticket) != 1:
                return None
            shares.append(upload_share_of(time.perf_counter() - t0 - c, moved, link_gbps))
    return statistics.median(shares)


def measure_mapped(path: str | Path, layout: ModelLayout, device: Device, costs: DeviceCosts, *, reps: int = 5,
                   n_threads: int = 2, use_cache: bool = True) -> DeviceCosts:
    """``costs`` with ``map_row_us``, a (token, expert) row the device computes from the host copy (``--miss
    mapped``), and ``upload_share``. One load of the model with every layer's experts on the host decodes one-token
    steps twice: as stock --cpu-moe (A), then with every layer a slot layer holding nothing, so that each row is
    read from the host copy (C). A - C = L (2 split + k cpu_row) - L k map_row, the split and the host row taken
    from ``costs``. Then C's steps again beside uploads into the empty slots: what the token waits for of them
    (``_upload_share``). One load, not two as ``measure`` has: a big model's pinned host copy is most of what it
    costs. On the RPC device a device copy stands in for the host's memory (csrc/mapped.cpp), so the row measured
    there is the device's own, not the link's. Cached beside the costs, with the link the share was
    measured against: ``costs`` with another link (bench's refit) get the share that charges the measured bytes
    the same time (``share_at``). What is cached is A - C with the A it was measured beside, and the row is solved
    from it with the costs it is read with, as that share of the A they predict: a row solved once went stale when
    bench refitted the costs (on the RPC device a plan predicted at 1.8 ms a token ran 13)."""
    from pyspecter.cache import ExpertCache

    key = cache_key(path, device, n_threads) + "|mapped"
    known = _STORE.entries().get(key, {})
    k, L = layout.n_expert_used, len(layout.layers)

    host = L * (2 * costs.split_us + k * costs.cpu_row_us)

    def row(a_over_c: float, a_us: float | None) -> float:
        # A - C in the costs' time: measured beside an A of a_us, where the costs say A takes base + host
        scale = (costs.base_us + host) / a_us if a_us else 1.0
        return max((host - a_over_c * scale) / (L * k), 0.0)

    if use_cache and "a_over_c_us" in known:  # upload_share null where refused
        return replace(costs, map_row_us=row(float(known["a_over_c_us"]), known.get("a_us")),
                       upload_share=share_at(known["upload_share"], known["share_link_gbps"], costs.link_gbps))
    with native.Model(path, device=device, pinned=True) as m:
        steps = [_warm_up(m.n_vocab, reps)] + [[t] for t in _tokens(m.n_vocab, reps)]
        (ta,) = _timed_rounds([m], steps, n_threads)
        cache = ExpertCache(m, layout, k, miss="mapped", hook=False)  # nothing resident: every row a miss
        try:
            (tc,) = _timed_rounds([m], steps, n_threads)
            share = _upload_share(m, layout, k, costs.link_gbps, statistics.median(tc), n_threads)
        finally:
            cache.close()
    a_us = statistics.median(ta) * 1e6
    a_over_c = a_us - statistics.median(tc) * 1e6
    _STORE.save(key, {"a_over_c_us": a_over_c, "a_us": a_us, "upload_share": share,
                      "share_link_gbps": costs.link_gbps, "source": "measured"})
    return replace(costs, map_row_us=row(a_over_c, a_us), upload_share=share)


def mapped_cached(path: str | Path, device: Device, n_threads: int = 2) -> bool:
    """Whether ``measure_mapped``'s measurement for this model, device and host threads is cached."""
    return "a_over_c_us" in _STORE.entries().get(cache_key(path, device, n_threads) + "|mapped", {})


def share_at(share: float | None, measured_gbps: float, link_gbps: float) -> float | None:
    """An upload share measured against a link of ``measured_gbps`` (``upload_share_of``) for costs whose link is
    ``link_gbps``: the same time for the same bytes, so it scales with the link, in [0, 1]. None stays None."""
    if share is None or measured_gbps <= 0 or link_gbps <= 0:
        return share
    return min(max(share * link_gbps / measured_gbps, 0.0), 1.0)


_FIELDS = ("split_us", "link_gbps", "cpu_row_us", "dev_row_us", "base_us", "map_row_us", "upload_share")


def _costs(entry: dict) -> DeviceCosts:
    return DeviceCosts(**{k: float(entry[k]) for k in _FIELDS if entry.get(k) is not None})


def calibrate(layout: ModelLayout, costs: DeviceCosts, cpu_moe_ms: float, n_cpu_moe_ms: float | None,
              n_cpu_moe: int, link_gbps: float) -> DeviceCosts:
    """The costs refitted to what bench measured on real text: stock --cpu-moe's and --n-cpu-moe N's time per
    token (N the --n-cpu-moe at bench's budget; its full layers are the MoE layers from block N on) and the link
    over bench's many uploads. As ``solve`` does, the host-over-full difference per layer (2 split + k (cpu_row -
    dev_row)) is kept exactly: the split gives way first (the row costs, from a measurement of their own, stay),
    then the host row; the base is what --cpu-moe's time leaves. Without full layers at that budget the two rows
    are one placement, and only the base and the link move. Where the rows would leave --cpu-moe's time less than
    nothing (measured on a busier machine: on the RPC device they left a base of 0 and every row predicted 20-55%
    slow), the base and rows as measured are scaled down by one factor, and the split still keeps the difference."""
    k = layout.n_expert_used
    L = len(layout.layers)
    m = sum(1 for L_ in layout.layers if L_.index >= n_cpu_moe)
    a = 1e3 * cpu_moe_ms
    hof = 1e3 * (cpu_moe_ms - n_cpu_moe_ms) / m if m > 0 and n_cpu_moe_ms is not None else None

    def fit(f: float) -> tuple[float, float, float]:
        """split, host row and device row with the rows as measured times f, the difference kept where known."""
        split, cpu, dev = costs.split_us, f * costs.cpu_row_us, f * costs.dev_row_us
        if hof is not None:
            split = (hof - k * (cpu - dev)) / 2
            if split < 0:
                split, cpu = 0.0, dev + max(hof, 0.0) / k
        return split, cpu, dev

    f = 1.0
    split, cpu, dev = fit(f)
    if a - L * (2 * split + k * cpu) < 0:
        # a = f base + L (2 split + k cpu): with the difference known, L (hof + k f dev); else split as measured
        num, den = ((a - L * hof, costs.base_us + L * k * costs.dev_row_us) if hof is not None
                    else (a - 2 * L * costs.split_us, costs.base_us + L * k * costs.cpu_row_us))
        if num > 0 and den > 0:
            f = num / den
            split, cpu, dev = fit(f)
    base = max(a - L * (2 * split + k * cpu), 0.0)
    return DeviceCosts(split_us=split, link_gbps=link_gbps if link_gbps > 0 else costs.link_gbps, cpu_row_us=cpu,
                       dev_row_us=dev, base_us=base)


def save_calibration(path: str | Path, device: Device, n_threads: int, costs: DeviceCosts, source: str) -> None:
    """Keep ``costs`` (``calibrate``'s) as the model's costs on this machine and device: ``plan_for`` (the session's
    layer plan, ``inspect --device``, bench's ``plan``) reads them from now on instead of measuring."""
    _STORE.save(cache_key(path, device, n_threads), {**costs.as_dict(), "source": source})


def cost_source(path: str | Path, device: Device, n_threads: int = 2) -> str:
    """Where the cached costs came from: "measured" (``measure``'s few seconds), a bench calibration's line, or
    "none" (not cached yet)."""
    entry = _STORE.entries().get(cache_key(path, device, n_threads))
    return "none" if entry is None else str(entry.get("source", "measured"))


def plan_for(path: str | Path, layout: ModelLayout, device: Device, device_bytes: int,
             n_threads: int = 2, mapped: bool = False) -> tuple[LayerPlan, dict]:
    """The plan the cost model chooses for ``device_bytes`` of experts on the device, and what it predicts per
    token beside stock's --cpu-moe and --n-cpu-moe at that memory, measured with the host's ``n_threads``. Where
    every expert fits, every layer is full, as the session runs it (``placement.device_layer_plan``): stock's own
    placement, no switch to trade. ``mapped``: slot layers as ``--miss mapped`` runs them, priced with a row read
    from the host copy (``measure_mapped``). Slot layers hit as LRU does on the model's routing, or as the hot
    set does, whichever the plan chose, its moves charged (``hitrates``)."""
    costs = measure(path, layout, device, n_threads=n_threads)
    if mapped:
        costs = measure_mapped(path, layout, device, costs, n_threads=n_threads)
    hits, hot, moves = lru_hits(path, layout, n_threads), hot_hits(path, layout, n_threads), hot_moves(path, layout,
                                                                                                       n_threads)
    plan = (stock_plan(layout, 0) if device_bytes >= layout.expert_total_bytes
            else choose_plan(layout, device_bytes, costs, zero_slots(layout, device), mapped=mapped, hits=hits,
                             hot_hits=hot, hot_moves=moves))
    n_cpu = n_cpu_moe_for(layout, device_bytes)
    return plan, {"plan": plan.describe(layout), "cost_source": cost_source(path, device, n_threads),
                  "kinds": {str(il): k for il, k in sorted(plan.kinds.items())},
                  "n_slots": plan.n_slots, "n_zero": plan.n_zero, "hot": plan.hot,
                  "device_bytes": plan.device_bytes(layout), "costs": costs.as_dict(), "lru_hits": hits,
                  "hot_hits": hot, "hot_moves": moves,
                  "hit_rate": (hit_rate(plan.n_slots, layout.n_expert, hot if plan.hot else hits)
                               if plan.layers("slots") else None),
                  "predicted_ms": predict_us(plan, layout, costs, mapped=mapped, hits=hits, hot_hits=hot,
                                             hot_moves=moves) / 1e3,
                  "stock_n_cpu_moe": n_cpu,
                  "mapped": mapped,
                  "predicted_stock_n_cpu_moe_ms": predict_us(stock_plan(layout, n_cpu), layout, costs) / 1e3,
                  "predicted_stock_cpu_moe_ms": predict_us(stock_plan(layout, None), layout, costs) / 1e3}
