"""What slots hold of the model's own routing: LRU's and a hot set's hit rate by slot count, the hot set's moves, and
the profile a hot set starts from, from two prefills on the CPU of packaged text bench never measures on: the tune
split's chat prompts, then the calibration text. The layer plan prices its slot layers with them
(``devcosts.plan_for``); the session's hot slot layers and bench's static-hot and adaptive-hot rows start from the
same profile. Cached per model file (``~/.cache/pyspecter/routing.json``): routing is the model's, whatever the
device."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from pyspecter import native
from pyspecter.hotset import curves
from pyspecter.layout import ModelLayout
from pyspecter.lru import lru_miss_curve
from pyspecter.native.hooks import Hooks
from pyspecter.paths import Measurements
from pyspecter.policies import hot_hit_curve
from pyspecter.prompts import calibration_tokens, tune_tokens

# tokens of each text: LRU's first HIT_WARM only fill the cache; the hot set is the chat prompts' profile and its hit
# rate is measured on the calibration text, never on the text it was chosen from. Measured on the same text (first
# half against second) it read 77% at 16 of 32 slots on bench-qwen3moe, where bench's held-out text hit 46%: text
# unlike the profile's misses more, and so may a user's
HIT_TOKENS, HIT_WARM = 256, 32
_STORE = Measurements("routing", 3)


def _key(path: str | Path) -> str:
    st = Path(path).stat()
    return _STORE.key(Path(path).resolve(), st.st_size, st.st_mtime_ns)


def cached(path: str | Path) -> bool:
    """Whether this model file's routing figures are cached (else the first plan traces it: two CPU prefills)."""
    return _key(path) in _STORE.entries()


def _routing(path: str | Path, layout: ModelLayout, n_threads: int, use_cache: bool) -> dict:
    """The traces' figures on the calibration text: ``hits`` (LRU's), ``static_hits`` (the chat prompts' hot set,
    pinned), ``hot_hits`` and ``hot_moves`` (that set re-chosen as it runs, ``hotset.curves``); and ``counts``
    (the chat prompts' profile: per MoE layer, the times each expert was selected), cached."""
    key = _key(path)
    known = _STORE.entries()
    if use_cache and key in known:
        return known[key]
    k, E = layout.n_expert_used, layout.n_expert
    with native.Model(path) as model:
        chat, calib = _traces(model, layout, [tune_tokens(model, HIT_TOKENS), calibration_tokens(model, HIT_TOKENS)],
                              n_threads)
    misses = np.mean([lru_miss_curve(a, E, warm=min(HIT_WARM, len(a) // 4)) for a in calib.values()], axis=0)
    static = np.mean([hot_hit_curve(_counts(chat[il], E), calib[il]) for il in calib], axis=0)
    held, loaded = np.mean([curves(_counts(chat[il], E), calib[il], k) for il in calib], axis=0)
    entry = {"hits": [float(min(max(1.0 - m / k, 0.0), 1.0)) for m in misses],
             "static_hits": [float(h) for h in static], "hot_hits": [float(h) for h in held],
             "hot_moves": [float(m) for m in loaded],
             "counts": {str(il): _counts(a, E) for il, a in sorted(chat.items())}, "tokens": HIT_TOKENS}
    _STORE.save(key, entry)
    return entry


@contextmanager
def recording(model: native.Model, layout: ModelLayout) -> Iterator[dict[int, list[np.ndarray]]]:
    """While open, each MoE layer's routing ids of every decode call, [tokens, k] per call in call order, every row
    on the host path (one slot, never filled). Empty the dict to start again."""
    moe = {L.index for L in layout.layers}
    ids: dict[int, list[np.ndarray]] = {}

    def on_route(il: int, n_tokens: int, n_used: int, ids_p, _w_p) -> None:
        if il in moe:
            a = np.ctypeslib.as_array(ids_p, shape=(n_tokens * n_used,)).reshape(n_tokens, n_used)
            ids.setdefault(il, []).append(a.copy())

    hooks = Hooks(model, on_route, n_slots=1)
    try:
        yield ids
        hooks.check()
    finally:
        hooks.close()


def _traces(model: native.Model, layout: ModelLayout, texts: list[list[int]],
            n_threads: int) -> list[dict[int, np.ndarray]]:
    """Each MoE layer's routing ids [n, k] of one prefill of each text, every row on the host path."""
    out = []
    with recording(model, layout) as ids:
        for toks in texts:
            ids.clear()
            with native.Context(model, n_ctx=len(toks) + 16, n_threads=n_threads) as ctx:
                ctx.decode(toks, logits_all=True)  # every row's routing, the last layer's too
            out.append({il: np.concatenate(v) for il, v in ids.items()})
    return out


def _counts(ids: np.ndarray, n_expert: int) -> list[int]:
    return [int(x) for x in np.bincount(ids[ids >= 0], minlength=n_expert)]


def lru_hits(path: str | Path, layout: ModelLayout, n_threads: int = 2, use_cache: bool = True) -> list[float]:
    """LRU's hit rate with s = 0..E slots a layer, over every MoE layer's rows. Real text repeats its experts from
    token to token, so this is above the floor of s / E that the plan assumes without it."""
    return [float(h) for h in _routing(path, layout, n_threads, use_cache)["hits"]]


def hot_hits(path: str | Path, layout: ModelLayout, n_threads: int = 2, use_cache: bool = True,
             static: bool = False) -> list[float]:
    """The hot set's hit rate with s = 0..E slots a layer on the calibration text: starting as each layer's s
    experts selected most often in the chat prompts' trace (``hot_profile``) and re-chosen as it runs
    (``hotset``); static=True: never re-chosen (bench's static-hot rows)."""
    return [float(h) for h in _routing(path, layout, n_threads, use_cache)["static_hits" if static else "hot_hits"]]


def hot_moves(path: str | Path, layout: ModelLayout, n_threads: int = 2) -> list[float]:
    """The experts the hot set of s = 0..E slots loads a layer a token on the calibration text (``hot_hits``)."""
    return [float(m) for m in _routing(path, layout, n_threads, True)["hot_moves"]]


def hot_profile(path: str | Path, layout: ModelLayout, n_threads: int = 2) -> dict[int, list[int]]:
    """Per MoE layer, the times each expert was selected in the chat prompts' trace: what a static hot set is
    chosen from (``policies.hot_experts``)."""
    return {int(il): c for il, c in _routing(path, layout, n_threads, True)["counts"].items()}
