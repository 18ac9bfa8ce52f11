"""How far to speculate: the adaptive-K governor.

Cascade's lesson (speculation can cost more than it gives): pick the draft length that maximises expected tokens
per second from measured acceptance and measured step times, including K = 0 (the draft runs for its routing
only) and OFF (plain decoding, no draft at all), and tell when the draft should be dropped for good.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OFF = -1  # a "K" for the governor: no draft this step (plain decoding)


@dataclass
class KGovernor:
    """Chooses K: by the tokens per second measured at that K where it has been tried, else by a cost model from
    an EMA of the per-token acceptance rate and of measured step costs."""

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

    def observe(self, k: int, accepted: int, t_draft_total: float, t_verify: float) -> None:
        self.steps += 1
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

    def _verify_cost(self, k: int) -> float | None:
        if k in self.t_verify:
            return self.t_verify[k]
        known = sorted(self.t_verify)
        if not known:
            return None
        # the verification pass costs a fixed part plus a little per token: interpolate linearly
        if len(known) == 1:
            return self.t_verify[known[0]]
        k0, k1 = known[0], known[-1]
        slope = (self.t_verify[k1] - self.t_verify[k0]) / (k1 - k0)
        return self.t_verify[k0] + slope * (k - k0)

    def expected_tokens(self, k: int) -> float:
        a = min(max(self.alpha, 0.0), 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

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
        """Whether some K would emit tokens faster than plain decoding, at the acceptance measured so far
        (accepted / drafted over the drafting steps) and the measured costs, granting plain decoding the cost of
        a whole K+1 token verification pass (it costs less, so this leans towards the draft). A step of K drafts
        costs (K+1) t_draft + t_verify(K) (the draft reads the current token and each draft but the last) and
        emits E(K) = (1 - a^(K+1)) / (1 - a) tokens: it pays iff E(K) > 1 + (K+1) t_draft / t_verify(K). With
        nothing accepted E(K) = 1: never, whatever the timings."""
        if self.accepted == 0:
            return False
        a = min(self.accepted / max(self.drafted, 1), 0.999)
        for k in range(1, self.k_max + 1):
            tv = self._verify_cost(k)
            if tv is None or tv <= 0:
                return True  # nothing measured to judge by
            if (1 - a ** (k + 1)) / (1 - a) > 1 + (k + 1) * self.t_draft / tv:
                return True
        return False

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
        if self.pinned is not None:
            return self.pinned
        if self.steps < 3:
            return self.k
        best, best_rate = self.k, -1.0
        choices = range(OFF if self.draft_at_k0 else 0, self.k_max + 1)
        for k in choices:
            if k in self.seen_rate:
                rate = self.seen_rate[k]
            else:  # not tried yet: the cost model's estimate
                tv = self._verify_cost(max(k, 0))
                if tv is None:
                    continue
                extra = self.t_draft if k > 0 or (k == 0 and self.draft_at_k0) else 0.0
                rate = self.expected_tokens(max(k, 0)) / (tv + max(k, 0) * self.t_draft + extra)
            if rate > best_rate:
                best, best_rate = k, rate
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
