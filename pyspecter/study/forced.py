"""Teacher-forced decoding for bench and scale: every step feeds the next token of a held-out text instead of the
one the model picked, timed the same way.

Why: the greedy output of a random-weight model cycles through two or three tokens, so every cache hits (the
engine hit 99.1% on big-qwen3moe, and stock's capped page cache looked almost as good). Forcing real text makes the
routing move as it does on text. The held-out text is the packaged held-out prose (data/heldout.txt, never fitted
on) and the packaged eval prompts' own words, tokenized with the model's tokenizer (the fixtures' "test"
tokenizer hashes 5-byte chunks to ids: repeated words repeat ids, as in text); prompt i of a run is forced with
the ``n`` tokens from offset ``i * n`` of it, wrapping around.

Identity is then checked on the logits, not on tokens that no longer come from the model: each step records a
digest of the logits row the token was fed after (float32 bytes, bit for bit), and an exact policy must give
stock's digests at every step.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import numpy as np

from pyspecter.errors import SpecterError
from pyspecter.sampling import Sampler

FREE, FORCED = "free", "teacher-forced"
_RANDOM_WEIGHT = re.compile(r"(tiny-(qwen3moe|qwen2moe|mixtral|gptoss)|bench-qwen3moe|big-qwen3moe(-q4)?)"
                            r"(-[0-9a-f]{16})?(\.gguf)?")


def random_weights(model: str | Path) -> bool:
    """A random-weight built-in (tiny-*, bench-qwen3moe, big-qwen3moe), by name or by its cached file's name."""
    return _RANDOM_WEIGHT.fullmatch(Path(model).name) is not None


def default_mode(model: str | Path, forced: bool | None) -> str:
    """What a bench or scale run decodes: as asked, else teacher-forced on random weights and free otherwise."""
    if forced is None:
        forced = random_weights(model)
    return FORCED if forced else FREE


def heldout_text() -> str:
    """The held-out prose and the packaged eval prompts' words, one paragraph each."""
    from pyspecter.prompts import load_prompts

    prose = resources.files("pyspecter.data").joinpath("heldout.txt").read_text(encoding="utf-8")
    paras = [s.strip() for s in prose.split("\n\n") if s.strip()]
    paras += [m["content"] for p in load_prompts(split="eval") for m in p["messages"]]
    return "\n\n".join(paras)


def forced_tokens(model, n_prompts: int, n: int) -> list[list[int]]:
    """For each of ``n_prompts`` prompts, the ``n`` held-out tokens its decode is fed, and the one after them (the
    last step's logits predict it; a session picks it without feeding it). ``model``: a native.Model."""
    text = model.tokenize(heldout_text(), add_special=False)
    if not text:
        raise SpecterError("the held-out text tokenized to nothing")
    return [[text[(i * n + t) % len(text)] for t in range(n + 1)] for i in range(n_prompts)]


def digest(logits: np.ndarray) -> str:
    """A logits row, bit for bit, as a short string (equal rows give equal digests; any changed bit another)."""
    return hashlib.sha1(np.ascontiguousarray(logits, np.float32).tobytes()).hexdigest()[:16]


def same_logits(ref: Sequence[str] | None, got: Sequence[str] | None) -> bool | None:
    """Whether a run's logits digests are the reference's at every step (None: nothing to compare)."""
    if ref is None or got is None:
        return None
    return len(ref) == len(got) and all(a == b for a, b in zip(ref, got, strict=True))


class ForcedSampler(Sampler):
    """A sampler that picks the held-out text's next token whatever the logits say: what a session decodes
    teacher-forced (``Session.sampler``). It keeps a copy of each row it was shown (digested afterwards by
    ``digests``, outside the timed steps: a copy costs microseconds, a hash of the row up to a millisecond)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        super().__init__()
        self.tokens, self.rows = list(tokens), []

    def pick(self, logits: np.ndarray, recent: Sequence[int] = ()) -> int:
        if len(self.rows) >= len(self.tokens):
            raise SpecterError(f"teacher-forced decode asked for more than the {len(self.tokens)} tokens of text")
        self.rows.append(np.array(logits, np.float32))
        return self.tokens[len(self.rows) - 1]

    def digests(self) -> list[str]:
        return [digest(r) for r in self.rows]
