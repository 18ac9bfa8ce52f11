"""`pyspecter demo` end to end on a fixture (the smol-moe run is `make demo`): both capped children run, the
table prints, and the greedy tokens match."""

from __future__ import annotations

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow


def test_demo_on_a_fixture() -> None:
    r = run_cli("demo", "tiny-mixtral", "--budget", "50%", "-n", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "greedy tokens identical" in r.stdout
    assert "stock llama.cpp" in r.stdout and "expert slots, disk" in r.stdout and "tok/s" in r.stdout
    assert "memory:" in r.stdout and "Traceback" not in r.stderr
