"""Eviction policies: which resident expert to give up. Strategy objects, so the cache's victim loop does not
know which policy it runs. Also the static hot set, for caches that never evict.

A policy only ranks slots; the cache decides which slots are candidates (not pending, not needed now, not
protected by a prediction). Lower rank is evicted first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Scores(Protocol):
    """Per-expert scores read by index (a list, an array)."""

    def __getitem__(self, e: int, /) -> float: ...


class LayerSlots(Protocol):
    """What a policy reads of one layer's slot table (``residency.LayerSlots`` is the record; declared here so
    that the policies, below the residency that uses them, import nothing of it)."""

    owner: list[int]  # slot -> expert (-1 free)
    last_use: list[int]  # slot -> clock of last hit
    freq: list[int]  # expert -> times selected
    loaded: list[int]  # slot -> clock its expert was mapped
    prev_call: int  # clock of the layer's previous routing call
    scores: Scores  # expert -> predicted reuse (empty: none)


class Policy:
    name = "?"

    def rank(self, st: LayerSlots, slot: int) -> tuple[int, ...]:
        """Eviction order of a resident ``slot`` of the layer ``st`` (its expert is ``st.owner[slot]``). Called
        in the victim loop inside the routing hook, once per candidate slot: keep it a few list reads."""
        raise NotImplementedError


class LRU(Policy):
    """Least recently used: recency is what works for MoE routing (no static hot set: almost every expert is
    active within ~1k tokens)."""

    name = "lru"

    def rank(self, st: LayerSlots, slot: int) -> tuple[int, ...]:
        return (st.last_use[slot],)


class LFU(Policy):
    """Least frequently used, recency breaking ties."""

    name = "lfu"

    def rank(self, st: LayerSlots, slot: int) -> tuple[int, ...]:
        return (st.freq[st.owner[slot]], st.last_use[slot])


class PrevToken(Policy):
    """Previous-token reuse, the baseline that remembers one token: the experts the layer's previous routing call
    (the previous token, in decode) used are kept, and the others go first-in first-out, by when they were
    loaded. No recency or frequency beyond one token, which is what it measures against LRU. Keeping is all its
    prefetching: with misses waited for, the previous token's experts are resident once it has run."""

    name = "prev-token"

    def rank(self, st: LayerSlots, slot: int) -> tuple[int, ...]:
        # last_use >= prev_call: hit or mapped during the previous call (or since); the current call's experts
        # are never candidates
        return (st.last_use[slot] >= st.prev_call, st.loaded[slot])


class Predicted(Policy):
    """Eviction by predicted reuse: the resident expert with the lowest score (``Residency.set_scores``) goes
    first, least recently used among equals; LRU when nothing is predicted. Decoding runs this rule in C, with the
    learned reuse maps (csrc/residency.cpp); here it is the Python hook's, which tests compare C's with."""

    name = "predicted"

    def rank(self, st: LayerSlots, slot: int) -> tuple[float, int]:
        scores = st.scores
        return (scores[st.owner[slot]] if scores else 0.0, st.last_use[slot])


POLICIES: dict[str, type[Policy]] = {"lru": LRU, "lfu": LFU, "prev-token": PrevToken, "predicted": Predicted}


def make_policy(name: str) -> Policy:
    from pyspecter.errors import SpecterError

    try:
        return POLICIES[name]()
    except KeyError:
        raise SpecterError(f"unknown policy {name!r}: use one of {', '.join(POLICIES)}") from None


def hot_experts(counts: Sequence[int], n: int) -> list[int]:
    """The static hot set: the ``n`` experts of a layer selected most often in a routing profile (``counts[e]``
    = times expert e was selected), most used first; ties go to the lower id, so a profile gives one answer."""
    order = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
    return order[: max(n, 0)]
