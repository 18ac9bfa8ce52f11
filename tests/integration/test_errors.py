"""Bad input ends with one line on stderr and exit code 2, never a traceback; chat outlives its context."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from pyspecter.models.tiny import build_tiny


def _one_line_error(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and needle in r.stderr, r.stderr


def test_missing_draft_file(tmp_path: Path) -> None:
    _one_line_error(run_cli("generate", "tiny-mixtral", "-p", "x", "--draft", str(tmp_path / "nope.gguf")),
                    "no such file")


def test_draft_of_another_model_is_refused() -> None:
    # tiny-qwen2moe as a "draft" of tiny-qwen3moe: another arch and expert count; refused before anything runs
    _one_line_error(run_cli("generate", "tiny-qwen3moe", "-p", "x", "--draft", str(build_tiny("tiny-qwen2moe"))),
                    "draft")


def test_unreadable_model_file(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    p = tmp_path / "m.gguf"
    p.write_bytes(build_tiny("tiny-mixtral").read_bytes())
    p.chmod(0)
    _one_line_error(run_cli("inspect", str(p)), "cannot read")


@pytest.mark.parametrize("flag", ["--prompt-tokens", "-n", "--repeat"])
def test_bench_counts_must_be_positive(flag: str) -> None:
    _one_line_error(run_cli("bench", "tiny-mixtral", flag, "0"), "at least 1")


def test_empty_prompt_without_bos() -> None:
    # the random fixtures' test tokenizer adds no BOS: an empty prompt leaves nothing to continue from
    _one_line_error(run_cli("generate", "tiny-mixtral", "-p", ""), "empty prompt")


def test_corrupt_trace(tmp_path: Path) -> None:
    p = tmp_path / "t.npz"
    p.write_bytes(b"PK\x03\x04 definitely not a zip")
    _one_line_error(run_cli("analyze", str(p)), "not a routing trace")
    np.savez(p, meta=np.array("{not json"), target_ids=np.zeros((1, 1, 1), np.int16))
    _one_line_error(run_cli("analyze", str(p)), "not a routing trace")


def test_chat_outlives_its_context() -> None:
    """200 turns through a pipe at a 128-token context: the oldest turns are dropped with a notice, a message too
    long for the context is one error line, and the chat goes on to the end."""
    lines = [f"turn {i} says hello again and again" for i in range(200)]
    lines[50] = "word " * 400  # alone longer than the context
    r = subprocess.run([sys.executable, "-m", "pyspecter", "chat", "tiny-qwen3moe", "-n", "8", "-c", "128"],
                       input="\n".join(lines) + "\n/quit\n", capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "context full" in r.stderr and "message too long" in r.stderr
    assert r.stdout.count("\n") >= 199  # every turn but the one too long ended its answer with a newline
