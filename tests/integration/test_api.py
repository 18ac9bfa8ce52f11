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
    r = run_cli("generate", "tiny-mixtral", "-p", "speculate on this", "-n", "12", "--budget", "50%", "--json")
    assert r.returncode == 0, r.stderr
    assert [p.token for p in parts] == json.loads(r.stdout)["tokens"]
