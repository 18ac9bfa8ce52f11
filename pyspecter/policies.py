"""Eviction policies by name, and the static hot set. The policies themselves run in C (csrc/policy.cpp), inside the
routing op; here are only the names a user picks from and the rules that need no slot table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from pyspecter.errors import SpecterError

# lru: least recently used (recency is what works for MoE routing: almost every expert is active within ~1k
# tokens); lfu: least often selected, recency breaking ties; prev-token: keep what the layer's previous call used,
# the rest first in first out (the baseline that remembers one token); predicted: lowest predicted reuse first
# (a learned predictor's reuse maps, C's SCORE policy), LRU among equals and where nothing is predicted
POLICIES = ("lru", "lfu", "prev-token", "predicted")


class Scores(Protocol):
    """Per-expert scores read by index (a list, an array)."""

    def __getitem__(self, e: int, /) -> float: ...


def check_policy(name: str) -> None:
    """Refuse a policy name C does not run."""
    if name not in POLICIES:
        raise SpecterError(f"unknown policy {name!r}: use one of {', '.join(POLICIES)}")


def hot_experts(counts: Sequence[int], n: int) -> list[int]:
    """The static hot set: the ``n`` experts of a layer selected most often in a routing profile (``counts[e]``
    = times expert e was selected), most used first; ties go to the lower id, so a profile gives one answer."""
    c = np.asarray(counts, np.float64)
    return [int(e) for e in np.lexsort((np.arange(len(c)), -c))[: max(n, 0)]]  # by count, then by id


def hot_hit_curve(counts: Sequence[int], ids: np.ndarray) -> np.ndarray:
    """The share of the routing ``ids`` [n, k] (one layer, -1: none) that a static hot set of s = 0..E experts
    chosen from the profile ``counts`` (``hot_experts``) holds: a hit with s slots iff the expert's rank in the
    profile is below s, so one pass gives every slot count."""
    rank = np.empty(len(counts), np.int64)
    rank[hot_experts(counts, len(counts))] = np.arange(len(counts))
    r = rank[ids[ids >= 0]]
    return np.array([np.mean(r < s) if len(r) else 0.0 for s in range(len(counts) + 1)], np.float64)
