"""What to upload ahead of need, and by when.

As the draft routes each layer, its confident experts for that layer are protected (never evicted while the
window is in flight) and uploaded asynchronously, in layer order, which is the order the verification pass will
need them. A layer is cut off when the link cannot deliver before the verification pass reaches it.
"""

from __future__ import annotations

import math

from pyspecter.cache import ExpertCache


class Prefetcher:
    def __init__(self, cache: ExpertCache, min_confidence: float = 0.0, link_gbps: float | None = None,
                 cutoff: bool = True) -> None:
        self.cache = cache
        self.min_confidence = min_confidence
        self.link_gbps = link_gbps  # None: the link speed measured online on the cache's own uploads
        self.cutoff = cutoff  # False: upload every prediction, however late (what the cut-off is measured against)
        self.budget_bytes: float = math.inf  # bytes the link can still deliver before the current layer needs them
        self.bytes_per_s = math.inf  # inf: no cut-off this window
        self.t0_s = self.t_token_s = self.issued_bytes = 0.0
        self.issued = 0
        self.skipped_late = 0

    def start_window(self, time_until_verify_s: float | None, t_token_s: float | None = None) -> None:
        """A new window: the verification pass starts in ``time_until_verify_s`` and one target token takes
        ``t_token_s``, so layer L's experts are due at time_until_verify + (L's position / layers) * t_token.
        Each layer gets the bytes the link can deliver by its own deadline, less what earlier layers took."""
        self.cache.unprotect_all()
        # a given link speed, else the one measured online on this session's uploads
        gbps = self.link_gbps or self.cache.link_gbps()
        if self.cutoff and gbps and time_until_verify_s is not None:
            self.bytes_per_s = gbps * 1e9
            self.t0_s = time_until_verify_s
            self.t_token_s = t_token_s or 0.0
        else:
            self.bytes_per_s = math.inf
        self.issued_bytes = 0.0
        self.budget_bytes = math.inf

    def on_draft_layer(self, il: int, experts: dict[int, float]) -> None:
        keep = [e for e, w in sorted(experts.items(), key=lambda kv: -kv[1]) if w >= self.min_confidence]
        if not keep:
            return
        self.cache.protect(il, keep)
        nbytes = self.cache.expert_bytes.get(il, 0)
        if math.isinf(self.bytes_per_s):
            affordable = keep
        else:
            pos = self.cache.layer_pos.get(il, 0) / max(len(self.cache.layer_pos), 1)
            self.budget_bytes = self.bytes_per_s * (self.t0_s + pos * self.t_token_s) - self.issued_bytes
            affordable = keep if nbytes == 0 else keep[: max(0, int(self.budget_bytes // nbytes))]
        self.skipped_late += len(keep) - len(affordable)
        n = self.cache.prefetch(il, affordable)
        self.issued_bytes += n * nbytes
        self.issued += n
