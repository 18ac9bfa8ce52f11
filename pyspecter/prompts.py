"""Prompts: the packaged prompt sets, users' prompt files (plain text or JSONL), and rendering a conversation
with the model's own chat template."""

from __future__ import annotations

import ctypes
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from pyspecter.errors import SpecterError
from pyspecter.native import Model

SPLITS = ("tune", "eval")


PACKAGED = "eval_prompts.jsonl"  # the packaged prompt set (pyspecter/data), half tune, half eval


def calibration_prompts() -> list[str]:
    """The packaged calibration prompts (pyspecter/data/calibration_prompts.txt: what builders fit on, never the
    held-out text benchmarks measure on), comments and blank lines dropped."""
    text = resources.files("pyspecter.data").joinpath("calibration_prompts.txt").read_text(encoding="utf-8")
    return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]


def calibration_tokens(model: Model, n: int) -> list[int]:
    """The first ``n`` tokens of the calibration prompts as one text, as the model tokenizes it, a line at a time."""
    toks: list[int] = []
    for line in calibration_prompts():
        toks += model.tokenize(line + "\n", add_special=not toks)
        if len(toks) >= n:
            break
    return toks[:n]


def tune_tokens(model: Model, n: int) -> list[int]:
    """The first ``n`` tokens of the packaged prompts' tune split, each rendered with the model's chat template, as
    one text: a chat as a session sees it, and never what bench measures (the eval split, the held-out text)."""
    toks: list[int] = []
    for p in load_prompts(split="tune"):
        toks += model.tokenize(render_prompt(model, p["messages"]), add_special=not toks)
        if len(toks) >= n:
            break
    return toks[:n]


def load_prompts(path: str | os.PathLike | None = None, split: str | None = None) -> list[dict]:
    """Prompts from a file (default: the packaged eval_prompts.jsonl), as dicts with "id", "split" ("tune" |
    "eval"), "kind" and "messages" [{role, content}].

    The format is detected per file: JSONL when the name ends in .jsonl or .ndjson, or when the first line that is
    neither empty nor a '#' comment is a JSON object or string; otherwise plain text. JSONL: one JSON object a line,
    with "messages", or a "prompt" or "text" string (one user message), or a bare JSON string; '#' lines are
    comments. Plain text: every non-empty line is one prompt, a user message (a '#' line too: it is text there).
    Empty lines are skipped in both. A missing, unreadable, non-UTF-8 or empty file, or a line of a JSONL file
    that is not a prompt, is a SpecterError naming the file (and line)."""
    if path is None:
        text = resources.files("pyspecter.data").joinpath(PACKAGED).read_text(encoding="utf-8")
        where, jsonl = PACKAGED, True
    else:
        p = Path(path)
        if not p.is_file():
            raise SpecterError(f"{p}: no such prompt file")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise SpecterError(f"{p}: not UTF-8 text") from None
        except OSError as e:
            raise SpecterError(f"{p}: cannot read the prompt file ({e.strerror or e})") from None
        where, jsonl = str(p), p.suffix.lower() in (".jsonl", ".ndjson") or _looks_like_jsonl(text)
    if split is not None and split not in SPLITS:
        raise SpecterError(f"unknown split {split!r}: use {' or '.join(SPLITS)}")
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or (jsonl and s.startswith("#")):
            continue
        if not jsonl:
            out.append({"id": f"line{lineno}", "split": "eval", "kind": "text",
                        "messages": [{"role": "user", "content": s}]})
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise SpecterError(f"{where}:{lineno}: not JSON ({e.msg})") from None
        out.append(normalize_prompt(obj, f"{where}:{lineno}", len(out)))
    if not out:
        raise SpecterError(f"{where}: no prompts (every line is empty{' or a comment' if jsonl else ''})")
    chosen = [p for p in out if split is None or p["split"] == split]
    if not chosen:
        raise SpecterError(f"{where}: no prompts of split {split!r} (a prompt without one is \"eval\")")
    return chosen


def _looks_like_jsonl(text: str) -> bool:
    """The first line that is neither empty nor a '#' comment parses as a JSON object or string."""
    for line in text.splitlines():
        s = line.strip()
        if s and not s.startswith("#"):
            try:
                return isinstance(json.loads(s), dict | str)
            except json.JSONDecodeError:
                return False
    return False


def normalize_prompt(obj: Any, where: str, index: int) -> dict:
    """One prompt (an object or a bare string) as load_prompts returns it; ``where`` names it in errors."""
    if isinstance(obj, str):
        obj = {"prompt": obj}
    if not isinstance(obj, dict):
        raise SpecterError(f"{where}: a prompt must be an object or a string")
    messages = obj.get("messages")
    text = next((obj[k] for k in ("prompt", "text") if isinstance(obj.get(k), str)), None)
    if messages is None and text is not None:
        if not text.strip():
            raise SpecterError(f"{where}: empty prompt")
        messages = [{"role": "user", "content": text}]
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages)):
        raise SpecterError(f"{where}: a prompt needs a \"prompt\" or \"text\" string, or \"messages\": a "
                           "non-empty list of {role, content} strings")
    split = obj.get("split", "eval")
    if split not in SPLITS:
        raise SpecterError(f"{where}: split {split!r} is not {' or '.join(SPLITS)}")
    return {"id": str(obj.get("id", f"p{index}")), "split": split, "kind": str(obj.get("kind", "chat")),
            "messages": messages}


def render_chatml(messages: list[dict]) -> str:
    """ChatML (SmolLM2, Qwen): each turn in <|im_start|>role ... <|im_end|>, then an open assistant turn."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def render_prompt(model: Model, messages: list[dict]) -> str:
    """The model's own chat template when llama.cpp knows it (Mixtral's [INST], gpt-oss' harmony...), else ChatML.
    Fixtures have no template; the random ones tokenize any text."""
    import llama_cpp

    tmpl = llama_cpp.llama_model_chat_template(model.ptr, None)
    if not tmpl:
        return render_chatml(messages)
    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]  # alive while C reads them
    chat = (llama_cpp.llama_chat_message * len(keep))(*[llama_cpp.llama_chat_message(r, c) for r, c in keep])
    size = 4 * sum(len(r) + len(c) for r, c in keep) + 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(tmpl, chat, len(keep), True, buf, size)
        if n < 0:  # a Jinja template llama.cpp's built-in matcher doesn't recognise
            return render_chatml(messages)
        if n <= size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n + 1
    return render_chatml(messages)


def has_chat_template(model: Model) -> bool:
    """Whether the GGUF carries a chat template (fixtures have none: their prompts are plain text)."""
    import llama_cpp

    return bool(llama_cpp.llama_model_chat_template(model.ptr, None))
