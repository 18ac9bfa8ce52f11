"""The decode loops: plain greedy, and speculative decoding with a draft that also predicts experts.

One speculative step: the draft (in step with the target's accepted tokens) drafts K tokens; while it does, its
per-layer routing drives expert prefetch on the target (plan.Prefetcher); the target then verifies the current
token plus the K drafts in one batch; the accepted prefix plus one token from the target is emitted, and both
KV caches are rolled back past the rejected drafts. Greedy output equals the target's own greedy output; with a
temperature, standard speculative sampling keeps the target's distribution.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pyspecter.native import Context
from pyspecter.plan import OFF, KGovernor, Prefetcher
from pyspecter.predict import DraftRouting


def greedy(ctx: Context, prompt: list[int], n: int, *, stop_at_eog: bool = False) -> tuple[list[int], np.ndarray]:
    """Greedy-decode n tokens after prompt. Returns the tokens and the logits each was chosen from ([n, vocab])."""
    logits = ctx.decode(prompt)
    out: list[int] = []
    rows = []
    for _ in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        rows.append(logits)
        if stop_at_eog and ctx.model.is_eog(tok):
            break
        if len(out) == n:
            break
        logits = ctx.decode([tok])
    return out, np.stack(rows)


def _softmax(x: np.ndarray, temperature: float) -> np.ndarray:
    z = (x - x.max()) / temperature
    p = np.exp(z)
    return p / p.sum()


def accept_one(logits: np.ndarray, draft: int | None, q: np.ndarray | None, temperature: float,
               rng: np.random.Generator) -> int | None:
    """One position of verification. Returns None if the draft token is accepted, else the token to emit there
    (the target's choice: greedy argmax, or with a temperature standard speculative sampling (Leviathan et al.,
    Chen et al.): accept with probability min(1, p/q), else sample from normalise(max(0, p - q)); with no draft
    left, sample the bonus token from p). The emitted tokens are distributed exactly as the target's own."""
    if temperature <= 0:
        tok = int(np.argmax(logits))
        return None if tok == draft else tok
    p = _softmax(logits, temperature)
    if draft is None:
        return int(rng.choice(len(p), p=p))
    if rng.random() < min(1.0, p[draft] / max(q[draft], 1e-20)):
        return None
    resid = np.maximum(p - q, 0.0)
    total = resid.sum()
    return int(rng.choice(len(p), p=resid / total)) if total > 0 else int(np.argmax(p))


def speculative_accept(target_logits: np.ndarray, draft_probs: list[np.ndarray], drafts: list[int],
                       temperature: float, rng: np.random.Generator) -> tuple[int, int]:
    """Verify K drafts against K+1 rows of target logits. Returns (number accepted, the token emitted after)."""
    for i, d in enumerate(drafts):
        tok = accept_one(target_logits[i], d, draft_probs[i] if draft_probs else None, temperature, rng)
        if tok is not None:
            return i, tok
    return len(drafts), accept_one(target_logits[len(drafts)], None, None, temperature, rng)


@dataclass
class SpecStats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    k_hist: dict[int, int] = field(default_factory=dict)
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_k(self) -> float:
        return sum(max(k, 0) * c for k, c in self.k_hist.items()) / self.steps if self.steps else 0.0

    dropped_at: int | None = None  # the step at which the draft was dropped (its memory given to slots)

    @property
    def draft_off(self) -> float:
        """Fraction of steps the governor ran without the draft at all."""
        return self.k_hist.get(OFF, 0) / self.steps if self.steps else 0.0


class SpeculativeDecoder:
    """Target + draft contexts on the same vocabulary. ``routing``/``prefetcher`` are optional: without them this
    is plain speculative decoding; with them the draft's routing prefetches the target's experts."""

    def __init__(self, target: Context, draft: Context, *, k: int = 4, adaptive: bool = True, k_max: int = 6,
                 routing: DraftRouting | None = None, prefetcher: Prefetcher | None = None,
                 temperature: float = 0.0, seed: int = 0, batch_verify: bool = False,
                 predict_at_k0: bool = False, drop_draft: Callable[[], None] | None = None) -> None:
        if target.model.n_vocab != draft.model.n_vocab:
            raise ValueError("draft and target must share a vocabulary")
        self.target, self.draft = target, draft
        self.k, self.adaptive = k, adaptive
        self.routing, self.prefetcher = routing, prefetcher
        # K=0 still runs the draft on the current token, one step ahead of the target, when its routing is what
        # fills the slots (not all experts resident); with nothing to prefetch, K=0 is plain target decoding
        self.predict_at_k0 = predict_at_k0 and routing is not None and prefetcher is not None
        self.governor = KGovernor(k_max=k_max, k=k, draft_at_k0=self.predict_at_k0)
        if routing is not None and prefetcher is not None:
            routing.on_layer = prefetcher.on_draft_layer
        self.temperature = temperature
        # llama.cpp's numbers depend on the ubatch size (kernels differ for 1 vs many rows; on Q4 models logits
        # move by up to ~2, DESIGN §4), so a batched verification pass can flip a near-tie that token-by-token
        # decoding would not. Exact (default): the target verifies one token at a time, stopping at the first
        # rejection; the window's experts are already resident, so the I/O saving remains. batch_verify=True is
        # the faster, approximate mode.
        self.batch_verify = batch_verify
        self.rng = np.random.default_rng(seed)
        self.stats = SpecStats()
        self._draft_lag: list[int] = []  # tokens the draft has not read yet: the prompt, and steps run without it
        self._t_token: float | None = None  # EMA of one target token's decode time (the prefetch deadlines)
        # Called once the governor measures that plain decoding beats every K that runs the draft: the owner
        # frees the draft and gives its memory to the slots; decoding goes on without a draft for good.
        self.drop_draft = drop_draft
        # over the OFF steps so far: seconds, seconds in the cache's hooks (stalls), misses, and the misses plain
        # LRU would have had with the draft's memory as slots too (the cache's ghost LRU)
        self._off = [0.0, 0.0, 0, 0]

    def _pick(self, logits: np.ndarray) -> int:
        if self.temperature <= 0:
            return int(np.argmax(logits))
        return int(self.rng.choice(len(logits), p=_softmax(logits, self.temperature)))

    def generate(self, prompt: list[int], n: int, *, stop_at_eog: bool = True,
                 on_token: Callable[[int], None] | None = None) -> list[int]:
        tgt, dft = self.target, self.draft
        tgt.clear()
        cur = self._pick(tgt.decode(prompt))
        # The draft reads the prompt only when a step first needs it, as a catch-up: the first token waits for
        # the target's prefill alone, and a draft that ends up unused (OFF, dropped) never reads it.
        self._draft_lag = []
        if dft is not None:
            dft.clear()
            self._draft_lag = list(prompt)
        out = [cur]
        if on_token:
            on_token(cur)
        while len(out) < n and not (stop_at_eog and tgt.model.is_eog(cur)):
            if (self.draft is not None and self.drop_draft is not None
                    and self.governor.draft_idle(off_gain=self._off_gain())):
                self._drop()
            k = min(self.governor.choose() if self.adaptive else self.k, n - len(out))
            new = self._step(cur, k)
            for t in new:
                out.append(t)
                if on_token:
                    on_token(t)
                if len(out) >= n or (stop_at_eog and tgt.model.is_eog(t)):
                    break
            cur = new[-1]
        out = out[:n]
        # leave both caches holding the prompt and every emitted token but the last (which is pending, as after
        # plain decoding), so a caller can continue the sequence
        keep = len(prompt) + len(out) - 1
        if tgt.n_past > keep:
            tgt.truncate(keep)
        if dft is not None and dft.n_past > keep:
            dft.truncate(keep)
        return out

    def _off_gain(self) -> float:
        """How much faster plain decoding would run once the draft's memory is slots: its stalls scale with its
        misses, and the ghost LRU tells how many misses are left with the extra slots."""
        t, stall, misses, ghost = self._off
        if t <= 0 or misses == 0:
            return 1.0
        return t / max(t - stall * (1 - ghost / misses), 1e-9)

    def _drop(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.cache.unprotect_all()
        self.drop_draft()
        self.draft = self.routing = self.prefetcher = None
        self.predict_at_k0 = False
        self._draft_lag = []
        self.governor.pin(OFF)
        self.stats.dropped_at = self.stats.steps

    def _step(self, cur: int, k: int) -> list[int]:
        tgt, dft = self.target, self.draft
        base = tgt.n_past
        t0 = time.perf_counter()
        drafts: list[int] = []
        qs: list[np.ndarray] = []
        if k > 0 or (k == 0 and self.predict_at_k0):
            if self._draft_lag:  # catch up on tokens of steps run without the draft; their routing is stale
                dft.decode(self._draft_lag, logits=False)
                self._draft_lag = []
                # not this step's cost: keep it out of the governor's per-K measurements
                self.stats.draft_s += time.perf_counter() - t0
                t0 = time.perf_counter()
            if self.routing is not None:
                self.routing.start()
            if self.prefetcher is not None:
                # the verification pass starts after K+1 draft tokens; uploads must land before it needs them
                self.prefetcher.start_window(self.governor.t_draft * (k + 1) if self.governor.t_draft else None,
                                             self._t_token)
            # The draft's last token of a step is run for its routing only (it predicts the last verified
            # position): no logits, so llama.cpp skips the output head and the last layer's FFN, ~15-30% of a
            # draft token here, at the price of that one layer's prediction for that one position.
            logits = dft.decode([cur], logits=k > 0)
            for i in range(k):
                q = _softmax(logits, self.temperature) if self.temperature > 0 else None
                d = int(np.argmax(logits)) if q is None else int(self.rng.choice(len(q), p=q))
                drafts.append(d)
                if q is not None:
                    qs.append(q)
                logits = dft.decode([d], logits=i < k - 1)
            if self.routing is not None:
                self.routing.stop()
        else:
            self._draft_lag.append(cur)
            if self.prefetcher is not None:  # no window in flight: nothing may stay pinned in the slots
                self.prefetcher.cache.unprotect_all()
        t1 = time.perf_counter()
        watch = k == OFF and self.draft is not None and self.drop_draft is not None and self.prefetcher is not None
        if watch:
            tot = self.prefetcher.cache.totals
            before = (tot.hook_ns, tot.misses, tot.ghost_misses)
        if self.batch_verify:
            rows = tgt.decode([cur, *drafts], logits_all=True)
            accepted, bonus = speculative_accept(rows, qs, drafts, self.temperature, self.rng)
        else:
            toks = [cur, *drafts]
            accepted = 0
            while True:
                tok = accept_one(tgt.decode([toks[accepted]]), drafts[accepted] if accepted < k else None,
                                 qs[accepted] if accepted < k and qs else None, self.temperature, self.rng)
                if tok is not None:
                    bonus = tok
                    break
                accepted += 1
        t2 = time.perf_counter()
        if watch:
            o = self._off
            o[0] += t2 - t0
            o[1] += (tot.hook_ns - before[0]) / 1e9
            o[2] += tot.misses - before[1]
            o[3] += tot.ghost_misses - before[2]
        if not self.batch_verify:
            per = (t2 - t1) / (accepted + 1)
            self._t_token = per if self._t_token is None else 0.8 * self._t_token + 0.2 * per

        # roll both caches back to the accepted prefix: cur + accepted drafts
        keep = base + 1 + accepted
        tgt.truncate(keep)
        if dft is not None and dft.n_past > keep:
            dft.truncate(keep)
        s = self.stats
        s.steps += 1
        s.drafted += max(k, 0)
        s.accepted += accepted
        s.emitted += accepted + 1
        s.k_hist[k] = s.k_hist.get(k, 0) + 1
        s.draft_s += t1 - t0
        s.verify_s += t2 - t1
        self.governor.observe(k, accepted, t1 - t0, t2 - t1)
        return [*drafts[:accepted], bonus]
