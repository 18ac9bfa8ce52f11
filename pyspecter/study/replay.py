"""Replays of native residency's slot decisions (csrc/residency.cpp) on every routing call of a bench run, prompt
batches included, so that an eviction or admission rule can be judged offline in the bench's own figure: bytes
read per decoded token.

``simulate.py`` simulates one layer's decode stream; the bench's caches also live through each prompt's batch,
which needs most experts of every layer, fills the slots in expert order (what does not fit is computed on the
host) and reads the next layer's most used experts ahead. ``replay`` follows those rules: per layer, each call's
needed experts in ascending order take a free slot, else the lowest-ranked resident one not needed by the call; a
batch's call first reads ahead the next layer's experts by how often they were needed so far. Reads land at once:
which slot an expert takes does not depend on when its read lands, except where a read still in flight at a
later call keeps its slot from being a victim (a prompt's read-ahead on a slow link), which the replay does not
model. Only decode calls' reads are counted, as the bench counts them.

On smol-moe (disk tier, the 24 packaged eval prompts, 16 tokens each) the replay gives the bench's bytes per token
to its printed digit for LRU, LFU and learned-evict at 50% and 30%.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pyspecter.layout import read_layout
from pyspecter.native import Context, Model
from pyspecter.native.hooks import Hooks


@dataclass
class Call:
    """One routing call: ``step`` -1 for a prompt's batch, else the decode step; ``ids`` [n_tokens, n_used]; ``x``:
    the router input of its last row (what C scores by), when recorded."""

    prompt: int
    step: int
    il: int
    ids: np.ndarray
    x: np.ndarray | None = None


def record_calls(path: str | Path, prompts: Sequence[Sequence[int]], n: int, *, n_threads: int = 2,
                 inputs: bool = False) -> tuple[list[Call], list[int]]:
    """Every routing call of prefilling each prompt and decoding ``n`` greedy tokens after it (the bench's run,
    ``bench_runs.run_policy``), observed with every row on the host path (stock's computation: exact policies see
    the same routing); ``inputs``: keep each call's last router input row. Returns the calls and the tokens."""
    calls: list[Call] = []
    where = {"p": 0, "t": -1}
    last_x: dict[int, np.ndarray] = {}

    def on_input(il: int, x) -> None:
        last_x[il] = np.array(x[-1], np.float32)

    def on_route(il: int, n_tokens: int, n_used: int, ids_p, _w) -> None:
        ids = np.ctypeslib.as_array(ids_p, shape=(n_tokens * n_used,)).reshape(n_tokens, n_used).copy()
        calls.append(Call(where["p"], where["t"], il, ids, last_x.pop(il, None)))

    tokens: list[int] = []
    with Model(path) as model:
        hooks = Hooks(model, on_route, n_slots=1, on_input=on_input if inputs else None)
        try:
            with Context(model, n_threads=n_threads, n_ctx=max(map(len, prompts)) + n + 8) as ctx:
                for i, prompt in enumerate(prompts):
                    ctx.clear()
                    where.update(p=i, t=-1)
                    logits = ctx.decode(list(prompt))
                    hooks.check()
                    for t in range(n):
                        tokens.append(int(np.argmax(logits)))
                        where["t"] = t
                        logits = ctx.decode([tokens[-1]])
                        hooks.check()
        finally:
            hooks.close()
    return calls, tokens


# (layer state, slot, expert, clock) -> eviction key, lower evicted first
Rank = Callable[["ReplayLayer", int, int, int], tuple]
RANKS: dict[str, Rank] = {
    "lru": lambda L, s, e, clock: (L.last_use[s],),
    "lfu": lambda L, s, e, clock: (L.freq[e], L.last_use[s]),
    "prev-token": lambda L, s, e, clock: (L.last_use[s] >= L.prev_call, L.loaded[s]),
}


class ReplayLayer:
    """One layer's slot table as C keeps it."""

    def __init__(self, il: int, n_slots: int, n_expert: int) -> None:
        self.il = il
        self.owner = [-1] * n_slots  # slot -> expert
        self.where = [-1] * n_expert  # expert -> slot
        self.last_use = [0] * n_slots
        self.loaded = [0] * n_slots
        self.freq = [0] * n_expert
        self.prev_call = self.last_call = 0
        self.scores: np.ndarray | None = None  # this call's, for a score rank

    def victim(self, rank: Rank, keep: set[int], skip: set[int], clock: int) -> int:
        """A free slot, else the lowest-ranked resident not in ``keep``, slots in ``skip`` aside; -1: none."""
        best, best_key = -1, None
        for s, e in enumerate(self.owner):
            if s in skip:
                continue
            if e < 0:
                return s
            if e in keep:
                continue
            key = rank(self, s, e, clock)
            if best < 0 or key < best_key:
                best, best_key = s, key
        return best

    def put(self, e: int, s: int, clock: int) -> None:
        if self.owner[s] >= 0:
            self.where[self.owner[s]] = -1
        self.owner[s], self.where[e] = e, s
        self.last_use[s] = self.loaded[s] = clock


def replay(calls: Sequence[Call], slots: dict[int, int], n_expert: int, policy: str | Rank = "lru", *,
           lookahead: bool = True, scores: Callable[[ReplayLayer, Call], np.ndarray] | None = None) -> int:
    """Experts read into slots by decode calls over ``calls``, with ``slots`` (layer -> count) and an eviction
    rank (a name of ``RANKS`` or a function); ``scores(layer, call)``: the call's per-expert scores, set before
    its decisions (``ReplayLayer.scores``, for a rank that reads them); ``lookahead``: a batch reads ahead."""
    rank = RANKS[policy] if isinstance(policy, str) else policy
    layers = {il: ReplayLayer(il, n, n_expert) for il, n in slots.items()}
    order = sorted(layers)
    following = dict(zip(order, order[1:], strict=False))
    landing: dict[int, list[int]] = {}  # layer -> slots its read-ahead filled, mapped at its next call
    clock = reads = 0
    for c in calls:
        L = layers[c.il]
        clock += 1
        L.prev_call, L.last_call = L.last_call, clock
        needed = sorted({int(e) for e in c.ids.ravel() if 0 <= e < n_expert})
        for e in needed:
            L.freq[e] += 1
        if scores is not None:
            L.scores = scores(L, c)
        for s in landing.pop(c.il, []):
            L.last_use[s] = L.loaded[s] = clock
        missing = []
        for e in needed:
            if L.where[e] >= 0:
                L.last_use[L.where[e]] = clock
            else:
                missing.append(e)
        if len(c.ids) > 1 and lookahead and c.il in following:
            N = layers[following[c.il]]
            want = sorted(range(n_expert), key=lambda e: -N.freq[e])[:len(needed)]  # stable: ties by id
            filling = landing.setdefault(N.il, [])
            for e in want:
                if N.where[e] >= 0:
                    continue
                s = N.victim(rank, set(want), set(filling), clock)
                if s < 0:
                    break
                N.put(e, s, clock)
                filling.append(s)
        taken: set[int] = set()
        for e in missing:
            s = L.victim(rank, set(needed), taken, clock)
            if s < 0:
                continue  # more experts than slots: the host computes the rest
            L.put(e, s, clock)
            taken.add(s)
            reads += c.step >= 0
    return reads


def bench_slots(path: str | Path, budget_bytes: int) -> dict[int, int]:
    """The slots per layer the bench's baselines get at ``budget_bytes`` (``bench.run_bench``)."""
    from pyspecter.budget import allocate_slots

    return allocate_slots(read_layout(path).require_moe(), budget_bytes)
