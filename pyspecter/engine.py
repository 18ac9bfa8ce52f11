"""The decode loop. For now plain greedy decoding on one context; the speculative engine grows here."""

from __future__ import annotations

import numpy as np

from pyspecter.native import Context


def greedy(ctx: Context, prompt: list[int], n: int, *, stop_at_eog: bool = False) -> tuple[list[int], np.ndarray]:
    """Greedy-decode n tokens after prompt. Returns the tokens and the logits each was chosen from ([n, vocab])."""
    logits = ctx.decode(prompt)
    out: list[int] = []
    rows = []
    for _ in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        rows.append(logits)
        if stop_at_eog and ctx.model.is_eog(tok):
            break
        if len(out) == n:
            break
        logits = ctx.decode([tok])
    return out, np.stack(rows)
