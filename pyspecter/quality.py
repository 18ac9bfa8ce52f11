"""The measured quality cost of the approximate ``--miss surrogate`` mode: perplexity against exact decoding.

A session in that mode reports it before its first token (``pyspecter.load`` returns it as ``session.quality``, the
CLI prints ``describe`` of it); ``pyspecter surrogate`` measures it at the slots a budget leaves
(study/quality.py). The surrogates' neuron groups are handed in: building them is a model builder's work
(models/calibration.py), which the runtime does not import."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from pyspecter import native
from pyspecter.layout import read_layout
from pyspecter.paths import content_key, models_dir, write_text_atomic
from pyspecter.surrogate import Surrogates


def _heldout_text() -> str:
    """The packaged held-out prose (disjoint from every calibration text)."""
    from importlib import resources

    return resources.files("pyspecter.data").joinpath("heldout.txt").read_text(encoding="utf-8")


def perplexity_delta(path: Path, groups: dict[int, np.ndarray], keep: float, n_slots: int, tier: str = "ram",
                     n_tokens: int = 256, progress: bool = True) -> dict:
    """Perplexity of held-out text decoded one token at a time through ``n_slots`` slots per layer on ``tier``:
    exact misses (wait) against misses served by surrogates that keep ``groups`` (each expert's neuron groups,
    ``models.calibration.select_neurons(path, keep)``). The surrogate mode's price, measured; cached by the model
    file's identity and the options (the tier matters: on a slow one fewer uploads land in time)."""
    from pyspecter.cache import ExpertCache
    from pyspecter.tiers import make_tier

    path = Path(path)
    st = path.stat()
    key = content_key(str(path.resolve()), str(st.st_size), str(st.st_mtime_ns), f"{keep:g}", str(n_slots), tier,
                      str(n_tokens), Path(__file__).read_bytes(),
                      *(str(il).encode() + np.ascontiguousarray(g).tobytes() for il, g in sorted(groups.items())))
    cached = models_dir() / f"surrogate-ppl-{path.stem}-{key}.json"
    if cached.exists():
        try:
            return json.loads(cached.read_text())
        except (OSError, ValueError):  # a damaged cache file is measured again, not fatal
            cached.unlink(missing_ok=True)
    lay = read_layout(path).require_moe()
    sur = Surrogates(lay, groups)
    if progress:
        print(f"surrogate: measuring its perplexity cost on {n_tokens} held-out tokens ...", file=sys.stderr,
              flush=True)
    res = {}
    for mode in ("wait", "surrogate"):
        with native.Model(path) as m:
            toks = m.tokenize(_heldout_text(), add_special=True)[:n_tokens]
            # closed (uploads drained) before the model is freed, also on an error or Ctrl-C
            with ExpertCache(m, lay, n_slots, miss=mode, tier=make_tier(tier),
                             surrogates=sur if mode == "surrogate" else None) as cache:
                nll = 0.0
                with native.Context(m, n_ctx=len(toks) + 8, n_threads=2) as ctx:
                    for i in range(len(toks) - 1):
                        lg = ctx.decode([toks[i]]).astype(np.float64)
                        mx = lg.max()
                        nll += mx + math.log(np.exp(lg - mx).sum()) - lg[toks[i + 1]]
                    cache.check()
                c = cache.counters()
        res[mode] = {"ppl": math.exp(nll / (len(toks) - 1)), "hit_rate": c["hit_rate"],
                     "surrogate_uses": c["surrogate_uses"], "needed": c["needed"]}
    res["keep"], res["slots"], res["tokens"] = keep, n_slots, n_tokens
    res["surrogate_mib"] = sur.nbytes / 2**20
    res["ppl_delta"] = res["surrogate"]["ppl"] - res["wait"]["ppl"]
    res["tier"] = tier
    write_text_atomic(cached, json.dumps(res))
    return res


def describe(res: dict) -> str:
    """The cost as one line (what a command prints before the first token)."""
    return (f"surrogate mode (approximate): perplexity {res['surrogate']['ppl']:.3f} vs exact {res['wait']['ppl']:.3f} "
            f"({res['ppl_delta']:+.3f}) on {res['tokens']} held-out tokens at {res['slots']} slots/layer on "
            f"{res['tier']}, width {res['keep']:g}, {res['surrogate_mib']:.0f} MiB of surrogates, "
            f"{100 * res['surrogate']['surrogate_uses'] / max(res['surrogate']['needed'], 1):.1f}% of experts "
            "served by one")
