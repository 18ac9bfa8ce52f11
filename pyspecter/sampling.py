"""Choosing tokens from logits: greedy, temperature sampling, and the acceptance rule of speculative sampling.

Every decode loop samples through here, so greedy and sampled output are the same code in plain decoding,
speculative decoding and chat.
"""

from __future__ import annotations

import numpy as np


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = (logits - logits.max()) / temperature
    p = np.exp(z)
    return p / p.sum()


class Sampler:
    """Greedy when ``temperature`` <= 0, else sampling from softmax(logits / temperature) with a seeded RNG."""

    def __init__(self, temperature: float = 0.0, seed: int = 0) -> None:
        self.temperature = temperature
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: np.ndarray) -> np.ndarray | None:
        """The distribution a token is drawn from (None when greedy: no distribution is needed)."""
        return None if self.greedy else softmax(logits, self.temperature)

    def pick(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        p = softmax(logits, self.temperature)
        return int(self.rng.choice(len(p), p=p))

    def accept(self, logits: np.ndarray, draft: int | None, q: np.ndarray | None) -> int | None:
        """One position of verification. None if the draft token is accepted, else the token to emit there: the
        target's argmax when greedy; with a temperature, standard speculative sampling (Leviathan et al., Chen et
        al.): accept with probability min(1, p/q), else sample from normalise(max(0, p - q)); with no draft left,
        sample the bonus token from p. The emitted tokens are distributed exactly as the target's own."""
        if self.greedy:
            tok = int(np.argmax(logits))
            return None if tok == draft else tok
        p = softmax(logits, self.temperature)
        if draft is None:
            return int(self.rng.choice(len(p), p=p))
        if self.rng.random() < min(1.0, p[draft] / max(q[draft], 1e-20)):
            return None
        resid = np.maximum(p - q, 0.0)
        total = resid.sum()
        return int(self.rng.choice(len(p), p=resid / total)) if total > 0 else int(np.argmax(p))

    def verify(self, rows: np.ndarray, drafts: list[int], qs: list[np.ndarray]) -> tuple[int, int]:
        """K drafts against K+1 rows of target logits: (number accepted, the token emitted after them)."""
        for i, d in enumerate(drafts):
            tok = self.accept(rows[i], d, qs[i] if qs else None)
            if tok is not None:
                return i, tok
        return len(drafts), self.accept(rows[len(drafts)], None, None)
