"""The decode loops: plain decoding, and speculative decoding with a draft that also predicts experts.

Both are generators (mlx-lm's ``generate_step`` is the model): they yield tokens as they are decided, and leave
the KV caches consistent whenever the caller stops reading.

One speculative step: the draft (in step with the target's accepted tokens) drafts K tokens; one call before it
does (``_hand_over``) arms its routing op to turn each drafted token's confident experts into prefetches on the
target, in C as it routes them (csrc/draft.cpp: protected, queued into the target's one prefetch queue, due when
the verification pass reaches their layer, the most confident first); the target then verifies the current token
plus the K drafts; the accepted prefix plus one token from the target is emitted, and both KV caches are rolled
back past the rejected drafts. Until the measured acceptance shows that drafting pays, the target verifies one
token at a time instead and never decodes a rejected draft (``_verify``). Greedy output equals the target's own
greedy output; with a temperature, standard speculative sampling keeps the target's distribution.

Why this module is long: the speculative step, the draft's prefetch feed and the draft's drop are one state
machine over the same window (handed over, scored, closed); split, that state would cross modules.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pyspecter.governor import OFF, KGovernor
from pyspecter.native import Context, batch_invariant
from pyspecter.predict import DraftRouting
from pyspecter.sampling import Sampler, SamplingParams

if TYPE_CHECKING:
    from pyspecter.cache import ExpertCache


def generate_step(ctx: Context, prompt: list[int], sampler: Sampler,
                  history: list[int] | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """Plain decoding: decode ``prompt``, then yield (token, the logits it was chosen from) forever. The next
    token is decoded only when the caller asks for it, so stopping costs nothing. ``history``: everything before
    the first sampled position when the context already holds part of it (default: ``prompt``)."""
    logits = ctx.decode(prompt)
    before = prompt if history is None else history
    recent = list(before[-sampler.params.repeat_last_n:]) if sampler.params.repeat_penalty != 1.0 else []
    while True:
        tok = sampler.pick(logits, recent)
        yield tok, logits
        if recent:
            recent.append(tok)
        logits = ctx.decode([tok])


def greedy(ctx: Context, prompt: list[int], n: int, *, stop_at_eog: bool = False) -> tuple[list[int], np.ndarray]:
    """Greedy-decode n tokens after prompt. Returns the tokens and the logits each was chosen from ([n, vocab])."""
    out: list[int] = []
    rows = []
    for tok, logits in generate_step(ctx, prompt, Sampler()):
        out.append(tok)
        rows.append(logits)
        if len(out) >= n or (stop_at_eog and ctx.model.is_eog(tok)):
            break
    return out, np.stack(rows)


@dataclass
class SpecStats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    k_hist: dict[int, int] = field(default_factory=dict)
    draft_s: float = 0.0
    verify_s: float = 0.0
    dropped_at: int | None = None  # the step at which the draft was dropped (its memory given to slots)
    # the draft's routing as a prefetch signal (C's counters, csrc/draft.cpp): prefetches it queued, how many of
    # them the verification pass they were made for then used (their precision), the bytes each side stands for
    # (counted at the mean expert size), and the step it was cut off at
    prefetches: int = 0
    prefetches_scored: int = 0  # ... of which checked against their pass (windows closed)
    prefetches_used: int = 0
    prefetch_bytes: int = 0
    prefetch_used_bytes: int = 0
    prefetch_stopped_at: int | None = None
    serial_verifies: int = 0  # steps with drafts whose window the target verified one token at a time
    handovers: int = 0  # draft steps handed to the target's planner (one call each)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prefetch_precision(self) -> float | None:
        """Prefetches the draft queued that their verification pass used, of those checked (None before any)."""
        return self.prefetches_used / self.prefetches_scored if self.prefetches_scored else None

    @property
    def mean_k(self) -> float:
        return sum(max(k, 0) * c for k, c in self.k_hist.items()) / self.steps if self.steps else 0.0

    @property
    def draft_off(self) -> float:
        """Fraction of steps the governor ran without the draft at all."""
        return self.k_hist.get(OFF, 0) / self.steps if self.steps else 0.0


class _OffWatch:
    """Over the OFF steps: seconds, seconds stalled in the cache's hooks, misses, and the misses plain LRU would
    have had with the draft's memory as slots too (the cache's ghost LRU). What dropping the draft would buy."""

    def __init__(self) -> None:
        self.t = self.stall = 0.0
        self.misses = self.ghost = 0

    def add(self, seconds: float, before, after) -> None:
        self.t += seconds
        self.stall += (after.hook_ns - before[0]) / 1e9
        self.misses += after.misses - before[1]
        self.ghost += after.ghost_misses - before[2]

    def gain(self) -> float:
        """How much faster plain decoding would run once the draft's memory is slots: its stalls scale with its
        misses, and the ghost LRU tells how many misses are left with the extra slots."""
        if self.t <= 0 or self.misses == 0:
            return 1.0
        return self.t / max(self.t - self.stall * (1 - self.ghost / self.misses), 1e-9)


class SpeculativeDecoder:
    """Target + draft contexts on the same vocabulary. ``routing``/``slots`` are optional: without them this
    is plain speculative decoding; with them the draft's routing prefetches into the target's expert slots (its
    experts at ``min_confidence`` or more)."""

    # The draft's prefetches stop for good once MIN_PREFETCHES of them are measured and fewer than MIN_PRECISION
    # of them were used by the verification pass they were made for: below an even chance a prefetch costs a
    # link-bound tier more than it saves (the native planner's min_prob, for the same reason). C scores them
    # (csrc/draft.cpp), under native residency, the only place the handover runs.
    MIN_PREFETCHES = 16
    MIN_PRECISION = 0.5

    def __init__(self, target: Context, draft: Context, *, k: int = 4, adaptive: bool = True, k_max: int = 6,
                 routing: DraftRouting | None = None, slots: ExpertCache | None = None, min_confidence: float = 0.0,
                 temperature: float | SamplingParams = 0.0, seed: int = 0, batch_verify: bool | None = None,
                 predict_at_k0: bool = False, drop_draft: Callable[[], None] | None = None,
                 close_draft: Callable[[], None] | None = None) -> None:
        if target.model.n_vocab != draft.model.n_vocab:
            raise ValueError("draft and target must share a vocabulary")
        self.target, self.draft = target, draft
        self.k, self.adaptive = k, adaptive
        self.routing, self.slots, self.min_confidence = routing, slots, min_confidence
        # K=0 still runs the draft on the current token, one step ahead of the target, when its routing is what
        # fills the slots (not all experts resident); with nothing to prefetch, K=0 is plain target decoding
        self.predict_at_k0 = predict_at_k0 and routing is not None and slots is not None
        self.governor = KGovernor(k_max=k_max, k=k, draft_at_k0=self.predict_at_k0)
        self.sampler = Sampler(temperature, seed)
        # Stock CPU kernels give different bits for 1 and for K+1 rows (llamafile's sgemm tiles them differently:
        # max |dlogit| 0.98 on smol-moe), so a batched pass could flip a near-tie that token-by-token decoding
        # would not. With batch-invariant matmuls (patch 0004) for the verification pass only, its K+1 rows are
        # bit for bit what K+1 one-token stock decodes give (measured on smol-moe, bench-qwen3moe and the
        # fixtures), so the target may verify the whole window in one pass (once drafting pays: _verify). The
        # switch reaches only this process's CPU backend: a target on a device verifies token by token, stopping
        # at the first rejection (its window's experts are already resident, so the I/O saving remains).
        if batch_verify is None:
            batch_verify = getattr(target.model, "device", None) is None
        self.batch_verify = batch_verify
        self.stats = SpecStats()
        self._draft_lag: list[int] = []  # tokens the draft has not read yet: the prompt, and steps run without it
        # Called once the governor measures that plain decoding beats every K that runs the draft: the owner
        # frees the draft and gives its memory to the slots; decoding goes on without a draft for good.
        self.drop_draft = drop_draft
        # ... and where its memory was not the slots', the owner still frees it on a drop (its model and context)
        self.close_draft = close_draft
        self._off = _OffWatch()
        # the draft's routing still feeds the target's planner (native residency: C takes it over); a window is open
        self._feeding = routing is not None and slots is not None and slots.native
        self._window = False
        if self._feeding:
            lay = slots.layout
            self._expert_bytes = sum(L.expert_bytes for L in lay.layers) / max(len(lay.layers), 1)
        self.check: Callable[[], None] = lambda: None  # the owner's hook-error check, run after every step

    @property
    def temperature(self) -> float:
        return self.sampler.temperature

    def stream(self, prompt: list[int], *, stop_at_eog: bool = True, reuse: bool = False) -> Iterator[int]:
        """Yield tokens after ``prompt``, one speculative step's worth at a time, until an end-of-generation token
        (when ``stop_at_eog``) or until the caller stops. Whenever it stops, both caches hold the prompt and every
        yielded token but the last (which is pending, as after plain decoding), so a caller can continue.
        ``reuse``: keep what both caches already hold of ``prompt`` and process only the rest (a chat turn)."""
        tgt = self.target
        if reuse:
            todo = tgt.reuse(prompt)
        else:
            tgt.clear()
            todo = prompt
        self._recent = list(prompt)  # what the repetition penalty reads: the prompt and every emitted token
        cur = self.sampler.pick(tgt.decode(todo), self._recent)
        self._recent.append(cur)
        # The draft reads the prompt only when a step first needs it, as a catch-up: the first token waits for
        # the target's prefill alone, and a draft that ends up unused (OFF, dropped) never reads it.
        self._draft_lag = []
        if self.draft is not None:
            if reuse:
                self._draft_lag = self.draft.reuse(prompt)
            else:
                self.draft.clear()
                self._draft_lag = list(prompt)
        n_out = 1
        try:
            yield cur
            while not (stop_at_eog and tgt.model.is_eog(cur)):
                if self.draft is not None and self.adaptive and self.governor.draft_useless(self._routing_pays()):
                    self._drop()
                elif self.draft is not None and self.drop_draft is not None \
                        and self.governor.draft_idle(off_gain=self._off.gain()):
                    self._drop()
                if self.stats.dropped_at is not None:
                    new = [self._plain_step(cur)]
                else:
                    new = self._step(cur, self.governor.choose() if self.adaptive else self.k)
                self.check()
                self._recent += new
                for t in new:
                    n_out += 1
                    yield t
                    if stop_at_eog and tgt.model.is_eog(t):
                        return
                cur = new[-1]
        finally:
            self._keep(len(prompt) + n_out - 1)
            if self._feeding:  # the last window is scored (its queued prefetches taken back: nothing verifies it)
                self._close_window()

    def generate(self, prompt: list[int], n: int, *, stop_at_eog: bool = True,
                 on_token: Callable[[int], None] | None = None, reuse: bool = False) -> list[int]:
        """Up to n tokens after prompt (the governor never drafts past n)."""
        out: list[int] = []
        self._limit = n
        gen = self.stream(prompt, stop_at_eog=stop_at_eog, reuse=reuse)
        try:
            for t in gen:
                out.append(t)
                self._limit = n - len(out)
                if on_token:
                    on_token(t)
                if len(out) >= n:
                    break
        finally:
            gen.close()
            self._limit = None
        return out

    _limit: int | None = None  # tokens still wanted: no step drafts past them
    _recent: list[int] = []  # the prompt and every token emitted so far (the repetition penalty's window)

    def _before(self, drafts: list[int]) -> list[int]:
        """The tokens before a draft position, for the repetition penalty (no copy when it is off)."""
        return self._recent + drafts if self.sampler.params.repeat_penalty != 1.0 else []

    def _keep(self, keep: int) -> None:
        for ctx in (self.target, self.draft):
            if ctx is not None and ctx.n_past > keep:
                ctx.truncate(keep)

    def _routing_pays(self) -> bool:
        """Whether the draft's routing is worth its cost as a prefetch signal: still fed, and at least
        MIN_PRECISION of its prefetches used so far (none measured: it has saved nothing yet)."""
        p = self.stats.prefetch_precision
        return self._feeding and p is not None and p >= self.MIN_PRECISION

    def _drop(self) -> None:
        """The draft is done for good: nothing of it stays on the path (no draft pass, no prefetch, nothing
        protected, its held slots the target's). The owner frees it (``drop_draft``) where it can; without one
        (its memory was not the slots') it is only never run again."""
        self._stop_prefetch()
        if self.drop_draft is not None:
            self.drop_draft()
        elif self.close_draft is not None:
            self.close_draft()
        self.draft = self.routing = self.slots = None
        self.predict_at_k0 = False
        self._draft_lag = []
        self.governor.pin(OFF)
        self.stats.dropped_at = self.stats.steps

    def _hand_over(self, n_tokens: int, per_pass: int) -> None:
        """The step's one call into the target's planner: the previous window is scored and closed, and the draft's
        next n_tokens tokens (the current one and each draft it reads) become prefetches as its routing op routes
        them, due where the verification pass (per_pass tokens a pass) needs them. Nothing per layer or expert."""
        self.slots.nat.handover(self.draft.model, self.min_confidence, per_pass, n_tokens)
        self._window = True
        self.stats.handovers += 1

    def _close_window(self) -> None:
        """A step without the draft: the window in flight is scored and closed, its queued prefetches taken back."""
        if self._window:
            self.slots.nat.handover(None)
            self._window = False
        self._score_prefetches()

    def _score_prefetches(self) -> None:
        """The closed windows' prefetches as C scored them against their verification pass. Cuts them off once
        they are measured to miss (MIN_PRECISION)."""
        if not self._feeding:
            return
        d, s = self.slots.nat.draft_stats(), self.stats
        s.prefetches, s.prefetches_scored, s.prefetches_used = d.prefetches, d.scored, d.used
        s.prefetch_bytes = round(d.prefetches * self._expert_bytes)
        s.prefetch_used_bytes = round(d.used * self._expert_bytes)
        if s.prefetches_scored >= self.MIN_PREFETCHES and s.prefetches_used < self.MIN_PRECISION * s.prefetches_scored:
            self._stop_prefetch()

    def _stop_prefetch(self) -> None:
        """No more draft prefetches or protections (the window closed, its queued prefetches taken back); K=0 no
        longer runs the draft (its routing was all it did)."""
        if self._feeding:
            self.stats.prefetch_stopped_at = self.stats.steps
            if self._window:
                self.slots.nat.handover(None)
                self._window = False
            self.routing.stop()
            self.slots.unprotect_all()
        self._feeding = False
        self.predict_at_k0 = False

    def _step(self, cur: int, k: int) -> list[int]:
        """One step: draft k tokens (k = 0: the draft only predicts; OFF: no draft), verify, roll back."""
        if self._limit is not None:
            k = min(k, self._limit)
        base = self.target.n_past
        io0 = self._io()
        t0 = time.perf_counter()
        # one pass over the window once drafting pays (_verify); the planner's deadlines follow the same choice
        batched = k > 0 and self.batch_verify and self.governor.tokens_pay()
        if k > 0 or (k == 0 and self.predict_at_k0):
            t0 = self._catch_up_draft(t0)
            if self._feeding:
                # the draft reads the current token and each draft but the last: k + 1 tokens, verification
                # positions 0..k
                self._hand_over(k + 1, k + 1 if batched else 1)
                self._score_prefetches()
            drafts, qs = self._draft(cur, k)
        else:
            drafts, qs = [], []
            if self.draft is not None:
                self._draft_lag.append(cur)
            if self._feeding:
                self._close_window()
            elif self.slots is not None:  # no window in flight: nothing may stay pinned in the slots
                self.slots.unprotect_all()
        t1 = time.perf_counter()
        watch = k == OFF and self.draft is not None and self.drop_draft is not None and self.slots is not None
        if watch:
            tot = self.slots.totals
            before = (tot.hook_ns, tot.misses, tot.ghost_misses)
        accepted, bonus = self._verify(cur, drafts, qs, batched)
        t2 = time.perf_counter()
        if watch:
            self._off.add(t2 - t0, before, tot)
        self._keep(base + 1 + accepted)  # roll both caches back to the accepted prefix: cur + accepted drafts
        io1 = self._io() if io0 is not None else None
        self._record(k, accepted, t1 - t0, t2 - t1,
                     None if io1 is None else (io1[0] - io0[0], (io1[1] - io0[1]) / 1e9))
        return [*drafts[:accepted], bonus]

    def _io(self) -> tuple[int, int] | None:
        """(bytes moved into the target's slots, ns its routing ops waited for them) so far, under native
        residency (None otherwise): what a step's union of experts costs, for the K rule."""
        if self.slots is None or not self.slots.native:
            return None
        c = self.slots.nat.stats()
        return c.read_bytes + c.upload_bytes, c.wait_ns

    def _plain_step(self, cur: int) -> int:
        """A step once the draft is dropped: the target decodes one token as plain decoding does (the same sampler
        call a step without drafts makes), with nothing of a speculative step around it (no window, no rollback, no
        timing for a governor that has nothing left to choose); counted as an OFF step."""
        tok = self.sampler.accept(self.target.decode([cur]), None, None, self._recent)
        s = self.stats
        s.steps += 1
        s.emitted += 1
        s.k_hist[OFF] = s.k_hist.get(OFF, 0) + 1
        return tok

    def _catch_up_draft(self, t0: float) -> float:
        """The draft reads the tokens of steps run without it (their routing is stale); not this step's cost."""
        if not self._draft_lag:
            return t0
        self.draft.decode(self._draft_lag, logits=False)
        self._draft_lag = []
        now = time.perf_counter()
        self.stats.draft_s += now - t0
        return now

    def _draft(self, cur: int, k: int) -> tuple[list[int], list[np.ndarray]]:
        """K draft tokens (and, when sampling, the distributions they were drawn from), with the draft's routing
        driving the target's prefetch as it goes (armed by ``_hand_over``)."""
        drafts: list[int] = []
        qs: list[np.ndarray] = []
        # The draft's last token of a step is run for its routing only (it predicts the last verified position):
        # no logits, so llama.cpp skips the output head and the last layer's FFN, ~15-30% of a draft token here,
        # at the price of that one layer's prediction for that one position.
        logits = self.draft.decode([cur], logits=k > 0)
        for i in range(k):
            recent = self._before(drafts)
            q = self.sampler.probs(logits, recent)
            d = self.sampler.pick(logits, recent) if q is None else int(self.sampler.rng.choice(len(q), p=q))
            drafts.append(d)
            if q is not None:
                qs.append(q)
            logits = self.draft.decode([d], logits=i < k - 1)
        return drafts, qs

    def _verify(self, cur: int, drafts: list[int], qs: list[np.ndarray], batched: bool) -> tuple[int, int]:
        """(drafts accepted, the target's token after them). One batched pass over the window (``batched``) only
        once the measured acceptance shows that drafting pays (KGovernor.tokens_pay): the pass needs the union of
        its K+1 tokens' experts (and, being a multi-token ubatch, sets off the prefill lookahead), which for drafts that
        get rejected are reads a plain decode would not make. Until then (the probe steps, a draft whose tokens
        miss) the target decodes one token at a time and stops at the first rejection, so a step with nothing
        accepted reads what a plain decode reads. Sampling takes the same path: the same draws in the same order
        on the same logits (batched rows are batch-invariant), so the same tokens."""
        if not drafts:  # one token: stock's own decode, bit for bit what the batch-invariant kernels would give
            return self.sampler.verify(self.target.decode([cur], logits_all=True), drafts, qs, self._recent)
        if batched:
            with batch_invariant():
                rows = self.target.decode([cur, *drafts], logits_all=True)
            return self.sampler.verify(rows, drafts, qs, self._recent)
        toks = [cur, *drafts]
        k = len(drafts)
        accepted = 0
        self.stats.serial_verifies += 1
        while True:
            tok = self.sampler.accept(self.target.decode([toks[accepted]]), drafts[accepted] if accepted < k else None,
                                      qs[accepted] if accepted < k and qs else None,
                                      self._before(drafts[:accepted]))
            if tok is not None:
                return accepted, tok
            accepted += 1

    def _record(self, k: int, accepted: int, t_draft: float, t_verify: float,
                io: tuple[int, float] | None = None) -> None:
        s = self.stats
        s.steps += 1
        s.drafted += max(k, 0)
        s.accepted += accepted
        s.emitted += accepted + 1
        s.k_hist[k] = s.k_hist.get(k, 0) + 1
        s.draft_s += t_draft
        s.verify_s += t_verify
        self.governor.observe(k, accepted, t_draft, t_verify, io)
