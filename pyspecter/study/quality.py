"""``pyspecter surrogate``: what the approximate ``--miss surrogate`` mode costs in quality at a budget."""

from __future__ import annotations

from pathlib import Path

from pyspecter.layout import read_layout
from pyspecter.models.calibration import select_neurons
from pyspecter.quality import perplexity_delta
from pyspecter.surrogate import Surrogates


def measure(path: Path, width: float, budget: str, tier: str = "ram", n_tokens: int = 256) -> dict:
    """The surrogate mode's perplexity cost at the slots ``budget`` leaves once the surrogates are paid for."""
    from pyspecter.budget import MemoryPlan

    lay = read_layout(path).require_moe()
    groups = select_neurons(path, width)
    plan = MemoryPlan.for_budget(lay, budget, surrogate_bytes=Surrogates(lay, groups).nbytes)  # refuses what cannot fit
    return perplexity_delta(path, groups, width, plan.slots, tier, n_tokens=n_tokens)
