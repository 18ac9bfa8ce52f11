"""`make demo`: one chat answer through expert slots next to stock llama.cpp on the same prompt."""

from __future__ import annotations

import time
from pathlib import Path

from pyspecter import native
from pyspecter.engine import greedy
from pyspecter.prompts import render_prompt
from pyspecter.session import Session, SessionConfig


def demo(path: Path, *, budget: str, n: int, question: str) -> dict:
    """Greedy answers of stock llama.cpp and of a Session with ``budget`` of expert slots (misses on the CPU):
    the tokens (which must be identical) and the speed of each."""
    messages = [{"role": "user", "content": question}]
    with native.Model(path) as m, native.Context(m) as ctx:
        toks = m.tokenize(render_prompt(m, messages), add_special=False)
        ctx.warmup()
        t0 = time.perf_counter()
        stock, _ = greedy(ctx, toks, n, stop_at_eog=True)
        stock_s = time.perf_counter() - t0
    with Session(SessionConfig(model=path, budget=budget, miss="cpu", n_ctx=512)) as s:
        t0 = time.perf_counter()
        out = s.generate(toks, n)
        dt = time.perf_counter() - t0
        return {"tokens": out, "text": s.target.detokenize([t for t in out if not s.target.is_eog(t)]),
                "tok_s": len(out) / dt, "stock_tok_s": len(stock) / stock_s, "identical": stock == out,
                "slots": s.n_slots, "n_expert": s.layout.n_expert, "stats": s.stats()}
