"""Chat keeps its KV cache between turns: each turn processes only what is new, and greedy answers are the ones
re-reading the whole history gives."""

from __future__ import annotations

import pytest

from pyspecter.models.tiny import build_tiny
from pyspecter.prompts import render_prompt
from pyspecter.session import Session, SessionConfig

TURNS = ["hello there", "tell me more about the slots", "and the disk tier?", "thanks", "one more question"]


def _conversation(s: Session, reuse: bool) -> tuple[list[list[int]], list[int]]:
    history: list[dict[str, str]] = []
    answers, processed = [], []
    for line in TURNS:
        history.append({"role": "user", "content": line})
        prompt = s.tokenize(render_prompt(s.target, history), add_special=False)
        before = s.tctx.n_decoded
        out = s.generate(prompt, 10, stop_at_eog=False, reuse=reuse)
        processed.append(s.tctx.n_decoded - before)
        answers.append(out)
        history.append({"role": "assistant", "content": s.target.detokenize(out)})
    return answers, processed


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_chat_turns_reuse_the_cache(tier: str) -> None:
    path = build_tiny("tiny-qwen3moe")
    with Session(SessionConfig(model=path, budget="50%", tier=tier, n_ctx=1024)) as s:
        fresh, fresh_n = _conversation(s, reuse=False)
    with Session(SessionConfig(model=path, budget="50%", tier=tier, n_ctx=1024)) as s:
        kept, kept_n = _conversation(s, reuse=True)
    assert kept == fresh
    assert sum(kept_n[1:]) < sum(fresh_n[1:]) / 2, (kept_n, fresh_n)  # later turns read only what is new
    print(f"tokens processed per turn: re-reading {fresh_n}, reusing {kept_n}")


def test_speculative_chat_reuses_both_caches(tmp_path) -> None:
    from pyspecter.models.draft import make_draft

    path = build_tiny("tiny-mixtral")
    draft = make_draft(path, tmp_path / "d.gguf", experts_type="Q4_0", progress=False)
    cfg = dict(model=path, draft=draft, budget="100%", k=2, adaptive=False, n_ctx=1024)
    with Session(SessionConfig(**cfg)) as s:
        fresh, _ = _conversation(s, reuse=False)
        fresh_draft = s.dctx.n_decoded
    with Session(SessionConfig(**cfg)) as s:
        kept, _ = _conversation(s, reuse=True)
        kept_draft = s.dctx.n_decoded
    assert kept == fresh
    assert kept_draft < fresh_draft  # the draft did not re-read every turn either
