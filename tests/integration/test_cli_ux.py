"""What a new user meets: a model that fits runs as stock llama.cpp, Python and the CLI place a model alike,
generate answers through the chat template, chat's commands, and bad input refused in one line before anything
else is printed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import run_cli

import pyspecter
from pyspecter.native import slots

QUESTION = "Write a haiku about the sea"


def _no_figures(line: str) -> str:
    """The placement line without the memory figures, which move between two runs."""
    return re.sub(r"[\d.]+ [KMGT]?i?B", "#", line)


def _placement_line(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.startswith("pyspecter: ") and "error" not in x]
    assert len(lines) == 1, stderr
    return lines[0].removeprefix("pyspecter: ")


def test_a_model_that_fits_runs_as_stock() -> None:
    with pyspecter.load("tiny-qwen3moe") as s:
        assert s.placement.stock and s.cache is None
        out = s.generate(s.tokenize("the sea"), 8)
        api = slots()
        # no slots, no routing op in the graph (so no hook), nothing uploaded
        assert api.n_slots(s.target.ptr) == 0 and api.slots_nbytes(s.target.ptr) == 0
        assert api.stats(s.target.ptr).route_calls == 0
        st = s.stats()
        assert st["stock"] and st["uploads"] == 0 and st["tokens"] > 0 and out
    r = run_cli("generate", "tiny-qwen3moe", "-p", "the sea", "-n", "8")
    assert r.returncode == 0, r.stderr
    assert "runs as stock llama.cpp" in r.stderr and "stock llama.cpp: all 32 experts resident" in r.stderr


def test_python_and_chat_choose_the_same_placement() -> None:
    with pyspecter.load("smol-moe") as s:
        from_python = s.placement
    r = subprocess.run([sys.executable, "-m", "pyspecter", "chat", "smol-moe"], input="/quit\n",
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert _no_figures(_placement_line(r.stderr)) == _no_figures(from_python.why)
    # with a budget: the same slot count, said the same way, from the library and from chat's /stats
    with pyspecter.load("smol-moe", budget="50%", tier="disk") as s:
        count = s.stats()["slots_text"]
    r = subprocess.run([sys.executable, "-m", "pyspecter", "chat", "smol-moe", "--budget", "50%", "--tier", "disk"],
                       input="/stats\n/quit\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert f"| {count}, tier disk" in r.stdout, (count, r.stdout)
    inspected = json.loads(run_cli("inspect", "smol-moe", "--budget", "50%", "--tier", "disk", "--json").stdout)
    assert inspected["slots"] == count


# Linux keeps a process's peak RSS across exec, and counts in it the memory of the process it was forked from: a
# child of this pytest process (gigabytes after a long suite) would report at least that. So a small Python
# process starts the command and reports the kernel's figure for it.
_SPAWN = """
import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
_, status, usage = os.wait4(p.pid, 0)
rc = os.waitstatus_to_exitcode(status)
print(usage.ru_maxrss if rc == 0 else -1)
sys.stderr.write(p.stderr.read().decode())
"""


def _peak_rss(argv: list[str]) -> int:
    """Peak resident memory of a child process, in bytes (the kernel's own figure for it)."""
    r = subprocess.run([sys.executable, "-c", _SPAWN, *argv], capture_output=True, text=True, env={**os.environ})
    kib = int(r.stdout.strip() or -1)
    assert kib > 0, r.stderr
    return kib * 1024


# stock llama.cpp on the same prompt and token count, in the same Python as the CLI (its imports included), so the
# difference is what the runtime holds beside llama.cpp
STOCK = """
import sys
import numpy as np
import pyspecter.cli  # noqa: F401 - the CLI's own imports, so both children carry the same Python
from pyspecter.native import Context, Model
from pyspecter.prompts import render_prompt

m = Model(sys.argv[1], extra_bufts=True)
ctx = Context(m, n_ctx=2048, n_threads=int(sys.argv[2]))
ctx.warmup()
logits = ctx.decode(m.tokenize(render_prompt(m, [{"role": "user", "content": sys.argv[3]}]), add_special=False))
for _ in range(int(sys.argv[4])):
    logits = ctx.decode([int(np.argmax(logits))])
"""


def test_no_flags_peak_rss_is_stocks() -> None:
    from pyspecter.models.catalog import resolve_model

    path, threads, n = str(resolve_model("smol-moe")), "2", "16"
    stock = _peak_rss([sys.executable, "-c", STOCK, path, threads, QUESTION, n])
    ours = _peak_rss([sys.executable, "-m", "pyspecter", "generate", "smol-moe", "-p", QUESTION, "-n", n,
                      "-t", threads])
    print(f"peak RSS: stock {stock / 2**20:.1f} MiB, generate with no flags {ours / 2**20:.1f} MiB")
    assert abs(ours - stock) <= 0.05 * stock, (ours / 2**20, stock / 2**20)
    # slots on the RAM tier's CPU: misses computed from the home copy in place (miss mode host), so even a 100%
    # budget's slots are never written and hold no memory
    host = _peak_rss([sys.executable, "-m", "pyspecter", "generate", "smol-moe", "-p", QUESTION, "-n", n,
                      "-t", threads, "--budget", "100%"])
    print(f"peak RSS: --budget 100%, misses in place {host / 2**20:.1f} MiB")
    assert abs(host - stock) <= 0.05 * stock, (host / 2**20, stock / 2**20)
    # misses copied into slots (--miss cpu) with every expert resident hold a second copy: the check can fail
    slotted = _peak_rss([sys.executable, "-m", "pyspecter", "generate", "smol-moe", "-p", QUESTION, "-n", n,
                         "-t", threads, "--budget", "100%", "--miss", "cpu"])
    print(f"peak RSS: --budget 100% --miss cpu (every expert in slots) {slotted / 2**20:.1f} MiB")
    assert slotted > 1.05 * stock, (slotted / 2**20, stock / 2**20)


def test_generate_answers_through_the_chat_template() -> None:
    r = run_cli("generate", "smol-moe", "-p", QUESTION, "-n", "24", "--json")
    raw = run_cli("generate", "smol-moe", "-p", QUESTION, "-n", "24", "--json", "--raw")
    assert r.returncode == 0 and raw.returncode == 0, r.stderr + raw.stderr
    with pyspecter.load("smol-moe") as s:
        answered = [x.token for x in pyspecter.stream_generate(s, QUESTION, max_tokens=24)]
        continued = [x.token for x in pyspecter.stream_generate(s, QUESTION, max_tokens=24, chat=False)]
    assert json.loads(r.stdout)["tokens"] == answered[: len(json.loads(r.stdout)["tokens"])]
    assert json.loads(raw.stdout)["tokens"] == continued
    assert answered != continued


def test_chat_commands_are_not_sent_to_the_model() -> None:
    r = subprocess.run([sys.executable, "-m", "pyspecter", "chat", "tiny-qwen3moe", "-n", "4"],
                       input="/foo bar\n/help\n/stats\n/quit\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "unknown command /foo" in r.stdout and "nothing was sent to the model" in r.stdout
    assert all(c in r.stdout for c in ("/help", "/stats", "/reset", "/quit"))
    assert "[0 tok," in r.stdout  # /stats: nothing was generated


@pytest.mark.parametrize("args, needle", [
    (["generate", "tiny-qwen3moe", "-p", "x", "--temp", "-1"], "temperature must be >= 0"),
    (["generate", "tiny-qwen3moe", "-p", "x", "-n", "-5"], "-n must be >= 0"),
    (["chat", "tiny-qwen3moe", "--top-p", "2"], "top-p must be in (0, 1]"),
    (["bench", "tiny-qwen3moe", "--policies", "nonsense"], "unknown policy 'nonsense'"),
    (["bench", "tiny-qwen3moe", "--repeat", "0"], "--repeat must be at least 1"),
    (["generate", "tiny-qwen3moe", "-p", "x", "--budget", "1KiB"], "= top-4 slots per layer (384.0 KiB)"),
    # usage errors that click finds (issue 45): the same one line, not typer's boxed usage text
    (["generate", "tiny-qwen3moe", "-p", "x", "-n", "abc"], "invalid value for '-n' / '--n-predict'"),
    (["bench", "tiny-qwen3moe", "--repeat", "x"], "invalid value for '--repeat'"),
    (["generate", "tiny-qwen3moe", "-p", "x", "--bogus"], "no such option: --bogus"),
    (["generate", "tiny-qwen3moe"], "missing option '--prompt' / '-p'"),
    (["models", "build"], "missing argument"),
    (["nosuch"], "no such command 'nosuch'"),
])
def test_an_error_is_the_only_line(args: list[str], needle: str) -> None:
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and needle in r.stderr, r.stderr
    assert r.stdout == ""
    if needle.startswith(("invalid", "no such", "missing")):  # click's usage errors also say where to look
        assert "--help)" in r.stderr, r.stderr


def test_n_minus_one_runs_until_the_context_is_full() -> None:
    r = run_cli("generate", "tiny-qwen3moe", "-p", "the sea", "-n", "-1", "-c", "32", "--json", "--raw")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert 0 < len(out["tokens"]) <= 32


def test_version_from_the_entry_point() -> None:
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith(f"pyspecter {pyspecter.__version__}\n"), r.stderr
    assert "C API v" in r.stdout and "llama-cpp-python" in r.stdout
