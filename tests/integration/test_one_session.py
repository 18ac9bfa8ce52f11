"""One way to open a session: the CLI's generate, chat and serve open theirs with ``pyspecter.load``, so each
command line gives the session that ``load`` gives for the same options under their Python names. The CLI runs
in this process (typer's runner), its session captured as ``load`` returns it, and compared field by field with
one that the test opens through ``load`` directly: a command that dropped, renamed or defaulted an option
differently from the library would differ here."""

from __future__ import annotations

import dataclasses
import re
import socket
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli
from typer.testing import CliRunner

import pyspecter
from pyspecter import api
from pyspecter.cli import app
from pyspecter.errors import SpecterError
from pyspecter.session import Session

MODEL = "tiny-mixtral"
LOAD = api.load  # the library's, whatever a test puts in its place for the CLI
HINT = "no learned predictor for"  # said once per model file (predictor_hint), so not comparable across two opens


def _facts(s: Session) -> dict:
    """What a session is: its configuration after placement, what it resolved (miss mode, sampling, slots,
    predictor, draft), what it said and an approximate mode's measured cost."""
    groups = s.cfg.surrogate_groups
    return {"cfg": dataclasses.asdict(dataclasses.replace(s.cfg, surrogate_groups=None)),
            "groups": None if groups is None else {il: np.asarray(g).tolist() for il, g in sorted(groups.items())},
            "placement": dataclasses.replace(s.placement, why=_no_memory(s.placement.why)), "miss": s.miss,
            "sampling": s.sampling, "n_slots": s.n_slots, "held": s.held,
            "slots": s.slot_count(), "predictor": None if s.predictor is None else s.predictor.nbytes,
            "draft": s.draft is not None, "k": None if s.decoder is None else (s.decoder.k, s.decoder.adaptive),
            "notes": [_no_memory(n) for n in s.notes if HINT not in n], "quality": s.quality}


def _no_memory(line: str | None) -> str | None:
    """A placement line without its figures of memory: what is available moves between two opens on a machine
    that others use too."""
    return line and re.sub(r"\d+(\.\d+)? ?[KMGT]i?B", "#", line)


@pytest.fixture
def cli_sessions(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Every session the CLI opens in this test, as ``_facts``; serve's HTTP loop and socket are left out (the
    session is what is compared, and it is opened before either)."""
    import pyspecter.server as server

    seen: list[dict] = []

    def load(*args, **kwargs) -> Session:
        s = LOAD(*args, **kwargs)
        seen.append(_facts(s))
        return s

    monkeypatch.setattr(api, "load", load)
    monkeypatch.setattr(server, "bind", lambda host, port: socket.socket())
    monkeypatch.setattr(server, "serve", lambda session, sock, **kw: sock.close())
    return seen


def _cli(*argv: str, stdin: str = "") -> None:
    r = CliRunner().invoke(app, list(argv), input=stdin)
    assert r.exit_code == 0, (r.output, r.exception)


def _load(**options) -> dict:
    with LOAD(MODEL, **options) as s:
        return _facts(s)


def _differences(cli: list[dict], direct: dict) -> dict:
    """What differs between the one session the CLI opened and ``direct``: fact -> (CLI's, load's); a
    configuration by its differing fields."""
    assert len(cli) == 1, len(cli)
    out = {k: (v, direct[k]) for k, v in cli[0].items() if k != "cfg" and v != direct[k]}
    out |= {f"cfg.{k}": (v, direct["cfg"][k]) for k, v in cli[0]["cfg"].items() if v != direct["cfg"][k]}
    return out


def _same(cli: list[dict], direct: dict) -> None:
    assert _differences(cli, direct) == {}


SAMPLING = ["--temp", "0.7", "--top-k", "5", "--top-p", "0.9", "--min-p", "0.1", "--repeat-penalty", "1.1",
            "--seed", "3"]
SAMPLING_API = dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repeat_penalty=1.1, seed=3)

# (options on the command line, the same under load()'s names), for generate and chat
CASES = [
    ([], {}),  # the defaults: threads, context, K, sampling, placement chosen alike
    (["--budget", "50%"], dict(budget="50%")),
    (["--budget", "50%", "--tier", "disk", "--miss", "cpu", "-t", "1", "-c", "256", "-k", "2", *SAMPLING],
     dict(budget="50%", tier="disk", miss="cpu", n_threads=1, n_ctx=256, k=2, **SAMPLING_API)),
    (["--budget", "60%", "--tier", "emulated:4", "--miss", "wait", "--force"],
     dict(budget="60%", tier="emulated:4", miss="wait", force=True)),
    (["--budget", "100%", "--miss", "surrogate", "--surrogate-width", "0.5"],
     dict(budget="100%", miss="surrogate", surrogate_width=0.5)),
    (["--draft", MODEL, "--budget", "3MiB", "-k", "3"], dict(draft=MODEL, budget="3MiB", k=3)),
]


@pytest.mark.parametrize(("argv", "options"), CASES, ids=lambda c: " ".join(c) if isinstance(c, list) else None)
def test_generate_opens_the_session_load_opens(cli_sessions: list[dict], argv: list[str], options: dict) -> None:
    _cli("generate", MODEL, "-p", "ab", "-n", "1", *argv)
    _same(cli_sessions, _load(**options))


def test_generate_fixed_k_is_load_adaptive_false(cli_sessions: list[dict]) -> None:
    _cli("generate", MODEL, "-p", "ab", "-n", "1", "--draft", MODEL, "--budget", "3MiB", "--fixed-k")
    _same(cli_sessions, _load(draft=MODEL, budget="3MiB", adaptive=False))
    assert cli_sessions[0]["k"] == (4, False)


@pytest.mark.parametrize(("argv", "options"), [CASES[0], CASES[2], CASES[4]], ids=["defaults", "options",
                                                                                   "surrogate"])
def test_chat_opens_the_session_load_opens(cli_sessions: list[dict], argv: list[str], options: dict) -> None:
    _cli("chat", MODEL, *argv, stdin="/quit\n")
    _same(cli_sessions, _load(**options))


def test_serve_opens_the_session_load_opens(cli_sessions: list[dict]) -> None:
    _cli("serve", MODEL, "--budget", "50%", "--tier", "disk", "--miss", "cpu", "-c", "512", "-t", "1")
    _same(cli_sessions, _load(budget="50%", tier="disk", miss="cpu", n_ctx=512, n_threads=1))


def test_a_divergence_would_show(cli_sessions: list[dict]) -> None:
    """The comparison sees one option's difference (here the context size): the tests above can fail."""
    _cli("generate", MODEL, "-p", "ab", "-n", "1", "--budget", "50%", "-c", "256")
    assert _differences(cli_sessions, _load(budget="50%")) == {"cfg.n_ctx": (256, 2048)}


# bad input: the command's one line is load()'s error, word for word
BAD = [
    (["--miss", "sometimes"], dict(miss="sometimes")),
    (["--surrogate-width", "1.5"], dict(surrogate_width=1.5)),
    (["--layer-plan", "auto"], dict(layer_plan="auto")),
    (["--device", "rpc:127.0.0.1:1", "--layer-plan", "most"], dict(device="rpc:127.0.0.1:1", layer_plan="most")),
    (["-c", "0"], dict(n_ctx=0)),
    (["--top-p", "2"], dict(top_p=2.0)),
    (["--profile", "/nonexistent/trace.npz"], dict(profile=Path("/nonexistent/trace.npz"))),
    (["--budget", "lots"], dict(budget="lots")),
    (["--tier", "tape"], dict(tier="tape")),
]


@pytest.mark.parametrize(("argv", "options"), BAD, ids=lambda c: " ".join(c) if isinstance(c, list) else None)
def test_bad_input_is_loads_error(argv: list[str], options: dict) -> None:
    with pytest.raises(SpecterError) as e:
        pyspecter.load(MODEL, **options)
    r = run_cli("generate", MODEL, "-p", "ab", "-n", "1", *argv)
    assert r.returncode == 2 and r.stderr.strip() == f"pyspecter: error: {e.value}", r.stderr


def test_surrogate_mode_through_load() -> None:
    """The approximate mode from Python: its neuron groups built, its measured cost returned as a value (and said
    as the command says it), and its misses served by surrogates."""
    from pyspecter.quality import describe

    with pyspecter.load(MODEL, budget="100%", miss="surrogate", surrogate_width=0.5) as s:
        assert s.miss == "surrogate" and s.surrogates is not None and s.cfg.surrogate_groups
        q = s.quality
        assert q is not None and q["keep"] == 0.5 and q["slots"] == s.n_slots
        assert q["surrogate"]["surrogate_uses"] > 0 and q["ppl_delta"] == q["surrogate"]["ppl"] - q["wait"]["ppl"]
        assert describe(q) in s.notes
        out = s.generate(s.tokenize("surrogate experts, please"), 12, stop_at_eog=False)
        assert len(out) == 12 and s.stats()["surrogate_uses"] > 0


def test_exact_modes_report_no_quality_cost() -> None:
    with pyspecter.load(MODEL, budget="50%", miss="wait") as s:
        assert s.quality is None and s.surrogates is None
