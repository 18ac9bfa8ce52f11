"""A ready-to-use runtime: target model with expert slots, optional draft with prefetch, the decode loop.

`generate`, `chat` and the `specter` benchmark policy all build one of these, so they run the same code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pyspecter import native
from pyspecter.cache import ExpertCache, make_tier
from pyspecter.engine import SpeculativeDecoder
from pyspecter.errors import SpecterError
from pyspecter.layout import parse_budget, read_layout, slots_for_budget
from pyspecter.plan import Prefetcher
from pyspecter.predict import DraftRouting


@dataclass
class SessionConfig:
    model: Path
    draft: Path | None = None
    budget: str | None = None  # fast-tier bytes for target expert slots; None: all experts resident
    tier: str = "ram"
    miss: str | None = None  # None: "wait" on the disk tier (the host copy is on disk too), else "cpu"
    policy: str = "lru"
    k: int = 4
    adaptive: bool = True
    temperature: float = 0.0
    seed: int = 0
    n_ctx: int = 2048
    n_threads: int = 2
    min_confidence: float = 0.0
    draft_counts_in_budget: bool = True  # equal total fast memory: the draft's bytes come out of the slot budget
    profile: Path | None = None  # a trace (pyspecter trace): warm the slots with its hottest experts
    prefetch_cutoff: bool = True  # skip uploads the link cannot deliver before the verification pass needs them
    surrogate_width: float = 0.25  # miss="surrogate" only: fraction of each expert's neurons its surrogate keeps


class Session:
    def __init__(self, cfg: SessionConfig) -> None:
        self.cfg = cfg
        self.layout = read_layout(cfg.model).require_moe()
        self.tier = make_tier(cfg.tier)
        budget_bytes = parse_budget(cfg.budget, self.layout.expert_total_bytes) if cfg.budget else None
        self.draft_bytes = Path(cfg.draft).stat().st_size if cfg.draft else 0
        full_budget = budget_bytes
        if budget_bytes is not None and cfg.draft and cfg.draft_counts_in_budget:
            budget_bytes -= self.draft_bytes
            if budget_bytes <= 0:
                raise SpecterError(f"the draft ({self.draft_bytes / 2**20:.0f} MiB) does not fit in budget "
                                   f"{cfg.budget}")
        self.miss = cfg.miss or ("wait" if self.tier.name == "disk" else "cpu")
        self.surrogates = None
        if self.miss == "surrogate":
            from pyspecter.surrogate import Surrogates, select_neurons

            self.surrogates = Surrogates(self.layout, select_neurons(cfg.model, cfg.surrogate_width))
            if budget_bytes is not None:  # they live in fast memory too
                budget_bytes -= self.surrogates.nbytes
                if budget_bytes <= 0:
                    raise SpecterError(f"the surrogates ({self.surrogates.nbytes / 2**20:.1f} MiB) do not fit in "
                                       f"budget {cfg.budget}")
        self.n_slots = (slots_for_budget(self.layout, budget_bytes) if budget_bytes is not None
                        else self.layout.n_expert)
        if self.n_slots < self.layout.n_expert_used:
            raise SpecterError(f"budget {cfg.budget} buys {self.n_slots} expert slots per layer, below "
                               f"top-{self.layout.n_expert_used}" + (" once the draft is counted" if cfg.draft else ""))
        # Slots the draft's memory would buy back: allocated now, used once the engine drops a draft that does
        # not pay (CPU slots never written take no memory, patch 0006)
        self.held = 0
        if full_budget is not None and cfg.draft and cfg.draft_counts_in_budget and self.surrogates is None:
            self.held = max(0, min(slots_for_budget(self.layout, full_budget), self.layout.n_expert) - self.n_slots)
        self.target = native.Model(cfg.model)
        # wait mode computes a layer's resident experts while its misses land (measured: 1.21-1.22x at 30% on
        # the disk tier, level at 50%; exact either way)
        self.cache = ExpertCache(self.target, self.layout, self.n_slots + self.held, policy=cfg.policy,
                                 miss=self.miss, tier=self.tier, surrogates=self.surrogates,
                                 ordered=self.miss == "wait", held=self.held)
        if cfg.profile is not None:
            from pyspecter.predict import routing_profile

            self.cache.warm(routing_profile(cfg.profile, self.layout))
        self.tctx = native.Context(self.target, n_ctx=cfg.n_ctx, n_threads=cfg.n_threads)
        self.decoder: SpeculativeDecoder | None = None
        self.draft = None
        if cfg.draft:
            dlay = read_layout(cfg.draft)
            self.draft = native.Model(cfg.draft)
            if self.draft.n_vocab != self.target.n_vocab:
                raise SpecterError(f"{cfg.draft}: draft vocabulary ({self.draft.n_vocab}) differs from the target's")
            routing = DraftRouting(self.draft, dlay) if dlay.is_moe else None
            self.dctx = native.Context(self.draft, n_ctx=cfg.n_ctx, n_threads=cfg.n_threads)
            pf = Prefetcher(self.cache, cfg.min_confidence, cutoff=cfg.prefetch_cutoff) if routing else None
            self.decoder = SpeculativeDecoder(self.tctx, self.dctx, k=cfg.k, adaptive=cfg.adaptive,
                                              routing=routing, prefetcher=pf, temperature=cfg.temperature,
                                              seed=cfg.seed, predict_at_k0=self.n_slots < self.layout.n_expert,
                                              drop_draft=self._drop_draft if self.held else None)
        self.tctx.warmup()
        if self.draft:
            self.dctx.warmup()
        self.tokens_out = 0
        self.decode_s = 0.0

    def _drop_draft(self) -> None:
        """The engine measured that the draft does not pay: free it, and give its memory to the slots."""
        self.dctx.close()
        self.draft.close()
        self.dctx = self.draft = None
        self.cache.release_held()
        self.n_slots += self.held
        self.held = self.draft_bytes = 0

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.target.tokenize(text, add_special=add_special)

    def generate(self, prompt: list[int], n: int, on_token: Callable[[int], None] | None = None,
                 stop_at_eog: bool = True) -> list[int]:
        """Decode up to n tokens after prompt, from a fresh context."""
        t0 = time.perf_counter()
        n_out = [0]

        def counted(tok: int) -> None:
            n_out[0] += 1
            if on_token:
                on_token(tok)

        try:
            if self.decoder is not None:
                out = self.decoder.generate(prompt, n, stop_at_eog=stop_at_eog, on_token=counted)
            else:
                out = self._plain(prompt, n, counted, stop_at_eog)
            self.cache.check()
        finally:  # an answer stopped early (Ctrl-C) still counts in /stats
            self.decode_s += time.perf_counter() - t0
            self.tokens_out += n_out[0]
        return out

    def _plain(self, prompt, n, on_token, stop_at_eog) -> list[int]:
        import numpy as np

        self.tctx.clear()
        logits = self.tctx.decode(prompt)
        out: list[int] = []
        while len(out) < n:
            if self.cfg.temperature > 0:
                from pyspecter.engine import _softmax

                rng = getattr(self, "_rng", None) or np.random.default_rng(self.cfg.seed)
                self._rng = rng
                tok = int(rng.choice(len(logits), p=_softmax(logits, self.cfg.temperature)))
            else:
                tok = int(np.argmax(logits))
            out.append(tok)
            if on_token:
                on_token(tok)
            if (stop_at_eog and self.target.is_eog(tok)) or len(out) >= n:
                break
            logits = self.tctx.decode([tok])
            self.cache.check()
        return out

    def stats(self) -> dict:
        c = self.cache.counters()
        out = {"tokens": self.tokens_out, "tok_s": self.tokens_out / self.decode_s if self.decode_s else 0.0,
               "slots_per_layer": self.n_slots, "n_expert": self.layout.n_expert, "tier": self.tier.name,
               "miss": self.miss, "hit_rate": c["hit_rate"], "coverage": c["slot_row_rate"],
               "uploads": c["uploads"], "upload_mib": c["upload_bytes"] / 2**20, "prefetches": c["prefetches"],
               "stall_ms": c["hook_ms"], "draft_mib": self.draft_bytes / 2**20,
               "surrogate_uses": c["surrogate_uses"]}
        if self.decoder is not None:
            s = self.decoder.stats
            out.update(acceptance=s.acceptance, mean_k=s.mean_k, steps=s.steps, draft_off=s.draft_off,
                       draft_dropped_at=s.dropped_at)
        return out

    def reset_stats(self) -> None:
        self.cache.reset_counters()
        self.tokens_out, self.decode_s = 0, 0.0

    def close(self) -> None:
        self.cache.close()
        self.tctx.close()
        self.target.close()
        if self.draft is not None:
            self.dctx.close()
            self.draft.close()


def apply_chat_template(model: native.Model, messages: list[dict[str, str]]) -> str:
    """The model's own chat template through llama.cpp (ChatML for models without one it knows)."""
    from pyspecter.trace import render_prompt

    return render_prompt(model, messages)
