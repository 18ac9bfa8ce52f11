"""The disk tier gives a prompt's host-path expert pages back (big-qwen3moe at 10%: peak RSS 9.2 GB -> 5.0 GB): the
routing op unmaps the earlier layers' expert pages at each layer's call of a multi-token ubatch, and all of them
(and drops them from the page cache) once decoding starts. Output stays stock's."""

from __future__ import annotations

import os

from pyspecter import native
from pyspecter.cache import ExpertCache
from pyspecter.engine import greedy
from pyspecter.layout import read_layout
from pyspecter.models.tiny import build_tiny
from pyspecter.tiers import DiskTier


def _mapped_rss(path: str) -> int:
    """Bytes of the file's mappings resident in this process (/proc/self/smaps)."""
    real, total, ours = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:  # a mapping's header line
                ours = len(parts) >= 6 and parts[-1].startswith("/") and os.path.realpath(parts[-1]) == real
            elif ours and parts[0] == "Rss:":
                total += int(parts[1]) * 1024
    return total


def test_prompt_pages_go_back_and_tokens_stay_stock() -> None:
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    prompt = "a prompt long enough to route to most experts of every layer"
    with native.Model(path) as m, native.Context(m) as ctx:
        toks = m.tokenize(prompt)
        ref = greedy(ctx, toks, 6)[0]
        stock_rss = _mapped_rss(path)
    experts = sum(L.expert_bytes * lay.n_expert for L in lay.layers)
    layer_experts = max(L.expert_bytes * lay.n_expert for L in lay.layers)
    # stock keeps the experts its prompt touched mapped: what the release is measured against
    assert stock_rss > os.path.getsize(path) - layer_experts
    with native.Model(path, lazy_experts=True) as m:
        cache = ExpertCache(m, lay, lay.n_expert_used, miss="wait", tier=DiskTier())
        assert cache.native
        try:
            with native.Context(m) as ctx:
                got = greedy(ctx, toks, 6)[0]
                cache.check()
                rss = _mapped_rss(path)
        finally:
            cache.close()
    assert got == ref
    # the prompt's host path faulted most experts in (more distinct experts than top-k slots); what stays mapped
    # is the file's other tensors and at most about one layer's experts
    assert rss <= os.path.getsize(path) - experts + layer_experts, (rss, experts)
