"""The package's shape: imports only point down the data path, and the runtime imports without llama.cpp."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pyspecter"
STUDY_AND_BUILDERS = ("pyspecter.study", "pyspecter.models")
# the Python API is an entry point: it may build a built-in model on demand (as the cli/ package may: it is not
# among the runtime modules below)
ENTRY_POINTS = {"__main__.py", "api.py"}


RUNTIME_PACKAGES = ("native", "server")


def _runtime_modules() -> list[Path]:
    mods = [p for p in PKG.glob("*.py") if p.name not in ENTRY_POINTS]
    return mods + [p for d in RUNTIME_PACKAGES for p in (PKG / d).glob("*.py")]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):  # function-level imports count too
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_runtime_never_imports_study_or_model_builders() -> None:
    bad = {f"{p.relative_to(PKG)} imports {m}" for p in _runtime_modules() for m in _imports(p)
           if m.startswith(STUDY_AND_BUILDERS)}
    assert not bad, sorted(bad)


def _imports_study(path: Path) -> bool:
    """Whether a module imports study code in any spelling, ``from pyspecter import study`` included."""
    return any(m.startswith("pyspecter.study") for m in _imports(path)) or any(
        isinstance(node, ast.ImportFrom) and node.module == "pyspecter" and any(a.name == "study" for a in node.names)
        for node in ast.walk(ast.parse(path.read_text())))


def test_nothing_below_study_imports_it() -> None:
    """Study code may use the runtime and the model builders, never the other way round: not the runtime, not the
    Python API, not models/ (the embedded model's predictor fit is a builder's, models/predictor_fit.py)."""
    below = [*_runtime_modules(), *(PKG / n for n in ENTRY_POINTS), *(PKG / "models").glob("*.py")]
    bad = sorted(str(p.relative_to(PKG)) for p in below if _imports_study(p))
    assert not bad, bad


def test_the_study_rule_sees_every_spelling(tmp_path: Path) -> None:
    for i, line in enumerate(("from pyspecter import study", "import pyspecter.study.simulate",
                              "def f():\n    from pyspecter.study.quality import describe")):
        (tmp_path / f"m{i}.py").write_text(line + "\n")
        assert _imports_study(tmp_path / f"m{i}.py"), line
    (tmp_path / "ok.py").write_text("from pyspecter import models\n")
    assert not _imports_study(tmp_path / "ok.py")


def test_the_rule_sees_a_violation(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from pyspecter.study.trace import record_trace\n")
    assert any(m.startswith(STUDY_AND_BUILDERS) for m in _imports(p))


def _import_cycles(pkg: Path) -> list[list[str]]:
    """Cycles among the package's top-level modules, counting every import: function-level and TYPE_CHECKING ones
    too (a type-only import still points up the data path)."""
    mods = {p.stem for p in pkg.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for m in mods:
        deps = set()
        for node in ast.walk(ast.parse((pkg / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[0] == pkg.name and len(parts) > 1:
                    deps.add(parts[1])
                elif node.module == pkg.name:
                    deps.update(a.name for a in node.names)
        graph[m] = (deps & mods) - {m}
    cycles, done = [], set()

    def walk(m: str, path: list[str]) -> None:
        for d in sorted(graph[m]):
            if d in path:
                cycles.append(path[path.index(d):] + [d])
            elif d not in done:
                walk(d, path + [d])
        done.add(m)

    for m in sorted(mods):
        if m not in done:
            walk(m, [m])
    return cycles


def test_runtime_imports_have_no_cycle() -> None:
    """Imports point down the data path (native -> residency and tiers -> prediction and prefetch -> engine ->
    session): no module imports one that imports it back, not even for a type (the policies read the slot table
    through a protocol of their own, the miss handlers their cache through another)."""
    assert not _import_cycles(PKG), _import_cycles(PKG)


def test_the_cycle_rule_sees_a_back_edge(tmp_path: Path) -> None:
    pkg = tmp_path / "pyspecter"
    pkg.mkdir()
    (pkg / "residency.py").write_text("from pyspecter.policies import Policy\n")
    (pkg / "policies.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from pyspecter.residency import LayerSlots\n")
    (pkg / "cache.py").write_text("from pyspecter import misses\n")
    (pkg / "misses.py").write_text("def f():\n    from pyspecter.cache import ExpertCache\n")
    assert sorted(map(tuple, _import_cycles(pkg))) == [("cache", "misses", "cache"), ("policies", "residency",
                                                                                       "policies")]


def test_runtime_imports_without_the_library() -> None:
    """Every runtime module imports with llama.cpp's bindings unavailable: the library is bound on first use."""
    names = sorted(f"pyspecter.{p.stem}" for p in PKG.glob("*.py") if p.stem != "__main__")
    names += sorted(f"pyspecter.{d}.{p.stem}".removesuffix(".__init__") for d in RUNTIME_PACKAGES
                    for p in (PKG / d).glob("*.py"))
    code = ("import sys; sys.modules['llama_cpp'] = None\n"
            f"import importlib\nfor n in {names!r}: importlib.import_module(n)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _lines(p: Path) -> int:
    return len(p.read_text().splitlines())


# Modules over the ~400-line limit today, each with the reason it stays whole. A docstring does not exempt a module:
# this list does, and an entry for a module back under the limit goes (test_modules_stay_small says so).
LONG_MODULES = {
    "engine.py": "the speculative step, the draft's prefetch feed and its drop are one state machine over one window",
    "models/smol.py": "one builder end to end: fetch the wheel, calibration tokens, the upcycling, its quality report",
    "native/lib.py": "the C API's one declaration, a typed stub per function of the header, checked against it",
    "cache.py": "one class serves both residency paths behind the same methods (issue 43 retires the Python one)",
    "session.py": "placement and the build of every part, in the order each needs the others, read top to bottom",
    "study/analyze.py": "every analysis reads the same trace arrays into one result",
}
CSRC = PKG.parent / "csrc"
CSRC_LIMIT = 800
LONG_CSRC: dict[str, str] = {}  # csrc files over CSRC_LIMIT, with their reasons: none today


def test_modules_stay_small() -> None:
    """One job per module: none over ~400 lines unless LONG_MODULES says why, and none over 600 at all."""
    sizes = {str(p.relative_to(PKG)): _lines(p) for p in PKG.rglob("*.py")}
    big = sorted(m for m, n in sizes.items() if n > 420 and m not in LONG_MODULES)
    assert not big, big
    stale = sorted(m for m in LONG_MODULES if sizes.get(m, 0) <= 420)
    assert not stale, f"no longer over the limit (or gone): drop them from LONG_MODULES: {stale}"
    huge = sorted(m for m, n in sizes.items() if n > 600)
    assert not huge, huge


def test_csrc_files_stay_small() -> None:
    """The native side is held to the same rule: no csrc/ file over 800 lines unless LONG_CSRC says why."""
    sizes = {str(p.relative_to(CSRC)): _lines(p) for p in CSRC.rglob("*") if p.suffix in (".cpp", ".h")}
    assert len(sizes) >= 10, sizes
    big = sorted(f for f, n in sizes.items() if n > CSRC_LIMIT and f not in LONG_CSRC)
    assert not big, {f: sizes[f] for f in big}
    stale = sorted(f for f in LONG_CSRC if sizes.get(f, 0) <= CSRC_LIMIT)
    assert not stale, f"no longer over the limit (or gone): drop them from LONG_CSRC: {stale}"


def test_csrc_sources_are_all_built() -> None:
    """Every csrc/*.cpp is in the top-level CMakeLists.txt's pyspecter_core list (a file left out is never compiled)."""
    cmake = (PKG.parent / "CMakeLists.txt").read_text()
    listed = set(re.findall(r"csrc/[\w-]+\.cpp", cmake[cmake.index("add_library(pyspecter_core"):]))
    assert listed == {f"csrc/{p.name}" for p in CSRC.glob("*.cpp")}, listed


def test_the_cli_is_thin() -> None:
    """The command line parses and prints: one module per command group, none over 400 lines, and placement
    (tier, budget, device fit) is the library's."""
    cli = PKG / "cli"
    assert not (PKG / "cli.py").exists()
    mods = list(cli.glob("*.py"))
    assert len(mods) >= 5 and all(_lines(p) <= 400 for p in mods), {p.name: _lines(p) for p in mods}
    for p in mods:
        names = _imports(p)
        assert "pyspecter.budget" not in names, f"{p.name}: fitting budgets is pyspecter.placement's job"
        assert "psutil" not in names or p.name == "options.py", f"{p.name}: memory is the placement's to read"


def test_cli_lists_the_bench_policies_it_runs() -> None:
    from pyspecter import cli
    from pyspecter.study import bench

    assert cli.BENCH_POLICIES == bench.POLICIES and cli.BENCH_DEFAULTS == bench.DEFAULT_POLICIES


def test_the_server_package_imports_down_the_data_path() -> None:
    """app -> http, worker -> wire: the wire format knows no worker and no app; the worker knows no HTTP."""
    srv = PKG / "server"
    assert not {m for m in _imports(srv / "wire.py") if m.startswith("pyspecter.")} - {"pyspecter.errors"}
    assert not {m for m in _imports(srv / "worker.py") if m.startswith("pyspecter.server")} - {"pyspecter.server.wire"}
    assert not {m for m in _imports(srv / "http.py") if m.startswith("pyspecter.server")} - {"pyspecter.server.wire"}
    top = {a.name.split(".")[0] for n in ast.parse((srv / "app.py").read_text()).body  # module level only
           for a in (n.names if isinstance(n, ast.Import) else [])} | \
        {n.module.split(".")[0] for n in ast.parse((srv / "app.py").read_text()).body
         if isinstance(n, ast.ImportFrom) and n.module}
    assert not top & {"fastapi", "uvicorn", "sse_starlette", "starlette"}  # the extra is imported when serving
    assert not (PKG / "server.py").exists() and not (PKG / "serving.py").exists()
