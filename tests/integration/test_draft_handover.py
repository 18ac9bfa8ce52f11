"""A draft's routing in the target's native planner (csrc/draft.cpp): handed over once per draft step, turned into
prefetches by the draft's own routing op in C, taken back by the target's demand reads, and scored (precision,
coverage, recall, a ghost LRU's hit rate), with the target's greedy output unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyspecter import native
from pyspecter.cache import ExpertCache
from pyspecter.engine import SpeculativeDecoder, greedy
from pyspecter.layout import read_layout
from pyspecter.models.draft import make_draft
from pyspecter.models.tiny import build_tiny
from pyspecter.predict import DraftRouting
from pyspecter.tiers import DiskTier

TEXT = "def fib(n): return n if n < 2 else fib(n-1) + fib(n-2)"


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    native.quiet_logs()
    return make_draft(build_tiny("tiny-qwen3moe"), tmp_path_factory.mktemp("draft") / "draft.gguf",
                      experts_type="Q4_0", ffn_keep=1.0, progress=False)


class _Counted:
    """A bound C function of the shared SlotAPI, counting its calls."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.fn(*args)


@pytest.mark.parametrize("batch_verify", [False, True])
def test_one_handover_a_draft_step_and_no_call_per_layer_or_expert(draft: Path, batch_verify: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step drafts (K = 2, not adaptive): the engine makes one handover call per step (and one close at the
    end), no schedule or protect call at all; the prefetches come from C, are all scored once their windows
    close, mostly used (this draft is the target at Q4_0), and the output is the target's greedy output."""
    model = build_tiny("tiny-qwen3moe")
    lay = read_layout(model)
    with native.Model(model) as m, native.Context(m, n_threads=1) as ctx:
        toks = m.tokenize(TEXT)
        ref = greedy(ctx, toks, 24)[0]
    api = native.slots()
    counted = {name: _Counted(getattr(api, name)) for name in ("draft_handover", "schedule", "set_protected")}
    for name, c in counted.items():
        monkeypatch.setattr(api, name, c)
    with native.Model(model) as tm, native.Model(draft) as dm:
        cache = ExpertCache(tm, lay, lay.n_expert_used + 4, miss="wait", ordered=True)
        routing = DraftRouting(dm, read_layout(draft))
        try:
            assert cache.native
            with native.Context(tm, n_threads=1) as tctx, native.Context(dm, n_threads=1) as dctx:
                eng = SpeculativeDecoder(tctx, dctx, k=2, adaptive=False, routing=routing, slots=cache,
                                         batch_verify=batch_verify)
                if batch_verify:  # every window in one pass: the handover's deadlines follow it
                    eng.governor.tokens_pay = lambda: True
                assert eng.generate(toks, 24, stop_at_eog=False) == ref
                cache.check()
            c = cache.counters()
            d = cache.nat.draft_stats()
        finally:
            routing.close()
            cache.close()
    st = eng.stats
    steps = st.k_hist[2] + st.k_hist.get(1, 0)  # (the last step drafts only what is still wanted)
    assert steps == st.steps and st.serial_verifies == (0 if batch_verify else steps)
    handovers = [a for a in counted["draft_handover"].calls if a[1] is not None]
    closes = [a for a in counted["draft_handover"].calls if a[1] is None]
    assert len(handovers) == d.handovers == st.handovers == steps and len(closes) == 1
    # per_pass: the window's tokens in one pass when batched, one a pass otherwise
    assert all(a[3] == (a[4] if batch_verify else 1) for a in handovers)
    assert counted["schedule"].calls == [] and counted["set_protected"].calls == []
    assert c["draft_handovers"] == steps
    assert 0 < d.prefetches and d.scored == d.prefetches  # every window closed
    assert d.used > 0 and c["draft_precision"] == pytest.approx(d.used / d.scored) and c["draft_precision"] > 0.5
    assert d.needed > 0 and d.picks > 0 and d.predicted > 0
    for key in ("draft_coverage", "draft_recall", "draft_lru_hit_rate"):
        assert 0.0 <= c[key] <= 1.0, (key, c)
    assert c["draft_recall"] > 0.5  # the draft is the target at Q4_0: it names most of what the target routes


def test_a_demand_takes_back_the_drafts_queued_prefetches(draft: Path) -> None:
    """Handed over, the draft's routing of one token queues prefetches behind a slow link (250 KB/s: 96 ms
    an expert), two readers, and earlier prefetches of other experts that keep them busy; when the target then
    routes that token it needs what the draft named, finds those still queued and takes them back whole, to read
    them as demand reads. The target's logits stay stock's."""
    model = build_tiny("tiny-qwen3moe")
    lay = read_layout(model)
    with native.Model(model) as m:
        toks = m.tokenize(TEXT)[:3]
    with native.Model(model) as stock, native.Context(stock, n_threads=2) as ctx:
        for t in toks[:2]:
            ctx.decode([t])
        ref = ctx.decode([toks[2]])
    with native.Model(model) as tm, native.Model(draft) as dm:
        cache = ExpertCache(tm, lay, lay.n_expert // 2, miss="wait", tier=DiskTier(queue_depth=1, read_chunk=4096),
                            lookahead=False)
        routing = DraftRouting(dm, read_layout(draft))
        try:
            with native.Context(tm, n_threads=2) as tctx, native.Context(dm, n_threads=2) as dctx:
                for t in toks[:2]:  # one token at a time: the next decode's graph is built already
                    tctx.decode([t])
                    dctx.decode([t])
                cache.drain()
                before = cache.counters()
                native.slots().set_link_gbps(tm.ptr, 0.00025)
                # the readers kept busy first, whatever the machine's load: prefetches due now (deadline 0, ahead
                # of every draft prediction) of the last layer's experts not resident
                last = lay.layers[-1].index
                busy = [e for e, s in enumerate(cache.nat.layers()[last].where) if s < 0]
                assert cache.prefetch(last, busy, deadline=0) > 4
                cache.nat.handover(dm, 0.0, 1, 1)
                dctx.decode([toks[2]], logits=False)  # its routing op queues the target's prefetches, in C
                queued = cache.nat.draft_stats().prefetches
                got = tctx.decode([toks[2]])
                cache.nat.handover(None)
                native.slots().set_link_gbps(tm.ptr, 0.0)
                cache.drain()
                cache.check()
            c = cache.counters()
            d = cache.nat.draft_stats()
        finally:
            routing.close()
            cache.close()
    assert np.abs(ref - got).max() <= 1e-4
    assert queued > 0 and d.scored == queued and d.used > 0
    assert c["taken_back"] - before["taken_back"] > 0, c
    assert c["failed_uploads"] == 0
