"""The control plane's decisions, without llama.cpp: the K governor, speculative sampling, budgets, eviction
policy names. The slot table's rules (failed reads, reads in flight, protected experts) are C's:
tests/integration/test_faults.py, test_slots.py and test_native_residency.py hold them."""

from __future__ import annotations

import numpy as np
import pytest

from pyspecter.budget import MemoryPlan, check_slots, parse_budget, slots_for_budget
from pyspecter.errors import SpecterError
from pyspecter.governor import OFF, KGovernor
from pyspecter.layout import ExpertTensor, ModelLayout, MoELayer
from pyspecter.policies import check_policy
from pyspecter.sampling import Sampler, SamplingParams


def test_governor_turns_speculation_off_when_it_does_not_pay() -> None:
    g = KGovernor(k_max=6, k=3)
    for _ in range(20):
        k = g.choose()
        # nothing is ever accepted and drafting costs as much as verifying
        g.observe(k, 0, 0.01 * (k + 1), 0.01 + 0.001 * k)
    assert g.choose() == 0
    g2 = KGovernor(k_max=6, k=1)
    for _ in range(20):
        k = g2.choose()
        g2.observe(k, k, 0.001 * (k + 1), 0.01 + 0.0005 * k)  # everything accepted, drafting cheap
    assert g2.k >= 3


def test_governor_trusts_measured_speed_over_its_model() -> None:
    # the cost model alone would speculate (cheap draft, everything accepted), but every K > 0 step is measured
    # slow (e.g. prefetch bandwidth wasted on drafts' routing): the governor must settle on K = 0
    g = KGovernor(k_max=4, k=2, draft_at_k0=True)
    for _ in range(40):
        k = g.choose()
        g.observe(k, k, 0.001 * (k + 1), 0.01 if k == 0 else 0.2)
    assert g.k == 0
    assert g.seen_rate[0] > max(v for kk, v in g.seen_rate.items() if kk > 0)


def test_governor_calls_the_draft_idle_only_when_plain_decoding_is_measured_faster() -> None:
    g = KGovernor(k_max=4, k=2, draft_at_k0=True)
    for _ in range(40):
        k = g.choose()
        g.observe(k, 0, 0.01 * (k + 1) if k != OFF else 0.0, 0.01)  # the draft costs, nothing is accepted
    assert g.draft_idle()
    g.pin(OFF)
    assert g.choose() == OFF and not g.draft_idle()
    g2 = KGovernor(k_max=4, k=2, draft_at_k0=True)
    for _ in range(40):
        k = g2.choose()
        g2.observe(k, k, 0.001 * (k + 1) if k != OFF else 0.0, 0.01)  # a cheap draft, everything accepted
    assert not g2.draft_idle()

    # prediction pays a little (K=0 measured 10% faster than OFF), but OFF would have the draft's memory as slots:
    # idle only when that gain (estimated by the engine) outweighs it
    g3 = KGovernor(k_max=4, k=0, draft_at_k0=True)
    for _ in range(40):
        k = g3.choose()
        g3.observe(k, 0, 0.0, 0.01 if k == 0 else 0.011 if k == OFF else 0.03)
    assert not g3.draft_idle() and not g3.draft_idle(off_gain=1.1)
    assert g3.draft_idle(off_gain=1.5)


def test_governor_drops_a_draft_early_when_neither_its_tokens_nor_its_routing_pay() -> None:
    g = KGovernor(k_max=6, k=4, draft_at_k0=True)
    for _ in range(2):
        g.observe(4, 0, 0.025, 0.1)  # a cheap draft (5 ms a token), nothing accepted
    assert not g.draft_useless(routing_pays=False)  # two drafting steps: too early to tell
    g.observe(OFF, 0, 0.0, 0.1)  # a step without drafts does not count towards the verdict
    assert not g.draft_useless(routing_pays=False)
    g.observe(4, 0, 0.025, 0.1)
    assert not g.tokens_pay() and g.draft_useless(routing_pays=False)
    assert not g.draft_useless(routing_pays=True)  # its routing still pays: draft_idle judges that by time
    g.pin(OFF)
    assert not g.draft_useless(routing_pays=False)  # dropped already
    # half the drafts accepted at 5 ms a draft token against a 100 ms pass: E(1) = 1.5 > 1 + 2 * 0.05
    g2 = KGovernor(k_max=6, k=4)
    for _ in range(3):
        g2.observe(4, 2, 0.025, 0.1)
    assert g2.tokens_pay() and not g2.draft_useless(routing_pays=False)
    # a quarter accepted but a draft token costs as much as the whole pass: E(K) < 4/3 < 1 + (K+1) for every K
    g3 = KGovernor(k_max=6, k=4)
    for _ in range(3):
        g3.observe(4, 1, 0.5, 0.1)
    assert not g3.tokens_pay() and g3.draft_useless(routing_pays=False)


def test_speculative_sampling_preserves_target_distribution() -> None:
    # the first emitted token must follow the target's p exactly, whatever the draft's q
    rng = np.random.default_rng(0)
    V = 6
    p_logits = rng.normal(size=(2, V)) * 1.5
    q_logits = rng.normal(size=V) * 1.5
    q = np.exp(q_logits - q_logits.max())
    q /= q.sum()
    p0 = np.exp(p_logits[0] - p_logits[0].max())
    p0 /= p0.sum()
    counts = np.zeros(V)
    sampler = Sampler(SamplingParams(1.0, top_k=0, top_p=1.0, min_p=0.0))  # the plain softmax
    sampler.rng = rng
    N = 40000
    for _ in range(N):
        d = int(rng.choice(V, p=q))
        accepted, tok = sampler.verify(p_logits, [d], [q])
        counts[d if accepted == 1 else tok] += 1
    freq = counts / N
    assert np.abs(freq - p0).max() < 0.01, (freq, p0)


def _layout(n_expert: int = 8, n_used: int = 2, n_layers: int = 2, expert_bytes: int = 1000) -> ModelLayout:
    layers = [MoELayer(i, {"up": ExpertTensor(f"blk.{i}.ffn_up_exps.weight", "up", "F16", (n_expert, 4, 4),
                                              0, expert_bytes)}) for i in range(n_layers)]
    return ModelLayout(path=None, arch="test", name="t", n_layer=n_layers, n_expert=n_expert,  # type: ignore[arg-type]
                       n_expert_used=n_used, n_shared_expert_layers=0, file_bytes=0,
                       tensor_bytes=n_layers * n_expert * expert_bytes + 500, layers=layers)


def test_budget_text() -> None:
    assert parse_budget("64MiB", 0) == 64 * 2**20 and parse_budget("1.5GB", 0) == 1_500_000_000
    assert parse_budget("40%", 1000) == 400 and parse_budget("123456", 0) == 123456
    for bad in ("", "abc", "0", "-5MiB", "150%", "0%", "12 parsecs"):
        with pytest.raises(SpecterError):
            parse_budget(bad, 1000)


def test_memory_plan() -> None:
    lay = _layout()  # one slot in every layer: 2000 bytes
    assert slots_for_budget(lay, 9_999) == 4 and slots_for_budget(lay, 10**9) == 8
    assert MemoryPlan.for_budget(lay, None).slots == 8
    p = MemoryPlan.for_budget(lay, "10000")
    assert (p.slots, p.held, p.reserved, p.usable) == (5, 0, 0, 5)
    # a counted draft of 4000 bytes leaves 3 slots now; the 2 its memory buys back are held for later
    p = MemoryPlan.for_budget(lay, "10000", draft_bytes=4000)
    assert (p.slots, p.held, p.usable) == (5, 2, 3)
    assert MemoryPlan.for_budget(lay, "10000", draft_bytes=4000, count_draft=False).held == 0
    p = MemoryPlan.for_budget(lay, "12000", surrogate_bytes=2000)
    assert (p.slots, p.reserved, p.usable) == (5, 2, 3)
    with pytest.raises(SpecterError, match="too small"):
        MemoryPlan.for_budget(lay, "3000", draft_bytes=4000)
    with pytest.raises(SpecterError, match="too small"):
        MemoryPlan.for_budget(lay, "3000")


def test_a_budget_too_small_names_the_smallest_that_works() -> None:
    lay = _layout()  # one slot in every layer: 2000 bytes, top-2
    with pytest.raises(SpecterError) as e:
        MemoryPlan.for_budget(lay, "1KiB", predictor_bytes=5 * 2**20, spread=True)
    msg = str(e.value)
    assert msg == ("budget 1KiB is too small: the smallest that works is 5.0 MiB = top-2 slots per layer (3.9 KiB) "
                   "+ the learned predictor (5.0 MiB); give --budget 5.1MiB or more"), msg
    MemoryPlan.for_budget(lay, "5.1MiB", predictor_bytes=5 * 2**20, spread=True)  # the figure given works
    with pytest.raises(SpecterError, match=r"budget 3000 \(2.9 KiB\) is too small: the smallest that works is "
                                           r"7.8 KiB = top-2 slots per layer \(3.9 KiB\) \+ the draft \(3.9 KiB\)"):
        MemoryPlan.for_budget(lay, "3000", draft_bytes=4000)
    with pytest.raises(SpecterError, match=r"smallest that works is 11.9 KB = 4 slots per layer \(top-2 for full "
                                           r"experts, as many for surrogates\) \(8.0 KB\) \+ the surrogates"):
        MemoryPlan.for_budget(lay, "5KB", surrogate_bytes=3900)
    with pytest.raises(SpecterError, match="surrogate mode needs 4"):
        check_slots(lay, 3, reserved=2)


def test_only_the_policies_c_runs_are_accepted() -> None:
    for name in ("lru", "lfu", "prev-token", "predicted"):
        check_policy(name)
    with pytest.raises(SpecterError, match="unknown policy 'fifo'"):
        check_policy("fifo")




def test_filters_keep_what_llama_cpp_keeps() -> None:
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    probs = lambda **kw: Sampler(SamplingParams(1.0, **{"top_k": 0, "top_p": 1.0, "min_p": 0.0, **kw})).probs(logits)  # noqa: E731
    assert np.count_nonzero(probs(top_k=2)) == 2
    assert np.count_nonzero(probs(top_p=0.8)) == 3  # 0.5 + 0.2 < 0.8 <= 0.85
    assert np.count_nonzero(probs(min_p=0.25)) == 3  # >= 0.125: 0.5, 0.2, 0.15
    assert np.allclose(probs(top_k=2)[:2], [0.5 / 0.7, 0.2 / 0.7])
    # repetition penalty: llama.cpp divides positive logits and multiplies negative ones
    pen = Sampler(SamplingParams(0.0, repeat_penalty=2.0))
    assert pen.pick(np.array([1.0, 0.9, -1.0]), recent=[0]) == 1
    assert pen.pick(np.array([1.0, 0.9, -1.0])) == 0
    with pytest.raises(SpecterError):
        SamplingParams(1.0, top_p=0.0).check()


def test_speculative_sampling_preserves_the_filtered_distribution() -> None:
    """With top-k, top-p, min-p and a repetition penalty on, the first emitted token still follows the target's
    processed distribution exactly, whatever the draft's (processed) distribution is."""
    rng = np.random.default_rng(1)
    V = 12
    params = SamplingParams(0.8, top_k=8, top_p=0.9, min_p=0.05, repeat_penalty=1.3)
    sampler = Sampler(params)
    sampler.rng = rng
    recent = [1, 4]
    p_logits = rng.normal(size=(2, V)) * 2.0
    q = Sampler(params).probs(rng.normal(size=V) * 2.0, recent)
    p0 = sampler.probs(p_logits[0], recent)
    counts = np.zeros(V)
    N = 40000
    for _ in range(N):
        d = int(rng.choice(V, p=q))
        accepted, tok = sampler.verify(p_logits, [d], [q], recent)
        counts[d if accepted == 1 else tok] += 1
    assert np.abs(counts / N - p0).max() < 0.01, (counts / N, p0)


def test_memory_cgroup_v1_then_v2_then_none(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's cap: v1's memory controller when present, else a v2 child with memory.max where the root
    delegates the memory controller, else none (and the rows say so). Exercised on folders shaped like each."""
    from pyspecter.study import capped as bench

    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    monkeypatch.setattr(bench, "CGROUP_ROOT", v1)
    monkeypatch.setattr(bench, "CGROUP2_ROOT", v2)
    assert bench._make_cgroup(1 << 20) == (None, "none")
    v2.mkdir()
    (v2 / "cgroup.subtree_control").write_text("cpu io\n")
    assert bench._make_cgroup(1 << 20) == (None, "none")  # memory not delegated to children
    (v2 / "cgroup.subtree_control").write_text("cpu memory io\n")
    cg, kind = bench._make_cgroup(1 << 20)
    assert kind == "v2" and (cg / "memory.max").read_text() == str(1 << 20)
    v1.mkdir()
    cg, kind = bench._make_cgroup(2 << 20)
    assert kind == "v1" and (cg / "memory.limit_in_bytes").read_text() == str(2 << 20)


def test_fitting_a_model_to_the_memory_available() -> None:
    """Without --tier/--budget: all-resident from RAM when the file fits beside a margin and the runtime, else
    experts from disk with as many slots as the rest of the memory holds; refused when not even top-k fits."""
    from pyspecter.budget import RUNTIME_HEADROOM, fit_to_memory, usable_memory

    lay = _layout(n_expert=8, n_used=2, n_layers=2, expert_bytes=100 * 2**20)  # 1.6 GB of experts
    lay.file_bytes = lay.tensor_bytes
    roomy = fit_to_memory(lay, 8 * 2**30)
    assert (roomy.tier, roomy.budget) == ("ram", None) and "every expert resident" in roomy.why
    tight = 2 * lay.file_bytes // 3 + RUNTIME_HEADROOM
    fit = fit_to_memory(lay, tight)
    assert fit.tier == "disk" and "stream from disk" in fit.why
    budget = int(fit.budget)
    slot_row = 2 * 100 * 2**20
    assert budget % slot_row == 0 and budget + lay.nonexpert_bytes <= usable_memory(tight)
    assert MemoryPlan.for_budget(lay, fit.budget).slots == budget // slot_row >= 2
    with pytest.raises(SpecterError, match="does not fit"):
        fit_to_memory(lay, RUNTIME_HEADROOM + 300 * 2**20)


def _rates(a: float, td: float, c: float, stall: float, union, k_max: int) -> dict[int, float]:
    """What best_k's docstring says a step of K emits per second, computed here by hand."""
    from pyspecter.governor import expected_tokens

    out = {0: 1 / (c + stall)}  # no draft at K=0 (draft_at_k0 off): plain decoding
    for k in range(1, k_max + 1):
        out[k] = expected_tokens(a, k) / ((k + 1) * td + c + stall * union(k))
    return out


@pytest.mark.parametrize("a,stall,union,pays", [
    (0.7, 0.0, lambda k: 1.0 + k, True),  # compute-bound: the union costs nothing, speculation pays
    (0.7, 0.03, lambda k: 1.0 + k, False),  # reads dominate and every draft brings a token's worth: the union loses
    (0.7, 0.03, lambda k: 1.0 + 0.1 * k, True),  # ... the same with tokens sharing their experts: it pays again
    (0.2, 0.0, lambda k: 1.0, False),  # drafts mostly rejected: nothing pays
])
def test_the_k_rule_weighs_acceptance_against_the_unions_bytes(a, stall, union, pays) -> None:
    """best_k on synthetic inputs picks the K with the most tokens per second by its docstring's formula: E(K)
    tokens for (K+1) draft tokens plus compute plus the one-token stall scaled by the union's bytes."""
    from pyspecter.governor import best_k

    k_max, td, c = 6, 0.002, 0.01
    measured_union = {k: union(k) for k in range(1, k_max + 1)}
    got = best_k(a, td, {0: c}, stall, measured_union, k_max)
    want = _rates(a, td, c, stall, union, k_max)
    assert got == max(want, key=lambda k: (want[k], -k))
    assert (got > 0) == pays
    # a K not measured is read on the line through those that were: one measured point gives the slope
    assert best_k(a, td, {0: c}, stall, {1: union(1)}, k_max) == got
    # ... and with none measured every draft is taken to bring a whole token's experts (the pessimistic slope 1)
    assert best_k(a, td, {0: c}, stall, {}, k_max) == best_k(a, td, {0: c}, stall, measured_union | {
        k: 1.0 + k for k in range(1, k_max + 1)}, k_max)


def test_the_k_rule_trusts_a_measured_rate_and_offers_off_with_a_draft_at_k0() -> None:
    from pyspecter.governor import best_k

    # the model would speculate (everything accepted, compute-bound), but K >= 1 was measured slow
    assert best_k(0.99, 0.001, {0: 0.01}, 0.0, {}, 4) == 4
    assert best_k(0.99, 0.001, {0: 0.01}, 0.0, {}, 4, measured={k: 1.0 for k in range(1, 5)}) == 0
    # K=0 with a draft costs a draft token for its routing only: by the model plain decoding (OFF) beats it; a
    # measured K=0 faster than OFF (its prefetches paid) wins
    assert best_k(0.0, 0.002, {0: 0.01}, 0.02, {}, 4, draft_at_k0=True) == OFF
    assert best_k(0.0, 0.002, {0: 0.01}, 0.02, {}, 4, draft_at_k0=True, measured={0: 40.0, OFF: 33.0}) == 0


@pytest.mark.parametrize("share,speculates", [(1.0, False), (0.1, True)])
def test_governor_adapts_k_to_the_measured_union(share: float, speculates: bool) -> None:
    """A simulated I/O-bound target (a one-token pass: 10 ms compute + 30 ms of reads for 30 MB) and a draft
    accepted 70% of the time: where each draft brings a token's worth of new experts (share 1) the governor
    settles on no speculation; where drafted tokens mostly share experts (share 0.1) it speculates."""
    rng = np.random.default_rng(0)
    g = KGovernor(k_max=6, k=3)
    picks = []
    for step in range(120):
        k = g.choose()
        accepted = 0
        while accepted < k and rng.random() < 0.7:
            accepted += 1
        u = 1.0 + share * max(k, 0)
        stall = 0.03 * u
        g.observe(k, accepted, 0.002 * (k + 1) if k > 0 else 0.0, 0.01 + stall, (int(30e6 * u), stall))
        if step >= 60 and step % 32:
            picks.append(k)
    assert g.union()[1] == pytest.approx(1.0 + share)
    assert (min(picks) > 0) == speculates and (max(picks) == 0) == (not speculates), picks


def test_the_drafts_rates_are_read_from_counts_and_merge_from_summed_counts() -> None:
    """A bench sums the counters of its prompts: the draft's counts add up and its rates are read again from the
    sums (a prompt with nothing scored has None rates, which must not be summed)."""
    from pyspecter.native_residency import draft_rates
    from pyspecter.study.bench_runs import merge_counters

    counts = {"draft_scored": 10, "draft_used": 9, "draft_needed": 40, "draft_hits": 30, "draft_recalled": 36,
              "draft_lru_hits": 12}
    a = {**counts, **draft_rates(counts)}
    assert (a["draft_precision"], a["draft_coverage"], a["draft_recall"], a["draft_lru_hit_rate"]) == (
        0.9, 0.75, 0.9, 0.3)
    empty = dict.fromkeys(counts, 0)
    b = {**empty, **draft_rates(empty)}
    assert b["draft_precision"] is None and b["draft_coverage"] is None
    out = merge_counters([a, b, a])
    assert out["draft_scored"] == 20 and out["draft_precision"] == 0.9 and out["draft_lru_hit_rate"] == 0.3


def test_disk_overlap_is_busy_time_less_the_waits_inside_it() -> None:
    """The disk's overlap with compute: read-busy time the routing op did not wait through, summed over runs; none
    where nothing was read, and never below 0 (a wait is timed a little wider than the read it waits for)."""
    from pyspecter.study.bench_runs import disk_overlap

    assert disk_overlap([{"read_busy_ms": 30.0, "wait_ms": 10.0}, {"read_busy_ms": 10.0, "wait_ms": 10.0}]) == 0.5
    assert disk_overlap([{"read_busy_ms": 0.0, "wait_ms": 0.0}]) is None and disk_overlap([]) is None
    assert disk_overlap([{"read_busy_ms": 10.0, "wait_ms": 10.5}]) == 0.0
