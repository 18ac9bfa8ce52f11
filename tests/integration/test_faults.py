"""Faults never produce a wrong token. Native residency's readers fail chosen reads (after filling the slot's bytes
with NaN, as a torn read would), read slowly, or land late (the slot's bytes NaN until the read lands): the output
is the stock greedy one in every miss mode and tier, or a clean SpecterError; a slot is never read before its
bytes landed (a read of the NaN bytes would turn the logits NaN)."""

from __future__ import annotations

import pytest

from pyspecter import native
from pyspecter.cache import ExpertCache
from pyspecter.engine import greedy
from pyspecter.errors import SpecterError
from pyspecter.layout import read_layout
from pyspecter.models.tiny import build_tiny
from pyspecter.tiers import DiskTier, RamTier

PROMPT = "faults must never change a token"


def _run(tier, mode: str, n_tokens: int = 16):
    path = build_tiny("tiny-mixtral")
    lay = read_layout(path)
    with native.Model(path) as m, native.Context(m) as ctx:
        toks = m.tokenize(PROMPT)
        ref, _ = greedy(ctx, toks, n_tokens)
    with native.Model(path) as m:
        cache = ExpertCache(m, lay, lay.n_expert_used + 1, miss="cpu" if mode == "cpu" else "wait",
                            ordered=mode == "ordered", tier=tier)
        assert cache.native
        err = None
        try:
            with native.Context(m) as ctx:
                got, _ = greedy(ctx, toks, n_tokens)
                cache.check()
        except SpecterError as e:
            err, got = e, None
        finally:
            cache.close()
        # read while the model lives
        seen = {"injected": cache.faults_injected(), "failed": cache.failed_uploads(),
                "uploads": cache.counters()["uploads"]}
    return ref, got, err, seen


def _tier(name: str, faults: native.ReadFaults):
    return DiskTier(faults=faults) if name == "disk" else RamTier(faults=faults)


@pytest.mark.parametrize("tier", ["disk", "ram"])
@pytest.mark.parametrize("torn", [False, True], ids=["eio", "torn"])
@pytest.mark.parametrize("mode", ["wait", "ordered", "cpu"])
def test_failed_reads_never_map_a_slot(mode: str, torn: bool, tier: str) -> None:
    ref, got, err, seen = _run(_tier(tier, native.ReadFaults(fail_every=3, torn=torn)), mode)
    if err is not None:  # a late expert that failed twice: a clean error, never a wrong token
        assert mode == "ordered" and "failed" in str(err), err
    else:
        assert got == ref
    assert seen["injected"] > 0
    assert seen["failed"] > 0


@pytest.mark.parametrize("tier", ["disk", "ram"])
@pytest.mark.parametrize("mode", ["wait", "ordered", "cpu"])
def test_slow_reads_landing_late_are_never_read_early(mode: str, tier: str) -> None:
    ref, got, err, seen = _run(_tier(tier, native.ReadFaults(slow_us=500, land_us=2000)), mode, n_tokens=10)
    assert err is None, err
    assert got == ref
    assert seen["injected"] == 0
    assert seen["uploads"] > 0  # reads did go through the faults


def test_bad_faults_are_refused() -> None:
    path = build_tiny("tiny-mixtral")
    lay = read_layout(path)
    with native.Model(path) as m:
        with pytest.raises(SpecterError, match="read faults"):
            ExpertCache(m, lay, lay.n_expert_used + 1, tier=RamTier(faults=native.ReadFaults(fail_every=-1)))
