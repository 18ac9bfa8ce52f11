"""What a hot set holds of chat answers: pinned from the profile, re-chosen as the session re-chooses it
(``pyspecter.hotset``), and LRU, on the model's own routing of the packaged eval chat prompts and its greedy
answers. Counts only, on the CPU: no timing.

    python tools/hotset_study.py smol-moe -n 160 [--json]

Per eval prompt: one prefill (every row on the host path, as ``hitrates`` traces), then ``-n`` greedy tokens. The
answers' rows are scored, each slot count s of E:
  - pinned: the profile's top s (``hitrates.hot_profile``: the tune prompts' routing), never moved;
  - adaptive: the session's rule from the same profile (``hotset.curves`` with the prompt as its first window, as
    C hands a prefill's counts over after it), then every ``hotset.EVERY`` answer tokens; loads per answer token;
  - LRU: the prompt's rows fill the cache, the answer's are scored (``lru.lru_miss_curve``), a miss an upload.

``--sweep`` scores the adaptive rule again for each window (``--every``, tokens) and decay (``--decay``) given, on
the same traces, at a quarter, half and three quarters of the experts: how much the fixed ``hotset.EVERY`` and
``hotset.DECAY`` matter.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from pyspecter import native
from pyspecter.hitrates import hot_profile, recording
from pyspecter.hotset import DECAY, EVERY, curves
from pyspecter.layout import read_layout
from pyspecter.lru import lru_miss_curve
from pyspecter.models.catalog import resolve_model
from pyspecter.policies import hot_hit_curve
from pyspecter.prompts import load_prompts, render_prompt


def traces(path, layout, n: int) -> list[dict[int, tuple[np.ndarray, np.ndarray]]]:
    """Per eval prompt, per MoE layer: (the prompt's routing ids, the answer's), [tokens, k] each."""
    out = []
    with native.Model(path) as model, recording(model, layout) as cur:
        for p in load_prompts(split="eval"):
            toks = model.tokenize(render_prompt(model, p["messages"]))
            cur.clear()
            with native.Context(model, n_ctx=len(toks) + n + 8, n_threads=2) as ctx:
                logits = ctx.decode(toks)
                for _ in range(n):
                    logits = ctx.decode([int(np.argmax(logits))])
            # the prefill's call first; the last layer routes only the rows whose logits are asked for
            out.append({il: (v[0], np.concatenate(v[1:])) for il, v in cur.items()})
    return out


def sweep(path, layout, turns, everys: list[int], decays: list[float]) -> list[dict]:
    """The adaptive rule's hit rate and loads a layer a token for each (every, decay), at E/4, E/2 and 3E/4 slots."""
    E, k = layout.n_expert, layout.n_expert_used
    profile = hot_profile(path, layout)
    at = sorted({max(1, E // 4), E // 2, 3 * E // 4})
    out = []
    for every in everys:
        for decay in decays:
            held, loads = [], []
            for turn in turns:
                for il, (prompt, answer) in turn.items():
                    h, ld = curves(profile[il], np.concatenate([prompt, answer]), k, every=every, decay=decay,
                                   prompt=len(prompt))
                    held.append(h)
                    loads.append(ld)
            mh, ml = np.mean(held, axis=0), np.mean(loads, axis=0)
            out.append({"every": every, "decay": decay, "slots": at, "hit": [float(mh[s]) for s in at],
                        "loads": [float(ml[s]) for s in at]})
    return out


def study(name: str, n: int, everys: list[int] | None = None, decays: list[float] | None = None) -> dict:
    path = resolve_model(name)
    layout = read_layout(path)
    E, k = layout.n_expert, layout.n_expert_used
    profile = hot_profile(path, layout)
    acc: dict[str, list[np.ndarray]] = {"pinned": [], "adaptive": [], "adaptive_loads": [], "lru": []}
    turns = traces(path, layout, n)
    for turn in turns:
        for il, (prompt, answer) in turn.items():
            acc["pinned"].append(hot_hit_curve(profile[il], answer))
            held, loaded = curves(profile[il], np.concatenate([prompt, answer]), k, prompt=len(prompt))
            acc["adaptive"].append(held)
            acc["adaptive_loads"].append(loaded)
            acc["lru"].append(1 - lru_miss_curve(np.concatenate([prompt, answer]), E, warm=len(prompt)) / k)
    rows = {key: [float(x) for x in np.mean(v, axis=0)[1:E]] for key, v in acc.items()}
    return {"model": name, "n_expert": E, "n_expert_used": k, "answer_tokens": n, "prompts": len(load_prompts(
        split="eval")), "every": EVERY, "decay": DECAY, "slots": list(range(1, E)), **rows,
        **({"sweep": sweep(path, layout, turns, everys or [EVERY], decays or [DECAY])} if everys or decays else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smol-moe", help="GGUF path or built-in name (default smol-moe)")
    ap.add_argument("-n", type=int, default=160, help="greedy answer tokens per prompt (default 160)")
    ap.add_argument("--every", default="", help=f"with --sweep: windows to try, comma-separated (default {EVERY})")
    ap.add_argument("--decay", default="", help=f"with --sweep: decays to try, comma-separated (default {DECAY})")
    ap.add_argument("--sweep", action="store_true", help="also score the adaptive rule for each --every and --decay")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    a = ap.parse_args()
    everys = [int(x) for x in a.every.split(",") if x] if a.sweep else None
    decays = [float(x) for x in a.decay.split(",") if x] if a.sweep else None
    r = study(a.model, a.n, everys or ([EVERY] if a.sweep else None), decays or ([DECAY] if a.sweep else None))
    if a.json:
        print(json.dumps(r, indent=1))
        return
    print(f"{r['model']}: {r['prompts']} eval prompts, {r['answer_tokens']} greedy tokens each; share of the "
          f"answers' rows resident, and experts loaded a layer a token")
    print(f"{'slots':>5} {'pinned':>7} {'adaptive':>9} {'loads':>6} {'LRU':>6} {'LRU uploads':>11}")
    for i, s in enumerate(r["slots"]):
        print(f"{s:>5} {r['pinned'][i]:>7.1%} {r['adaptive'][i]:>9.1%} {r['adaptive_loads'][i]:>6.3f} "
              f"{r['lru'][i]:>6.1%} {(1 - r['lru'][i]) * r['n_expert_used']:>11.3f}")
    if "sweep" in r:
        at = r["sweep"][0]["slots"]
        print(f"\nthe adaptive rule by window and decay (the session's: {r['every']}, {r['decay']}): hit / loads a "
              f"layer a token at {', '.join(map(str, at))} of {r['n_expert']} slots")
        for row in r["sweep"]:
            cells = "  ".join(f"{h:6.1%} / {ld:.3f}" for h, ld in zip(row["hit"], row["loads"], strict=True))
            print(f"  every {row['every']:>3}  decay {row['decay']:<5} {cells}")


if __name__ == "__main__":
    main()
