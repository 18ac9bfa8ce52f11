"""The prefetch plan on the Python routing hook: what to upload next, and what to give up for it.

Decoding runs the learned predictor natively (csrc/planner.cpp applies the layer-ahead maps inside the routing op,
csrc/residency.cpp the reuse maps): this module is what a configuration on the Python hook can still run, and the
reference the tests compare C's eviction by the reuse maps against (tests/integration/test_learned_predictor.py).
Session and bench use only the native planner; the draft's one governor is ``governor.KGovernor``.

Each predictor says, for a MoE layer's next routing call, how likely each expert is to be needed and when that
call comes (its deadline):
- learned layer-ahead maps (``learned.py``): at layer L's router input, layers L+1..L+H of this same token,
  due in h layer-times;
- recency: the experts a layer used are likely again at its next call, one token-time away.

The plan keeps one probability per (layer, expert) for the layer's next call (the newest prediction of that
call, never below what recency says), and issues uploads most probable first while the link can still deliver
them before their deadline. Eviction reads the same table (policy ``predicted``): the victim is the resident expert
least likely to be needed, recency breaking ties, and a prediction never evicts an expert at least as likely to be
needed as the one it brings in. Just before a layer routes, the learned reuse maps replace its row with how likely
each expert is to be used by the next few tokens (``PrefetchPlan.reuse``). That part reads nothing ahead, so it
costs no link time and stays on whether or not the plan issues uploads (``enabled``).

Nothing here touches the output: a wrong plan costs reads, never correctness.
"""

from __future__ import annotations

import time

import numpy as np

from pyspecter.cache import ExpertCache
from pyspecter.learned import Recency
from pyspecter.policies import EvictionDuel, Scores

RECENCY = 0.5  # chance an expert a layer just used is needed at its next call (smol-moe's prev-token reuse ~0.5)
# Below an even chance a prefetch costs more than it saves on a link-bound tier: a wrong upload takes the link from
# the misses the compute thread waits for (measured on smol-moe, disk, 50%: uploading at p >= 0.25 read 47 MiB per
# token against LRU's 29 and ran 0.76x LRU)


class PrefetchPlan:
    def __init__(self, cache: ExpertCache, *, min_prob: float = 0.5, link_gbps: float | None = None) -> None:
        self.cache = cache
        self.min_prob = min_prob
        self.link_gbps = link_gbps  # None: measured online on the cache's own uploads
        E = cache.layout.n_expert
        self.n_expert = E
        # the table eviction reads: LayerSlots.need (expert -> probability it is needed at the layer's next call)
        for st in cache.layers.values():
            st.need = [0.0] * E
        self.due: dict[int, float] = {}  # layer -> perf_counter time of its next call
        self.enabled = True  # False: no uploads; the table (and eviction by it) is kept either way
        self.issued = self.skipped_late = self.issued_bytes = 0
        self._busy_until = 0.0  # when the link is done with what the plan has issued

    # --- predictors in ---------------------------------------------------------------------------------------

    def predict(self, il: int, probs: np.ndarray, due: float) -> None:
        """A prediction of layer il's next call (probabilities per expert, or per token and expert: a batch
        needs the union, so the most likely over its tokens) due at perf_counter time ``due``."""
        st = self.cache.layers.get(il)
        if st is None:
            return
        p = probs.max(axis=0) if probs.ndim == 2 else probs
        if not isinstance(st.need, list):  # the layer's reuse scores, for a call of its own in progress
            st.need = [0.0] * self.n_expert
        need = st.need
        for e in range(self.n_expert):
            # a newer prediction of the same call replaces the older one, but recency keeps its floor
            need[e] = float(p[e]) if p[e] > RECENCY or need[e] < RECENCY else need[e]
        self.due[il] = due

    def used(self, il: int, needed, next_call_in: float) -> None:
        """Layer il has just routed ``needed``: its next call (next token) is ``next_call_in`` seconds away."""
        st = self.cache.layers.get(il)
        if st is None:
            return
        st.need = [RECENCY if e in needed else 0.0 for e in range(self.n_expert)]  # the reuse scores are done
        self.due[il] = time.perf_counter() + next_call_in

    def reuse(self, il: int, scores: Scores) -> None:
        """Layer il is about to route: rank its residents for this call's evictions by ``scores``, how soon
        each expert is likely to be used again (the learned reuse maps)."""
        st = self.cache.layers.get(il)
        if st is not None:
            st.need = scores

    # --- uploads out -----------------------------------------------------------------------------------------

    def issue(self, layers) -> int:
        """Uploads for ``layers``' predicted experts, most probable first, while each can land before its
        layer's deadline. Returns how many were issued."""
        if not self.enabled:
            return 0
        now = time.perf_counter()
        gbps = self.link_gbps or self.cache.link_gbps()
        bytes_per_s = gbps * 1e9 if gbps else None
        busy = max(self._busy_until, now)
        cands = []
        for il in layers:
            st = self.cache.layers.get(il)
            if st is None:
                continue
            inflight = st.inflight()
            due = self.due.get(il, now)
            for e, p in enumerate(st.need):
                if p >= self.min_prob and st.where[e] < 0 and e not in inflight:
                    cands.append((-p, due, il, e))
        cands.sort()
        n = 0
        for neg_p, due, il, e in cands:
            nbytes = self.cache.expert_bytes[il]
            land = busy + nbytes / bytes_per_s if bytes_per_s else now
            if land > due:
                self.skipped_late += 1  # the miss path will read it, first in line
                continue
            if not self._upload(il, e, -neg_p):
                continue
            busy = land
            n += 1
            self.issued_bytes += nbytes
        self._busy_until = busy
        self.issued += n
        return n

    def _upload(self, il: int, e: int, p: float) -> bool:
        cache, res = self.cache, self.cache.residency
        st = cache.layers[il]
        slot = res.victim(il, {e})
        if slot < 0:
            return False
        owner = st.owner[slot]
        if owner >= 0 and st.need[owner] >= p:
            return False  # never give up an expert at least as likely to be needed
        res.evict(il, slot)
        res.start_upload(il, e, slot, cache.tier.upload_async(il, e, slot))
        cache.count_upload(il)
        cache.stats.prefetches += 1
        return True


class _LazyScores:
    """A layer's reuse scores, computed on the first read: most routing calls evict nothing (on bench-qwen3moe at
    50%, 6 in 10 layers of a token miss nothing), so most calls need no scores, and computing them on the
    compute thread cost ~45 us a layer (the map and the blend, in place). Read only during the layer's own routing
    call (its evictions, the duel's bookkeeping), so the layer's past is still what it was at its input."""

    __slots__ = ("_args", "_vals")

    def __init__(self, predictor, il: int, x: np.ndarray, recency: Recency | None) -> None:
        self._args = (predictor, il, x, recency)
        self._vals: list[float] | None = None

    def values(self) -> list[float]:
        if self._vals is None:
            predictor, il, x, recency = self._args
            s = predictor.reuse(il, x, recency)
            # plain floats: victim loops read them one by one; no map for the layer: all equal, LRU decides
            self._vals = s.tolist() if s is not None else [0.0] * predictor.n_expert
        return self._vals

    def __getitem__(self, e: int) -> float:
        return (self._vals or self.values())[e]

    def __len__(self) -> int:
        return len(self.values())

    def __iter__(self):
        return iter(self.values())


class LayerAhead:
    """The learned predictor as a plan source: at each MoE layer's router input (the input hook), the layer's
    reuse scores for its own evictions, and (while the plan issues) a prediction of the next H layers of the same
    token for the plan to upload; after each routing call, recency."""

    def __init__(self, plan: PrefetchPlan, predictor, *, reuse: bool = True, duel: bool = True) -> None:
        """duel: evict by the reuse scores only while a bookkeeping duel against LRU says they miss less
        (``policies.EvictionDuel``); False: always by the scores."""
        self.plan, self.predictor = plan, predictor
        self.reuse = reuse and predictor.has_reuse
        cache = plan.cache
        # a blended predictor was weighed against recency when it was fitted: the duel starts on its scores
        self.duel = (EvictionDuel({il: cache.usable(il) for il in cache.layers},
                                  start_learned=predictor.blend is not None) if self.reuse and duel else None)
        # each layer's past calls, which the predictor's blend weighs beside its map (where it has one)
        self._recency = ({il: Recency(cache.layout.n_expert) for il in cache.layers}
                         if self.reuse and predictor.blend is not None else {})
        self._scores: dict[int, _LazyScores] = {}
        self.t_layer = 0.0  # EMA of the time between consecutive routing calls of one token
        self.t_token = 0.0
        self._last_call = 0.0
        self._n_layers = len(plan.cache.layout.layers)
        self.predict_ns = 0
        self.calls = 0

    def on_input(self, il: int, x: np.ndarray) -> None:
        t0 = time.perf_counter_ns()
        if self.reuse:
            # the last row (a batch's next token is its last's); copied, as x lives only for this call
            scores = _LazyScores(self.predictor, il, np.array(x[-1] if x.ndim == 2 else x), self._recency.get(il))
            self._scores[il] = scores
            if self.duel is None or self.duel.use_learned:
                self.plan.reuse(il, scores)
        if not self.plan.enabled:  # the plan issues nothing: predicting ahead would only cost time
            self.predict_ns += time.perf_counter_ns() - t0
            self.calls += 1
            return
        preds = self.predictor.predict(il, x)
        now = time.perf_counter()
        step = self.t_layer or 0.0
        for h, (j, probs) in enumerate(sorted(preds.items()), start=1):
            self.plan.predict(j, probs, now + h * step)
        self.plan.issue(sorted(preds))
        self.predict_ns += time.perf_counter_ns() - t0
        self.calls += 1

    def on_route(self, il: int, needed, n_tokens: int) -> None:
        now = time.perf_counter()
        if n_tokens == 1 and self._last_call:
            gap = now - self._last_call
            if gap < 0.5:  # between layers of one token, not across a pause
                self.t_layer = gap if not self.t_layer else 0.9 * self.t_layer + 0.1 * gap
        self._last_call = now
        if self.duel is not None:  # before used(): the scores may be the layer's table, which used() rewrites
            self.duel.observe(il, needed, self._scores.pop(il, None), count=n_tokens == 1)
        rec = self._recency.get(il)
        if rec is not None:
            rec.observe(needed)
        self.plan.used(il, needed, self.t_layer * self._n_layers)
