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
    assert "-p" in _help("generate") and "--chat" in _help("generate")
    assert "-s" in _help("chat") and "--system" in _help("chat")
    assert "--eval-tokens" in _help("surrogate") and "-n " not in _help("surrogate")


def test_defaults_are_the_truth() -> None:
    physical = psutil.cpu_count(logical=False) or 1
    assert cli.DEFAULT_THREADS == physical
    assert f"[default: {physical}]" in _help("generate")
    assert "default: 0" not in _help("verify")  # --slots has no default: it or --budget is required
    assert "on-demand-lru-ordered" in _help("bench")  # the default policies are listed


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
