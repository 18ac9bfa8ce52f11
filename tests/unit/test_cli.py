"""The CLI speaks llama.cpp's dialect: aliases, truthful defaults, commands listed by use."""

from __future__ import annotations

import re

import psutil
from typer.testing import CliRunner

from pyspecter import cli

runner = CliRunner()


def _help(*args: str) -> str:
    r = runner.invoke(cli.app, [*args, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    return re.sub(r"\s+", " ", r.output)


def test_llama_cpp_flags_are_accepted() -> None:
    for cmd in ("generate", "chat"):
        h = _help(cmd)
        for flag in ("-n", "--n-predict", "-c", "--ctx-size", "-t", "--threads", "--temp", "--top-k", "--top-p",
                     "--min-p", "--repeat-penalty", "--seed"):
            assert f"{flag} " in h or f"{flag}," in h, (cmd, flag)
    assert "-p" in _help("generate") and "--raw" in _help("generate")
    assert "-s" in _help("chat") and "--system" in _help("chat")
    assert "--eval-tokens" in _help("surrogate") and "-n " not in _help("surrogate")


def test_defaults_are_the_truth() -> None:
    physical = psutil.cpu_count(logical=False) or 1
    assert cli.DEFAULT_THREADS == physical
    for cmd in ("generate", "bench"):
        h = _help(cmd)
        threads = h[h.index("--threads"):h.index("--threads") + 200]
        assert f"[default: {physical}]" in threads and threads.count("default") == 1, threads  # one default
    assert "default: 0" not in _help("verify")  # --slots has no default: it or --budget is required


def test_help_lists_are_whole_at_80_columns() -> None:
    r = runner.invoke(cli.app, ["bench", "--help"], env={"COLUMNS": "80", "NO_COLOR": "1"})
    h = re.sub(r"[\s│]+", " ", r.output)
    assert "…" not in r.output, r.output  # nothing cut
    assert ", ".join(cli.BENCH_DEFAULTS) in h  # the default policies, every one
    assert all(p in h for p in cli.BENCH_POLICIES)


def test_flags_show_no_value() -> None:
    for cmd in ("generate", "bench", "chat", "inspect", "serve"):
        assert "<bool>" not in _help(cmd), cmd
    assert "<bool>" not in runner.invoke(cli.app, ["--help"], env={"COLUMNS": "200"}).output


def test_every_model_command_defaults_to_the_embedded_model() -> None:
    import typer

    group = typer.main.get_command(cli.app)
    for name in cli.MODEL_COMMANDS:
        model = next(p for p in group.commands[name].params if p.name == "model")
        assert model.default == "smol-moe" and not model.required, name


def test_version_names_the_package_patches_and_llama_cpp() -> None:
    from pathlib import Path

    import pyspecter
    from pyspecter.native.lib import PATCH_SERIES_VERSION

    r = runner.invoke(cli.app, ["--version"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    n_patches = len(list((Path(__file__).resolve().parents[2] / "patches").glob("*.patch")))
    assert lines == [f"pyspecter {pyspecter.__version__}",
                     f"patch series: C API v{PATCH_SERIES_VERSION}, {n_patches} patches",
                     "llama.cpp: 0c1e570 (llama-cpp-python 0.3.36)"]


def test_commands_listed_by_use() -> None:
    import typer

    group = typer.main.get_command(cli.app)
    names = group.list_commands(None)
    assert names[:2] == ["chat", "generate"] and names.index("inspect") < names.index("trace")
    assert set(names) == set(group.commands)  # every command listed, once


def test_dash_m_names_the_model() -> None:
    f = cli.model_flag_to_positional
    assert f(["generate", "-m", "x.gguf", "-p", "hi"]) == ["generate", "x.gguf", "-p", "hi"]
    assert f(["chat", "--model=x.gguf", "-n", "3"]) == ["chat", "x.gguf", "-n", "3"]
    assert f(["inspect", "x.gguf", "--json"]) == ["inspect", "x.gguf", "--json"]
    assert f(["models", "build", "-m"]) == ["models", "build", "-m"]  # not a model command: untouched


def test_dash_m_through_the_real_entry_point() -> None:
    from conftest import run_cli

    r = run_cli("inspect", "-m", "nonexistent-model.gguf")
    assert r.returncode == 2 and "nonexistent-model.gguf: no such file" in r.stderr, r.stderr
