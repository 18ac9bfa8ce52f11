"""Prompts: the packaged prompt sets, and rendering a conversation with the model's own chat template."""

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


def load_prompts(path: str | os.PathLike | None = None, split: str | None = None) -> list[dict]:
    """Prompts from a JSONL file (default: the packaged eval_prompts.jsonl): one object a line with "id", "split"
    ("tune" | "eval"), "kind" and "messages" [{role, content}]. A line may instead give "prompt": text, which is
    taken as one user message. Blank lines and lines starting with '#' are skipped."""
    if path is None:
        text = resources.files("pyspecter.data").joinpath("eval_prompts.jsonl").read_text(encoding="utf-8")
        where = "eval_prompts.jsonl"
    else:
        p = Path(path)
        if not p.is_file():
            raise SpecterError(f"{p}: no such prompt file")
        text, where = p.read_text(encoding="utf-8"), str(p)
    if split is not None and split not in SPLITS:
        raise SpecterError(f"unknown split {split!r}: use {' or '.join(SPLITS)}")
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise SpecterError(f"{where}:{lineno}: not JSON ({e.msg})") from None
        out.append(normalize_prompt(obj, f"{where}:{lineno}", len(out)))
    return [p for p in out if split is None or p["split"] == split]


def normalize_prompt(obj: Any, where: str, index: int) -> dict:
    if isinstance(obj, str):
        obj = {"prompt": obj}
    if not isinstance(obj, dict):
        raise SpecterError(f"{where}: a prompt must be an object or a string")
    messages = obj.get("messages")
    if messages is None and isinstance(obj.get("prompt"), str):
        messages = [{"role": "user", "content": obj["prompt"]}]
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages)):
        raise SpecterError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
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
