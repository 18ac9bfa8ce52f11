"""What slots hold of the model's own routing: LRU's and a static hot set's hit rate by slot count, and the profile
a hot set is chosen from, from one prefill of the packaged calibration text on the CPU (never the held-out text
bench measures on). The layer plan prices its slot layers with them (``devcosts.plan_for``); the session's hot
slot layers and bench's static-hot rows hold the hot set of the same profile. Cached per model file
(``~/.cache/pyspecter/routing.json``): routing is the model's, whatever the device."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pyspecter import native
from pyspecter.layout import ModelLayout
from pyspecter.lru import lru_miss_curve
from pyspecter.native.hooks import Hooks
from pyspecter.paths import Measurements
from pyspecter.policies import hot_hit_curve
from pyspecter.prompts import calibration_tokens

# the trace's tokens of calibration text: LRU's first HIT_WARM only fill the cache; the hot set's hit rate is its
# profile of the first half of the trace measured on the second (never on the text it was chosen from)
HIT_TOKENS, HIT_WARM = 256, 32
_STORE = Measurements("routing", 1)


def _routing(path: str | Path, layout: ModelLayout, n_threads: int, use_cache: bool) -> dict:
    """The trace's figures: ``hits`` (LRU), ``hot_hits`` and ``counts`` (per MoE layer, the times each expert was
    selected over the whole trace), cached."""
    st = Path(path).stat()
    key = _STORE.key(Path(path).resolve(), st.st_size, st.st_mtime_ns)
    known = _STORE.entries()
    if use_cache and key in known:
        return known[key]
    k, E = layout.n_expert_used, layout.n_expert
    moe = {L.index for L in layout.layers}
    ids: dict[int, np.ndarray] = {}

    def on_route(il: int, n_tokens: int, n_used: int, ids_p, _w_p) -> None:
        if il in moe:
            ids[il] = np.ctypeslib.as_array(ids_p, shape=(n_tokens * n_used,)).reshape(n_tokens, n_used).copy()

    with native.Model(path) as model:
        toks = calibration_tokens(model, HIT_TOKENS)
        hooks = Hooks(model, on_route, n_slots=1)  # one slot, never filled: every row on the host path
        try:
            with native.Context(model, n_ctx=len(toks) + 16, n_threads=n_threads) as ctx:
                ctx.decode(toks, logits_all=True)  # every row's routing, the last layer's too
                hooks.check()
        finally:
            hooks.close()
    misses = np.mean([lru_miss_curve(a, E, warm=min(HIT_WARM, len(a) // 4)) for a in ids.values()], axis=0)
    half = len(toks) // 2
    hot = np.mean([hot_hit_curve(_counts(a[:half], E), a[half:]) for a in ids.values()], axis=0)
    entry = {"hits": [float(min(max(1.0 - m / k, 0.0), 1.0)) for m in misses], "hot_hits": [float(h) for h in hot],
             "counts": {str(il): _counts(a, E) for il, a in sorted(ids.items())}, "tokens": len(toks)}
    _STORE.save(key, entry)
    return entry


def _counts(ids: np.ndarray, n_expert: int) -> list[int]:
    return [int(x) for x in np.bincount(ids[ids >= 0], minlength=n_expert)]


def lru_hits(path: str | Path, layout: ModelLayout, n_threads: int = 2, use_cache: bool = True) -> list[float]:
    """LRU's hit rate with s = 0..E slots a layer, over every MoE layer's rows. Real text repeats its experts from
    token to token, so this is above the floor of s / E that the plan assumes without it."""
    return [float(h) for h in _routing(path, layout, n_threads, use_cache)["hits"]]


def hot_hits(path: str | Path, layout: ModelLayout, n_threads: int = 2, use_cache: bool = True) -> list[float]:
    """A static hot set's hit rate with s = 0..E slots a layer: each layer's s experts selected most often in the
    first half of the trace, measured on its second half."""
    return [float(h) for h in _routing(path, layout, n_threads, use_cache)["hot_hits"]]


def hot_profile(path: str | Path, layout: ModelLayout, n_threads: int = 2) -> dict[int, list[int]]:
    """Per MoE layer, the times each expert was selected over the whole trace: what a static hot set is chosen
    from (``policies.hot_experts``)."""
    return {int(il): c for il, c in _routing(path, layout, n_threads, True)["counts"].items()}
