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


def _root_names(path: Path) -> set[str]:
    """Names a module takes from the package root (``from pyspecter import X``) that are not modules of it."""
    return {a.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module == "pyspecter" and node.level == 0
            for a in node.names if not (PKG / f"{a.name}.py").is_file() and not (PKG / a.name).is_dir()}


def test_nothing_takes_names_from_the_package_root() -> None:
    """The root re-exports the API (load, generate), which sits above every module but the CLI: a module that
    took ``__version__`` from it would be an import pointing back up. The version lives in ``_version``."""
    bad = sorted(f"{p.relative_to(PKG)}: {sorted(n)}" for p in PKG.rglob("*.py") if (n := _root_names(p)))
    assert not bad, bad


def test_the_root_rule_sees_a_name(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("from pyspecter import native, __version__\n")
    assert _root_names(tmp_path / "m.py") == {"__version__"}


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


# csrc/ as a graph of files: A -> B where A includes B, or calls an extern function that B alone defines (a header's
# inline and template functions are its own calls). The check is textual, as a reviewer reads it: comments and
# strings out; a definition is a name followed by its parameters and a body at file scope (extern "C" and namespace
# blocks are not scopes here), not static; a call is a name followed by "(" inside a body, not after ".", "->" or
# "::" (member functions and std:: are not followed: a call through a pointer or an object is the lower level's
# registration, which is how a lower file reaches a higher one).
_C_NAME = re.compile(r"(?<![\w:.>])((?:[A-Za-z_]\w*\s*::\s*)*~?[A-Za-z_]\w*)\s*\(")
_C_NOT_CALLS = {"if", "for", "while", "switch", "return", "sizeof", "catch", "decltype", "alignof", "static_assert",
                "operator", "noexcept", "alignas", "throw", "new", "delete", "defined"}


def _c_close(src: str, i: int, opening: str, closing: str) -> int:
    depth = 1
    while i < len(src) and depth:
        depth += (src[i] == opening) - (src[i] == closing)
        i += 1
    return i


def _c_scan(text: str) -> tuple[list[str], set[str], set[str]]:
    """A C or C++ file's quoted includes, the extern functions it defines, and the plain names it calls."""
    includes = re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, flags=re.M)
    src = re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'',
                 lambda m: '""' if m.group(0)[0] in "\"'" else "\n" * m.group(0).count("\n"), text, flags=re.S)
    src = re.sub(r"^[ \t]*#.*$", "", src, flags=re.M)
    depth, level, scopes = [0] * (len(src) + 1), 0, []
    for i, ch in enumerate(src):
        depth[i] = level
        if ch == "{":
            plain = bool(re.search(r'(?:extern\s*""|namespace(?:\s+\w+)?)\s*$', src[max(0, i - 60):i]))
            scopes.append(plain)
            level += not plain
        elif ch == "}" and scopes:
            level -= not scopes.pop()
    defined, bodies, calls = set(), [], set()
    for m in _C_NAME.finditer(src):
        name = re.sub(r"\s+", "", m.group(1))
        if name.split("::")[-1] in _C_NOT_CALLS:
            continue
        end = _c_close(src, m.end(), "(", ")")
        body = re.match(r"\s*(?:(?:const|noexcept|override|final)\b\s*)*\{", src[end:])
        if body:
            start = end + body.end()
            bodies.append((start, _c_close(src, start, "{", "}")))
            head = src[max(src.rfind(";", 0, m.start()), src.rfind("}", 0, m.start())) + 1:m.start()]
            if depth[m.start()] == 0 and "::" not in name and not re.search(r"\bstatic\b", head):
                defined.add(name)
    for m in _C_NAME.finditer(src):
        name = re.sub(r"\s+", "", m.group(1))
        if "::" not in name and name not in _C_NOT_CALLS and any(a <= m.start() < b for a, b in bodies):
            calls.add(name)
    return includes, defined, calls - defined


def _c_graph(root: Path) -> tuple[dict[str, set[str]], dict[str, dict[str, set[str]]]]:
    """(include edges, include and call edges with what each edge uses) among root's .cpp and .h files."""
    scans = {str(p.relative_to(root)): _c_scan(p.read_text()) for p in sorted(root.rglob("*"))
             if p.suffix in (".cpp", ".h")}
    by_name = {Path(f).name: f for f in scans}
    owners: dict[str, set[str]] = {}
    for f, (_, defined, _) in scans.items():
        for name in defined:
            owners.setdefault(name, set()).add(f)
    includes: dict[str, set[str]] = {f: set() for f in scans}
    uses: dict[str, dict[str, set[str]]] = {f: {} for f in scans}
    for f, (incs, _, calls) in scans.items():
        for i in incs:
            if Path(i).name in by_name:
                includes[f].add(by_name[Path(i).name])
                uses[f].setdefault(by_name[Path(i).name], set()).add("#include")
        for name in calls:
            if len(owners.get(name, ())) == 1 and f not in owners[name]:
                uses[f].setdefault(next(iter(owners[name])), set()).add(f"{name}()")
    return includes, uses


def _cycles(graph) -> list[list[str]]:
    """The graph's cycles, one per set of nodes that reach each other (strongly connected, more than one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# csrc files allowed to sit in a cycle, each with its reason: none today. An entry names the files of the cycle.
CSRC_CYCLES: dict[tuple[str, ...], str] = {}


def test_csrc_has_no_include_cycle() -> None:
    includes, _ = _c_graph(CSRC)
    assert sum(map(len, includes.values())) >= 10, includes
    assert not _cycles(includes), _cycles(includes)


def test_no_csrc_file_calls_into_one_that_calls_back() -> None:
    """Files by concern, layered: a file calls down into the files whose functions it uses, and none of those calls
    back up, directly or round a longer loop; a higher file reaches a lower one's callers through a pointer it
    registers there (the planner's plan, the residency's deleter). Includes count as edges too."""
    _, uses = _c_graph(CSRC)
    loops = [c for c in _cycles(uses) if tuple(c) not in CSRC_CYCLES]
    why = {f"{a} -> {b}": sorted(uses[a][b]) for c in loops for a in c for b in c if b in uses[a]}
    assert not loops, (loops, why)
    stale = sorted(c for c in CSRC_CYCLES if list(c) not in _cycles(uses))
    assert not stale, f"no longer a cycle: drop them from CSRC_CYCLES: {stale}"


def test_the_csrc_rules_see_a_call_back_and_an_include_cycle(tmp_path: Path) -> None:
    (tmp_path / "low.h").write_text('#include "high.h"\nint low_get(void);\n')
    (tmp_path / "high.h").write_text('#include "low.h"\n')
    (tmp_path / "low.cpp").write_text('// high_plan() in a comment is no call\n'
                                      'int low_get(void) { return high_plan(); }\nstatic int own(void) { return 1; }\n')
    (tmp_path / "high.cpp").write_text('extern "C" {\nint high_plan(void) { return low_get() + obj.low_get(); }\n}\n'
                                       'namespace { int helper() { return std::max(1, 2); } }\n')
    includes, uses = _c_graph(tmp_path)
    assert _cycles(includes) == [["high.h", "low.h"]]
    assert uses["low.cpp"] == {"high.cpp": {"high_plan()"}} and uses["high.cpp"] == {"low.cpp": {"low_get()"}}
    assert ["high.cpp", "low.cpp"] in _cycles(uses)
    (tmp_path / "low.cpp").write_text("int low_get(void) { return plan ? plan() : 0; }\n")  # a registered pointer
    assert ["high.cpp", "low.cpp"] not in _cycles(_c_graph(tmp_path)[1])


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


def test_the_cli_opens_sessions_through_load() -> None:
    """generate, chat and serve open their session with ``pyspecter.load`` (one validation, one placement): no
    command builds a session of its own."""
    built = sorted(p.name for p in (PKG / "cli").glob("*.py")
                   if re.search(r"\b(Session|SessionConfig|ExpertCache)\(", p.read_text()))
    assert not built, built
    assert "api.load" in (PKG / "cli" / "run.py").read_text() or "import load" in (PKG / "cli" / "run.py").read_text()


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


# The per-layer record, struct llama_pyspecter_layer (csrc/pyspecter-impl.h), is in sections, each headed by a
# "// owner: FILE." comment: only FILE assigns the section's fields; every other file changes them through FILE's
# functions. Reads are not checked (they stay direct on the hot path). A write is what a reviewer would call one:
# an assignment or compound assignment, ++ or --, a mutating member call (push_back, assign, resize, reset, store,
# ...), the destination of std::fill/copy/memcpy/memset, or a non-const reference bound to the field, on a layer:
# `L`, a name declared a llama_pyspecter_layer pointer or reference in that file, or a layer reached through an
# index or a call (`layers[il]->`, `layer(il)->`). Exemptions: (file, field) -> reason; none today.
LAYER_RECORD = CSRC / "pyspecter-impl.h"
LAYER_WRITE_EXEMPTIONS: dict[tuple[str, str], str] = {}
_C_MUTATORS = ("push_back", "emplace_back", "pop_back", "assign", "resize", "clear", "reset", "store", "fetch_add",
               "fetch_sub", "exchange", "swap", "insert", "erase", "reserve", "shrink_to_fit")


def _c_strip(text: str) -> str:
    """Comments and string literals out, line numbers kept."""
    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'',
                  lambda m: '""' if m.group(0)[0] in "\"'" else "\n" * m.group(0).count("\n"), text, flags=re.S)


def _layer_owners(header: str) -> dict[str, str]:
    """Each field of struct llama_pyspecter_layer -> the owner file its section names."""
    start = header.index("struct llama_pyspecter_layer {")
    body = header[header.index("{", start) + 1:header.index("\n};", start)]
    owners: dict[str, str] = {}
    owner = ""
    for line in body.splitlines():
        m = re.match(r"\s*//\s*owner:\s*([\w.-]+?)\.?(?:\s|$)", line)
        if m:
            owner = m.group(1)
            continue
        code = re.sub(r"//.*", "", line)
        for rx in (r"\{[^{}]*\}", r"\[[^\[\]]*\]", r"=[^,;]*"):  # initialisers and array bounds out
            code = re.sub(rx, "", code)
        for decl in code.split(";")[:-1]:
            names = [re.findall(r"\w+", part)[-1] for part in decl.split(",") if re.findall(r"\w+", part)]
            for name in names:
                owners[name] = owner
    return owners


def _layer_writes(root: Path, fields: set[str]) -> list[tuple[str, int, str]]:
    """(file, line, field) of every write to a layer's field among root's .cpp and .h files."""
    f_alt = "|".join(sorted(fields, key=len, reverse=True))
    idx = r"(?:\s*\[(?:[^\[\]]|\[[^\[\]]*\])*\])*"
    out = []
    for p in sorted(root.rglob("*")):
        if p.suffix not in (".cpp", ".h"):
            continue
        src = _c_strip(p.read_text())
        names = set(re.findall(r"\bllama_pyspecter_layer\s*(?:const\s*)?[*&](?![*&])\s*(?:const\s+)?(\w+)", src))
        names = (names | {"L"}) - {"pyspecter_layer_of"}
        named = "|".join(sorted(names))
        recv = rf"(?:\b(?:{named})\s*(?:->|\.)|[\])]\s*->)"
        acc = rf"{recv}\s*(?P<f>{f_alt})\b{idx}"
        dest = r"\s*(?:\.\s*(?:begin|data)\s*\(\s*\))?\s*(?:[+-][^,;()]*)?"  # the range's start (+ an offset)
        rules = [rf"{acc}\s*(?:[-+*/%|&^]|<<|>>)?=(?!=)",
                 rf"(?:\+\+|--)\s*{acc}", rf"{acc}\s*(?:\+\+|--)",
                 rf"{acc}\s*\.\s*(?:{'|'.join(_C_MUTATORS)})\s*\(",
                 rf"(?<![\w.>])(?:std::)?(?:fill|fill_n|memset|memcpy|memmove|iota)\s*\(\s*&?\s*{acc}{dest},",
                 rf"(?<![\w.>])(?:std::)?(?:copy|copy_n)\s*\([^;]*,\s*{acc}{dest}\)",
                 rf"(?<![\w.>])(?:std::)?swap\s*\([^;]*?{acc}{dest}[,)]",
                 rf"(?:^|[;{{}}(])(?P<decl>[^;{{}}()=]*)&\s*\w+\s*=\s*{acc}\s*[;,)]"]
        for rule in rules:
            for m in re.finditer(rule, src, flags=re.M):
                if "const" in (m.groupdict().get("decl") or "").split():
                    continue  # a const reference reads
                out.append((str(p.relative_to(root)), src.count("\n", 0, m.start("f")) + 1, m.group("f")))
    return sorted(set(out))


def test_the_layer_record_has_an_owner_per_section() -> None:
    owners = _layer_owners(LAYER_RECORD.read_text())
    assert len(owners) >= 40, owners
    unowned = sorted(f for f, o in owners.items() if not o)
    assert not unowned, f"fields before any '// owner:' line: {unowned}"
    missing = sorted({o for o in owners.values() if not (CSRC / o).exists()})
    assert not missing, missing


def test_the_layer_record_is_written_only_by_its_owners() -> None:
    """Each section of llama_pyspecter_layer has one owner file (its "// owner:" line); a write from any other file
    goes through the owner's functions, unless LAYER_WRITE_EXEMPTIONS says why not."""
    owners = _layer_owners(LAYER_RECORD.read_text())
    writes = _layer_writes(CSRC, set(owners))
    assert len(writes) >= 50, writes  # the scan sees the owners' own writes
    foreign = [f"{f}:{line}: {field} (owner: {owners[field]})" for f, line, field in writes
               if f != owners[field] and (f, field) not in LAYER_WRITE_EXEMPTIONS]
    assert not foreign, foreign
    stale = sorted(k for k in LAYER_WRITE_EXEMPTIONS if not any((f, field) == k for f, _, field in writes))
    assert not stale, f"no longer written there: drop them from LAYER_WRITE_EXEMPTIONS: {stale}"


def test_the_owner_rule_sees_writes_from_outside(tmp_path: Path) -> None:
    (tmp_path / "pyspecter-impl.h").write_text(
        "struct llama_pyspecter_layer {\n    // owner: a.cpp. the table\n    int32_t il = -1;\n"
        "    std::vector<int32_t> remap, late; // expert -> slot\n    // owner: b.cpp.\n"
        "    int64_t file_off[4] = { -1, -1, -1, -1 };\n    std::atomic<bool> passed{false};\n};\n")
    owners = _layer_owners((tmp_path / "pyspecter-impl.h").read_text())
    assert owners == {"il": "a.cpp", "remap": "a.cpp", "late": "a.cpp", "file_off": "b.cpp", "passed": "b.cpp"}
    (tmp_path / "a.cpp").write_text(
        "void f(llama_pyspecter_layer * D, llama_pyspecter_layer ** out) {\n"
        "    D->il = 1; s->layers[2]->remap[e[1]] += 1; // L->late = x in a comment is none\n"
        "    if (L->il == 2) { L->file_off[k]++; } std::fill(L->late.begin(), L->late.end(), -1);\n"
        "    auto & r = L->remap; const auto & q = L->late; (*out)->passed.store(true);\n"
        "    st.il = 3; r->il = 4; std::copy(a, b, L->remap.begin()); x = L->il;\n}\n")
    got = _layer_writes(tmp_path, set(owners))
    assert got == [("a.cpp", 2, "il"), ("a.cpp", 2, "remap"), ("a.cpp", 3, "file_off"), ("a.cpp", 3, "late"),
                   ("a.cpp", 4, "passed"), ("a.cpp", 4, "remap"), ("a.cpp", 5, "remap")], got
