"""Eviction policies: which resident expert to give up. Strategy objects, so the cache's victim loop does not
know which policy it runs.

A policy only ranks slots; the cache decides which slots are candidates (not pending, not needed now, not
protected by a prediction). Lower rank is evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class Policy:
    name = "?"

    def rank(self, last_use: int, freq: int) -> tuple[int, ...]:
        """Eviction order of a slot whose expert was last used at clock ``last_use`` and selected ``freq`` times."""
        raise NotImplementedError


class LRU(Policy):
    """Least recently used: recency is what works for MoE routing (no static hot set: almost every expert is
    active within ~1k tokens)."""

    name = "lru"

    def rank(self, last_use: int, freq: int) -> tuple[int, ...]:
        return (last_use,)


class LFU(Policy):
    """Least frequently used, recency breaking ties."""

    name = "lfu"

    def rank(self, last_use: int, freq: int) -> tuple[int, ...]:
        return (freq, last_use)


POLICIES: dict[str, type[Policy]] = {"lru": LRU, "lfu": LFU}


def make_policy(name: str) -> Policy:
    from pyspecter.errors import SpecterError

    try:
        return POLICIES[name]()
    except KeyError:
        raise SpecterError(f"unknown policy {name!r}: use one of {', '.join(POLICIES)}") from None


class GhostLRU:
    """Plain LRU over ``capacity`` experts in bookkeeping only: the misses it would have had on the same routing.
    The cache runs one per layer over all allocated slots, held ones included, to estimate what dropping the
    draft (whose memory the held slots are) would buy."""

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
