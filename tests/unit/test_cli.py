"""The CLI speaks llama.cpp's dialect: aliases, truthful defaults, commands listed by use."""

from __future__ import annotations

import re

import psutil
import pytest
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


# the commands whose first argument is a MODEL
MODEL_COMMANDS = {"chat", "generate", "serve", "inspect", "bench", "verify", "draft", "trace", "surrogate", "demo",
                  "scale", "fit-predictor"}


def _model_commands() -> dict:
    import typer

    group = typer.main.get_command(cli.app)
    return {name: next(p for p in c.params if p.name == "model") for name, c in group.commands.items()
            if any(p.name == "model" and p.param_type_name == "argument" for p in c.params)}


def test_every_model_command_defaults_to_the_embedded_model() -> None:
    models = _model_commands()
    assert set(models) == MODEL_COMMANDS
    for name, model in models.items():
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


@pytest.mark.parametrize("argv", [["inspect", "-m", "x.gguf", "--json"], ["inspect", "--json", "--model", "x.gguf"],
                                  ["inspect", "--model=x.gguf"], ["inspect", "x.gguf"]])
def test_dash_m_names_the_model(argv: list[str]) -> None:
    """In-process too (the group hands the command its MODEL, no rewrite of sys.argv): every spelling reaches
    the command as its model."""
    from pyspecter.errors import SpecterError

    r = runner.invoke(cli.app, argv)
    assert isinstance(r.exception, SpecterError) and "x.gguf: no such file" in str(r.exception), r.output


def test_dash_m_is_only_a_model_commands() -> None:
    r = runner.invoke(cli.app, ["models", "list", "-m", "x.gguf"])  # not a model command: -m is unknown there
    assert r.exit_code == 2 and "-m" in r.output, r.output


def test_dash_m_through_the_real_entry_point() -> None:
    from conftest import run_cli

    r = run_cli("inspect", "-m", "nonexistent-model.gguf")
    assert r.returncode == 2 and "nonexistent-model.gguf: no such file" in r.stderr, r.stderr


def _bench_result() -> dict:
    row = {"tpot_ms": 10.0, "tpot_mean_ms": 11.0, "decode_tok_s": 100.0, "prefill_tok_s": 500.0, "cold_ttft_s": 0.5,
           "hit_rate": 1.0, "bytes_per_token": 0.0, "stall_ms_per_token": 0.0, "hook_us_per_call": 0.0,
           "vs_on_demand_lru": 1.2, "slots_mean": None}
    return {"model": "m.gguf", "arch": "qwen3moe", "tier": "ram", "emulated": False, "budget": "50%",
            "slots_per_layer": 8, "n_expert": 16, "slots": "8/16 slots per layer",
            "engine_slots": "7-8 of 16 slots per layer (mean 7.97); the rest of the budget: the learned predictor "
                            "1.06 MiB", "link_gbps": 10.0, "n_threads": 2, "prompts": None,
            "prompt_tokens": 64, "decode_tokens": 8, "repeat": 1, "memory_cap": "not capped",
            "policies": {"stock": row, "on-demand-lru": {**row, "slots_mean": 8.0, "vs_on_demand_lru": 1.0},
                         "oracle-bound": {"tpot_ms": 5.0, "tpot_mean_ms": 5.0, "decode_tok_s": 200.0,
                                          "bytes_per_token": 10.0, "computed": True, "vs_on_demand_lru": 2.0}}}


def test_bench_tables_say_na_and_why(capsys) -> None:
    from pyspecter.cli.bench import _print_bench

    _print_bench(_bench_result())
    out = capsys.readouterr().out
    assert "nan" not in out.lower() and "n/a" in out
    # both counts, each as placement.SlotCount says it: the baselines' whole budget, generate's beside a predictor
    assert "budget 50%: the baselines 8/16 slots per layer, generate (the engine) 7-8 of 16 slots per layer" in out
    notes = [line.strip() for line in out.splitlines() if line.strip().startswith("n/a:")]
    assert "n/a: slots — stock llama.cpp runs without slots" in notes
    assert any("all-resident was not among the policies" in n for n in notes)
    assert any(n.startswith("n/a: oracle-bound:") and "computed" in n for n in notes)


def test_bench_progress_is_a_line_per_run_when_piped() -> None:
    import io

    from pyspecter.cli.bench import progress_printer

    buf = io.StringIO()  # not a terminal: plain lines, no carriage returns
    show = progress_printer(buf)
    show("measuring the ram tier's link", 0, 0)
    for i, p in enumerate(["stock", "on-demand-lru"] * 2):
        show(f"{p}, repeat {i // 2 + 1}/2", i, 4)
    show("done", 4, 4)
    lines = buf.getvalue().splitlines()
    assert "\r" not in buf.getvalue() and len(lines) == 6
    assert lines[2] == "bench: [######..................] 1/4 running on-demand-lru, repeat 1/2"
    assert lines[-1].endswith("4/4 runs done")


def test_a_token_after_ctrl_c_is_not_shown() -> None:
    import pytest

    from pyspecter import chat

    shown: list[int] = []
    on_token = chat.stop_check(shown.append)
    chat._interrupted[0] = False
    on_token(1)
    chat._interrupted[0] = True
    try:
        with pytest.raises(chat.Stopped):
            on_token(2)
    finally:
        chat._interrupted[0] = False
    assert shown == [1]


def test_one_slot_count_says_what_takes_the_rest() -> None:
    from pyspecter.placement import NO_SLOTS, SlotCount

    # smol-moe at 30% with a fitted predictor: layers from 2 to 8 slots, said as such (not "2/16 (3 in 23 of 30)")
    counts = (2,) * 10 + (4,) * 5 + (8,) * 15
    s = SlotCount(counts, 16, (("the learned predictor", 5 * 2**20),))
    assert (s.min, s.max, round(s.mean, 2)) == (2, 8, 5.33)
    assert str(s) == "2-8 of 16 slots per layer (mean 5.33); the rest of the budget: the learned predictor 5.00 MiB"
    assert str(SlotCount((8,) * 30, 16)) == "8/16 slots per layer"
    assert str(SlotCount((4,) * 3, 16, zero=2)) == ("4/16 slots per layer + 2 zero slots each on the device, in the "
                                                    "budget")
    assert str(NO_SLOTS) == "no slots (every expert resident)" and NO_SLOTS.as_stats()["slots_max"] == 0


def _premature_breaks(text: str, width: int) -> list[str]:
    """Pairs of lines of rendered help where the second continues the first's text although its first word would
    have fitted on the first: a break the docstring made, not the terminal (issue 45: "/v1/completions," and "and"
    left alone at 120 columns). Works on typer's rich output: boxed tables (the text column of a row) and the
    unboxed description paragraphs."""
    lines = text.splitlines()
    bad = []
    for above, below in zip(lines, lines[1:], strict=False):
        col = re.match(r"[│ ]*", below).end()  # where the second line's text starts
        if col >= len(below) or below[col] in "[│" or below[:col].count("│") > 1:
            continue  # blank, a box edge, or typer's "[default: ...]" on a line of its own
        boxed = above.rstrip().endswith("│")
        starts = re.match(r"[│ ]*", above).end()
        if col >= len(above) or above[col] == " " or above[col - 1] != " ":
            continue  # the first line has no text starting at that column
        if (boxed and col <= starts) or (not boxed and col != starts):
            continue  # a new row of a table, or a paragraph at another indent
        right = len(above.rstrip()) - 1 if boxed else width  # the box's edge, or the terminal's
        if "  " in above[col:right].strip():
            continue  # col is not the first line's last column: the second line starts a new row
        if len(above[:right].rstrip()) + 1 + len(below[col:].split()[0]) <= right - 1:
            bad.append(f"{above}\n{below}")
    return bad


def test_help_breaks_lines_only_where_the_terminal_ends() -> None:
    for args in (["--help"], ["serve", "--help"], ["bench", "--help"], ["verify", "--help"], ["demo", "--help"],
                 ["models", "build", "--help"]):
        for width in (80, 120):
            r = runner.invoke(cli.app, args, env={"COLUMNS": str(width), "NO_COLOR": "1"})
            assert r.exit_code == 0, r.output
            assert _premature_breaks(r.output, width) == [], (args, width, r.output)


def test_reflow_joins_lines_within_paragraphs() -> None:
    from pyspecter.cli.app import reflow

    assert reflow("One two\n    three.\n\n    Four\n    five.") == "One two three.\n\nFour five."
    assert reflow("\b\nkept\nas is") == "\b\nkept\nas is"  # click's no-rewrap block
    assert reflow(None) is None and reflow("") == ""


def test_trace_ends_with_a_summary_not_json() -> None:
    from pyspecter.cli.study import trace_summary

    s = {"out": "/tmp/t.npz", "rows": 384, "prompts": 24, "moe_layers": 30, "n_expert": 16, "n_expert_used": 2,
         "k": 4, "draft": "/cache/smol-moe-draft-Q2_K-abc.gguf", "seconds": 12.345, "bytes": 2_500_000,
         "gate_lookahead": {"layers": 4, "note": None, "router_reproduction": 1.0},
         "acceptance_at": {"1": 0.8, "2": 0.64, "3": None, "4": 0.4}}
    text = trace_summary(s)
    assert "{" not in text and len(text.splitlines()) == 4, text
    assert "384 rows from 24 prompts" in text and "/tmp/t.npz (2.5 MB)" in text and "12.3 s" in text
    assert "smol-moe-draft-Q2_K-abc.gguf, k=4" in text and "80%, 64%, n/a, 40%" in text
    assert text.splitlines()[-1] == "next: pyspecter analyze /tmp/t.npz"
    plain = trace_summary({**s, "draft": None, "k": 0, "acceptance_at": None,
                           "gate_lookahead": {"layers": 0, "note": "gate_lookahead=0"}})
    assert "draft" not in plain and "router look-ahead: none (gate_lookahead=0)" in plain
