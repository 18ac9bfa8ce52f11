"""The CLI imports and prints its help on every typer that pyproject allows: checked in a venv at the lowest allowed
release and in one at the newest (issues 41 and 45: an assignment to a typer internal broke every command, at
import, on all typers but one).

Each venv holds pyproject's runtime dependencies with typer pinned, and runs pyspecter from this checkout
(PYTHONPATH), so what is tested is the code here against exactly that typer. Needs PyPI (or the pip cache) the first
time; the venvs are then kept under the cache folder by a key of Python's version and the requirements, so a rerun
costs one pip resolve for the newest end (a few seconds) and the CLI runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from pyspecter.paths import cache_dir, content_key

ROOT = Path(__file__).resolve().parents[2]


def requirements() -> tuple[str, list[str]]:
    """(typer's requirement, the other runtime requirements) from pyproject.toml."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    typer = [d for d in deps if re.match(r"typer\s*[<>=!~]", d)]
    assert len(typer) == 1, deps
    return typer[0], [d for d in deps if d not in typer]


def pip(python: Path, *args: str) -> str:
    r = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"pip {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def newest_allowed(typer_req: str) -> str:
    """The release pip would pick for typer's requirement today (a dry-run resolve, no install)."""
    report = json.loads(pip(Path(sys.executable), "install", "--quiet", "--dry-run", "--ignore-installed",
                            "--no-deps", "--report", "-", typer_req))
    return report["install"][0]["metadata"]["version"]


def venv_at(version: str, others: list[str]) -> Path:
    """A venv with typer==version and the other runtime requirements, built once and kept (built under a temporary
    name and renamed, so concurrent runs never see a half-made one)."""
    reqs = [f"typer=={version}", *others]
    py_version = ".".join(map(str, sys.version_info[:3]))
    d = cache_dir() / "typer-venvs" / f"typer-{version}-{content_key(py_version, *reqs)}"
    python = d / "bin" / "python"
    if not python.exists():
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=d.name + ".", dir=d.parent))
        try:
            # no pip of its own (ensurepip is 3 s a venv): this Python's pip installs into it (pip --python)
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp)], check=True, timeout=120)
            pip(Path(sys.executable), "--python", str(tmp / "bin" / "python"), "install", "--quiet", *reqs)
            os.rename(tmp, d)
        except OSError:
            if not python.exists():  # not a concurrent run that renamed first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return python


def run_cli(python: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONNOUSERSITE": "1", "COLUMNS": "200", "NO_COLOR": "1"}
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run([str(python), "-m", "pyspecter", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("end", ["lowest", "newest"])
def test_cli_runs_at_both_ends_of_the_typer_range(end: str) -> None:
    typer_req, others = requirements()
    if end == "lowest":
        m = re.search(r">=\s*([0-9][0-9.]*)", typer_req)
        assert m, f"{typer_req!r}: give typer a lowest version (>=) so that it can be tested"
        version = m.group(1)
    else:
        assert "<" in typer_req, f"{typer_req!r}: cap typer at the newest release tested (this test)"
        version = newest_allowed(typer_req)
    python = venv_at(version, others)

    got = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('typer'))"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONNOUSERSITE": "1"})
    assert got.stdout.strip() == version, got

    r = run_cli(python, "--help")
    assert r.returncode == 0, f"typer {version}: `pyspecter --help` failed\n{r.stdout}\n{r.stderr}"
    text = re.sub(r"\s+", " ", r.stdout)
    assert "Usage:" in text and "ends with a one-line error" in text, r.stdout  # the app's own help
    # the commands, in the order the group class lists them
    at = [text.index(f" {name} ") for name in ("chat", "generate", "serve", "inspect", "bench")]
    assert at == sorted(at), r.stdout

    r = run_cli(python, "generate", "--help")
    assert r.returncode == 0, f"typer {version}: `pyspecter generate --help` failed\n{r.stdout}\n{r.stderr}"
    assert all(flag in r.stdout for flag in ("--prompt", "--n-predict", "--temp", "--raw")), r.stdout
    assert r.stderr == "", r.stderr

    # click's usage errors are one line and exit 2 (caught through click's public Command API, which typer 0.28+
    # runs on its own copy of click): a bad value, and an unknown option of a sub-group's command
    for args, needle in ((["generate", "-n", "abc"], "'--n-predict'"), (["models", "list", "--x"], "--x")):
        r = run_cli(python, *args)
        assert r.returncode == 2 and r.stdout == "", f"typer {version}: {args}\n{r.stdout}\n{r.stderr}"
        assert r.stderr.startswith("pyspecter: error: ") and r.stderr.count("\n") == 1 and needle in r.stderr, \
            f"typer {version}: {args}\n{r.stderr}"
    # llama.cpp's -m MODEL, handed to the command by the group (click's public resolve_command)
    r = run_cli(python, "inspect", "-m", "nonexistent-model.gguf")
    assert r.returncode == 2 and "nonexistent-model.gguf: no such file" in r.stderr, f"typer {version}: {r.stderr}"
    # a group with no command still shows its help, with whichever exit code that typer gives it (0, or 2 on 0.28+)
    r = run_cli(python, "models")
    assert "Usage:" in r.stdout and "build" in r.stdout and "error" not in r.stderr, r
