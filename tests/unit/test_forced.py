"""Teacher-forced decoding's pieces that need no llama.cpp: which models default to it, the logits identity check
(it must fail on a perturbed row), and the sampler that feeds the text."""

from __future__ import annotations

import numpy as np
import pytest

from pyspecter.errors import SpecterError
from pyspecter.study import forced as fd


def test_the_random_weight_built_ins_default_to_teacher_forced() -> None:
    for name in ("tiny-qwen3moe", "tiny-gptoss", "bench-qwen3moe", "big-qwen3moe", "big-qwen3moe-q4",
                 "/root/.cache/pyspecter/models/tiny-mixtral-757ee9d62d113a6b.gguf",
                 "bench-qwen3moe-143864b63936c703.gguf"):
        assert fd.random_weights(name), name
        assert fd.default_mode(name, None) == fd.FORCED
        assert fd.default_mode(name, False) == fd.FREE
    for name in ("smol-moe", "smol-moe-16x2-97db0ed9df29d80b.gguf", "my-tiny-qwen3moe.gguf", "Qwen3-30B-A3B.gguf"):
        assert not fd.random_weights(name), name
        assert fd.default_mode(name, None) == fd.FREE
        assert fd.default_mode(name, True) == fd.FORCED


def test_the_logits_identity_check_fails_on_a_perturbed_row() -> None:
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(6, 2048)).astype(np.float32)
    ref = [fd.digest(r) for r in rows]
    assert fd.same_logits(ref, [fd.digest(r.copy()) for r in rows]) is True
    bent = rows.copy()
    bent[3, 1000] = np.nextafter(bent[3, 1000], np.float32(np.inf))  # one ulp of one logit of one step
    assert fd.same_logits(ref, [fd.digest(r) for r in bent]) is False
    assert fd.same_logits(ref, ref[:5]) is False  # a run that stopped early
    assert fd.same_logits(None, ref) is None


def test_the_forced_sampler_picks_the_text_and_keeps_each_row() -> None:
    s = fd.ForcedSampler([7, 3, 9])
    rows = [np.full(16, i, np.float32) for i in range(3)]
    assert [s.pick(r) for r in rows] == [7, 3, 9]  # whatever the logits say
    rows[0][:] = -1  # the sampler kept its own copy
    assert s.digests() == [fd.digest(np.full(16, i, np.float32)) for i in range(3)]
    with pytest.raises(SpecterError, match="more than the 3 tokens"):
        s.pick(rows[0])


def test_the_held_out_text_is_the_packaged_prose_and_eval_prompts() -> None:
    from pyspecter.prompts import load_prompts

    text = fd.heldout_text()
    assert len(text) > 2000
    for p in load_prompts(split="eval"):
        assert p["messages"][-1]["content"] in text
    for p in load_prompts(split="tune"):  # static-hot's profile reads the tune split: never the forced text
        assert p["messages"][-1]["content"] not in text


def test_step_token_times_give_a_burst_its_step_time_per_token() -> None:
    from pyspecter.study.bench_runs import step_token_times

    # prefill's token at 0; step 1 emits one token at 10; step 2 a burst of three at 40, 40.001, 40.002; step 3 at 45
    stamps = [0.0, 10.0, 40.0, 40.001, 40.002, 45.0]
    steps = [0, 1, 2, 2, 2, 3]
    t = step_token_times(stamps, steps)
    assert len(t) == 5
    assert t[0] == 10.0 and t[4] == 45.0 - 40.002
    assert all(abs(x - (40.002 - 10.0) / 3) < 1e-12 for x in t[1:4])
    assert abs(sum(t) - 45.0) < 1e-9  # the decode's wall time, whatever the bursts
    # one token a step: the gaps themselves, as every other policy's row counts them
    assert step_token_times([0.0, 1.0, 3.0], [0, 1, 2]) == [1.0, 2.0]
    assert step_token_times([0.0], [0]) == []
