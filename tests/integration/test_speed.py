"""One definition of tok/s (speed.py): generate's and bench's decode speed are the same counters, and agree on the
same model and settings; prefill is apart; -n 0 decodes nothing, as llama.cpp's -n 0."""

from __future__ import annotations

import contextlib
import io
import json
import statistics
import time

import pytest
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


def _generate_tok_s() -> tuple[float, dict]:
    from pyspecter.cli.run import generate

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        generate(prompt=PROMPT, model="smol-moe", raw=True, n=N, json_out=True)
    st = json.loads(buf.getvalue())["stats"]
    return st["tok_s"], st


def test_generate_and_bench_agree_on_decode_speed() -> None:
    """generate's tok/s and bench's decode tok/s on the same model and settings (no flags: what each places,
    here stock llama.cpp) within 10%, in one process, interleaved. The machine is shared and a single run moves
    either way (CI saw one bench run at 87.8 tok/s beside 71.5 and 74.6, and generate's 71.6-74.2: fastest-of-three
    read 0.84), so each side's median of three is compared."""
    from pyspecter.study.bench import run_bench

    path = resolve_model("smol-moe")
    # one of each first, not counted: the first load of a process pays the page cache and the allocator (measured
    # here: generate's first run 50.8 tok/s, its next two 69.0 and 76.3, bench's 70.9-77.5)
    _generate_tok_s()
    run_bench(path, policies=["default"], n=N, repeat=1, n_threads=DEFAULT_THREADS)
    gen, bench = [], []
    for _ in range(3):
        tok_s, st = _generate_tok_s()
        assert st["decode_tokens"] >= N // 2, st  # a raw continuation: no early end of text
        gen.append(tok_s)
        r = run_bench(path, policies=["default"], n=N, repeat=1, n_threads=DEFAULT_THREADS)
        bench.append(r["policies"]["default"]["decode_tok_s"])
    spread = max(max(xs) / min(xs) for xs in (gen, bench))
    if spread > 1.25:  # the same run three times moved by more than the tolerance: the machine is too busy
        pytest.skip(f"speeds moved {spread:.2f}x between repeats (generate {gen}, bench {bench}): too noisy to "
                    "compare within 10%; test_session_decode_time_is_the_time_between_tokens holds the definition")
    ratio = statistics.median(gen) / statistics.median(bench)
    assert 0.9 <= ratio <= 1.1, (gen, bench)


def test_n_0_generates_nothing() -> None:
    """llama.cpp's -n 0 (llama-completion's loop runs while n_remain != 0) decodes nothing: neither do we."""
    r = run_cli("generate", "smol-moe", "-p", "hi", "-n", "0", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens"] == [] and out["text"] == "" and out["stats"]["tokens"] == 0
