"""The OpenAI wire format for `pyspecter serve`, without a web framework: request validation (every refusal an
``ApiError`` with OpenAI's error shape), stop sequences over an incremental detokenizer, response objects.

Kept apart from ``app`` so it imports without the ``server`` extra and is unit-tested without a model.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_STOPS = 4  # as OpenAI
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_MISSING = object()


class ApiError(Exception):
    """A refusal: HTTP status and OpenAI's ``{"error": {"message", "type", "param", "code"}}`` body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --- the request body ------------------------------------------------------------------------------------------

MAX_DEPTH = 64  # nesting of a request body: an OpenAI request needs about 5
_SURROGATE = re.compile("[\ud800-\udfff]")


def _invalid_json(why: str) -> ApiError:
    return ApiError(400, f"could not parse the JSON body of the request: {why}", code="invalid_json")


def nesting_depth(body: bytes) -> int:
    """How deep arrays and objects nest in ``body``, counted on the bytes without decoding (brackets inside
    strings do not count): the decoder recurses once per level, so a deep body is refused before it runs.
    Vectorised, in pieces: linear time and bounded memory for any 8 MiB body."""
    import numpy as np

    deepest = depth = run = 0  # carried across pieces: nesting, backslashes just before the piece
    in_str = False
    for i in range(0, len(body), _PIECE):
        c = np.frombuffer(body, np.uint8, count=min(_PIECE, len(body) - i), offset=i)
        bs = c == ord("\\")
        pos = np.arange(len(c), dtype=np.int32)
        last_other = np.maximum.accumulate(np.where(bs, -1, pos))
        runs = np.where(last_other >= 0, pos - last_other, pos + 1 + run)  # backslashes ending at each byte
        before = np.concatenate(([run], runs[:-1]))  # ... and just before it: odd escapes a quote
        quotes = np.cumsum((c == ord('"')) & (before % 2 == 0), dtype=np.int32) + in_str
        outside = quotes % 2 == 0
        step = (outside & ((c == ord("[")) | (c == ord("{")))).astype(np.int8) - \
            (outside & ((c == ord("]")) | (c == ord("}")))).astype(np.int8)
        d = np.cumsum(step, dtype=np.int32) + depth
        deepest, depth = max(deepest, int(d.max())), int(d[-1])
        run, in_str = int(runs[-1]), bool(quotes[-1] % 2)
    return deepest


_PIECE = 1 << 20


def decode_json(body: bytes) -> Any:
    """The request body's JSON value. Anything malformed is a 400 ``invalid_json``: bytes that are not JSON (or
    not UTF-8), nesting deeper than MAX_DEPTH, and strings with a lone surrogate (``"\\ud800"``: valid JSON
    syntax, but no text, so nothing can encode or tokenize it)."""
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH:  # else it cannot nest deeper: no need to look
        depth = nesting_depth(body)
        if depth > MAX_DEPTH:
            raise _invalid_json(f"nested {depth} levels deep (at most {MAX_DEPTH})")
    try:
        value = json.loads(body)
    except RecursionError:
        raise _invalid_json(f"nested too deep (at most {MAX_DEPTH})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise _invalid_json(str(e)) from None
    where = _lone_surrogate(value)
    if where is not None:
        raise _invalid_json(f"{where}: a lone surrogate escape (\\ud800-\\udfff without its pair) is not text")
    return value


def _lone_surrogate(value: Any) -> str | None:
    """Where the first string with a lone surrogate is (a key or a value), or None."""
    todo: list[tuple[str, Any]] = [("body", value)]
    while todo:
        where, v = todo.pop()
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v):
                return where
        elif isinstance(v, dict):
            for k, x in v.items():
                if not k.isascii() and _SURROGATE.search(k):
                    return f"{where} key {k.encode('utf-8', 'backslashreplace').decode()!r}"
                todo.append((f"{where}.{k}" if where != "body" else k, x))
        elif isinstance(v, list):
            todo.extend((f"{where}[{i}]", x) for i, x in enumerate(v))
    return None


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"'{param}': {message}", code=code, param=param)


def _number(body: dict, name: str, lo: float, hi: float, *, integer: bool = False, lo_open: bool = False,
            default: Any = None) -> Any:
    """body[name] checked for type and range; ``default`` when absent or null. Booleans are not numbers here."""
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kinds):
        raise _bad(name, f"expected {'an integer' if integer else 'a number'}, got {type(v).__name__} {v!r}",
                   "invalid_type")
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        lo_s = "(" if lo_open else "["
        raise _bad(name, f"{v!r} is out of range {lo_s}{lo:g}, {hi:g}]")
    return v


def _flag(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, None)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"expected a boolean, got {type(v).__name__} {v!r}", "invalid_type")
    return v


def _unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"'{param}' is not supported by pyspecter serve: {why}", code="unsupported_parameter",
                    param=param)


@dataclass
class GenRequest:
    """What one request asks of the engine, validated. ``max_tokens`` None: as much as the context leaves."""

    model: str | None
    max_tokens: int | None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    messages: list[dict[str, str]] | None = None  # chat
    prompt: str | list[int] | None = None  # completions: text, or token ids

    def sampling(self) -> dict:
        """The sampling fields the request set (pyspecter.sampling.SamplingParams names)."""
        return {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty")
                if getattr(self, k) is not None}


def _common(body: Any, max_name: tuple[str, ...]) -> GenRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"expected a string, got {type(model).__name__}", "invalid_type")
    max_tokens = None
    for name in max_name:
        v = _number(body, name, 1, 2**31 - 1, integer=True)
        if v is not None:
            max_tokens = v
    if _number(body, "n", 1, 128, integer=True, default=1) != 1:
        raise _unsupported("n", "one choice per request (batch size 1)")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, -2, 2, default=0) != 0:
            raise _unsupported(name, "use 'repeat_penalty' (llama.cpp's repetition penalty) instead")
    if body.get("logit_bias"):
        raise _unsupported("logit_bias", "not implemented")
    for name in ("tools", "functions"):
        if body.get(name):
            raise _unsupported(name, "no tool calling")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise _unsupported("response_format", "plain text only")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", "expected a string or a list of strings", "invalid_type")
    if len(stop) > MAX_STOPS:
        raise _bad("stop", f"at most {MAX_STOPS} stop sequences, got {len(stop)}")
    if any(not s for s in stop):
        raise _bad("stop", "stop sequences must not be empty")
    seed = _number(body, "seed", -2**63, 2**64 - 1, integer=True)
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
        raise _bad("stream_options", "expected an object {\"include_usage\": boolean}", "invalid_type")
    if opts is not None and not stream:
        raise _bad("stream_options", "only allowed when 'stream' is true")
    return GenRequest(
        model=model, max_tokens=max_tokens, stop=stop, seed=seed, stream=stream,
        include_usage=bool(opts and opts.get("include_usage")),
        temperature=_number(body, "temperature", 0, 2), top_p=_number(body, "top_p", 0, 1, lo_open=True),
        top_k=_number(body, "top_k", 0, 2**31 - 1, integer=True), min_p=_number(body, "min_p", 0, 1),
        repeat_penalty=_number(body, "repeat_penalty", 0, 100, lo_open=True))


def _content(i: int, m: dict) -> str:
    c = m.get("content")
    if c is None and m.get("role") == "assistant":
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for p in c:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise _bad(f"messages[{i}].content", "only text parts ({\"type\": \"text\", \"text\": ...}) are "
                           "supported", "invalid_type")
            parts.append(p["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content", "expected a string or a list of text parts", "invalid_type")


def parse_chat(body: Any) -> GenRequest:
    req = _common(body, ("max_tokens", "max_completion_tokens"))
    for name in ("logprobs", "top_logprobs"):
        if body.get(name):
            raise _unsupported(name, "not implemented")
    msgs = body.get("messages", _MISSING)
    if msgs is _MISSING:
        raise ApiError(400, "'messages' is required", code="missing_required_parameter", param="messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "expected a non-empty list of messages", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "expected an object {\"role\", \"content\"}", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list or an object is no role (and unhashable)
            raise _bad(f"messages[{i}].role", f"{role!r} is not one of {', '.join(ROLES)} (no tool messages)")
        out.append({"role": ROLES[role], "content": _content(i, m)})
    req.messages = out
    return req


def parse_completion(body: Any) -> GenRequest:
    req = _common(body, ("max_tokens",))
    if body.get("echo"):
        raise _unsupported("echo", "not implemented")
    if body.get("suffix") is not None:
        raise _unsupported("suffix", "no fill-in-the-middle")
    if _number(body, "best_of", 1, 128, integer=True, default=1) != 1:
        raise _unsupported("best_of", "one choice per request (batch size 1)")
    if body.get("logprobs") is not None:
        raise _unsupported("logprobs", "not implemented")
    p = body.get("prompt", _MISSING)
    if p is _MISSING:
        raise ApiError(400, "'prompt' is required", code="missing_required_parameter", param="prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        req.prompt = list(p)
    elif isinstance(p, str):
        req.prompt = p
    elif isinstance(p, list) and len(p) > 1:
        raise _unsupported("prompt", "one prompt per request (batch size 1)")
    else:
        raise _bad("prompt", "expected a string or a list of token ids", "invalid_type")
    # default as OpenAI's: 16 tokens
    if req.max_tokens is None:
        req.max_tokens = 16
    return req


def context_error(n_ctx: int, n_prompt: int, n_answer: int | None, param: str = "messages") -> ApiError:
    if n_answer is None:
        msg = (f"This model's maximum context length is {n_ctx} tokens; the prompt alone is {n_prompt} tokens, "
               f"which leaves no room for an answer. Please shorten the prompt.")
    else:
        msg = (f"This model's maximum context length is {n_ctx} tokens. However, you requested "
               f"{n_prompt + n_answer} tokens ({n_prompt} in the prompt, {n_answer} in the completion). Please "
               f"reduce the length of the prompt or of the completion (max_tokens).")
    return ApiError(400, msg, code="context_length_exceeded", param=param)


class StopText:
    """Text of the answer so far, released as it becomes final: a multi-byte character split across tokens
    comes out whole (as ``chat.Streamer``), and text that may be the start of a stop sequence is held back until
    it is known not to be one. A stop sequence ends the answer and is not emitted."""

    def __init__(self, detokenize: Callable[[list[int]], str], is_eog: Callable[[int], bool],
                 stops: list[str]) -> None:
        self.detokenize, self.is_eog, self.stops = detokenize, is_eog, stops
        self.tokens: list[int] = []
        self.shown = 0  # characters of the text released so far
        self.stopped = False

    def _text(self) -> str:
        return self.detokenize([t for t in self.tokens if not self.is_eog(t)])

    def push(self, tok: int) -> str:
        """The text that became final with this token ('' if none); sets ``stopped`` on a stop sequence."""
        self.tokens.append(tok)
        if self.is_eog(tok):
            return ""
        text = self._text()
        if text.endswith("\ufffd"):  # an incomplete character: wait for the rest of its bytes
            return ""
        hits = [i for i in (text.find(s, self.shown) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.shown = text[self.shown:min(hits)], len(text)
            return out
        hold = 0
        for k in range(min(len(text) - self.shown, max(map(len, self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stops):
                hold = k
                break
        out = text[self.shown:len(text) - hold]
        self.shown = len(text) - hold
        return out

    def flush(self) -> str:
        """The rest, at the end of the answer (a held-back partial stop sequence was not one)."""
        if self.stopped:
            return ""
        text = self._text()
        out, self.shown = text[self.shown:], len(text)
        return out


# --- response objects ---------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def chat_response(rid: str, model: str, text: str, finish: str, n_prompt: int, n_completion: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": usage(n_prompt, n_completion)}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def completion_response(rid: str, model: str, text: str, finish: str, n_prompt: int, n_completion: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": usage(n_prompt, n_completion)}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, obj: str, n_prompt: int, n_completion: int) -> dict:
    """The last chunk of a stream when ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(n_prompt, n_completion)}
