"""`make demo`: what the project is for, in under two minutes on a warm cache.

A MoE model given half of its expert bytes as memory, the rest of the experts on disk: stock llama.cpp (its
weights mmap'd, so the page cache is its memory) beside pyspecter (expert slots, misses read from the GGUF with
O_DIRECT), each in a child process whose memory, page cache included, a cgroup holds to the same cap (budget +
non-expert weights + runtime headroom, the bench's rule), each starting with the file's page cache dropped. One
short chat answer each: speed side by side, and the greedy tokens, which must be identical.

The child runs as ``python -m pyspecter.study.demo CGROUP_PROCS ARGS_JSON`` (the bench's capped runner, with a
job of its own: a chat answer and its tokens).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

# the child imports no more than this before it joins the cgroup: everything else is imported where it is used
N_CTX = 512


def _stock(path: Path, messages: list[dict], n: int, n_threads: int) -> dict:
    """llama.cpp's own decode loop, greedy: the model mmap'd, no slots, no hook (same kernels and settings as
    the slot path, so the tokens can be compared)."""
    import numpy as np

    from pyspecter.native import Context, Model
    from pyspecter.prompts import render_prompt

    t0 = time.perf_counter()
    with Model(path) as m, Context(m, n_ctx=N_CTX, n_threads=n_threads) as ctx:
        prompt = m.tokenize(render_prompt(m, messages), add_special=False)
        ctx.warmup()
        t1 = time.perf_counter()
        logits = ctx.decode(prompt)
        out, stamps = [], []
        while True:
            out.append(int(np.argmax(logits)))
            stamps.append(time.perf_counter())
            if m.is_eog(out[-1]) or len(out) >= n:
                break
            logits = ctx.decode([out[-1]])
        return {"tokens": out, "prompt_tokens": len(prompt), "load_s": t1 - t0, "ttft_s": stamps[0] - t1,
                "decode_tokens": len(out) - 1, "decode_s": stamps[-1] - stamps[0]}


def _specter(path: Path, messages: list[dict], n: int, n_threads: int, budget: str) -> dict:
    """A Session on the disk tier with ``budget`` of expert slots: what `pyspecter chat --tier disk` runs."""
    from pyspecter.prompts import render_prompt
    from pyspecter.session import Session, SessionConfig

    t0 = time.perf_counter()
    with Session(SessionConfig(model=path, budget=budget, tier="disk", force=True, n_ctx=N_CTX,
                               n_threads=n_threads)) as s:
        prompt = s.tokenize(render_prompt(s.target, messages), add_special=False)
        t1 = time.perf_counter()
        out = s.generate(prompt, n)
        sp = s.speed  # the session's own counters: what generate and chat's /stats report
        return {"tokens": out, "prompt_tokens": len(prompt), "load_s": t1 - t0, "ttft_s": sp.first_token_s,
                "decode_tokens": sp.decode_tokens, "decode_s": sp.decode_s,
                "text": s.target.detokenize([t for t in out if not s.target.is_eog(t)]),
                "slots": s.slot_count().min, "n_expert": s.layout.n_expert, "stats": s.stats()}


def _capped(job: dict, path: Path, cap_bytes: int) -> tuple[dict, dict]:
    """One job in a child process under the memory cap, the file's page cache dropped first (the bench's runner)."""
    from pyspecter.study.capped import run_capped

    return run_capped("pyspecter.study.demo", job, path, cap_bytes)


def demo(path: Path, *, budget: str = "50%", n: int = 24, question: str, n_threads: int = 2) -> dict:
    """Stock llama.cpp and pyspecter under the same memory cap, experts on disk: one greedy chat answer each."""
    from pyspecter.budget import parse_budget
    from pyspecter.layout import read_layout
    from pyspecter.study.bench import RUNTIME_HEADROOM

    lay = read_layout(path).require_moe()
    budget_bytes = parse_budget(budget, lay.expert_total_bytes)
    cap = budget_bytes + lay.nonexpert_bytes + RUNTIME_HEADROOM
    job = {"messages": [{"role": "user", "content": question}], "n": n, "n_threads": n_threads}
    stock, how = _capped({**job, "fn": "stock"}, path, cap)
    ours, _ = _capped({**job, "fn": "specter", "budget": budget}, path, cap)
    return {"stock": stock, "specter": ours, "memory": how, "budget_bytes": budget_bytes,
            "expert_bytes": lay.expert_total_bytes, "nonexpert_bytes": lay.nonexpert_bytes,
            "identical": stock["tokens"] == ours["tokens"]}


def tok_s(run: dict) -> float:
    """Decode speed after the first token (the first is the prompt's prefill): ``speed.decode_tok_s``."""
    from pyspecter.speed import decode_tok_s

    return decode_tok_s(run["decode_tokens"], run["decode_s"])


def prefill_tok_s(run: dict) -> float:
    """Prompt tokens per second up to the first token."""
    return run["prompt_tokens"] / run["ttft_s"] if run["ttft_s"] else 0.0


def _run_job(job: dict) -> dict:
    path = Path(job["path"])
    if job["fn"] == "stock":
        return _stock(path, job["messages"], job["n"], job["n_threads"])
    return _specter(path, job["messages"], job["n"], job["n_threads"], job["budget"])


if __name__ == "__main__":
    from pyspecter.study.capped import child_main

    child_main(sys.argv[1:], _run_job)
