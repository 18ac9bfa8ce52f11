"""Fast memory: what a budget buys. Every fit check (top-k, draft, surrogates, held slots) lives here.

A budget is bytes of fast memory for expert slots. The draft's bytes come out of it when the draft is counted
(equal total fast memory: headline comparisons count it), and so do surrogates. One slot is one expert's worth
of bytes in every MoE layer, so the same number of slots is allocated per layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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


@dataclass(frozen=True)
class MemoryPlan:
    """Slots per layer for a budget: ``slots`` allocated in all, of which ``held`` wait for the draft's memory
    (used once a draft that does not pay is dropped) and ``reserved`` hold surrogates."""

    slots: int
    held: int = 0
    reserved: int = 0
    budget_bytes: int | None = None  # None: no budget, every expert resident

    @property
    def usable(self) -> int:
        """Slots eviction may use from the start."""
        return self.slots - self.held - self.reserved

    @classmethod
    def for_budget(cls, layout: ModelLayout, budget: str | None, *, draft_bytes: int = 0,
                   count_draft: bool = True, surrogate_bytes: int = 0, predictor_bytes: int = 0) -> MemoryPlan:
        """What ``budget`` (text, as a user gives it) buys for ``layout`` once the draft (when counted) and the
        surrogates have taken their bytes out of it."""
        layout.require_moe()
        reserved = layout.n_expert_used if surrogate_bytes else 0
        if budget is None:
            plan = cls(slots=layout.n_expert, reserved=reserved)
            check_slots(layout, plan.slots, reserved=reserved)
            return plan
        full = parse_budget(budget, layout.expert_total_bytes)
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
    gb = 1e9
    usable = usable_memory(available_bytes)
    size = layout.file_bytes
    if size <= usable:
        return Fit("ram", None, f"model {size / gb:.1f} GB fits in {available_bytes / gb:.1f} GB available ({_KEPT}): "
                                "every expert resident")
    slot_bytes = usable - layout.nonexpert_bytes
    slots = slots_for_budget(layout, max(slot_bytes, 0))
    if slots < layout.n_expert_used:
        raise SpecterError(f"model {size / gb:.1f} GB does not fit: {available_bytes / gb:.1f} GB available leaves "
                           f"room for {slots} expert slots per layer ({_KEPT}), top-{layout.n_expert_used} needed")
    budget = slots * sum(L.expert_bytes for L in layout.layers)
    return Fit("disk", str(budget), f"model {size / gb:.1f} GB > {usable / gb:.1f} GB usable of "
                                    f"{available_bytes / gb:.1f} GB available: experts stream from disk, "
                                    f"{budget / gb:.1f} GB of slots ({100 * budget / layout.expert_total_bytes:.0f}%)")


def check_budget_fits(layout: ModelLayout, budget_bytes: int, available_bytes: int) -> None:
    """Refuse a budget whose slots, beside the non-expert weights, need more than the usable share of the memory
    available now (the share fit_to_memory fills). Slots are allocated memory that cannot be paged out (these
    machines have no swap): past that share the process is killed mid-run instead of refused at the start."""
    gb = 1e9
    usable = usable_memory(available_bytes)
    if budget_bytes + layout.nonexpert_bytes <= usable:
        return
    most = max(usable - layout.nonexpert_bytes, 0) // 10**8 / 10  # GB, rounded down: the figure given must fit
    raise SpecterError(f"budget {budget_bytes / gb:.1f} GB + {layout.nonexpert_bytes / gb:.1f} GB of non-expert "
                       f"weights > {usable / gb:.1f} GB usable of {available_bytes / gb:.1f} GB available ({_KEPT}); "
                       f"give --budget {most:.1f}GB or less, or --force to run anyway")
