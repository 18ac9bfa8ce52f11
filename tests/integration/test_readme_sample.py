"""The README's `make demo` sample against what the code prints now: the library's C API line and the inspect
lines for smol-moe (tests/unit/test_readme.py checks the same facts against the sources without a build)."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

from conftest import run_cli

from pyspecter import native
from pyspecter.learned import LearnedPredictor
from pyspecter.models.catalog import resolve_model
from pyspecter.paths import cache_dir
from pyspecter.study import demo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_readme import README, _demo_sample  # noqa: E402

SAMPLE = _demo_sample(README.read_text())
AVAILABLE = re.compile(r"[\d.]+ GB available")  # this machine's memory now, not a fact of the code
KEY = re.compile(r"[0-9a-f]{16}\.gguf")


def _inspect_lines(sample: str) -> list[str]:
    """The sample's lines from inspect: from the model's name line to the fit line."""
    lines = sample.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("smol-moe: "))
    last = next(i for i, line in enumerate(lines) if line.startswith("on this machine, without"))
    return lines[first:last + 1]


def test_the_sample_names_the_library_it_runs_on() -> None:
    assert f"patched llama.cpp with pyspecter C API v{native.patch_series_version()}\n" in SAMPLE


def test_the_sample_shows_what_inspect_prints() -> None:
    path = resolve_model("smol-moe")
    budget = inspect.signature(demo.demo).parameters["budget"].default
    r = run_cli("inspect", "smol-moe", "--budget", budget, "--tier", "disk")  # as the demo runs it
    assert r.returncode == 0, r.stdout + r.stderr
    got, want = r.stdout.splitlines(), _inspect_lines(SAMPLE)
    assert len(got) == len(want), (got, want)
    # the name line ends with the file's path: the sample shows the default cache (~/.cache/pyspecter, where
    # $SPECTER_CACHE may point elsewhere), and the file's key changes with the builder's code
    name = got[0].replace(str(cache_dir()), "~/.cache/pyspecter").replace(str(Path.home()), "~")
    assert KEY.sub("KEY.gguf", name) == KEY.sub("KEY.gguf", want[0])
    fitted = LearnedPredictor.for_model(path) is not None  # then its bytes come out of the budget first
    for g, w in zip(got[1:], want[1:], strict=True):
        if not fitted and w.startswith("budget "):  # the sample's budget pays for a fitted predictor first
            assert g.startswith(f"budget {budget}, tier disk: ") and "the learned predictor" not in g, g
            continue
        assert AVAILABLE.sub("N GB available", g) == AVAILABLE.sub("N GB available", w)
