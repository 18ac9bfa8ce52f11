"""How far to speculate: the adaptive-K governor.

Cascade's lesson (speculation can cost more than it gives): pick the draft length that maximises expected tokens
per second from measured acceptance, measured step times and the measured bytes of the K+1 tokens' union of
experts, including K = 0 (the draft runs for its routing only) and OFF (plain decoding, no draft at all), and tell
when the draft should be dropped for good. The rule is one function, ``best_k``; ``KGovernor`` measures its inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

OFF = -1  # a "K" for the governor: no draft this step (plain decoding)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step of k drafts emits when each draft is accepted with probability ``acceptance`` given the
    previous one was: the accepted prefix plus the target's own token, (1 - a^(k+1)) / (1 - a)."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


def _at(k: int, known: Mapping[int, float], k0: float, default_slope: float) -> float:
    """A per-K measure at k: measured where it was, else on the line from (0, k0) through the measured points'
    mean slope (default_slope where none was measured)."""
    if k in known:
        return known[k]
    slopes = [(v - k0) / kk for kk, v in known.items() if kk > 0]
    return k0 + k * (sum(slopes) / len(slopes) if slopes else default_slope)


def best_k(acceptance: float, t_draft: float, compute: Mapping[int, float], stall: float,
           union: Mapping[int, float], k_max: int, *, draft_at_k0: bool = False,
           measured: Mapping[int, float] | None = None) -> int:
    """The K rule: the draft length (OFF, 0 .. k_max) that emits the most tokens per second.

    A step of K >= 1 drafts emits E(K) = (1 - a^(K+1)) / (1 - a) tokens (``expected_tokens``) and costs the draft's
    K+1 tokens (it reads the current token and each draft but the last; K = 0 with ``draft_at_k0``: one, for its
    routing only) plus the target's verification pass over K+1 tokens. That pass needs the *union* of its tokens'
    experts (Cascade: an MoE whose expert reads are the bottleneck can run 1.5x slower with speculation if K ignores
    it), so its cost is its compute plus the one-token pass's stall for reads scaled by the union's bytes:

        verify(K) = compute(K) + stall * union(K),   union(K) = bytes of the K+1 tokens' union / one token's

    compute and union are measured per K (compute: the pass's time less its waits for reads); a K not measured is
    read on the line through those that were (union with slope 1, every token's experts disjoint, until one is;
    compute flat). OFF is plain decoding: compute(0) + stall, no draft. A K measured over two steps or more is
    judged by its measured tokens per second instead (``measured``), which holds what the model leaves out (reads
    wasted on rejected drafts' routing, a tier slower than its mean). Ties go to the smaller K: less to lose."""
    c0 = compute.get(0, min(compute.values(), default=0.0))
    measured = measured or {}
    best, best_rate = 0, -1.0
    for k in range(OFF if draft_at_k0 else 0, k_max + 1):
        if k in measured:
            rate = measured[k]
        else:
            kk = max(k, 0)
            verify = _at(kk, compute, c0, 0.0) + stall * (_at(kk, union, 1.0, 1.0) if kk else 1.0)
            drafts = kk + 1 if k > 0 or (k == 0 and draft_at_k0) else 0
            rate = expected_tokens(acceptance, kk) / max(drafts * t_draft + verify, 1e-12)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


@dataclass
class KGovernor:
    """Chooses K by ``best_k`` from what it measures step by step: an EMA of the per-token acceptance rate, of the
    draft's time per token, of each K's verification compute and tokens per second, and of the bytes each K's step
    moves into the target's slots against a one-token step's (the union's cost)."""

    k_max: int = 6
    k: int = 3
    alpha: float = 0.7  # P(a drafted token is accepted | the previous one was)
    t_draft: float = 0.0  # seconds per drafted token
    t_verify: dict[int, float] = field(default_factory=dict)  # K -> seconds for the target pass over K+1 tokens
    decay: float = 0.8
    steps: int = 0
    # K=0 steps run the draft too (for its routing), so they pay one draft token; K=OFF (-1) is then also a
    # choice: plain target decoding with no draft at all, for when prediction does not pay for the draft
    draft_at_k0: bool = False
    # K -> EMA of tokens emitted per second over whole steps (draft + verify). Once a K has been tried this is
    # what counts: it includes what the cost model leaves out, such as prefetch bandwidth wasted on the
    # routing of drafts that get rejected, which on a slow tier can make speculation slower than K=0.
    seen_rate: dict[int, float] = field(default_factory=dict)
    samples: dict[int, int] = field(default_factory=dict)  # K -> steps measured
    pinned: int | None = None  # a K chosen for good (OFF once the draft is dropped)
    # what the steps that drafted tokens measured, raw (the early verdict reads these, not the EMAs, whose priors
    # would outweigh a few steps)
    drafting_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    early_steps: int = 3  # drafting steps before the early verdict (draft_useless)
    # the union's cost (steps under native residency): K -> EMA of bytes moved into the target's slots per step
    # (K <= 0, one-token passes, pooled at 0), of the verification pass's compute (its time less its waits for
    # reads), and of a one-token pass's waits for reads
    step_bytes: dict[int, float] = field(default_factory=dict)
    compute: dict[int, float] = field(default_factory=dict)
    stall: float = 0.0

    def observe(self, k: int, accepted: int, t_draft_total: float, t_verify: float,
                io: tuple[int, float] | None = None) -> None:
        """One step: k drafted (OFF: none), accepted of them, its draft and verification seconds, and (bytes moved
        into the target's slots, seconds its routing waited for them) over the step, where that is measured."""
        self.steps += 1
        kk = max(k, 0)
        stall = min(io[1], t_verify) if io is not None else 0.0
        self.compute[kk] = self._ema(self.compute.get(kk), t_verify - stall)
        if io is not None:
            if kk == 0:
                self.stall = self._ema(self.stall if 0 in self.step_bytes else None, stall)
            self.step_bytes[kk] = self._ema(self.step_bytes.get(kk), float(io[0]))
        rate = (accepted + 1) / max(t_draft_total + t_verify, 1e-9)
        self.samples[k] = self.samples.get(k, 0) + 1
        old = self.seen_rate.get(k)
        self.seen_rate[k] = rate if old is None else self.decay * old + (1 - self.decay) * rate
        if k == OFF:
            return
        if k > 0:
            self.drafting_steps += 1
            self.drafted += k
            self.accepted += accepted
        if k > 0 or self.draft_at_k0:
            if k > 0:
                # accepted tokens follow a truncated geometric law; a simple unbiased-enough update of alpha
                self.alpha = self.decay * self.alpha + (1 - self.decay) * accepted / k
            per = t_draft_total / (k + 1)
            self.t_draft = per if self.t_draft == 0 else self.decay * self.t_draft + (1 - self.decay) * per
        old = self.t_verify.get(k)
        self.t_verify[k] = t_verify if old is None else self.decay * old + (1 - self.decay) * t_verify

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def union(self) -> dict[int, float]:
        """K -> bytes a step of K drafts moved into the target's slots over a one-token step's, where both were
        measured (a one-token step that moved nothing gives no ratio)."""
        one = self.step_bytes.get(0, 0.0)
        return {k: b / one for k, b in self.step_bytes.items() if k > 0 and one > 0}

    def best(self, acceptance: float, *, measured: bool = True, draft_at_k0: bool | None = None) -> int:
        """``best_k`` on what has been measured so far."""
        rates = {k: r for k, r in self.seen_rate.items() if self.samples.get(k, 0) >= 2} if measured else None
        return best_k(acceptance, self.t_draft, self.compute, self.stall, self.union(), self.k_max,
                      draft_at_k0=self.draft_at_k0 if draft_at_k0 is None else draft_at_k0, measured=rates)

    def expected_tokens(self, k: int) -> float:
        return expected_tokens(self.alpha, k)

    def draft_idle(self, off_gain: float = 1.0, min_steps: int = 16, margin: float = 1.1) -> bool:
        """Plain decoding (OFF) clearly faster than every K that runs the draft, once each has been tried: the
        draft's memory would do more as expert slots. ``off_gain``: how much faster OFF would run with the
        draft's memory as slots too (estimated by the caller; 1 = as measured). Only where OFF is a choice (not
        every expert resident)."""
        if not self.draft_at_k0 or self.pinned is not None or self.steps < min_steps:
            return False
        off = self.seen_rate.get(OFF)
        others = [r for k, r in self.seen_rate.items() if k != OFF and self.samples.get(k, 0) >= 2]
        return (off is not None and self.samples.get(OFF, 0) >= 2 and bool(others)
                and off * off_gain > margin * max(others))

    def tokens_pay(self) -> bool:
        """Whether some K >= 1 would emit tokens faster than plain decoding, by ``best_k``'s model at the acceptance
        measured so far (accepted / drafted over the drafting steps; measured rates left out: this asks about
        the tokens, not the routing). With nothing accepted E(K) = 1: never, whatever the timings."""
        if self.accepted == 0:
            return False
        return self.best(self.accepted / max(self.drafted, 1), measured=False, draft_at_k0=False) > 0

    def draft_useless(self, routing_pays: bool) -> bool:
        """The early verdict, from the first ``early_steps`` steps that drafted tokens on (draft_idle waits for
        min_steps of measured rates, which on a short answer is never): drop the draft when neither thing it is
        for pays, its tokens (``tokens_pay``) and its routing as a prefetch signal (``routing_pays``: the engine's
        measure, its prefetches' precision). A draft that pays only by its routing is left to draft_idle."""
        if self.pinned is not None or self.drafting_steps < self.early_steps:
            return False
        return not routing_pays and not self.tokens_pay()

    def pin(self, k: int) -> None:
        self.pinned = self.k = k

    def choose(self) -> int:
        """This step's K: ``best_k`` on the measurements, with exploration now and then so they stay honest."""
        if self.pinned is not None:
            return self.pinned
        if self.steps < 3:
            return self.k
        best = self.best(self.alpha)
        choices = range(OFF if self.draft_at_k0 else 0, self.k_max + 1)
        # explore now and then, so the measurements stay honest: K=0, OFF and 1 until each has two samples (one
        # step is noisy: a disk read can take twice as long as the next), else a neighbour of the best,
        # alternating down and up
        if 3 <= self.steps < 9 or self.steps % 32 == 0:
            untried = [k for k in (0, OFF, 1) if k in choices and self.samples.get(k, 0) < 2]
            if untried:
                best = untried[0]
            elif (self.steps // 32) % 2 and best > choices[0]:
                best -= 1
            else:
                best = min(self.k_max, best + 1)
        self.k = best
        return best
