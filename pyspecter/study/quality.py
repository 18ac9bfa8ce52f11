"""The measured quality cost of the approximate ``--miss surrogate`` mode: perplexity against exact decoding."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from pyspecter import native
from pyspecter.layout import read_layout
from pyspecter.models.calibration import select_neurons
from pyspecter.paths import content_key, models_dir, write_text_atomic
from pyspecter.surrogate import Surrogates


def perplexity_delta(path: Path, keep: float, n_slots: int, tier: str = "ram", n_tokens: int = 256,
                     progress: bool = True) -> dict:
    """Perplexity of held-out text decoded one token at a time through ``n_slots`` slots per layer on ``tier``:
    exact misses (wait) against surrogate misses. The surrogate mode's price, measured; cached by the model
    file's identity and the options (the tier matters: on a slow one fewer uploads land in time)."""
    from pyspecter.cache import ExpertCache
    from pyspecter.models.smol import heldout_text
    from pyspecter.tiers import make_tier

    path = Path(path)
    st = path.stat()
    key = content_key(str(path.resolve()), str(st.st_size), str(st.st_mtime_ns), f"{keep:g}", str(n_slots), tier,
                      str(n_tokens), Path(__file__).read_bytes())
    cached = models_dir() / f"surrogate-ppl-{path.stem}-{key}.json"
    if cached.exists():
        try:
            return json.loads(cached.read_text())
        except (OSError, ValueError):  # a damaged cache file is measured again, not fatal
            cached.unlink(missing_ok=True)
    lay = read_layout(path).require_moe()
    sur = Surrogates(lay, select_neurons(path, keep, progress=progress))
    if progress:
        print(f"surrogate: measuring its perplexity cost on {n_tokens} held-out tokens ...", file=sys.stderr,
              flush=True)
    res = {}
    for mode in ("wait", "surrogate"):
        with native.Model(path) as m:
            toks = m.tokenize(heldout_text(), add_special=True)[:n_tokens]
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
    return (f"surrogate mode (approximate): perplexity {res['surrogate']['ppl']:.3f} vs exact {res['wait']['ppl']:.3f} "
            f"({res['ppl_delta']:+.3f}) on {res['tokens']} held-out tokens at {res['slots']} slots/layer on "
            f"{res['tier']}, width {res['keep']:g}, {res['surrogate_mib']:.0f} MiB of surrogates, "
            f"{100 * res['surrogate']['surrogate_uses'] / max(res['surrogate']['needed'], 1):.1f}% of experts "
            "served by one")




def measure(path: Path, width: float, budget: str, tier: str = "ram", n_tokens: int = 256) -> dict:
    """The surrogate mode's perplexity cost at the slots ``budget`` leaves once the surrogates are paid for."""
    from pyspecter.budget import MemoryPlan

    lay = read_layout(path).require_moe()
    sur = Surrogates(lay, select_neurons(path, width))
    plan = MemoryPlan.for_budget(lay, budget, surrogate_bytes=sur.nbytes)  # refuses what cannot fit
    return perplexity_delta(path, width, plan.slots, tier, n_tokens=n_tokens)
