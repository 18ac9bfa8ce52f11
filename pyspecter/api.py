"""The Python API: load a model with a memory budget, then generate or stream, the way mlx-lm's
``load``/``generate``/``stream_generate`` work. The CLI opens its sessions with this ``load`` (one validation, one
placement), not a second path::

    import pyspecter

    model = pyspecter.load("smol-moe", budget="50%", tier="disk")
    for r in pyspecter.stream_generate(model, "Why is the sky blue?", max_tokens=32):
        print(r.text, end="", flush=True)
    print(r.stats["hit_rate"])
    model.close()
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspecter.errors import SpecterError
from pyspecter.placement import is_host, parse_layer_plan, place
from pyspecter.predictor_hint import fit_seconds_estimate, predictor_hint
from pyspecter.prompts import has_chat_template, render_prompt
from pyspecter.quality import describe as describe_quality
from pyspecter.quality import perplexity_delta
from pyspecter.sampling import SamplingParams
from pyspecter.session import Session, SessionConfig


@dataclass
class Response:
    """One step of ``stream_generate``: the new text (may be empty while a multi-byte character is incomplete),
    the token, and the session's figures so far."""

    text: str
    token: int
    stats: dict


def load(model: str | os.PathLike, *, budget: str | None = None, tier: str | None = None,
         device: str | None = None, draft: str | os.PathLike | None = None, miss: str | None = None,
         layer_plan: str | None = None, surrogate_width: float = 0.25,
         notify: Callable[[str], None] | None = None, **config: Any) -> Session:
    """A model (a GGUF path or a built-in name such as ``smol-moe``) with ``budget`` of fast memory for its
    experts (``"40%"``, ``"2GiB"``) on ``tier`` (ram, disk, emulated:GBPS) and ``device`` (cuda0, rpc:HOST:PORT).
    What is left out is chosen as the command line chooses it: the CLI's generate, chat and serve open their
    session here. A model that fits runs as stock llama.cpp; ``session.placement.why`` says what was chosen.

    ``miss``: wait, cpu, host, mapped, or surrogate (APPROXIMATE: single-token misses computed by a narrow copy of
    each expert keeping ``surrogate_width`` of its neurons; its measured perplexity cost is ``session.quality``, see
    ``quality.describe``); None: as the tier says, and on a GPU whose layer plan is predicted faster so, mapped.
    ``layer_plan`` (with a device): auto, slots or n-cpu-moe:N. Other keyword arguments are
    ``SessionConfig`` fields (``n_ctx``, ``n_threads``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``repeat_penalty``, ``seed``, ``k``, ``adaptive``, ``profile``, ``force``, ``predictor``...).

    Bad input raises ``SpecterError`` before anything is loaded. What the session has to say (its placement, a
    layer plan, how to get a predictor, an approximate mode's cost) goes to ``notify`` as it is decided, one line
    each, and stays in ``session.notes``. Close the session (or use it in a ``with`` block) to free the model."""
    from pyspecter.models.catalog import resolve_model  # built-in names are built (or found cached) on demand

    check_options(miss=miss, surrogate_width=surrogate_width, device=device, layer_plan=layer_plan, **config)
    notes: list[str] = []

    def say(line: str | None) -> None:
        if line:
            notes.append(line)
            if notify is not None:
                notify(line)

    path = resolve_model(str(model))
    dpath = resolve_model(str(draft)) if draft else None
    where = place(path, tier=tier, budget=budget, device=device, force=bool(config.get("force", False)))
    say(where.why)
    groups = None
    if miss == "surrogate":  # the surrogates' neuron groups: a model builder's artifact, handed to the runtime
        from pyspecter.models.calibration import select_neurons

        groups = select_neurons(path, surrogate_width)
    s = Session(SessionConfig(model=Path(path), draft=dpath, budget=where.budget, tier=where.tier,
                              device=where.device, miss=miss, layer_plan=layer_plan, surrogate_groups=groups,
                              **config), placement=where, notify=say)
    try:
        if s.layer_plan is not None:
            say(s.layer_plan.why)
        elif s.predictor is None and dpath is None and s.n_slots < s.layout.n_expert and s.miss != "host":
            say(_predictor_hint(s, str(model)))
        if s.miss == "surrogate":  # approximate: what it costs, measured, before the first token
            s.quality = perplexity_delta(path, groups, surrogate_width, s.n_slots, where.tier)
            say(describe_quality(s.quality))
    except BaseException:
        s.close()
        raise
    s.notes = notes
    return s


def check_options(*, miss: str | None = None, surrogate_width: float = 0.25, device: str | None = None,
                  layer_plan: str | None = None, temperature: float = 0.0, n_ctx: int = 2048,
                  profile: str | os.PathLike | None = None, top_k: int | None = None, top_p: float | None = None,
                  min_p: float | None = None, repeat_penalty: float | None = None, **_: Any) -> None:
    """Refuse bad options with one ``SpecterError`` line, before anything is read or loaded."""
    from pyspecter.misses import MISS_MODES

    given = {k: v for k, v in dict(top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty).items()
             if v is not None}
    SamplingParams(temperature=temperature, **given).check()
    if not 0 < surrogate_width <= 1:
        raise SpecterError(f"--surrogate-width must be in (0, 1], got {surrogate_width}")
    if profile is not None and not Path(profile).exists():
        raise SpecterError(f"{profile}: no such file")
    if n_ctx < 1:
        raise SpecterError(f"--ctx-size must be at least 1, got {n_ctx}")
    if miss is not None and miss not in MISS_MODES:
        raise SpecterError(f"unknown miss mode {miss!r}: use one of {', '.join(MISS_MODES)}")
    if layer_plan is not None:
        if is_host(device):
            raise SpecterError("--layer-plan needs --device: on the CPU every layer's experts are in RAM already")
        parse_layer_plan(layer_plan)


def _predictor_hint(s: Session, name: str) -> str | None:
    """Once per model file: a session that would prefetch with a learned predictor says how to get one."""
    lay = s.layout
    active = lay.nonexpert_bytes + lay.n_expert_used * sum(L.expert_bytes for L in lay.layers)
    n_embd = lay.layers[0].tensors["up"].shape[2]  # (experts, n_ff, n_embd)
    est = fit_seconds_estimate(len(lay.layers), active, n_embd, lay.n_expert, has_chat_template(s.target))
    return predictor_hint(s.cfg.model, name, est)


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
