"""The README's Python API example, run as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import run_cli

import pyspecter

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs() -> None:
    code = re.search(r"Python API\b.*?```python\n(.*?)```", README.read_text(), re.S).group(1)  # heading or bold
    code = code.replace('"smol-moe"', '"tiny-qwen3moe"')  # the same calls on a fixture: seconds, not minutes
    exec(compile(code, "README.md", "exec"), {})


def test_stream_matches_the_cli() -> None:
    with pyspecter.load("tiny-mixtral", budget="50%") as model:
        parts = list(pyspecter.stream_generate(model, "speculate on this", max_tokens=12, chat=False))
    assert len(parts) == 12 and 0 <= parts[-1].stats["hit_rate"] <= 1
    # each step's stats count the tokens streamed so far, as generate's count its answer
    assert [p.stats["tokens"] for p in parts] == list(range(1, 13))
    assert parts[-1].stats["tok_s"] > 0 and parts[0].stats["first_token_s"] > 0
    r = run_cli("generate", "tiny-mixtral", "-p", "speculate on this", "-n", "12", "--budget", "50%", "--json")
    assert r.returncode == 0, r.stderr
    assert [p.token for p in parts] == json.loads(r.stdout)["tokens"]


def test_a_stream_stopped_early_counts_what_it_took_and_generate_adds_to_it() -> None:
    with pyspecter.load("tiny-qwen3moe", budget="50%") as model:
        for i, _ in enumerate(pyspecter.stream_generate(model, "count me", max_tokens=50, chat=False)):
            if i == 4:
                break
        assert model.stats()["tokens"] == 5
        model.generate(model.tokenize("and me"), 3, stop_at_eog=False)
        assert model.stats()["tokens"] == 8
