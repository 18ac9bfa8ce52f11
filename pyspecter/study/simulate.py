"""The reference cache simulator: what an expert cache of some size would miss on a routing stream, under LRU,
LFU, Belady's MIN, eviction by predicted-reuse scores, or knowing the next k tokens exactly. Every study
(``analyze``, ``predictor_fit``, ``bench``) and every test that needs such a figure computes it here.

A stream is one MoE layer's routing calls in order, ``steps`` [T, U]: each step the experts needed at once (-1:
none). A step's experts must all be resident together, so a miss never evicts an expert the same step needs.
A multi-layer routing trace ``[(layer, experts)]`` (what ``ExpertCache(record=True)`` keeps) is split into one
stream per layer by ``per_layer``; each layer's cache is simulated on its own, with optional extra slots per
layer (a budget spread by layer).

Two families of LRU, because they answer different questions:
- set-LRU (``lru_stack_positions``, ``simulate_cache(..., "lru")``): every step's experts are made resident,
  the router's first choice counting as the most recent; one stack pass gives every slot count at once;
- the engine's bookkeeping step (``eviction_misses``, ``ghost_step``): what does not fit stays out (the host
  computes it), and the victim is the least recently used or the lowest-scored. This is the step the duel between
  LRU and the learned scores runs (in C, csrc/residency.cpp; ``EvictionDuel`` is its reference here), so the fit
  judges its maps by the rule that uses them.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

# the set-LRU stack and the engine's eviction step: the predictor fit (a model builder's work, which imports no
# study code) judges its maps by them, so they live beside it; here they are the same functions, re-exported
from pyspecter.models.reuse_fit import eviction_misses as eviction_misses
from pyspecter.models.reuse_fit import ghost_step
from pyspecter.models.reuse_fit import lru_miss_curve as lru_miss_curve
from pyspecter.models.reuse_fit import lru_stack_positions as lru_stack_positions
from pyspecter.policies import Scores

Trace = Sequence[tuple[int, Sequence[int]]]  # [(layer, experts needed at one routing call)]


def per_layer(trace: Trace) -> dict[int, list[Sequence[int]]]:
    """A routing trace as one stream of steps per layer, in trace order."""
    out: dict[int, list[Sequence[int]]] = {}
    for il, needed in trace:
        out.setdefault(il, []).append(needed)
    return out


POLICIES = ("lru", "lfu", "belady")


def simulate_cache(steps, slots: int, policy: str) -> int:
    """Hits of a cache of ``slots`` on a stream of expert sets [T, U] (one layer), starting empty, every step's
    experts made resident: 'lru' (set-LRU, the same cache as ``lru_stack_positions``), 'lfu' (counts kept across
    evictions, ties by recency) or 'belady' (MIN: evict the resident expert used farthest in the future)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: use one of {', '.join(POLICIES)}")
    T = len(steps)
    resident: set[int] = set()
    hits = 0
    if policy == "belady":
        occ: dict[int, list[int]] = {}
        for s, row in enumerate(steps):
            for e in row:
                if e >= 0:
                    occ.setdefault(int(e), []).append(s)
        ptr = dict.fromkeys(occ, 0)

        def key(e: int) -> float:
            o, p = occ[e], ptr[e]
            return o[p] if p < len(o) else math.inf
    elif policy == "lru":
        recent: dict[int, tuple[int, int]] = {}

        def key(e: int) -> tuple[int, int]:  # victim: the oldest step, and in it the router's last choice
            s, u = recent[e]
            return -s, u
    else:
        freq: dict[int, int] = {}
        last: dict[int, int] = {}

        def key(e: int) -> float:  # LFU victim has the smallest (freq, last use); negated for max()
            return -(freq[e] * (T + 1) + last[e])
    for s, row in enumerate(steps):
        need = {int(e) for e in row if e >= 0}
        if policy == "belady":
            for e in need:
                ptr[e] += 1  # next use now points past this step
        for e in need:
            if e in resident:
                hits += 1
                continue
            if len(resident) >= slots:
                victims = resident - need
                resident.remove(max(victims, key=key) if victims else next(iter(resident)))
            resident.add(e)
        if policy == "lru":
            for u, e in enumerate(row):
                if e >= 0:
                    recent[int(e)] = (s, u)
        elif policy == "lfu":
            for e in need:
                freq[e] = freq.get(e, 0) + 1
                last[e] = s
    return hits


class EvictionDuel:
    """The reference of the duel C runs (csrc/residency.cpp, ``duel_observe``): set dueling, as CPU caches choose
    between replacement policies. Every MoE layer's cache is simulated in bookkeeping twice, under LRU and under
    eviction by the learned reuse scores, with the layer's own slot count, and the real cache evicts by whichever
    missed less lately (decayed counts of one-token calls, with a margin so that a near-tie does not flip it).
    Counts of misses on the same routing are not noisy the way timings are, and nothing is explored on the real
    cache: it starts with LRU, the safe choice (or with the scores, for a predictor whose fit already weighed them
    against recency), and moves to the learned scores only once they have missed less (on smol-moe, a cold start
    favours LRU for a prompt or so, and steady decoding favours the scores by 13% fewer reads)."""

    def __init__(self, slots: dict[int, int], *, decay: float = 0.998, margin: float = 0.03,
                 start_learned: bool = False) -> None:
        """slots: layer -> its slot count; start_learned: evict by the scores until they miss more than LRU
        (scores whose fit already weighed them against recency on held-out text, ``learned.Recency``: a cold start
        under LRU only costs reads)."""
        self.slots = dict(slots)
        self._lru: dict[int, dict[int, int]] = {il: {} for il in slots}
        self._learned: dict[int, dict[int, int]] = {il: {} for il in slots}
        self.decay, self.margin = decay, margin
        self.clock = 0
        self.recent = [0.0, 0.0]  # decayed misses: LRU, learned
        self.totals = [0, 0]  # misses since the start: LRU, learned
        self.use_learned = self.trust_learned = start_learned
        self.switches = 0

    def observe(self, il: int, needed, scores: Scores | None, *, count: bool = True) -> None:
        """Layer il's routing call needed ``needed``; ``scores``: the reuse scores it would have evicted by (None:
        none were computed, the learned simulation falls back to LRU for this call). ``count``: a one-token call
        (a prompt's batch moves both simulations but is not what decode speed depends on)."""
        if il not in self.slots:
            return
        self.clock += 1
        cap = self.slots[il]
        a = ghost_step(self._lru[il], needed, cap, self.clock, None)
        b = ghost_step(self._learned[il], needed, cap, self.clock, scores)
        if not count:
            return
        d = self.decay
        self.recent = [self.recent[0] * d + a, self.recent[1] * d + b]
        self.totals[0] += a
        self.totals[1] += b
        lru, learned = self.recent
        m = self.margin  # the trusted side keeps a near-tie
        if self.trust_learned:
            use = lru >= (1 - m) * learned if self.use_learned else learned <= lru
        else:
            use = learned < (1 - m) * lru if not self.use_learned else learned <= lru
        if use != self.use_learned:
            self.use_learned = use
            self.switches += 1


def oracle_scores(ids: np.ndarray, n_expert: int, k: int) -> np.ndarray:
    """Scores [n, E] of a predictor that knows the next ``k`` rows of one layer's routing ids [n, u] exactly:
    k + 1 - d for an expert next used d rows ahead (d <= k), else 0. Evicting by them (``eviction_misses``) is
    the best any predictor of the next k tokens can do; k -> inf is Belady's MIN."""
    nxt = np.full(n_expert, np.inf)  # row of each expert's next use after the current row
    out = np.zeros((len(ids), n_expert), np.float32)
    for t in range(len(ids) - 1, -1, -1):
        d = nxt - t
        out[t] = np.where(d <= k, k + 1 - d, 0.0)
        for e in ids[t]:
            if e >= 0:
                nxt[e] = t
    return out


def belady_misses(trace: Trace, slots: int, extra: Mapping[int, int] | None = None) -> int:
    """Uploads an optimal (MIN) cache of `slots` per layer needs for this routing trace [(layer, experts)],
    starting from the best cache it could hold: the real caches start warm from the prompt, so an empty start
    would count first uses no real cache pays. The best start holds the first `slots` distinct experts used (what
    MIN itself would load into empty slots), so it is MIN from empty less those loads: a lower bound for any cache
    of that size, whatever it held before. ``extra``: layer -> slots beyond ``slots`` in that layer."""
    total = 0
    for il, steps in per_layer(trace).items():
        n = slots + (extra or {}).get(il, 0)
        total += (sum(len(set(s)) for s in steps) - simulate_cache(steps, n, "belady")
                  - min(n, len({e for s in steps for e in s if e >= 0})))
    return total


class GhostLRU:
    """Plain LRU over ``capacity`` experts in bookkeeping only: the misses it would have had on the same routing.
    The reference of the held slots' ghost, which C runs per layer over all of a layer's regular slots, held ones
    included, to estimate what dropping the draft (whose memory the held slots are) would buy (csrc/residency.cpp,
    ``held_ghost_observe``): needed experts in the order given (ascending, as C serves them)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: OrderedDict[int, None] = OrderedDict()  # oldest first

    def observe(self, needed: Iterable[int]) -> int:
        """One ubatch's experts; returns how many of them LRU would have missed."""
        needed = list(needed)
        misses = sum(1 for e in needed if e not in self._held)
        for e in needed:
            self._held[e] = None
            self._held.move_to_end(e)
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)
        return misses
