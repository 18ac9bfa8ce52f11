"""Surrogate misses (approximate, opt-in): the expansion into reserved slots is right (all neurons kept gives the
target's exact numbers), a narrow surrogate really is used and really changes the numbers, and the perplexity
cost is measured."""

from __future__ import annotations

import numpy as np
import pytest

from pyspecter.cache import ExpertCache
from pyspecter.engine import greedy
from pyspecter.errors import SpecterError
from pyspecter.layout import read_layout
from pyspecter.models.calibration import select_neurons
from pyspecter.models.tiny import build_tiny
from pyspecter.native import Context, Model
from pyspecter.surrogate import Surrogates
from pyspecter.tiers import make_tier

ARCHS = ["tiny-qwen3moe", "tiny-qwen2moe", "tiny-mixtral"]


def _run(path, slots: int, surrogates=None, n: int = 12, tier: str = "ram"):
    lay = read_layout(path)
    with Model(path, lazy_experts=tier == "disk") as m:
        cache = ExpertCache(m, lay, slots, miss="surrogate" if surrogates else "wait", surrogates=surrogates,
                            tier=make_tier(tier))
        with Context(m, n_threads=2) as ctx:
            toks, logits = greedy(ctx, m.tokenize("surrogate experts, please"), n)
            cache.check()
        c = cache.counters()
        cache.close()
    return toks, logits, c


@pytest.mark.parametrize("tier", ["ram", "disk"])
@pytest.mark.parametrize("name", ARCHS)
def test_full_width_surrogate_is_exact(name: str, tier: str) -> None:
    """C expands the kept bytes (csrc/surrogate.cpp): with every neuron kept, the expansion is the expert itself,
    whichever tier the full experts are read from in the background."""
    path = build_tiny(name)
    lay = read_layout(path)
    sur = Surrogates(lay, select_neurons(path, 1.0, n_calib=64, progress=False))
    ref, ref_logits, _ = _run(path, lay.n_expert)
    got, got_logits, c = _run(path, 2 * lay.n_expert_used, sur, tier=tier)
    assert c["surrogate_uses"] > 0
    assert got == ref
    assert np.abs(got_logits - ref_logits).max() == 0.0


@pytest.mark.parametrize("name", ARCHS)
def test_narrow_surrogate_is_used_and_approximate(name: str) -> None:
    path = build_tiny(name)
    lay = read_layout(path)
    sur = Surrogates(lay, select_neurons(path, 0.5, n_calib=64, progress=False))
    assert 0.4 < sur.nbytes / lay.expert_total_bytes < 0.6
    _, ref_logits, _ = _run(path, lay.n_expert)
    _, got_logits, c = _run(path, 2 * lay.n_expert_used, sur)
    assert c["surrogate_uses"] > 0
    assert np.isfinite(got_logits).all()
    assert np.abs(got_logits[1:] - ref_logits[1:len(got_logits)]).max() > 0  # decode steps used surrogates


def test_surrogates_that_do_not_fit_their_slots_are_refused() -> None:
    """C checks what it is handed: reserved slots among the usable ones, or neuron groups out of range, are a
    one-line SpecterError, never a write outside a slot."""
    path = build_tiny("tiny-mixtral")
    lay = read_layout(path)
    groups = select_neurons(path, 0.5, n_calib=64, progress=False)
    with Model(path) as m:
        cache = ExpertCache(m, lay, 2 * lay.n_expert_used, miss="wait")
        il = lay.layers[0].index
        with pytest.raises(SpecterError, match="do not fit"):  # would overwrite slots eviction hands out
            Surrogates(lay, groups).install(cache.api, m.ptr, il, 0, lay.n_expert_used)
        sur = Surrogates(lay, groups)
        sur.groups = {k: g + 10**6 for k, g in groups.items()}  # neuron groups the experts do not have
        with pytest.raises(SpecterError, match="do not fit"):
            sur.install(cache.api, m.ptr, il, cache.usable(il), lay.n_expert_used)
        cache.close()


def test_surrogate_mode_needs_room() -> None:
    path = build_tiny("tiny-mixtral")
    lay = read_layout(path)
    sur = Surrogates(lay, select_neurons(path, 0.5, n_calib=64, progress=False))
    with Model(path) as m, pytest.raises(SpecterError, match="surrogate mode needs"):
        ExpertCache(m, lay, lay.n_expert_used, miss="surrogate", surrogates=sur)


def test_cli_measures_the_cost() -> None:
    import json

    from conftest import run_cli

    r = run_cli("surrogate", "tiny-mixtral", "--width", "0.5", "--budget", "100%", "--eval-tokens", "48", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["surrogate"]["surrogate_uses"] > 0 and res["wait"]["surrogate_uses"] == 0
    assert res["ppl_delta"] == res["surrogate"]["ppl"] - res["wait"]["ppl"]
    r = run_cli("surrogate", "tiny-mixtral", "--width", "0.5", "--budget", "30%")
    assert r.returncode == 2 and "too small" in r.stderr and "as many for surrogates" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli("generate", "tiny-mixtral", "-p", "ab", "-n", "4", "--budget", "100%", "--miss", "surrogate",
                "--surrogate-width", "0.5")
    assert r.returncode == 0, r.stderr
    assert "surrogate mode (approximate): perplexity" in r.stderr
