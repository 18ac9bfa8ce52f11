"""The disk tier gives a prompt's host-path expert pages back (big-qwen3moe at 10%: peak RSS 9.2 GB -> 5.0 GB):
unmapped at each layer's routing call of a multi-token ubatch, dropped from the page cache once decoding starts.
Output stays stock's."""

from __future__ import annotations

from pyspecter import native
from pyspecter.cache import ExpertCache
from pyspecter.engine import greedy
from pyspecter.layout import read_layout
from pyspecter.models.tiny import build_tiny
from pyspecter.tiers import DiskTier


class CountingDisk(DiskTier):
    def __init__(self) -> None:
        super().__init__()
        self.in_batch_calls = self.after_batch_calls = 0

    def in_batch(self) -> None:
        self.in_batch_calls += 1
        super().in_batch()

    def after_batch(self) -> None:
        self.after_batch_calls += 1
        super().after_batch()


def test_prompt_pages_go_back_and_tokens_stay_stock() -> None:
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    with native.Model(path) as m, native.Context(m) as ctx:
        toks = m.tokenize("a prompt long enough to route to most experts of every layer")
        ref = greedy(ctx, toks, 6)[0]
    tier = CountingDisk()
    with native.Model(path, lazy_experts=True) as m:
        cache = ExpertCache(m, lay, lay.n_expert_used, miss="wait", tier=tier)
        try:
            with native.Context(m) as ctx:
                got = greedy(ctx, toks, 6)[0]
                cache.check()
        finally:
            cache.close()
    assert got == ref
    # once per MoE layer of the prompt's ubatch but the last, which llama.cpp runs for the output row alone
    assert tier.in_batch_calls == len(lay.layers) - 1
    assert tier.after_batch_calls == 1  # then once, as one-token calls follow
