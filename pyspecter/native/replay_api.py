"""The replay of the C API (csrc/include/llama-pyspecter.h, csrc/replay.cpp): a routing trace run through native
residency's own eviction code on a private slot table, with no model. Declared like the rest of ``lib`` and bound
with it; ``Replay`` is what study/ and the tests use."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

import numpy as np

from pyspecter.native.lib import NATIVE_POLICIES, _i32, ctypes_function


class ReplayParams(ctypes.Structure):
    """struct llama_pyspecter_replay_params."""

    _fields_ = [
        ("n_layer", ctypes.c_int32),
        ("n_expert", ctypes.c_int32),
        ("slots", ctypes.POINTER(ctypes.c_int32)),  # [n_layer]; 0: not replayed
        ("expert_bytes", ctypes.POINTER(ctypes.c_int64)),  # [n_layer] or null
        ("policy", ctypes.c_int32),
        ("lookahead", ctypes.c_bool),
        ("held", ctypes.c_int32),
        ("duel", ctypes.c_bool),
        ("start_learned", ctypes.c_bool),
        ("decay", ctypes.c_float),
        ("margin", ctypes.c_float),
    ]


class ReplayStats(ctypes.Structure):
    """struct llama_pyspecter_replay_stats: counts of the counted calls, unless the header says otherwise."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "calls", "needed", "hits", "misses", "reads", "evictions", "bytes", "lookahead", "held_ghost_misses",
        "ghost_lru_misses", "ghost_score_misses")] + [("use_scores", ctypes.c_int32), ("switches", ctypes.c_int64)]

    def as_dict(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name, _ in self._fields_}


@ctypes_function("llama_pyspecter_replay_init", [ctypes.POINTER(ReplayParams)], ctypes.c_void_p)
def llama_pyspecter_replay_init(p: Any, /) -> int | None:
    """A replay's private slot table, or None on a bad argument (free it with replay_free)."""
    ...


@ctypes_function("llama_pyspecter_replay_free", [ctypes.c_void_p], None)
def llama_pyspecter_replay_free(r: int, /) -> None:
    """Free a replay."""
    ...


@ctypes_function("llama_pyspecter_replay_call", [ctypes.c_void_p, _i32, ctypes.POINTER(_i32), _i32, _i32,
                                                 ctypes.POINTER(ctypes.c_float), ctypes.c_bool], _i32)
def llama_pyspecter_replay_call(r: int, il: int, ids: Any, n_tokens: int, n_used: int, scores: Any, counted: bool,
                                /) -> int:
    """One routing call of layer il: ids [n_tokens][n_used], scores [n_expert] or None; counted: a decode call."""
    ...


@ctypes_function("llama_pyspecter_replay_get_stats", [ctypes.c_void_p, _i32, ctypes.POINTER(ReplayStats)], _i32)
def llama_pyspecter_replay_get_stats(r: int, il: int, out: Any, /) -> int:
    """Layer il's counts (il = -1: every layer's) into out."""
    ...


class Replay:
    """A replay of native residency's decisions over routing calls fed one by one (``call``); counts by ``stats``.

    slots: layer -> its usable slots; policy: a name of ``NATIVE_POLICIES`` ('lru', 'lfu', 'prev-token', 'score':
    the calls' scores, recency breaking ties); lookahead: a multi-token call reads the next layer's most used
    experts ahead;
    held: slots held back for a draft, with their ghost LRU over slots + held; duel: LRU against the calls'
    scores, as set_duel."""

    def __init__(self, slots: Mapping[int, int], n_expert: int, policy: str = "lru", *, lookahead: bool = True,
                 expert_bytes: Mapping[int, int] | None = None, held: int = 0, duel: bool = False,
                 start_learned: bool = False, decay: float = 0.998, margin: float = 0.03) -> None:
        self._r: int | None = None
        if policy not in NATIVE_POLICIES:
            raise ValueError(f"unknown policy {policy!r}: use one of {', '.join(NATIVE_POLICIES)}")
        n_layer = max(slots) + 1 if slots else 0
        self.n_expert = n_expert
        self._slots = (ctypes.c_int32 * n_layer)(*[slots.get(il, 0) for il in range(n_layer)])
        self._bytes = (ctypes.c_int64 * n_layer)(*[(expert_bytes or {}).get(il, 0) for il in range(n_layer)])
        p = ReplayParams(n_layer, n_expert, self._slots, self._bytes, NATIVE_POLICIES[policy], lookahead, held, duel,
                         start_learned, decay, margin)
        self._r = llama_pyspecter_replay_init(ctypes.byref(p))
        if not self._r:
            raise ValueError(f"replay refused its parameters: slots {dict(slots)}, {n_expert} experts, held {held}")

    def call(self, il: int, ids: Any, scores: Any = None, *, counted: bool = True) -> None:
        """One routing call of layer il: ids [n_tokens, n_used] (or one token's experts); scores: [n_expert]."""
        a = np.ascontiguousarray(np.atleast_2d(np.asarray(ids)), np.int32)
        s = None if scores is None else np.ascontiguousarray(scores, np.float32)
        if s is not None and s.shape != (self.n_expert,):
            raise ValueError(f"scores of {s.shape} for {self.n_expert} experts")
        rc = llama_pyspecter_replay_call(self._r, il, a.ctypes.data_as(ctypes.POINTER(_i32)), a.shape[0], a.shape[1],
                                         None if s is None else s.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                         counted)
        if rc != 0:
            raise ValueError(f"replay refused a call of layer {il} (status {rc}): not a replayed layer?")

    def stats(self, il: int = -1) -> dict[str, int]:
        """Layer il's counts, or every layer's summed (-1)."""
        out = ReplayStats()
        if llama_pyspecter_replay_get_stats(self._r, il, ctypes.byref(out)) != 0:
            raise ValueError(f"no layer {il} in this replay")
        return out.as_dict()

    def close(self) -> None:
        if self._r:
            llama_pyspecter_replay_free(self._r)
            self._r = None

    def __enter__(self) -> Replay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
