"""Where a model's experts live: the tier, the budget and the device fit, chosen in one place.

``Session`` (and so ``pyspecter.load``), generate, chat, serve and bench all call ``place``, so a model behaves
the same from Python and from the command line. What the user gave is kept; what they left out is fitted to this
machine (``budget.fit_to_memory``) or to the device's free memory; a budget the memory available cannot hold is
refused with the numbers unless ``force``. A model that fits runs as stock llama.cpp: no slots, no routing hook,
no second copy of the experts (``Placement.stock``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import psutil

from pyspecter.budget import (
    check_budget_fits,
    fit_to_memory,
    parse_budget,
    slots_for_budget,
    usable_memory,
    zero_slot_bytes,
    zero_slots,
)
from pyspecter.errors import SpecterError
from pyspecter.layerplan import LayerPlan, stock_plan
from pyspecter.layout import ModelLayout, read_layout
from pyspecter.tiers import make_tier
from pyspecter.units import fmt_bytes

# llama.cpp's default: one thread per physical core (every session's and command's, unless given)
DEFAULT_THREADS = max(1, psutil.cpu_count(logical=False) or 1)


@dataclass(frozen=True)
class Placement:
    """``tier`` (ram, disk, emulated:GBPS), ``budget`` (text as a user gives it; None: every expert resident),
    ``device`` (None: the CPU) and ``why``: the one line that says what was chosen, or None when the user chose
    it all."""

    tier: str
    budget: str | None
    device: str | None = None
    why: str | None = None

    @property
    def stock(self) -> bool:
        """Every expert resident in host RAM: the model runs as stock llama.cpp, without slots."""
        return self.budget is None and self.tier == "ram" and self.device is None

    @property
    def summary(self) -> str:
        """What was chosen, in a few words (the start of the one line)."""
        if self.stock:
            return "stock llama.cpp, every expert resident (no slots)"
        where = f" on {self.device}" if self.device else ""
        return f"tier {self.tier}, budget {self.budget or 'all experts'}{where}"


@dataclass(frozen=True)
class DeviceFit:
    """What a device holds of a model: non-expert weights first, then ``slot_bytes`` of expert slots."""

    name: str
    description: str
    free_bytes: int
    total_bytes: int
    slot_bytes: int
    slots_per_layer: int
    whole: bool  # every expert fits beside the non-expert weights
    why: str


def is_host(device: str | None) -> bool:
    return device is None or device.strip().lower() == "cpu"


def device_fit(layout: ModelLayout, device: str) -> DeviceFit:
    """Open ``device`` and say how many expert slots its free memory buys after the non-expert weights."""
    from pyspecter.native.devices import open_device

    dev = open_device(device)
    if dev is None:
        raise SpecterError(f"--device {device!r}: not a device")
    free, total = dev.memory()
    room = max(usable_memory(free) - layout.nonexpert_bytes, 0)
    zero = zero_slot_bytes(layout, dev)
    slots = slots_for_budget(layout, max(room - zero, 0))
    nonexp = fmt_bytes(layout.nonexpert_bytes)
    if room >= layout.expert_total_bytes:
        why = "the whole model fits on the device"
    elif slots < layout.n_expert_used:
        why = (f"after {nonexp} of non-expert weights, {fmt_bytes(room)} buys {slots} slots per layer, below "
               f"top-{layout.n_expert_used}: too small")
    else:
        why = (f"after {nonexp} of non-expert weights, {fmt_bytes(room)} of expert slots: {slots} of "
               f"{layout.n_expert} per layer ({100 * room / layout.expert_total_bytes:.0f}%)")
    return DeviceFit(dev.name, dev.description, free, total, room, slots, room >= layout.expert_total_bytes, why)


def place(model: ModelLayout | str | os.PathLike, *, tier: str | None = None, budget: str | None = None,
          device: str | None = None, force: bool = False, partial: str | None = None,
          available: int | None = None) -> Placement:
    """Where the experts live, for one run. ``tier``/``budget``/``device``: what the user gave (None: choose).
    ``partial``: the budget to use where every expert would be resident (bench: its caching policies would
    otherwise have nothing to do). ``available``: the memory available (default: psutil's figure now)."""
    layout = model if isinstance(model, ModelLayout) else read_layout(model)
    layout.require_moe()
    if tier is not None:
        make_tier(tier)  # a bad tier is refused before anything is fitted or said
    if not is_host(device):
        assert device is not None
        budget = budget if budget is not None else partial
        if budget is not None:
            return Placement(tier or "ram", budget, device)
        fit = device_fit(layout, device)
        return Placement(tier or "ram", None if fit.whole else str(fit.slot_bytes), device,
                         f"{fit.name}: {fit.why}")
    available = psutil.virtual_memory().available if available is None else available
    if tier is None and budget is None:  # the user said nothing about where experts live
        fit = fit_to_memory(layout, available)
        if fit.budget is None and partial is not None:
            return Placement("ram", partial, None,
                             f"{fit.why}; for bench that would leave the caching policies nothing to do, so they "
                             f"run at a budget of {partial} (--budget to choose)")
        p = Placement(fit.tier, fit.budget)
        why = fit.why + (": runs as stock llama.cpp, no slots" if p.stock else "")
        return Placement(fit.tier, fit.budget, None, why)
    if tier is None:  # a budget alone: the rest of the experts stay in RAM if the file fits there, else on disk
        tier = "ram" if layout.file_bytes <= usable_memory(available) else "disk"
    budget = budget if budget is not None else partial
    if budget is not None and not force:  # slots of the host tiers are RAM
        check_budget_fits(layout, parse_budget(budget, layout.expert_total_bytes), available, given=budget)
    return Placement(tier, budget)


def _check_device_room(device, layout: ModelLayout, expert_bytes: int, draft_bytes: int = 0) -> None:
    """Refuse, with the numbers, experts (and a draft) the device cannot hold beside the non-expert weights
    (compute buffers come on top, so this is a floor)."""
    need = layout.nonexpert_bytes + expert_bytes + draft_bytes
    free, _ = device.memory()
    if need > free:
        gib = 2**30
        draft = f" + draft {draft_bytes / gib:.2f} GiB" if draft_bytes else ""
        raise SpecterError(f"{device.name}: {need / gib:.2f} GiB needed (non-expert weights "
                           f"{layout.nonexpert_bytes / gib:.2f} GiB + experts {expert_bytes / gib:.2f} GiB{draft}) "
                           f"but the device has {free / gib:.2f} GiB free; lower --budget or --layer-plan")


@dataclass(frozen=True)
class DevicePlan:
    """A layer plan on a device (``layerplan.LayerPlan``) and the one line that says it; ``info``: what the cost
    model predicted (``devcosts.plan_for``), for an auto plan it measured."""

    plan: LayerPlan
    why: str
    info: dict | None = None
    mapped: bool = False  # an auto plan priced as --miss mapped runs it, and faster so: the session runs it so

    @property
    def has_slots(self) -> bool:
        return bool(self.plan.layers("slots"))


def parse_layer_plan(spec: str) -> str | int:
    """``auto``, ``slots``, or ``n-cpu-moe:N`` (returned as N); anything else is refused."""
    text = spec.strip().lower()
    if text in ("auto", "slots"):
        return text
    if text.startswith("n-cpu-moe:") and text[len("n-cpu-moe:"):].isdigit():
        return int(text[len("n-cpu-moe:"):])
    raise SpecterError(f"--layer-plan {spec!r}: use auto, slots or n-cpu-moe:N")


def device_layer_plan(layout: ModelLayout, device, budget: str | None, spec: str | LayerPlan | None = None, *,
                      why_not: str | None = None, draft_bytes: int = 0, n_threads: int = 2,
                      mapped: bool | None = False, say: Callable[[str], None] | None = None) -> DevicePlan | None:
    """What each MoE layer is on ``device`` (a ``native.devices.Device``) for ``budget`` (device memory for
    experts; None: all of them): ``spec`` as ``--layer-plan`` gives it (None: auto), or a ``LayerPlan`` itself.
    None: slots in every layer. ``why_not``: what keeps this session on slots in every layer (a draft, the
    surrogates: they index every layer's slots); auto then gives slots, an explicit plan is refused. With no
    budget (the whole model fits the device), auto is every layer full whatever ``why_not`` says: stock's
    placement, no slot to index; ``draft_bytes``: a draft beside it on the device. ``n_threads``: the session's
    (the cost model's host rows are measured with them). ``mapped``: the session's misses are read by the device
    from the host copy (``--miss mapped``): auto prices its slot layers so; None (no miss mode asked for): as
    ``priced_plan`` chooses, and ``DevicePlan.mapped`` says which. ``say``: hears one line before the plan's
    inputs are measured (the first time on a model, device and host threads: seconds, a big model's minute)."""
    if spec is None:
        spec = "auto"
    want = spec if isinstance(spec, LayerPlan) else parse_layer_plan(spec)
    if want == "slots":
        return None
    budget_bytes = (parse_budget(budget, layout.expert_total_bytes) if budget is not None
                    else layout.expert_total_bytes)
    if why_not is not None and not (want == "auto" and budget is None):
        if want == "auto":
            return None
        raise SpecterError(f"a layer plan other than slots in every layer runs without {why_not}")
    if want == "auto":  # the budget asked for is refused before anything is measured on the device
        _check_device_room(device, layout, budget_bytes, draft_bytes)
    if isinstance(want, LayerPlan):
        plan, info, how = replace(want, n_zero=zero_slots(layout, device)), None, "as given"
    elif isinstance(want, int):
        if want > layout.n_layer:
            raise SpecterError(f"--layer-plan n-cpu-moe:{want}: the model has {layout.n_layer} blocks")
        plan, info, how = stock_plan(layout, want), None, f"stock --n-cpu-moe {want}"
    elif budget_bytes >= layout.expert_total_bytes:  # every layer full: no switch at all, nothing to measure
        plan, info, how = stock_plan(layout, 0), None, "every expert fits on the device"
    else:
        from pyspecter import hitrates
        from pyspecter.devcosts import cost_source, mapped_cached

        once = "once per model, device and host threads; cached"
        if say is not None and cost_source(layout.path, device, n_threads) == "none":
            say(f"measuring the layer plan's costs on {device.name} ({once})")
        elif (say is not None and (mapped or (mapped is None and reads_host_copy(device, layout)))
              and not mapped_cached(layout.path, device, n_threads)):  # the costs without --miss mapped's row
            say(f"measuring a row the device reads from the host copy on {device.name} (--miss mapped; {once})")
        elif say is not None and not hitrates.cached(layout.path):  # costs cached, the routing not (a new version)
            say("measuring how the model's own routing hits slots (two CPU prefills of packaged text; once per "
                "model; cached)")
        plan, info = priced_plan(layout, device, budget_bytes, n_threads, mapped=mapped)
        mapped = info["mapped"]
        how = (f"predicted {info['predicted_ms']:.1f} ms/token vs stock --n-cpu-moe {info['stock_n_cpu_moe']} "
               f"{info['predicted_stock_n_cpu_moe_ms']:.1f} ms at the same memory"
               + (", slot layers' misses read from the host copy" if mapped and plan.layers("slots") else ""))
    if want != "auto":
        _check_device_room(device, layout, plan.device_bytes(layout))
    return DevicePlan(plan, f"layer plan: {plan.describe(layout)}; {how}", info,
                      mapped=bool(info and info["mapped"]))


def priced_plan(layout: ModelLayout, device, device_bytes: int, n_threads: int = 2,
                mapped: bool | None = False) -> tuple[LayerPlan, dict]:
    """The cost model's plan for ``device_bytes`` of experts on ``device`` and what it predicts
    (``devcosts.plan_for``); ``mapped``: its slot layers priced as ``--miss mapped`` runs them. None (no miss mode
    asked for): priced both ways where the device reads the host copy in place (``reads_host_copy``), and the
    faster of the two (``info["mapped"]`` says which), so the session takes the mapped path where the model
    predicts it pays, and not elsewhere."""
    from pyspecter.devcosts import plan_for

    plan, info = plan_for(layout.path, layout, device, device_bytes, n_threads, mapped=bool(mapped))
    if mapped is None and reads_host_copy(device, layout):
        mplan, minfo = plan_for(layout.path, layout, device, device_bytes, n_threads, mapped=True)
        if mplan.layers("slots") and minfo["predicted_ms"] < info["predicted_ms"]:
            return mplan, minfo
    return plan, info


def reads_host_copy(device, layout: ModelLayout) -> bool:
    """Whether ``device`` reads a miss from the host copy of the experts where it is (pinned host memory: a host
    buffer type, CUDA's) and takes a miss's negative id: where ``--miss mapped`` costs no device memory beyond the
    budget. The RPC device has no host buffer type (its stand-in copy is device memory), so it never does.
    ``SPECTER_NO_MAPPED=1``: no device does (what gpu_check sets when its mapped cases failed on that GPU, so the
    engine it benches keeps to the host path; ``--miss mapped`` asked for is still run)."""
    if os.environ.get("SPECTER_NO_MAPPED") == "1":
        return False
    return device.host_buffer_type() is not None and device.zero_slots(layout.n_expert_used) == 0


@dataclass(frozen=True)
class SlotCount:
    """What a budget buys, said the same way by inspect, generate, chat's /stats, serve and bench: ``counts``, the
    usable slots of each MoE layer (empty: no slots, every expert resident as in stock llama.cpp); ``others``: what
    takes the rest of the budget, (what, bytes) (a learned predictor, a draft, surrogates, or memory left free);
    ``zero``: on a device, the all-zero slots each slot layer also holds (one per expert a token uses: where its
    misses point), besides the slots and out of the same budget (``budget.zero_slots``)."""

    counts: tuple[int, ...]
    n_expert: int
    others: tuple[tuple[str, int], ...] = ()
    budget_bytes: int | None = None
    zero: int = 0

    @property
    def min(self) -> int:
        return min(self.counts, default=0)

    @property
    def max(self) -> int:
        return max(self.counts, default=0)

    @property
    def mean(self) -> float:
        return sum(self.counts) / len(self.counts) if self.counts else 0.0

    def as_stats(self) -> dict:
        """The figures for JSON and metrics: min, mean and max usable slots per layer (0 with no slots)."""
        return {"slots_min": self.min, "slots_mean": self.mean, "slots_max": self.max, "slots_text": str(self)}

    def __str__(self) -> str:
        if not self.counts:
            return "no slots (every expert resident)"
        if self.min == self.max:  # why each layer differs is the allocator's (budget.allocate_slots)
            text = f"{self.min}/{self.n_expert} slots per layer"
        else:
            text = f"{self.min}-{self.max} of {self.n_expert} slots per layer (mean {self.mean:.2f})"
        if self.zero:
            text += f" + {self.zero} zero slots each on the device, in the budget"
        if self.others:
            text += "; the rest of the budget: " + ", ".join(f"{what} {fmt_bytes(n)}" for what, n in self.others)
        return text


NO_SLOTS = SlotCount((), 0)  # stock llama.cpp, or a layer plan of full and host layers
IN_PLACE = "left free (misses are computed in place from the RAM copy)"


def predictor_part(pred) -> tuple[str, int]:
    """A predictor as a part of the budget: (what, bytes)."""
    kind = "the router-ahead maps" if pred.meta.get("kind") == "router-ahead" else "the learned predictor"
    return kind, pred.nbytes


def slot_count(layout: ModelLayout, plan, others: tuple[tuple[str, int], ...] = (),
               budget_bytes: int | None = None, zero: int = 0) -> SlotCount:
    """``plan``: a ``budget.MemoryPlan``; the usable slots of each layer (held and reserved ones are not usable)."""
    return SlotCount(tuple(plan.usable_in(L.index) for L in layout.layers), layout.n_expert, others,
                     budget_bytes if budget_bytes is not None else plan.budget_bytes, zero)


def budget_slot_count(layout: ModelLayout, budget: str, model_path: str | os.PathLike | None = None, *,
                      tier: str = "disk", device: str | None = None) -> SlotCount:
    """What ``budget`` buys a session on this model with no draft and no other flag, spent as ``Session`` spends
    it (tests/integration/test_slot_counts.py holds the two together): on the RAM tier of the CPU misses are
    computed in place, so nothing beyond top-k slots is filled and the rest stays free; otherwise the learned
    predictor fitted for the file (or, on the disk tier without one, the router-ahead maps) takes its bytes first:
    all of them where the planner prefetches (a device, an emulated link, router-ahead maps), else only its reuse
    maps. On a device the counts are uniform, and each slot layer's zero slots come out of the budget first."""
    from pyspecter.budget import MemoryPlan
    from pyspecter.learned import LearnedPredictor
    from pyspecter.misses import default_miss

    full = parse_budget(budget, layout.expert_total_bytes)
    tr = make_tier(tier)
    host = is_host(device)
    if default_miss(tr, host_slots=host) == "host":
        MemoryPlan.for_budget(layout, budget, spread=True)  # too small a budget is refused as a session does
        top = MemoryPlan(layout.n_expert_used, budget_bytes=full)
        used = layout.n_expert_used * sum(L.expert_bytes for L in layout.layers)
        return slot_count(layout, top, ((IN_PLACE, full - used),) if full > used else (), full)
    pred = LearnedPredictor.for_model(model_path) if model_path is not None else None
    if pred is None and model_path is not None and tr.name == "disk" and host:
        from pyspecter.router_ahead import router_ahead

        pred = router_ahead(model_path, layout)
    plans_ahead = not host or tr.name.startswith("emulated") or (
        pred is not None and pred.meta.get("kind") == "router-ahead")
    if pred is not None and not plans_ahead:
        pred = pred.reuse_only()
    from pyspecter.native.devices import open_device

    dev = None if host else open_device(device)
    plan = MemoryPlan.for_budget(layout, budget, predictor_bytes=pred.nbytes if pred else 0, spread=True,
                                 device=dev, curves=pred.miss_curves if pred else None)
    return slot_count(layout, plan, (predictor_part(pred),) if pred else (), full, zero=zero_slots(layout, dev))


def budget_slot_text(layout: ModelLayout, budget: str, model_path: str | os.PathLike | None = None, *,
                     tier: str = "disk", device: str | None = None) -> str:
    """``budget_slot_count`` as text, or why a session would refuse the budget (bench's header says it beside
    its baselines' slots, which it runs either way)."""
    try:
        return str(budget_slot_count(layout, budget, model_path, tier=tier, device=device))
    except SpecterError as e:
        return f"refused: {e}"


def uniform_slots(layout: ModelLayout, budget: str) -> int:
    """Slots per layer, the same in every layer, that ``budget`` buys (verify's --budget); none is refused."""
    slots = slots_for_budget(layout, parse_budget(budget, layout.expert_total_bytes))
    if slots == 0:
        raise SpecterError(f"budget {budget} fits no expert slot (one slot in every layer is "
                           f"{fmt_bytes(sum(L.expert_bytes for L in layout.layers))})")
    return slots
