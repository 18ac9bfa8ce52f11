"""A scaled-down bigger-than-RAM model (models/big.py's streaming writer, random Q8_0/Q4_0 blocks) loads in the
real llama.cpp, decodes with routing that is not degenerate, and gives stock's tokens through the slots."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pyspecter import native
from pyspecter.engine import greedy
from pyspecter.models.big import BIG_MODELS, build_big
from pyspecter.study.verify import verify

pytest.importorskip("llama_cpp")

PROMPT = "the quick brown fox jumps over the lazy dog while the cat sleeps"


@pytest.fixture(scope="module", params=["big-qwen3moe", "big-qwen3moe-q4"])
def small_big(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = replace(BIG_MODELS[request.param], name=f"{request.param}-small", n_layer=3, n_embd=256, n_head=4,
                   n_head_kv=2, head_dim=64, n_expert=16, n_expert_used=4, n_ff_exp=128, n_vocab=320)
    return build_big(spec, tmp_path_factory.mktemp("big"), progress=False)


def test_decodes_with_sane_logits(small_big: Path) -> None:
    with native.Model(small_big) as m, native.Context(m, n_threads=1) as ctx:
        toks, logits = greedy(ctx, m.tokenize(PROMPT), 8)
    assert np.all(np.isfinite(logits))
    # random weights at unit scale: logits spread (not all equal, not blown up), so greedy picks are not ties
    assert 1 < float(logits.std(axis=1).min()) and float(np.abs(logits).max()) < 100
    assert len(toks) == 8


def test_slots_give_stock_tokens(small_big: Path) -> None:
    r = verify(small_big, slots=8, miss="cpu", tier="ram", n_tokens=8, n_threads=1)
    assert r["identical_tokens"] and r["max_abs_logit_diff"] <= 1e-4
    assert 0 < r["hit_rate"] < 1  # half the experts in slots: routing spreads over more than the resident half
