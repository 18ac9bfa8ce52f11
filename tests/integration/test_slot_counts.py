"""One slot count: what inspect says a budget buys (placement.budget_slot_count) is what a session given that budget
holds (Session.slot_count), and a model that fits says "no slots" in stats, as generate, chat and serve read them."""

from __future__ import annotations

import pytest

from pyspecter.layout import read_layout
from pyspecter.models.catalog import resolve_model
from pyspecter.placement import budget_slot_count
from pyspecter.session import Session, SessionConfig


@pytest.mark.parametrize("budget, tier", [("30%", "disk"), ("50%", "disk"), ("50%", "ram"), ("40%", "emulated:20")])
def test_inspect_says_what_the_session_holds(budget: str, tier: str) -> None:
    path = resolve_model("smol-moe")
    said = budget_slot_count(read_layout(path), budget, path, tier=tier)
    with Session(SessionConfig(model=path, budget=budget, tier=tier, force=True)) as s:
        held = s.slot_count()
        st = s.stats()
    assert said.counts == held.counts and str(said) == str(held), (str(said), str(held))
    assert (st["slots_min"], st["slots_max"]) == (min(held.counts), max(held.counts))
    assert st["slots_mean"] == pytest.approx(sum(held.counts) / len(held.counts))


def test_a_fitting_model_says_no_slots() -> None:
    with Session(SessionConfig(model=resolve_model("smol-moe"))) as s:  # fits this machine: stock
        st = s.stats()
    assert st["stock"] and st["slots_text"] == "no slots (every expert resident)"
    assert st["slots_per_layer"] == st["slots_min"] == st["slots_max"] == st["slots_mean"] == 0
