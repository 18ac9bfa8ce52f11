"""The reference cache simulator: what an expert cache of some size would miss on a routing stream, under LRU,
LFU, Belady's MIN, eviction by predicted-reuse scores, or knowing the next k tokens exactly. Every study
(``analyze``, ``reuse_fit``, ``bench``) and every test that needs such a figure computes it here.

A stream is one MoE layer's routing calls in order, ``steps`` [T, U]: each step the experts needed at once (-1:
none). A step's experts must all be resident together, so a miss never evicts an expert the same step needs.
A multi-layer routing trace ``[(layer, experts)]`` (what ``ExpertCache(record=True)`` keeps) is split into one
stream per layer by ``per_layer``; each layer's cache is simulated on its own, with optional extra slots per
layer (a budget spread by layer).

Two families of caches, because they answer different questions:
- set caches (``lru_stack_positions``, ``simulate_cache``): every step's experts are made resident, the router's
  first choice counting as the most recent; for LRU one stack pass gives every slot count at once, and Belady's
  MIN, which no runtime can run, is the bound;
- the engine's own rules, where a figure must agree with the runtime: what does not fit stays out (the host
  computes it), and the victim is the least recently used or the lowest-scored. These are not written again here:
  ``eviction_misses`` and ``EvictionDuel`` replay C's code (csrc/policy.cpp, through ``native.Replay``), so the fit
  judges its maps by the rule that uses them. (study/replay.py replays the whole slot table the same way.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

# the LRU stack (the plan's pricing reads it: pyspecter/lru.py) and the engine's eviction step (the predictor fit,
# a model builder's work that imports no study code, judges its maps by it): the same functions, re-exported
from pyspecter.lru import lru_miss_curve as lru_miss_curve
from pyspecter.lru import lru_stack_positions as lru_stack_positions
from pyspecter.models.reuse_fit import eviction_misses as eviction_misses
from pyspecter.native import Replay
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
    experts made resident: 'lru' (set-LRU: ``lru_stack_positions``), 'lfu' (counts kept across evictions, ties by
    recency) or 'belady' (MIN: evict the resident expert used farthest in the future)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: use one of {', '.join(POLICIES)}")
    if policy == "lru":
        pos = lru_stack_positions(np.asarray(steps).reshape(len(steps), -1))
        return int(((pos >= 0) & (pos < slots)).sum())
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
        if policy == "lfu":
            for e in need:
                freq[e] = freq.get(e, 0) + 1
                last[e] = s
    return hits


class EvictionDuel:
    """The duel C runs (csrc/policy.cpp, ``duel_observe``), replayed by C's own code (``native.Replay``): set
    dueling, as CPU caches choose between replacement policies. Every MoE layer's cache is simulated in
    bookkeeping twice, under LRU and under eviction by the learned reuse scores, with the layer's own slot count,
    and the real cache evicts by whichever missed less lately (decayed counts of one-token calls, with a margin so
    that a near-tie does not flip it). Counts of misses on the same routing are not noisy the way timings are, and
    nothing is explored on the real cache: it starts with LRU, the safe choice (or with the scores, for a predictor
    whose fit already weighed them against recency), and moves to the learned scores only once they have missed
    less (on smol-moe, a cold start favours LRU for a prompt or so, and steady decoding favours the scores by 13%
    fewer reads)."""

    def __init__(self, slots: dict[int, int], n_expert: int, *, decay: float = 0.998, margin: float = 0.03,
                 start_learned: bool = False) -> None:
        """slots: layer -> its slot count; start_learned: evict by the scores until they miss more than LRU
        (scores whose fit already weighed them against recency on held-out text, ``learned.Recency``: a cold start
        under LRU only costs reads)."""
        self.slots = dict(slots)
        self._replay = Replay(slots, n_expert, lookahead=False, duel=True, start_learned=start_learned, decay=decay,
                              margin=margin)

    def observe(self, il: int, needed, scores: Scores | None, *, count: bool = True) -> None:
        """Layer il's routing call needed ``needed``; ``scores``: the reuse scores it would have evicted by (None:
        none were computed, the learned simulation falls back to LRU for this call). ``count``: a one-token call
        (a prompt's batch moves both simulations but is not what decode speed depends on)."""
        if il in self.slots:
            self._replay.call(il, list(needed) or [-1], None if scores is None else list(scores), counted=count)

    @property
    def use_learned(self) -> bool:
        return bool(self._replay.stats()["use_scores"])

    @property
    def switches(self) -> int:
        return self._replay.stats()["switches"]

    @property
    def totals(self) -> list[int]:
        """Misses since the start of counted calls: LRU, learned."""
        st = self._replay.stats()
        return [st["ghost_lru_misses"], st["ghost_score_misses"]]


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


def batched_misses(target_ids: np.ndarray, prompt_index: np.ndarray, n_expert: int, slots: int, batch: int) -> int:
    """Experts missed when every ``batch`` consecutive rows of a prompt go through one routing call, each layer a
    cache of ``slots`` under C's LRU rule (``native.Replay``): what verifying a draft's ``batch - 1`` tokens at
    once needs from the cache with every draft accepted, the upper end of what speculation can save in bytes.
    ``target_ids`` [T, L, U], rows in decode order; ``prompt_index`` [T]: no call spans two prompts. A miss is
    counted whether it is read into a slot or, where a call's experts outnumber the slots, computed from its
    bytes outside them: on the disk tier both read the expert."""
    T, L, U = target_ids.shape
    pi = np.asarray(prompt_index)
    starts = [t for t in range(T) if t == 0 or pi[t] != pi[t - 1]] + [T]
    with Replay(dict.fromkeys(range(L), slots), n_expert, "lru", lookahead=False) as r:
        for a, b in zip(starts, starts[1:], strict=False):
            for t in range(a, b, batch):
                rows = target_ids[t:min(t + batch, b)]
                for j in range(L):
                    r.call(j, rows[:, j, :], None)
        return r.stats()["misses"]
