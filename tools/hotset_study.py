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
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from pyspecter import native
from pyspecter.hitrates import hot_profile, recording
from pyspecter.hotset import EVERY, curves
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


def study(name: str, n: int) -> dict:
    path = resolve_model(name)
    layout = read_layout(path)
    E, k = layout.n_expert, layout.n_expert_used
    profile = hot_profile(path, layout)
    acc: dict[str, list[np.ndarray]] = {"pinned": [], "adaptive": [], "adaptive_loads": [], "lru": []}
    for turn in traces(path, layout, n):
        for il, (prompt, answer) in turn.items():
            acc["pinned"].append(hot_hit_curve(profile[il], answer))
            held, loaded = curves(profile[il], np.concatenate([prompt, answer]), k, prompt=len(prompt))
            acc["adaptive"].append(held)
            acc["adaptive_loads"].append(loaded)
            acc["lru"].append(1 - lru_miss_curve(np.concatenate([prompt, answer]), E, warm=len(prompt)) / k)
    rows = {key: [float(x) for x in np.mean(v, axis=0)[1:E]] for key, v in acc.items()}
    return {"model": name, "n_expert": E, "n_expert_used": k, "answer_tokens": n, "prompts": len(load_prompts(
        split="eval")), "every": EVERY, "slots": list(range(1, E)), **rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smol-moe", help="GGUF path or built-in name (default smol-moe)")
    ap.add_argument("-n", type=int, default=160, help="greedy answer tokens per prompt (default 160)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    a = ap.parse_args()
    r = study(a.model, a.n)
    if a.json:
        print(json.dumps(r, indent=1))
        return
    print(f"{r['model']}: {r['prompts']} eval prompts, {r['answer_tokens']} greedy tokens each; share of the "
          f"answers' rows resident, and experts loaded a layer a token")
    print(f"{'slots':>5} {'pinned':>7} {'adaptive':>9} {'loads':>6} {'LRU':>6} {'LRU uploads':>11}")
    for i, s in enumerate(r["slots"]):
        print(f"{s:>5} {r['pinned'][i]:>7.1%} {r['adaptive'][i]:>9.1%} {r['adaptive_loads'][i]:>6.3f} "
              f"{r['lru'][i]:>6.1%} {(1 - r['lru'][i]) * r['n_expert_used']:>11.3f}")


if __name__ == "__main__":
    main()
