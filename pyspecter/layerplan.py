"""A layer plan on a device: what each MoE layer is, chosen by a cost model from measured inputs.

  full   all the layer's experts on the device: no routing op and no host round trip (stock's device layers);
  host   all of them in host memory, computed there: two switches per token (stock ``--cpu-moe`` layers);
  slots  the dynamic cache: the slot path on the device, misses on the host, one host visit (two switches); with
         misses the device reads from the host copy (``--miss mapped``) no visit, each miss a row read over the link.
         A plan's slot layers are all LRU (misses uploaded) or all ``hot``: a hot set that starts from the model's
         routing of chat prompts and moves only between decodes (``hotset``: no upload inside a layer; each miss
         computed where the miss mode says).

Stock ``--n-cpu-moe N`` (the first N blocks host, the rest full) is one point of this space at its own device
memory, so the plan chosen at that memory is never predicted slower than it. The model's inputs (the cost of one
host switch, the link's speed, and the host's and the device's time per (token, expert) row) are measured on the
model itself by ``devcosts.measure`` and cached per machine, device and model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pyspecter import native
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout

KINDS = ("full", "host", "slots")
_NATIVE = {"slots": native.LAYER_SLOTS, "host": native.LAYER_HOST, "full": native.LAYER_FULL}


@dataclass(frozen=True)
class DeviceCosts:
    """What one token costs on a device, by piece (microseconds, GB/s), as measured (``devcosts.measure``)."""

    split_us: float  # one host<->device switch (a stream synchronisation and copy; a TCP round trip on RPC)
    link_gbps: float  # host -> device uploads
    cpu_row_us: float  # one (token, expert) row of the expert FFN on the host
    dev_row_us: float  # ... on the device
    base_us: float = 0.0  # everything else of a token (attention, dense layers, output) on the device
    # a row the device computes from the host copy, its expert read over the link (--miss mapped; None: unmeasured,
    # ``devcosts.measure_mapped``)
    map_row_us: float | None = None
    # the share of an upload's link time a token waits for when uploads run beside it under --miss mapped: 0 wholly
    # hidden (their own stream on a GPU), 1 the token waits for all of it (RPC's one server thread); None:
    # unmeasured, counted in full (``devcosts.measure_mapped``)
    upload_share: float | None = None

    def as_dict(self) -> dict[str, float]:
        out = {"split_us": self.split_us, "link_gbps": self.link_gbps, "cpu_row_us": self.cpu_row_us,
               "dev_row_us": self.dev_row_us, "base_us": self.base_us}
        return {**out, **{k: v for k, v in (("map_row_us", self.map_row_us), ("upload_share", self.upload_share))
                          if v is not None}}


@dataclass(frozen=True)
class LayerPlan:
    kinds: dict[int, str]  # MoE layer -> full | host | slots
    n_slots: int = 0  # slots per slot layer (0: no slot layer)
    n_zero: int = 0  # all-zero slots each slot layer holds besides (budget.zero_slots: 0 or top-k, by device)
    hot: bool = False  # the slot layers hold a hot set (hotset.HotSet): no residency engine, moves between decodes

    def __post_init__(self) -> None:
        bad = {k for k in self.kinds.values() if k not in KINDS}
        if bad:
            raise SpecterError(f"layer kinds {sorted(bad)}: expected {', '.join(KINDS)}")
        if self.layers("slots") and self.n_slots <= 0:
            raise SpecterError("a plan with slot layers needs n_slots > 0")

    def layers(self, kind: str) -> list[int]:
        return sorted(il for il, k in self.kinds.items() if k == kind)

    @property
    def host_layers(self) -> list[int]:
        """Layers whose experts stay in host memory (host and slot layers): the model load's placement."""
        return sorted(il for il, k in self.kinds.items() if k != "full")

    def native_kinds(self) -> dict[int, int]:
        """For ``ExpertCache(kinds=...)``."""
        return {il: _NATIVE[k] for il, k in self.kinds.items()}

    def device_bytes(self, layout: ModelLayout) -> int:
        """Device memory for experts: a full layer's every expert, a slot layer's slots and its zero slots."""
        eb = {L.index: L.expert_bytes for L in layout.layers}
        return sum(eb[il] * (layout.n_expert if k == "full" else self.n_slots + self.n_zero if k == "slots" else 0)
                   for il, k in self.kinds.items())

    def switches_per_token(self, mapped: bool = False) -> int:
        """Host<->device switches per token the plan's MoE layers cost (full: 0, host and slots: 2; slots whose
        misses the device reads from the host copy, ``mapped``: 0)."""
        return sum(2 for k in self.kinds.values() if k == "host" or (k == "slots" and not mapped))

    def describe(self, layout: ModelLayout) -> str:
        n = {k: len(self.layers(k)) for k in KINDS}
        parts = [f"{n['full']} full", f"{n['slots']} slots ({self.n_slots}/{layout.n_expert})", f"{n['host']} host"]
        if self.hot:
            parts[1] = f"{n['slots']} hot slots ({self.n_slots}/{layout.n_expert})"
        return ", ".join(p for p, k in zip(parts, ("full", "slots", "host"), strict=True) if n[k])


def n_cpu_moe_for(layout: ModelLayout, budget_bytes: int) -> int:
    """llama.cpp's --n-cpu-moe N for a device budget: the smallest N (experts of blocks < N stay on the host) whose
    device-side experts fit in ``budget_bytes``, so stock's device memory for experts equals ours."""
    on_device = 0
    for L in sorted(layout.layers, key=lambda L: -L.index):  # from the last block down
        layer_bytes = L.expert_bytes * layout.n_expert  # expert_bytes is one expert's
        if on_device + layer_bytes > budget_bytes:
            return L.index + 1
        on_device += layer_bytes
    return 0


def stock_plan(layout: ModelLayout, n_cpu_moe: int | None) -> LayerPlan:
    """Stock llama.cpp's placement as a plan: --n-cpu-moe N (blocks < N host, the rest full); None: --cpu-moe."""
    return LayerPlan({L.index: "host" if n_cpu_moe is None or L.index < n_cpu_moe else "full" for L in layout.layers})


def hit_rate(n_slots: int, n_expert: int, hits: Sequence[float] | None = None) -> float:
    """The hit rate the model assumes for n slots of n_expert: ``hits[n]`` where measured (``hitrates``: LRU's, or
    a hot set's, over the model's own routing of real text), else what they hold of an expert chosen at
    random, a floor (routing repeats itself from token to token and favours some experts: LRU keeps what repeats,
    a hot set what is favoured)."""
    n = min(max(n_slots, 0), n_expert)
    return float(hits[n]) if hits is not None and len(hits) == n_expert + 1 else n / n_expert


def predict_us(plan: LayerPlan, layout: ModelLayout, costs: DeviceCosts, mapped: bool = False,
               hits: Sequence[float] | None = None, hot_hits: Sequence[float] | None = None,
               hot_moves: Sequence[float] | None = None) -> float:
    """Predicted time per decode token: the costs' base plus each MoE layer's experts and switches. A slot layer's
    device path runs all k rows (misses on zero slots), its misses run on the host as well and are uploaded
    (counted in full: on RPC the link is this machine's CPU). ``mapped`` (``--miss mapped``, costs with a
    ``map_row_us``): a slot layer takes no switch, its hits are device rows and its misses rows the device reads
    from the host copy, and its uploads cost the token the measured share of their link time (``upload_share``;
    in full where unmeasured). A ``hot`` plan's slot layers move nothing inside a layer: their uploads are the hot
    set's moves, ``hot_moves[n]`` experts a layer a token, queued between decodes and charged as uploads are.
    ``hits``: LRU's hit rate by slot count, ``hot_hits`` the hot set's (``hit_rate``; each where measured,
    ``hitrates``)."""
    if mapped and costs.map_row_us is None:
        raise SpecterError("the costs have no measured row read from the host copy (devcosts.measure_mapped)")
    k = layout.n_expert_used
    h = hit_rate(plan.n_slots, layout.n_expert, hot_hits if plan.hot else hits)
    eb = {L.index: L.expert_bytes for L in layout.layers}
    t = costs.base_us
    share = costs.upload_share if mapped and costs.upload_share is not None else 1.0
    for il, kind in plan.kinds.items():
        miss = k * (1 - h)
        if kind == "full":
            t += k * costs.dev_row_us
        elif kind == "host":
            t += 2 * costs.split_us + k * costs.cpu_row_us
        elif mapped:
            t += k * h * costs.dev_row_us + miss * costs.map_row_us
        else:
            t += 2 * costs.split_us + k * costs.dev_row_us + miss * costs.cpu_row_us
        if kind == "slots" and costs.link_gbps > 0:
            # a hot set's moves (queued between decodes, landing beside the next), or LRU's misses
            loads = (hot_moves[plan.n_slots] if hot_moves is not None else 0.0) if plan.hot else miss
            t += share * loads * eb[il] / (costs.link_gbps * 1e3)
    return t


def choose_plan(layout: ModelLayout, device_bytes: int, costs: DeviceCosts, n_zero: int = 0,
                mapped: bool = False, hits: Sequence[float] | None = None,
                hot_hits: Sequence[float] | None = None, hot_moves: Sequence[float] | None = None) -> LayerPlan:
    """The plan of least predicted time whose experts fit in ``device_bytes``: f full layers (the last ones, as
    stock), s slot layers of n slots, the rest host, over every f, n and s (slots never fewer than top-k, nor E:
    a layer with every expert is a full layer). Stock's placements are among the candidates in their own right
    (--n-cpu-moe at this memory, which counts each layer's own bytes, first; then --cpu-moe, every layer host), so
    the plan is never predicted slower than either. Of plans predicted alike, the one with fewer host switches wins
    (then the earlier: stock's): a switch is the cost the model knows least well (a stream synchronisation on a
    GPU, measured apart from its neighbours), so where the model cannot tell, the plan crosses fewer. ``n_zero``:
    the zero slots a slot layer on the device holds besides its slots (``budget.zero_slots``); ``mapped``: slot
    layers priced as ``--miss mapped`` runs them, ``hits`` LRU's hit rate by slot count (``predict_us``);
    ``hot_hits``: the hot set's, measured, makes hot slot layers candidates too, their moves charged from
    ``hot_moves`` (LRU's win ties: a hot set starts from a profile, and text unlike it misses more)."""
    if device_bytes < 0:
        raise SpecterError("negative device memory for experts")
    layers = [L.index for L in sorted(layout.layers, key=lambda L: L.index)]
    E, k, z = layout.n_expert, layout.n_expert_used, n_zero
    eb = max(L.expert_bytes for L in layout.layers)  # plan by the largest layer: every plan below fits

    def better(t: float, plan: LayerPlan) -> bool:
        """Predicted faster than the best so far, or as fast with fewer switches."""
        return t < best[0] - 1e-9 or (t <= best[0] + 1e-9 and
                                      plan.switches_per_token(mapped) < best[1].switches_per_token(mapped))

    stock = stock_plan(layout, n_cpu_moe_for(layout, device_bytes))
    best = (predict_us(stock, layout, costs), stock)
    all_host = stock_plan(layout, None)
    if better(predict_us(all_host, layout, costs), all_host):
        best = (predict_us(all_host, layout, costs), all_host)
    for f in range(len(layers) + 1):
        left = device_bytes - f * E * eb
        if left < 0:
            break
        rest = layers[: len(layers) - f]
        full = {il: "full" for il in layers[len(layers) - f:]}
        for n in [0, *range(k, E)]:
            fit = min(len(rest), left // ((n + z) * eb)) if n else 0  # n slots and z zero slots
            for s in {0, fit}:
                kinds = {**{il: "host" for il in rest}, **full}
                for il in rest[len(rest) - s:] if s else []:
                    kinds[il] = "slots"
                for hot in (False, True) if s and hot_hits is not None else (False,):
                    plan = LayerPlan(kinds, n if s else 0, z if s else 0, hot=hot)
                    t = predict_us(plan, layout, costs, mapped=mapped, hits=hits, hot_hits=hot_hits,
                                   hot_moves=hot_moves)
                    if better(t, plan):
                        best = (t, plan)
    return best[1]
