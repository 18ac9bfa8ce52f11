"""Fast memory: what a budget buys. Every fit check (top-k, draft, surrogates, held slots) lives here.

A budget is bytes of fast memory for expert slots. The draft's bytes come out of it when the draft is counted
(equal total fast memory: headline comparisons count it), and so do surrogates. One slot is one expert's worth
of bytes in one MoE layer. A budget buys whole slot rows (one slot in every layer) and, where slots not written
take no memory (CPU), the remainder as single slots in some layers, or is spread over the layers by measured
miss curves (``allocate_slots``).
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_budget(text: str, expert_total_bytes: int) -> int:
    """Bytes from '64MiB', '1.5GB', '123456' or '40%' (of all expert bytes)."""
    s = text.strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise SpecterError(f"cannot parse budget {text!r} (examples: 64MiB, 1.5GB, 40%)") from None
        if not 0 < pct <= 100:
            raise SpecterError(f"budget {text!r} must be a percentage in (0, 100]")
        return int(expert_total_bytes * pct / 100)
    m = _SIZE_RE.match(s)
    if not m or m.group(2) is None and not s[-1:].isdigit():
        raise SpecterError(f"cannot parse budget {text!r} (examples: 64MiB, 1.5GB, 40%)")
    unit = (m.group(2) or "").lower()
    if unit not in _UNITS:
        raise SpecterError(f"cannot parse budget {text!r}: unknown unit {m.group(2)!r}")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise SpecterError(f"budget {text!r} must be positive")
    return value


def slots_for_budget(layout: ModelLayout, budget_bytes: int) -> int:
    """Expert slots per MoE layer (the same count in every layer) that fit in budget_bytes, capped at n_expert."""
    per_slot_row = sum(layer.expert_bytes for layer in layout.layers)  # one slot in every layer
    return min(layout.n_expert, budget_bytes // per_slot_row) if per_slot_row else 0


# per MoE layer position j: misses measured with s slots, s = 0..n_expert (a mapping by j, a list, a 2-d array)
Curves = Mapping[int, Sequence[float]] | Sequence[Sequence[float]]


class SlotDevice(Protocol):
    """What a budget needs of a device (``native.devices.Device``)."""

    def zero_slots(self, n_used: int) -> int: ...


def zero_slots(layout: ModelLayout, device: SlotDevice | None) -> int:
    """All-zero slots a slot layer holds besides its slots, where its misses point: one per expert a token uses
    on a device whose kernel takes neither a negative expert id nor an id twice in a token, none elsewhere (the
    CPU, CUDA and RPC take a miss's negative id as a zero row). The rule is csrc's (llama_pyspecter_zero_slots).
    They are device memory, so they come out of the budget, as stock --n-cpu-moe's every byte does."""
    return device.zero_slots(layout.n_expert_used) if device is not None else 0


def zero_slot_bytes(layout: ModelLayout, device: SlotDevice | None) -> int:
    """``zero_slots`` in every slot layer, in bytes: what a device budget gives them before any slot."""
    return zero_slots(layout, device) * sum(L.expert_bytes for L in layout.layers)


def slot_bytes(layout: ModelLayout, counts: Mapping[int, int]) -> int:
    """Bytes of fast memory that ``counts`` (layer index -> slots) take."""
    size = {L.index: L.expert_bytes for L in layout.layers}
    return sum(size[il] * n for il, n in counts.items())


# the least share of misses the fit text's curves must promise to save before slots follow them (see below)
CURVE_MIN_GAIN = 0.05


def allocate_slots(layout: ModelLayout, budget_bytes: int, *,
                   curves: Curves | None = None, base: int | None = None, device: bool = False) -> dict[int, int]:
    """Slots per MoE layer (layer index -> count) that ``budget_bytes`` buys, never more than the budget, each
    count in [base, n_expert] (base defaults to top-k: one token's experts must fit). Layers may have experts of
    different sizes, so a slot costs its own layer's expert bytes.

    Without ``curves``: whole slot rows, then the remainder as one more slot per layer in forward order while it
    lasts (a budget is rarely a whole number of rows, and whole rows alone would leave up to a row unspent: a 5 MiB
    predictor taken out of 8 rows of 50 MB would cost a whole row). With ``curves``
    (for MoE layer position j, ``curves[j][s]`` = misses measured with s slots, s = 0..n_expert; lower is better):
    from ``base`` everywhere, each next slot goes to the layer whose misses fall most per byte, looking past a
    flat stretch of its curve (the best average drop over its next slots), so a layer whose gain comes a few
    slots later is not starved. Ties (flat curves) go to the layer with the fewest slots, then in forward order,
    which spreads evenly. The curves come from the fit text, not the text the model will read, so they are
    followed only where they promise at least ``CURVE_MIN_GAIN`` fewer misses than the uniform counts: on
    smol-moe, where they promised 0.7-2.2%, they read 1-7% more on a cold prompt (ram tier, where bytes are
    deterministic); on bench-qwen3moe at 50%, where they promised 5.6%, 9-14% less.

    device=True: slots on a device are real memory in every layer up to the largest count (the C side allocates
    one count for all layers), so the counts stay uniform: whole rows only, curves ignored."""
    layers = layout.layers
    E, k = layout.n_expert, layout.n_expert_used
    floor = k if base is None else base
    if floor < k or floor > E:
        raise SpecterError(f"base {floor} slots per layer must be in [top-{k}, {E}]")
    row = sum(L.expert_bytes for L in layers)
    if floor * row > budget_bytes:
        raise SpecterError(f"budget {budget_bytes / 2**20:.1f} MiB buys fewer than {floor} expert slots per layer "
                           f"({row * floor / 2**20:.1f} MiB)")
    n = max(floor, min(E, budget_bytes // row if row else E))
    uniform = {L.index: n for L in layers}
    if device or n >= E:
        return uniform
    left = budget_bytes - n * row
    for L in layers:  # the remainder: less than a row, so at most one slot each
        if L.expert_bytes <= left:
            uniform[L.index] += 1
            left -= L.expert_bytes
    if curves is None:
        return uniform
    if len(curves) != len(layers):
        raise SpecterError(f"{len(curves)} miss curves for {len(layers)} MoE layers")
    for j in range(len(layers)):
        if len(curves[j]) < E + 1:
            raise SpecterError(f"miss curve {j} has {len(curves[j])} points; needs one per slot count 0..{E}")
    counts = {L.index: floor for L in layers}
    left = budget_bytes - floor * row
    arr = [np.asarray(curves[j], dtype=np.float64)[: E + 1] for j in range(len(layers))]
    steps = np.arange(1, E + 1, dtype=np.float64)

    def rate(j: int, n: int) -> float:
        # misses saved per byte by the best run of next slots (the lower hull's slope), so a flat stretch before
        # a drop does not hide the drop: greedy on single steps is only optimal for convex curves
        c = arr[j]
        best = max(0.0, float(np.max((c[n] - c[n + 1:]) / steps[: E - n])))
        return best / layers[j].expert_bytes if layers[j].expert_bytes else float("inf")

    heap = [(-rate(j, floor), floor, j) for j in range(len(layers)) if floor < E]
    heapq.heapify(heap)
    while heap:
        _, n, j = heapq.heappop(heap)
        L = layers[j]
        if L.expert_bytes > left:
            continue  # what is left only shrinks: this layer never fits another slot
        counts[L.index] = n + 1
        left -= L.expert_bytes
        if n + 1 < E:
            heapq.heappush(heap, (-rate(j, n + 1), n + 1, j))

    def misses(c: dict[int, int]) -> float:
        return sum(float(arr[j][c[L.index]]) for j, L in enumerate(layers))

    return counts if misses(counts) <= (1 - CURVE_MIN_GAIN) * misses(uniform) else uniform


def split_counts(counts: Mapping[int, int]) -> tuple[int, dict[int, int]]:
    """(slots every layer has, layer -> slots beyond that): ``ExpertCache(n_slots=..., extra=...)``'s form of
    per-layer counts. Layers without extra slots are left out."""
    n = min(counts.values())
    return n, {il: c - n for il, c in counts.items() if c > n}


def check_slots(layout: ModelLayout, n_slots: int, *, reserved: int = 0, held: int = 0) -> None:
    """Refuse a slot count that cannot serve one token: fewer usable slots than top-k, counting the ``reserved``
    (surrogate) and ``held`` (a draft's, for later) slots out."""
    k = layout.n_expert_used
    if reserved and n_slots - reserved < k:
        raise SpecterError(f"{max(n_slots, 0)} slots per layer: surrogate mode needs {2 * k} "
                           f"(top-{k} for full experts, as many for surrogates)")
    if n_slots < k:
        raise SpecterError(f"{n_slots} slots per layer is below top-{k}: one token's experts would not fit")
    if held and (reserved or n_slots - held < k):
        raise SpecterError("held slots need a usable top-k without them, and no surrogates")


def smallest_budget(layout: ModelLayout, budget: str, budget_bytes: int, *, draft_bytes: int = 0,
                    surrogate_bytes: int = 0, predictor_bytes: int = 0, zero_bytes: int = 0) -> None:
    """Refuse a budget below the smallest that works, naming that smallest and what it is made of: top-k slots in
    every layer (twice that with surrogates), and whatever else lives in fast memory (a device's zero slots, a
    counted draft, the learned predictor, the surrogates)."""
    from pyspecter.units import family, fmt_budget_arg, fmt_size

    k = layout.n_expert_used
    row = sum(L.expert_bytes for L in layout.layers)
    slots = 2 * k if surrogate_bytes else k
    what = (f"{slots} slots per layer (top-{k} for full experts, as many for surrogates)" if surrogate_bytes
            else f"top-{k} slots per layer")
    parts = [(what, slots * row), ("the device's zero slots", zero_bytes),
             ("the draft", draft_bytes), ("the learned predictor", predictor_bytes),
             ("the surrogates", surrogate_bytes)]
    parts = [(w, n) for w, n in parts if n]
    need = sum(n for _, n in parts)
    if budget_bytes >= need:
        return
    fam = family(budget, default="binary")
    made = " + ".join(f"{w} ({fmt_size(n, fam)})" for w, n in parts)
    given = budget if family(budget, default="") else f"{budget} ({fmt_size(budget_bytes, fam)})"
    raise SpecterError(f"budget {given} is too small: the smallest that works is {fmt_size(need, fam)} = {made}; "
                       f"give --budget {fmt_budget_arg(need, fam, up=True)} or more")


@dataclass(frozen=True)
class MemoryPlan:
    """Slots per layer for a budget: ``slots`` allocated in all, of which ``held`` wait for the draft's memory
    (used once a draft that does not pay is dropped) and ``reserved`` hold surrogates; ``extra``: layer -> regular
    slots that layer has beyond ``slots`` (a budget spread by layer; pass it on as ``ExpertCache(extra=...)``);
    ``held_extra``: layer -> slots that layer holds beyond ``held``, so that once the draft is dropped every layer
    has what the budget without a draft spreads to it (``ExpertCache(held_extra=...)``)."""

    slots: int
    held: int = 0
    reserved: int = 0
    budget_bytes: int | None = None  # None: no budget, every expert resident
    extra: dict[int, int] = field(default_factory=dict)
    held_extra: dict[int, int] = field(default_factory=dict)

    @property
    def usable(self) -> int:
        """Slots eviction may use from the start in every layer (a layer with extra slots has more)."""
        return self.slots - self.held - self.reserved

    def usable_in(self, il: int) -> int:
        """Slots eviction may use from the start in layer il."""
        return self.usable + self.extra.get(il, 0)

    @classmethod
    def for_budget(cls, layout: ModelLayout, budget: str | None, *, draft_bytes: int = 0,
                   count_draft: bool = True, surrogate_bytes: int = 0, predictor_bytes: int = 0,
                   spread: bool = False, curves: Curves | None = None,
                   device: SlotDevice | None = None) -> MemoryPlan:
        """What ``budget`` (text, as a user gives it) buys for ``layout`` once the draft (when counted) and the
        surrogates have taken their bytes out of it. spread=True (or ``curves``) spends what whole slot rows leave
        as ``extra`` slots in some layers (by ``curves``, when given: see ``allocate_slots``); a ``device`` keeps
        the counts uniform (device slots are real memory up to the largest count in every layer) and takes its
        zero slots out of the budget first (``zero_slots``)."""
        layout.require_moe()
        reserved = layout.n_expert_used if surrogate_bytes else 0
        if budget is None:
            plan = cls(slots=layout.n_expert, reserved=reserved)
            check_slots(layout, plan.slots, reserved=reserved)
            return plan
        full = parse_budget(budget, layout.expert_total_bytes)
        zero = zero_slot_bytes(layout, device)
        smallest_budget(layout, budget, full, draft_bytes=draft_bytes if count_draft else 0,
                        surrogate_bytes=surrogate_bytes, predictor_bytes=predictor_bytes, zero_bytes=zero)
        full -= zero  # what the slots may take
        left = full
        if draft_bytes and count_draft:
            left -= draft_bytes
            if left <= 0:
                raise SpecterError(f"the draft ({draft_bytes / 2**20:.0f} MiB) does not fit in budget {budget}")
        if predictor_bytes:  # a learned predictor's tables live in fast memory too
            left -= predictor_bytes
            if left <= 0:
                raise SpecterError(f"the learned predictor ({predictor_bytes / 2**20:.1f} MiB) does not fit in "
                                   f"budget {budget}")
        if surrogate_bytes:  # they live in fast memory too
            left -= surrogate_bytes
            if left <= 0:
                raise SpecterError(f"the surrogates ({surrogate_bytes / 2**20:.1f} MiB) do not fit in budget "
                                   f"{budget}; surrogate mode needs {2 * layout.n_expert_used} slots per layer "
                                   "beside them")
        if (spread or curves is not None) and device is None:
            return cls._spread(layout, budget, full, left, draft_bytes=draft_bytes if count_draft else 0,
                               reserved=reserved, curves=curves)
        slots = slots_for_budget(layout, left)
        if slots < layout.n_expert_used and not surrogate_bytes:
            raise SpecterError(f"budget {budget} buys {slots} expert slots per layer, below "
                               f"top-{layout.n_expert_used}" + (" once the draft is counted" if draft_bytes else ""))
        # Slots the draft's memory would buy back: allocated now, used once the engine drops a draft that does
        # not pay (CPU slots never written take no memory)
        held = 0
        if draft_bytes and count_draft and not surrogate_bytes:
            held = max(0, min(slots_for_budget(layout, full), layout.n_expert) - slots)
        plan = cls(slots=slots + held, held=held, reserved=reserved, budget_bytes=left)
        check_slots(layout, plan.slots, reserved=reserved, held=held)
        return plan

    @classmethod
    def _spread(cls, layout: ModelLayout, budget: str, full: int, left: int, *, draft_bytes: int, reserved: int,
                curves) -> MemoryPlan:
        """for_budget with per-layer counts: ``left`` bytes spread over layers, the floor uniform (held and
        reserved slots are uniform per layer; only regular slots differ)."""
        k = layout.n_expert_used
        try:
            counts = allocate_slots(layout, left, curves=curves, base=k + reserved)
        except SpecterError:
            have = slots_for_budget(layout, left)
            need = f"surrogate mode needs {2 * k}" if reserved else f"below top-{k}"
            raise SpecterError(f"budget {budget} buys {have} expert slots per layer, {need}"
                               + (" once the draft is counted" if draft_bytes else "")) from None
        slots, extra = split_counts(counts)
        held, held_extra = 0, {}
        if draft_bytes and not reserved:
            # what the draft's memory buys back: once it is dropped each layer gets what the budget without the
            # draft spreads to it (the engine's counts), where that spread gives no layer fewer slots than now
            after = allocate_slots(layout, left + draft_bytes, curves=curves, base=k)
            if all(after[il] >= n for il, n in counts.items()):
                held = min(after[il] - n for il, n in counts.items())
                held_extra = {il: after[il] - n - held for il, n in counts.items() if after[il] - n > held}
            else:  # in whole rows on top of every layer's count, within the full budget and n_expert
                row = sum(L.expert_bytes for L in layout.layers)
                rows = (full - slot_bytes(layout, counts)) // row if row else 0
                held = max(0, min(rows, layout.n_expert - max(counts.values())))
        plan = cls(slots=slots + held, held=held, reserved=reserved, budget_bytes=left, extra=extra,
                   held_extra=held_extra)
        check_slots(layout, plan.slots, reserved=reserved, held=held)
        return plan


RUNTIME_HEADROOM = 512 * 2**20  # KV cache, compute buffers, Python: kept free beside the weights
MARGIN = 0.10  # of the available memory, left to the rest of the machine


@dataclass(frozen=True)
class Fit:
    """Where a model's experts live when the user did not say: ``tier`` and ``budget`` (None: every expert
    resident), and the one line that says why."""

    tier: str
    budget: str | None
    why: str


_KEPT = f"{MARGIN:.0%} margin and {RUNTIME_HEADROOM / 2**30:.1f} GiB runtime kept free"


def usable_memory(available_bytes: int) -> int:
    """What the weights may take of the memory available now: a margin and the runtime's headroom stay free."""
    return int(available_bytes * (1 - MARGIN)) - RUNTIME_HEADROOM


def fit_to_memory(layout: ModelLayout, available_bytes: int) -> Fit:
    """Choose the tier and budget from the model's size and the memory available now (``psutil``'s figure),
    keeping a margin and the runtime's headroom free. A model that fits runs all-resident from RAM; one that does
    not streams its experts from disk with as many slots as the rest of the memory holds."""
    from pyspecter.units import fmt_size as gb

    usable = usable_memory(available_bytes)
    size = layout.file_bytes
    if size <= usable:
        return Fit("ram", None, f"model {gb(size)} fits in {gb(available_bytes)} available ({_KEPT}): "
                                "every expert resident")
    slot_bytes = usable - layout.nonexpert_bytes
    slots = slots_for_budget(layout, max(slot_bytes, 0))
    if slots < layout.n_expert_used:
        raise SpecterError(f"model {gb(size)} does not fit: {gb(available_bytes)} available leaves "
                           f"room for {slots} expert slots per layer ({_KEPT}), top-{layout.n_expert_used} needed")
    budget = slots * sum(L.expert_bytes for L in layout.layers)
    return Fit("disk", str(budget), f"model {gb(size)} > {gb(usable)} usable of "
                                    f"{gb(available_bytes)} available: experts stream from disk, "
                                    f"{gb(budget)} of slots ({100 * budget / layout.expert_total_bytes:.0f}%)")


def check_budget_fits(layout: ModelLayout, budget_bytes: int, available_bytes: int, given: str | None = None) -> None:
    """Refuse a budget whose slots, beside the non-expert weights, need more than the usable share of the memory
    available now (the share fit_to_memory fills). Slots are allocated memory that cannot be paged out (these
    machines have no swap): past that share the process is killed mid-run instead of refused at the start.
    ``given``: the budget as typed, whose unit family (MiB or MB) the message keeps."""
    from pyspecter.units import family, fmt_budget_arg, fmt_size

    usable = usable_memory(available_bytes)
    if budget_bytes + layout.nonexpert_bytes <= usable:
        return
    fam = family(given)
    most = fmt_budget_arg(max(usable - layout.nonexpert_bytes, 0), fam, up=False)  # the figure given must fit
    raise SpecterError(f"budget {fmt_size(budget_bytes, fam)} + {fmt_size(layout.nonexpert_bytes, fam)} of "
                       f"non-expert weights > {fmt_size(usable, fam)} usable of {fmt_size(available_bytes, fam)} "
                       f"available ({_KEPT}); give --budget {most} or less, or --force to run anyway")
