"""Choosing tokens from logits: greedy, sampling with llama.cpp's usual filters, and the acceptance rule of
speculative sampling.

Every decode loop samples through here, so plain decoding, speculative decoding, chat and the server share one
definition of "the target's distribution": repetition penalty over the recent tokens, then temperature, then
top-k, top-p and min-p (llama.cpp's order). Speculative sampling accepts a draft token with probability
min(1, p/q) on these *processed* distributions, so what it emits is distributed exactly as plain sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = (logits - logits.max()) / temperature
    p = np.exp(z)
    return p / p.sum()


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults where a field is left alone (``temperature`` 0 means greedy)."""

    temperature: float = 0.0
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1: off
    min_p: float = 0.05  # 0: off
    repeat_penalty: float = 1.0  # 1: off
    repeat_last_n: int = 64

    def check(self) -> SamplingParams:
        from pyspecter.errors import SpecterError

        if self.temperature < 0 or not np.isfinite(self.temperature):
            raise SpecterError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecterError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SpecterError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise SpecterError(f"min-p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise SpecterError(f"repeat penalty must be > 0, got {self.repeat_penalty}")
        return self


class Sampler:
    """Greedy when the temperature is 0, else sampling from the processed distribution with a seeded RNG.
    ``recent``: the tokens before the position being sampled (the repetition penalty reads its last N)."""

    def __init__(self, temperature: float | SamplingParams = 0.0, seed: int = 0) -> None:
        self.params = temperature if isinstance(temperature, SamplingParams) else SamplingParams(temperature)
        self.params.check()
        self.rng = np.random.default_rng(seed)

    @property
    def temperature(self) -> float:
        return self.params.temperature

    @property
    def greedy(self) -> bool:
        return self.params.temperature <= 0

    def _penalized(self, logits: np.ndarray, recent: Sequence[int]) -> np.ndarray:
        p = self.params
        if p.repeat_penalty == 1.0 or not recent or p.repeat_last_n == 0:
            return logits
        out = logits.astype(np.float32, copy=True)
        ids = np.unique(np.asarray(recent[-p.repeat_last_n:], dtype=np.int64))
        v = out[ids]
        out[ids] = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)  # llama.cpp's rule
        return out

    def probs(self, logits: np.ndarray, recent: Sequence[int] = ()) -> np.ndarray | None:
        """The distribution a token is drawn from (None when greedy: no distribution is needed)."""
        if self.greedy:
            return None
        p = self.params
        prob = softmax(self._penalized(logits, recent), p.temperature)
        if p.top_k > 0 and p.top_k < len(prob) or p.top_p < 1 or p.min_p > 0:
            order = np.argsort(-prob, kind="stable")
            keep = len(prob) if p.top_k <= 0 else min(p.top_k, len(prob))
            if p.top_p < 1:  # the smallest prefix whose mass reaches top_p
                keep = min(keep, int(np.searchsorted(np.cumsum(prob[order]), p.top_p)) + 1)
            if p.min_p > 0:
                keep = min(keep, max(1, int(np.count_nonzero(prob[order] >= p.min_p * prob[order[0]]))))
            mask = np.zeros(len(prob), bool)
            mask[order[:keep]] = True
            prob = np.where(mask, prob, 0.0)
            prob /= prob.sum()
        return prob

    def pick(self, logits: np.ndarray, recent: Sequence[int] = ()) -> int:
        if self.greedy:
            return int(np.argmax(self._penalized(logits, recent)))
        p = self.probs(logits, recent)
        return int(self.rng.choice(len(p), p=p))

    def accept(self, logits: np.ndarray, draft: int | None, q: np.ndarray | None,
               recent: Sequence[int] = ()) -> int | None:
        """One position of verification. None if the draft token is accepted, else the token to emit there: the
        target's choice when greedy; when sampling, standard speculative sampling (Leviathan et al., Chen et al.):
        accept with probability min(1, p/q), else sample from normalise(max(0, p - q)); with no draft left,
        sample the bonus token from p. The emitted tokens are distributed exactly as the target's own."""
        if self.greedy:
            tok = self.pick(logits, recent)
            return None if tok == draft else tok
        p = self.probs(logits, recent)
        if draft is None:
            return int(self.rng.choice(len(p), p=p))
        if self.rng.random() < min(1.0, p[draft] / max(q[draft], 1e-20)):
            return None
        resid = np.maximum(p - q, 0.0)
        total = resid.sum()
        return int(self.rng.choice(len(p), p=resid / total)) if total > 0 else int(np.argmax(p))

    def verify(self, rows: np.ndarray, drafts: list[int], qs: list[np.ndarray],
               recent: Sequence[int] = ()) -> tuple[int, int]:
        """K drafts against K+1 rows of target logits: (number accepted, the token emitted after them)."""
        recent = list(recent)
        for i, d in enumerate(drafts):
            tok = self.accept(rows[i], d, qs[i] if qs else None, recent + drafts[:i])
            if tok is not None:
                return i, tok
        return len(drafts), self.accept(rows[len(drafts)], None, None, recent + drafts)
