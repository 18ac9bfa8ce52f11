"""`generate` and `chat` as a user drives them: through the CLI, a pipe, exit codes."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest
from conftest import run_cli

from pyspecter import native
from pyspecter.models.tiny import build_tiny


@pytest.fixture(scope="module")
def mixtral_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import llama_cpp

    native.quiet_logs()
    p = tmp_path_factory.mktemp("draft") / "tiny-mixtral-q4_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    assert llama_cpp.llama_model_quantize(str(build_tiny("tiny-mixtral")).encode(), str(p).encode(),
                                          ctypes.byref(params)) == 0
    return p


def test_generate_with_draft_equals_plain(mixtral_draft: Path) -> None:
    plain = run_cli("generate", "tiny-mixtral", "-p", "speculate on this", "-n", "20", "--json")
    spec = run_cli("generate", "tiny-mixtral", "-p", "speculate on this", "-n", "20", "--json",
                   "--draft", str(mixtral_draft), "--budget", "100%", "--fixed-k", "-k", "3")
    assert plain.returncode == 0 and spec.returncode == 0, (plain.stderr, spec.stderr)
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert a["tokens"] == b["tokens"]
    for key in ("tok_s", "hit_rate", "uploads", "acceptance", "mean_k", "stall_ms"):
        assert key in b["stats"]
    assert 2 < b["stats"]["mean_k"] <= 3  # fixed K, shortened only at the end of the answer
    for st in (a["stats"], b["stats"]):  # prefill and the first sample, timed from the request; decode apart
        assert 0 < st["first_token_s"] and st["prompt_tokens"] > 0 and st["prefill_tok_s"] > 0
        assert st["decode_tokens"] == st["tokens"] - 1 and st["tok_s"] == st["decode_tokens"] / st["decode_s"]


def test_generate_budget_that_cannot_hold_the_draft(mixtral_draft: Path) -> None:
    r = run_cli("generate", "tiny-mixtral", "-p", "x", "--draft", str(mixtral_draft), "--budget", "10KiB")
    assert r.returncode == 2 and "too small" in r.stderr and "+ the draft" in r.stderr and "Traceback" not in r.stderr


def test_chat_through_a_pipe() -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pyspecter", "chat", "tiny-qwen3moe", "-n", "6", "--budget", "50%"],
                       input="hello\n/stats\n/reset\nagain\n/quit\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any("tok/s" in line and "hit" in line for line in lines)
    assert "(conversation cleared)" in r.stdout
    assert len([line for line in lines if line and not line.startswith(("[", "("))]) == 2  # two answers


def test_ctrl_c_stops_the_answer_not_the_repl() -> None:
    # The routing hook runs inside llama_decode on the main thread, where a KeyboardInterrupt would be swallowed
    # by ctypes; chat turns Ctrl-C into a flag checked between tokens instead.
    import os
    import signal

    from pyspecter.chat import Stopped as _Stopped
    from pyspecter.chat import interruptible as _interruptible
    from pyspecter.chat import stop_check as _stop_check

    seen: list[int] = []
    # what the REPL had before (a process started in the background inherits SIGINT ignored, not Python's default)
    before = signal.getsignal(signal.SIGINT)

    def fake_generate() -> None:
        cb = _stop_check(seen.append)
        cb(1)
        os.kill(os.getpid(), signal.SIGINT)
        cb(2)
        cb(3)

    with pytest.raises(_Stopped):
        _interruptible(fake_generate)
    assert seen == [1]  # the token decided after Ctrl-C is not shown
    assert signal.getsignal(signal.SIGINT) is before  # the REPL's own handler is back


def test_profile_warm_start(tmp_path: Path) -> None:
    # a routing profile from a trace fills every layer's slots before the first token, hottest experts first,
    # and changes nothing about the output
    import numpy as np

    from pyspecter.layout import read_layout
    from pyspecter.predict import routing_profile
    from pyspecter.study.trace import record_trace
    from pyspecter.tracefile import load_trace

    path = build_tiny("tiny-qwen3moe")
    tr_path = tmp_path / "t.npz"
    record_trace(path, tr_path, prompts=["warm me up", "and again"], n=6, progress=False, n_threads=1,
                 gate_lookahead=0)
    lay = read_layout(path)
    prof = routing_profile(tr_path, lay)
    ids = load_trace(tr_path)["target_ids"]
    counts = np.bincount(ids[:, 0, :].ravel(), minlength=lay.n_expert)
    assert counts[prof[lay.layers[0].index][0]] == counts.max()
    plain = run_cli("generate", "tiny-qwen3moe", "-p", "warm start", "-n", "8", "--budget", "25%", "--json",
                    "--miss", "cpu")  # the RAM tier's copying mode: its default (host) fills no slot
    warm = run_cli("generate", "tiny-qwen3moe", "-p", "warm start", "-n", "8", "--budget", "25%", "--json",
                   "--profile", str(tr_path), "--miss", "cpu")
    assert plain.returncode == 0 and warm.returncode == 0, warm.stderr
    a, b = json.loads(plain.stdout), json.loads(warm.stdout)
    assert a["tokens"] == b["tokens"]
    assert b["stats"]["uploads"] >= len(lay.layers) * b["stats"]["slots_per_layer"]
    bad = run_cli("generate", "tiny-mixtral", "-p", "x", "--profile", str(tr_path))
    assert bad.returncode == 2 and "profile is for a model" in bad.stderr
