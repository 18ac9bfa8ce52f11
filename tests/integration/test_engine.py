"""The speculative engine: greedy output identical to the target's own greedy decoding (every fixture arch, with a
draft made by llama.cpp's quantizer and expert prefetch on the target's slots), and speculative sampling that
preserves the target's distribution."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyspecter import native
from pyspecter.cache import ExpertCache
from pyspecter.engine import SpeculativeDecoder, greedy
from pyspecter.governor import KGovernor
from pyspecter.layout import read_layout
from pyspecter.models.draft import make_draft
from pyspecter.models.tiny import TINY_MODELS, build_tiny
from pyspecter.native import Replay
from pyspecter.predict import DraftRouting


@pytest.fixture(scope="session")
def tiny_drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, float], Path]:
    """Drafts made the way `pyspecter draft` makes them: experts at Q4_0, full width and narrowed to half."""
    out = {}
    d = tmp_path_factory.mktemp("drafts")
    native.quiet_logs()
    for name in TINY_MODELS:
        for keep in (1.0, 0.5):
            out[name, keep] = make_draft(build_tiny(name), d / f"{name}-q4_0-{keep}.gguf", experts_type="Q4_0",
                                         ffn_keep=keep, progress=False)
    return out


PROMPTS = ["hello there, speculative world", "def fib(n): return n if n < 2 else fib(n-1) + fib(n-2)"]


@pytest.mark.parametrize("keep", [1.0, 0.5])
@pytest.mark.parametrize("adaptive,batch_verify", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_greedy_identical_to_target(name: str, adaptive: bool, batch_verify: bool, keep: float,
                                    tiny_drafts: dict[tuple[str, float], Path]) -> None:
    # batched verification runs with batch-invariant matmuls (patch 0004): exact on every fixture and on smol-moe
    # (test_smol), where stock's kernels are not
    path = build_tiny(name)
    draft = tiny_drafts[name, keep]
    lay, dlay = read_layout(path), read_layout(draft)
    refs = []
    with native.Model(path) as m, native.Context(m) as ctx:
        for text in PROMPTS:
            ctx.clear()
            refs.append((m.tokenize(text), greedy(ctx, m.tokenize(text), 32)[0]))
    with native.Model(path) as tm, native.Model(draft) as dm:
        cache = ExpertCache(tm, lay, lay.n_expert // 2, miss="cpu")
        routing = DraftRouting(dm, dlay)
        with native.Context(tm) as tctx, native.Context(dm) as dctx:
            # adaptive runs also predict at K=0 (the draft runs one token ahead for its routing only)
            eng = SpeculativeDecoder(tctx, dctx, k=3, adaptive=adaptive, routing=routing, slots=cache,
                                     batch_verify=batch_verify, predict_at_k0=adaptive)
            for toks, ref in refs:
                out = eng.generate(toks, 32, stop_at_eog=False)
                cache.check()
                assert out == ref
                # KV rollback: the target holds the prompt and every emitted token but the last
                assert tctx.n_past == len(toks) + len(out) - 1
        if not adaptive:
            assert eng.stats.drafted > 0 and eng.stats.k_hist.get(3, 0) > 0
            assert cache.counters()["prefetches"] > 0
        cache.close()


def test_sampling_is_seeded(tiny_drafts: dict[str, Path]) -> None:
    path = build_tiny("tiny-mixtral")
    outs = []
    for _ in range(2):
        with native.Model(path) as tm, native.Model(tiny_drafts["tiny-mixtral", 1.0]) as dm:
            with native.Context(tm) as tctx, native.Context(dm) as dctx:
                eng = SpeculativeDecoder(tctx, dctx, k=3, adaptive=False, temperature=0.8, seed=7)
                outs.append(eng.generate(tm.tokenize("sample me"), 24, stop_at_eog=False))
    assert outs[0] == outs[1] and len(outs[0]) == 24


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_narrow_draft(name: str, tiny_drafts: dict[tuple[str, float], Path]) -> None:
    """Narrowed experts: half the hidden neurons (whole 32-blocks), everything else as in the full draft; the
    draft still routes well above chance on these random-weight experts, which share nothing."""
    import gguf

    from pyspecter.models.draft import routing_agreement

    full, narrow = read_layout(tiny_drafts[name, 1.0]), read_layout(tiny_drafts[name, 0.5])
    assert narrow.n_expert == full.n_expert and len(narrow.layers) == len(full.layers)
    assert 0.4 < narrow.expert_total_bytes / full.expert_total_bytes < 0.6
    r = gguf.GGUFReader(tiny_drafts[name, 0.5])
    n_ff = [int(t.shape[1]) for t in r.tensors if t.name.endswith("ffn_up_exps.weight")]
    n_ff_full = [int(t.shape[1]) for t in gguf.GGUFReader(tiny_drafts[name, 1.0]).tensors
                 if t.name.endswith("ffn_up_exps.weight")]
    assert all(a * 2 == b for a, b in zip(n_ff, n_ff_full, strict=True)) and n_ff[0] % 32 == 0
    agree = routing_agreement(build_tiny(name), tiny_drafts[name, 0.5])
    assert agree["overall"] > 2 * agree["chance"], agree


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_engine_exact_with_ordered_waits_on_disk(name: str, tiny_drafts: dict[tuple[str, float], Path]) -> None:
    """The session default on the disk tier: wait mode with late experts after resident ones (patch 0005), with
    the draft's prefetches in flight, K=0 prediction and speculation mixed by the governor."""
    from pyspecter.tiers import make_tier

    path = build_tiny(name)
    draft = tiny_drafts[name, 0.5]
    lay, dlay = read_layout(path), read_layout(draft)
    with native.Model(path) as m, native.Context(m) as ctx:
        toks = m.tokenize(PROMPTS[1])
        ref = greedy(ctx, toks, 24)[0]
    with native.Model(path) as tm, native.Model(draft) as dm:
        cache = ExpertCache(tm, lay, lay.n_expert_used + 1, miss="wait", ordered=True, tier=make_tier("disk"))
        routing = DraftRouting(dm, dlay)
        with native.Context(tm) as tctx, native.Context(dm) as dctx:
            eng = SpeculativeDecoder(tctx, dctx, k=2, adaptive=True, routing=routing, slots=cache,
                                     predict_at_k0=True)
            assert eng.generate(toks, 24, stop_at_eog=False) == ref
            cache.check()
        assert cache.counters()["late"] > 0
        cache.close()


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen3moe"])
def test_ghost_lru_counts_what_plain_lru_would_miss_with_the_held_slots(name: str) -> None:
    """The estimate behind dropping a draft: with held slots, C also runs plain LRU over all of a layer's slots
    in bookkeeping. Its misses, layer by layer, must be the replay's (the same C ghost on a private table) on the
    same routing trace (the prompt's ubatch included, whose distinct experts may outnumber the ghost)."""
    path = build_tiny(name)
    lay = read_layout(path)
    with native.Model(path) as m:
        cache = ExpertCache(m, lay, lay.n_expert_used + 3, miss="wait", held=2, record=True)
        assert cache.native
        with native.Context(m) as ctx:
            logits = ctx.decode(m.tokenize(PROMPTS[1]))
            for _ in range(12):
                logits = ctx.decode([int(logits.argmax())])
        cache.check()
        totals, trace, cap = cache.totals, list(cache.trace), cache.n_regular
        per_layer = {il: cache.nat.ghost_misses(il) for il in cache.layer_pos}
        cache.close()
    with Replay(dict.fromkeys(per_layer, cap - 2), lay.n_expert, lookahead=False, held=2) as ghosts:
        for il, needed in trace:
            ghosts.call(il, list(needed))
        expect = {il: ghosts.stats(il)["held_ghost_misses"] for il in per_layer}
    assert per_layer == expect and totals.ghost_misses == sum(expect.values()) > 0
    assert totals.misses >= totals.ghost_misses  # fewer usable slots miss at least as often


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_dropping_the_draft_gives_its_memory_to_the_slots(tier: str, tiny_drafts: dict[tuple[str, float], Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With the draft counted in the budget, the slots it would buy back are allocated but held; when the
    governor finds the draft idle, the session frees it and the held slots are used. Output stays the target's
    greedy output across the switch."""
    from pyspecter.session import Session, SessionConfig

    name = "tiny-qwen3moe"
    path, draft = build_tiny(name), tiny_drafts[name, 0.5]
    with native.Model(path) as m, native.Context(m) as ctx:
        toks = m.tokenize(PROMPTS[1])
        ref = greedy(ctx, toks, 24)[0]
    lay = read_layout(path)
    budget = draft.stat().st_size + 6 * sum(L.expert_bytes for L in lay.layers)  # 6 slots once the draft is paid
    monkeypatch.setattr(KGovernor, "draft_idle", lambda self, off_gain=1.0: self.pinned is None and self.steps >= 6)
    # the RAM tier's copying miss mode: its default (host) fills no slot, so it has no memory to give them
    s = Session(SessionConfig(model=path, draft=draft, budget=str(budget), tier=tier, k=2,
                              miss="cpu" if tier == "ram" else None))
    try:
        assert s.n_slots == 6 and s.held > 0 and s.cache.n_usable == 6
        assert s.cache.native and s.cache.hooks is None  # a draft session is native from its first token
        held = s.held
        assert s.generate(toks, 24, stop_at_eog=False) == ref
        assert s.cache.hooks is None and s.cache.api.stats(s.target.ptr).hook_ns == 0  # no Python hook
        assert s.draft is None and s.decoder.stats.dropped_at == 6
        assert all(s.cache.nat.held(il) == 0 for il in s.cache.layer_pos)  # released in C
        assert s.n_slots == 6 + held and s.cache.n_usable == s.cache.n_regular == s.n_slots
        # the freed slots are in use: some slot past the 6 usable before the drop holds an expert, once the reads
        # still in flight have landed (under load the answer can end first: CI's fresh clone did, once)
        s.cache.drain()
        assert any(e >= 0 for st in s.cache.layers.values() for e in st.owner[6:])
        assert s.stats()["draft_dropped_at"] == 6
        assert s.generate(toks, 8, stop_at_eog=False) == ref[:8]  # and the next answer runs without it
    finally:
        s.close()


@pytest.fixture(scope="session")
def useless_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real draft that predicts nothing: made the usual way (experts Q4_0, half width) from a model of the same
    shape and vocabulary with other random weights, so neither its tokens nor its routing match the target's."""
    import dataclasses

    from pyspecter.models import tiny

    d = tmp_path_factory.mktemp("useless")
    spec = dataclasses.replace(tiny.TINY_MODELS["tiny-qwen3moe"], seed=7)
    other = d / "other-tiny-qwen3moe.gguf"
    tiny._write(spec, other)
    native.quiet_logs()
    return make_draft(other, d / "useless-draft.gguf", experts_type="Q4_0", ffn_keep=0.5, progress=False)


def test_a_useless_draft_is_dropped_early_and_leaves_the_engine_behind(useless_draft: Path) -> None:
    """The governor's early verdict (KGovernor.draft_useless): after the first three drafting steps nothing was
    accepted and the draft's prefetches had missed (cut off already), so the draft is dropped; from then on the
    session runs the engine's configuration and reads what the engine without a draft reads, but for what the
    first steps left behind (the slots' contents and the use counts the prefill lookahead ranks by), and its
    output stays the target's greedy output."""
    from pyspecter.session import Session, SessionConfig

    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    with native.Model(path) as m, native.Context(m) as ctx:
        prompts = [m.tokenize(t) for t in PROMPTS]
        refs = []
        for toks in prompts:
            ctx.clear()
            refs.append(greedy(ctx, toks, 24)[0])
    budget = str(useless_draft.stat().st_size + 6 * sum(L.expert_bytes for L in lay.layers))
    read: dict[str, list[int]] = {}
    usable = {}
    for name, draft in (("engine", None), ("drafted", useless_draft)):
        # the engine a dropped draft leaves: no router-ahead maps (a session gets them only without a draft)
        s = Session(SessionConfig(model=path, draft=draft, budget=budget, tier="disk", k=3, predictor="off"))
        try:
            read[name] = []
            for i, (toks, ref) in enumerate(zip(prompts, refs, strict=True)):
                s.reset_stats()
                assert s.generate(toks, 24, stop_at_eog=False) == ref
                read[name].append(s.cache.counters()["read_bytes"])
                if draft is not None and i == 0:
                    st = s.decoder.stats
                    assert st.dropped_at == 3 and st.accepted == 0 and st.drafted == 9
                    # its prefetches were measured and cut off before the drop
                    assert st.prefetches_scored == st.prefetches > 0
                    assert st.prefetches_used < SpeculativeDecoder.MIN_PRECISION * st.prefetches
                    assert st.prefetch_stopped_at is not None and st.prefetch_stopped_at <= 3
                    done = (st.prefetches, st.steps)
                    assert s.draft is None and s.dctx is None and s.routing is None  # freed
                    assert all(s.cache.nat.held(il) == 0 for il in s.cache.layer_pos)
            if draft is not None:  # the second answer: no draft pass, no draft prefetch
                assert s.decoder.stats.prefetches == done[0] and s.decoder.stats.k_hist.get(3) == 3
                assert s.decoder.stats.steps == done[1] + 23
            usable[name] = s.cache.nat.usable
        finally:
            s.close()
    assert usable["drafted"] == usable["engine"]
    # the first answer pays for the three steps with the draft (measured: +18%); the second reads within 10% of
    # the engine's (measured: +6%, from the slots and use counts those steps left)
    assert read["drafted"][1] <= 1.1 * read["engine"][1]


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_probe_step_with_nothing_accepted_reads_what_a_plain_decode_reads(useless_draft: Path,
                                                                            prefetch: bool) -> None:
    """Until the measured acceptance shows that drafting pays, the target verifies a window one token at a time
    and stops at the first rejection: over the probe steps of a draft whose tokens all miss, the target decodes
    exactly what plain decoding decodes (the prompt, then one token per pass; no K+1 window, so no union of
    rejected tokens' experts and no prefill lookahead), and with the draft's prefetches off (a confidence floor
    above any routing weight) the session reads byte for byte what the engine without a draft reads. Output stays
    the target's greedy output."""
    from pyspecter.session import Session, SessionConfig

    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    with native.Model(path) as m, native.Context(m) as ctx:
        toks = m.tokenize(PROMPTS[1])
        ref = greedy(ctx, toks, 24)[0]
    budget = str(6 * sum(L.expert_bytes for L in lay.layers))  # the same slots with and without the draft
    read: dict[str, int] = {}
    sizes: dict[str, list[int]] = {}
    for name, draft in (("engine", None), ("drafted", useless_draft)):
        s = Session(SessionConfig(model=path, draft=draft, budget=budget, tier="disk", k=3, predictor="off",
                                  draft_counts_in_budget=False, min_confidence=0.0 if prefetch else 2.0))
        try:
            sizes[name] = seen = []
            decode = s.tctx.decode

            def counted(tokens: list[int], *a, _decode=decode, _seen=seen, **kw):  # noqa: ANN002, ANN003
                _seen.append(len(tokens))
                return _decode(tokens, *a, **kw)

            s.tctx.decode = counted
            s.reset_stats()
            assert s.generate(toks, 24, stop_at_eog=False) == ref
            read[name] = s.cache.counters()["read_bytes"]
            if draft is not None:
                st = s.decoder.stats
                assert st.dropped_at == 3 and st.drafted == 9 and st.accepted == 0 and st.serial_verifies == 3
                assert (st.prefetches > 0) == prefetch
        finally:
            s.close()
    assert sizes["drafted"] == sizes["engine"] == [len(toks)] + [1] * 23
    if not prefetch:
        assert read["drafted"] == read["engine"] > 0


@pytest.mark.parametrize("count_draft", [True, False])
def test_nothing_of_a_dropped_draft_stays_on_the_path(useless_draft: Path, count_draft: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the early verdict drops the draft, decoding is plain: no handover (the draft's routing reaches C once
    per drafting step, and no routing call is recorded for Python to score), no draft prefetch, nothing protected
    or held, no speculative step (the governor observes nothing more), and the draft's model and context are
    freed, also where its memory was not the slots' (drafted on top of the budget: no held slots). Output stays
    the target's greedy output."""
    from pyspecter.session import Session, SessionConfig

    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    with native.Model(path) as m, native.Context(m) as ctx:
        toks = m.tokenize(PROMPTS[1])
        ref = greedy(ctx, toks, 24)[0]
    slots = 6 * sum(L.expert_bytes for L in lay.layers)
    budget = str(slots + useless_draft.stat().st_size if count_draft else slots)
    s = Session(SessionConfig(model=path, draft=useless_draft, budget=budget, tier="disk", k=3,
                              draft_counts_in_budget=count_draft))
    try:
        assert bool(s.held) == count_draft and not s.cache.recording
        assert s.generate(toks, 24, stop_at_eog=False) == ref
        st = s.decoder.stats
        assert st.dropped_at == 3 and st.prefetch_stopped_at is not None
        assert s.draft is None and s.dctx is None and s.routing is None and s.decoder.draft is None
        assert not s.cache.recording and s.cache.take_calls() == []
        drafted = s.cache.nat.draft_stats()
        # one call per drafting step, until its prefetches are cut off
        assert 0 < drafted.handovers == st.handovers <= st.k_hist[3] == 3
        assert drafted.scored == drafted.prefetches  # every window closed: nothing of the draft left to score
        assert all(s.cache.nat.held(il) == 0 for il in s.cache.layer_pos)
        observed = s.decoder.governor.steps
        steps = []
        monkeypatch.setattr(SpeculativeDecoder, "_step", lambda self, *a: steps.append(a))
        assert s.generate(toks, 24, stop_at_eog=False) == ref
        s.tctx.decode([ref[-1]])  # one more decode with no check after it: C would hold its calls if it recorded
        assert s.cache.api.trace_take(s.target.ptr, None, 0) == 0
        assert steps == [] and s.decoder.governor.steps == observed
        after = s.cache.nat.draft_stats()
        assert (after.handovers, after.prefetches, after.scored) == (drafted.handovers, drafted.prefetches,
                                                                     drafted.scored)
        assert st.k_hist[-1] == st.steps - 3 and st.emitted == 2 * 23  # the first token of each: the prefill's
    finally:
        s.close()
