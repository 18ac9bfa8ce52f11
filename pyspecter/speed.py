"""Speed, one definition everywhere (generate, chat's /stats, serve's metrics, bench, demo, the README).

tok/s is decode speed: the tokens after each answer's first, over the time from that first token to the last.
Prefill is reported apart: prompt tokens per second of prefill time (the time to each answer's first token, which
is the prompt's processing and the first sample), and the time to the first token itself. A figure that mixes the
two (tokens out over a time that includes prefill) moves with the prompt's length, so it is not given anywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


def decode_tok_s(tokens: int, seconds: float) -> float:
    """Decode tokens per second of decode time (0 before any decode token)."""
    return tokens / seconds if seconds > 0 and tokens > 0 else 0.0


@dataclass
class Speed:
    """Counters of answers, summed: ``prompt_tokens`` processed in ``prefill_s`` (up to each answer's first token),
    ``decode_tokens`` (each answer's tokens after its first) in ``decode_s``; ``first_token_s``: the latest
    answer's time to its first token."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    answers: int = 0
    first_token_s: float | None = None

    @property
    def tokens(self) -> int:
        """Every token out: each answer's first (from prefill) and its decode tokens."""
        return self.answers + self.decode_tokens

    @property
    def tok_s(self) -> float:
        return decode_tok_s(self.decode_tokens, self.decode_s)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 and self.prompt_tokens else 0.0

    def reset(self) -> None:
        """Zero the counters in place (a clock timing an answer now keeps counting into them)."""
        self.__init__()

    def as_stats(self) -> dict:
        """The figures as ``Session.stats`` (and so chat's /stats, serve's /metrics) gives them."""
        return {"tokens": self.tokens, "tok_s": self.tok_s, "decode_tokens": self.decode_tokens,
                "decode_s": self.decode_s, "prompt_tokens": self.prompt_tokens, "prefill_s": self.prefill_s,
                "prefill_tok_s": self.prefill_tok_s, "first_token_s": self.first_token_s}


def speed_text(st: dict) -> str:
    """The speed as generate and chat's /stats print it: decode, then prefill apart."""
    text = f"{st['tokens']} tok, {st['tok_s']:.1f} tok/s decode"
    if st.get("first_token_s") is not None:
        text += (f" | prefill {st['prompt_tokens']} tok at {st['prefill_tok_s']:.1f} tok/s, first token "
                 f"{st['first_token_s']:.2f} s")
    return text


class AnswerClock:
    """Times one answer into ``speed``: the time to the first token is prefill, each later token's time since the
    one before is decode. The caller's own time between tokens (printing them, say) is not counted: ``token()`` is
    called as a token is decided, ``resume()`` once the caller is done with it."""

    def __init__(self, speed: Speed, prefilled: Callable[[], int] | None = None) -> None:
        """``prefilled()``: read at the first token, how many prompt tokens its prefill processed (a chat turn
        that reuses the KV cache processes only what is new)."""
        self.speed, self.prefilled = speed, prefilled
        self.t0 = self.t = time.perf_counter()
        self.n = 0

    def token(self) -> None:
        """A token was decided."""
        now = time.perf_counter()
        s = self.speed
        if self.n == 0:
            s.prefill_s += now - self.t
            s.prompt_tokens += self.prefilled() if self.prefilled is not None else 0
            s.answers += 1
            s.first_token_s = now - self.t0
        else:
            s.decode_s += now - self.t
            s.decode_tokens += 1
        self.n += 1
        self.t = now

    def resume(self) -> None:
        self.t = time.perf_counter()
