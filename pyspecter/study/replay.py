"""Replays of native residency's slot decisions on every routing call of a bench run, prompt batches included, so
that an eviction rule can be judged offline in the bench's own figure: bytes read per decoded token.

``simulate.py`` simulates one layer's decode stream; the bench's caches also live through each prompt's batch,
which needs most experts of every layer, fills the slots in expert order (what does not fit is computed on the
host) and reads the next layer's most used experts ahead. ``replay`` runs those calls through C's own decision
code on a private slot table (``native.Replay``, csrc/replay.cpp over csrc/policy.cpp): per layer, each call's
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
from pyspecter.native import Context, Model, Replay
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


def replay(calls: Sequence[Call], slots: dict[int, int], n_expert: int, policy: str = "lru", *,
           lookahead: bool = True, scores: Callable[[Call], np.ndarray] | None = None) -> int:
    """Experts read into slots by decode calls over ``calls``, with ``slots`` (layer -> count) and an eviction
    policy of C's (``native.NATIVE_POLICIES``: 'lru', 'lfu', 'prev-token', 'score'); ``scores(call)``: the
    call's per-expert scores (policy 'score' evicts the lowest, recency breaking ties); ``lookahead``: a batch
    reads ahead."""
    with Replay(slots, n_expert, policy, lookahead=lookahead) as r:
        for c in calls:
            r.call(c.il, c.ids, None if scores is None else scores(c), counted=c.step >= 0)
        return r.stats()["reads"]


def bench_slots(path: str | Path, budget_bytes: int) -> dict[int, int]:
    """The slots per layer the bench's baselines get at ``budget_bytes`` (``bench.run_bench``)."""
    from pyspecter.budget import allocate_slots

    return allocate_slots(read_layout(path).require_moe(), budget_bytes)
