"""One definition of tok/s (speed.py): generate's and bench's decode speed are the same counters; prefill is apart;
-n 0 decodes nothing, as llama.cpp's -n 0.

Whether the two agree in speed is a timing, so it is not asserted here (docs/BENCHMARKS.md: on this 2-core VM a
run decodes smol-moe at about 72 or about 87 tok/s, either way, for generate and bench alike, and a median of three
landed on different sides in two CI runs)."""

from __future__ import annotations

import json
import time

from conftest import run_cli

from pyspecter.cli.options import DEFAULT_THREADS
from pyspecter.models.catalog import resolve_model
from pyspecter.session import Session, SessionConfig
from pyspecter.study.bench_runs import step_token_times

PROMPT = "The history of the lighthouse begins on a small island where"
N = 32


def test_session_decode_time_is_the_time_between_tokens() -> None:
    """What bench times (each token's arrival, the first one prefill's) and what generate reports (the session's
    counters) are one measure: tokens after the first over the time from the first to the last."""
    with Session(SessionConfig(model=resolve_model("smol-moe"), n_threads=DEFAULT_THREADS)) as s:
        stamps: list[float] = []
        prompt = s.tokenize(PROMPT)
        out = s.generate(prompt, N, stop_at_eog=False, on_token=lambda _t: stamps.append(time.perf_counter()))
        st = s.stats()
    assert len(out) == N and st["tokens"] == N and st["decode_tokens"] == N - 1
    bench_s = sum(step_token_times(stamps, list(range(1, N + 1))))
    # the session leaves out the caller's time with each token (here: one append), nothing else
    assert 0.9 * bench_s <= st["decode_s"] <= bench_s
    assert st["prompt_tokens"] == len(prompt) and st["prefill_s"] > 0
    assert abs(st["first_token_s"] - st["prefill_s"]) < 0.05  # the prefill of the one answer
    assert st["tok_s"] == st["decode_tokens"] / st["decode_s"]


def test_n_0_generates_nothing() -> None:
    """llama.cpp's -n 0 (llama-completion's loop runs while n_remain != 0) decodes nothing: neither do we."""
    r = run_cli("generate", "smol-moe", "-p", "hi", "-n", "0", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens"] == [] and out["text"] == "" and out["stats"]["tokens"] == 0
