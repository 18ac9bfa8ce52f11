"""The Python API: load a model with a memory budget, then generate or stream, the way mlx-lm's
``load``/``generate``/``stream_generate`` work. These are the objects the CLI uses (a ``Session``), not a second
path::

    import pyspecter

    model = pyspecter.load("smol-moe", budget="50%", tier="disk")
    for r in pyspecter.stream_generate(model, "Why is the sky blue?", max_tokens=32):
        print(r.text, end="", flush=True)
    print(r.stats["hit_rate"])
    model.close()
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pyspecter.prompts import render_prompt
from pyspecter.session import Session, SessionConfig


@dataclass
class Response:
    """One step of ``stream_generate``: the new text (may be empty while a multi-byte character is incomplete),
    the token, and the session's figures so far."""

    text: str
    token: int
    stats: dict


def load(model: str | os.PathLike, *, budget: str | None = None, tier: str | None = None,
         device: str | None = None, draft: str | None = None, **config) -> Session:
    """A model (a GGUF path or a built-in name such as ``smol-moe``) with ``budget`` of fast memory for its
    experts (``"40%"``, ``"2GiB"``) on ``tier`` (ram, disk, emulated:GBPS) and ``device`` (cuda0, rpc:HOST:PORT).
    What is left out is chosen as the command line chooses it (``placement.place``): a model that fits runs as
    stock llama.cpp; ``session.placement.why`` says what was chosen. Other keyword arguments are
    ``SessionConfig`` fields (``n_ctx``, ``n_threads``, ``temperature``, ``top_p``, ``k``, ``force``...).
    Close it (or use it in a ``with`` block) to free the model."""
    from pyspecter.models.catalog import resolve_model  # built-in names are built (or found cached) on demand

    path = resolve_model(str(model))
    dpath = resolve_model(str(draft)) if draft else None
    return Session(SessionConfig(model=Path(path), draft=dpath, budget=budget, tier=tier, device=device,
                                 **config))


def _prompt_tokens(session: Session, prompt: str | list[dict[str, str]], chat: bool) -> list[int]:
    if isinstance(prompt, list):  # messages: always through the model's chat template
        return session.tokenize(render_prompt(session.target, prompt), add_special=False)
    if chat:
        return session.tokenize(render_prompt(session.target, [{"role": "user", "content": prompt}]),
                                add_special=False)
    return session.tokenize(prompt)


def stream_generate(session: Session, prompt: str | list[dict[str, str]], *, max_tokens: int = 256,
                    chat: bool = True) -> Iterator[Response]:
    """Tokens after ``prompt`` as they come. A string is sent as one user message through the model's chat
    template (``chat=False``: as raw text); a list of {role, content} messages is a conversation."""
    tokens = _prompt_tokens(session, prompt, chat)
    out: list[int] = []
    shown = 0
    gen = session.stream(tokens)
    try:
        for tok in gen:
            out.append(tok)
            text = session.target.detokenize([t for t in out if not session.target.is_eog(t)])
            new = "" if text.endswith("\ufffd") else text[shown:]
            shown += len(new)
            yield Response(new, tok, session.stats())
            if len(out) >= max_tokens:
                break
    finally:
        gen.close()


def generate(session: Session, prompt: str | list[dict[str, str]], *, max_tokens: int = 256,
             chat: bool = True) -> str:
    """The whole answer to ``prompt`` as text (see ``stream_generate``)."""
    return "".join(r.text for r in stream_generate(session, prompt, max_tokens=max_tokens, chat=chat))
