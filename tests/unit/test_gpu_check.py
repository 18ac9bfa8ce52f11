"""tools/gpu_check.sh without a GPU, a build or a registry: the wheelhouse --prepare carries starts from pyproject's
dependencies and covers what the package imports; the table's rows report the real cause of a failure and judge a
verify case by the GPU contract where verify reports one."""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# imported only by optional parts, declared as extras: `pyspecter serve` (server) and the report plots (plot);
# gpu_check runs neither
OPTIONAL = {"fastapi": "server", "starlette": "server", "sse_starlette": "server", "uvicorn": "server",
            "h11": "server", "matplotlib": "plot"}
BUILT = {"llama_cpp"}  # the bindings tools/build_llama.py builds; the script puts them on PYTHONPATH


def _name(req: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", req)[0]).lower()


def test_prepare_starts_from_pyprojects_dependencies() -> None:
    """--prepare downloads exactly pyproject's requirement strings (and their dependencies), read when it runs:
    nothing pinned in the script to fall behind pyproject."""
    r = subprocess.run(["bash", str(SCRIPT), "--list-requirements"], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:-1] == PYPROJECT["project"]["dependencies"]


def _third_party_imports() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in (ROOT / "pyspecter").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):  # function-level imports count too
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for m in mods:
                top = m.split(".")[0]
                if top != "pyspecter" and top not in sys.stdlib_module_names:
                    out.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return out


def test_every_runtime_import_is_a_declared_dependency() -> None:
    """What the package imports comes from a distribution pyproject names, so the wheelhouse (pyproject's
    dependencies, transitively) has it; a module only an optional part imports is in that part's extra."""
    deps = {_name(d) for d in PYPROJECT["project"]["dependencies"]}
    extras = {k: {_name(d) for d in v} for k, v in PYPROJECT["project"]["optional-dependencies"].items()}
    dists = md.packages_distributions()
    bad = []
    for mod, where in sorted(_third_party_imports().items()):
        if mod in BUILT:
            continue
        provided = {_name(d) for d in dists.get(mod, [])}
        if mod in OPTIONAL:
            # the extra must declare the module's distribution, or one that brings it (h11 comes with uvicorn)
            ok = not provided or provided & extras[OPTIONAL[mod]] or any(
                _name(r) in provided for d in extras[OPTIONAL[mod]] for r in (md.requires(d) or []))
        else:
            ok = bool(provided & deps)
        if not ok:
            bad.append(f"{mod} ({', '.join(sorted(provided)) or 'no distribution here'}), imported by "
                       f"{', '.join(sorted(where))}")
    assert not bad, bad


@pytest.fixture(scope="module")
def gc(tmp_path_factory: pytest.TempPathFactory):
    """The script's embedded Python (gc.py), as the script writes it."""
    text = SCRIPT.read_text()
    start = text.index("cat > \"$WORK/gc.py\" <<'EOF'\n")
    body = text[text.index("\n", start) + 1:text.index("\nEOF\n", start)]
    path = tmp_path_factory.mktemp("gc") / "gc.py"
    path.write_text(body + "\n")
    spec = importlib.util.spec_from_file_location("gc_py", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cause_is_the_exception_not_a_guess(gc, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The first GPU run's failure: an AttributeError at import. The row says that and where, not the last line."""
    out = tmp_path / "out.txt"
    out.write_text("""Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/repo/pyspecter/cli/app.py", line 40, in <module>
    typer.core.TyperOption.display_type_rich = _x
    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
AttributeError: type object 'TyperOption' has no attribute 'display_type_rich'
-- exit 1 after 1s
""")
    gc.cause(out)
    assert capsys.readouterr().out.strip() == ("AttributeError: type object 'TyperOption' has no attribute "
                                               "'display_type_rich' (at cli/app.py:40)")
    # no traceback: the first error line (the root, not its consequences) and the one after it
    out.write_text("loading model\nCUDA error: an illegal memory access was encountered\n  in mmq.cuh:1417\n"
                   "ggml-cuda.cu:109: CUDA error\n")
    gc.cause(out)
    assert capsys.readouterr().out.strip() == "CUDA error: an illegal memory access was encountered | in mmq.cuh:1417"
    out.write_text("\n\nsomething odd\n")
    gc.cause(out)
    assert capsys.readouterr().out.strip() == "something odd"


def _verify_json(**kw) -> dict:
    r = {"device": "CUDA0", "identical_tokens": True, "max_abs_logit_diff": 0.0, "n_tokens": 16,
         "n_prompt_tokens": 20, "hit_rate": 0.5, "uploads": 12}
    r.update(kw)
    return r


def _row(gc, tmp_path: Path, capsys, r: dict | None, rc: str = "0", noise: str = "") -> tuple[str, str]:
    f = tmp_path / "v.json"
    f.write_text(noise + (json.dumps(r, indent=1) if r is not None else "") + "\n")
    gc.verify_row(f, rc)
    st, detail = capsys.readouterr().out.rstrip("\n").split("\t")
    return st, detail


def test_verify_rows_use_the_contract_when_verify_reports_one(gc, tmp_path: Path, capsys) -> None:
    # no contract in the JSON (a verify before it): the CPU criterion
    assert _row(gc, tmp_path, capsys, _verify_json(), noise="a log line\n")[0] == "ok"
    assert _row(gc, tmp_path, capsys, _verify_json(max_abs_logit_diff=2e-4), rc="1")[0] == "DIFF"
    assert _row(gc, tmp_path, capsys, _verify_json(max_abs_logit_diff=float("nan")))[0] == "DIFF"
    assert _row(gc, tmp_path, capsys, _verify_json(identical_tokens=False), rc="1")[0] == "DIFF"
    # the contract decides: misses computed on the CPU may differ from stock-same-placement and still meet it
    contract = {"finite": True, "reference": "stock-device", "max_abs_logit_diff_vs_device": 0.02, "bound": 0.05,
                "bound_is": "stock --cpu-moe vs stock-device, same tokens", "ok": True}
    st, detail = _row(gc, tmp_path, capsys, _verify_json(identical_tokens=False, max_abs_logit_diff=0.3,
                                                         contract=contract, contract_ok=True), rc="1")
    assert st == "ok"
    assert "contract met" in detail and "stock-device 2.0e-02 <= bound 5.0e-02" in detail
    assert "stock --cpu-moe vs stock-device" in detail
    st, detail = _row(gc, tmp_path, capsys, _verify_json(contract={**contract, "finite": False, "ok": False},
                                                         contract_ok=False))
    assert st == "DIFF" and "NOT MET" in detail and "NaN/inf" in detail
    # --miss mapped: the rows read from the host copy are shown, and a case that read none (with misses) failed
    # to test the mapped path whatever its logits
    tables = {"spec_ubatches": 16, "mapped_rows": 40}
    st, detail = _row(gc, tmp_path, capsys, _verify_json(miss="mapped", hit_rate=0.5, device_tables=tables))
    assert st == "ok" and "16 ubatches speculated, 40 rows read from the host copy" in detail
    st, detail = _row(gc, tmp_path, capsys, _verify_json(miss="mapped", hit_rate=0.5,
                                                         device_tables={**tables, "mapped_rows": 0}))
    assert st == "DIFF" and "never ran" in detail
    # a result, then a crash (a signal): FAIL, whatever the numbers
    assert _row(gc, tmp_path, capsys, _verify_json(), rc="139")[0] == "FAIL"
    # no JSON at all: exit 3, and the script falls back to the cause of the failure
    with pytest.raises(SystemExit) as e:
        _row(gc, tmp_path, capsys, None, noise="Segmentation fault\n")
    assert e.value.code == 3


PROBE_KEYS = {"sync_us", "visit_us", "upload_expert_us", "h2d_pinned_gbps", "h2d_pageable_gbps",
              "zero_copy_expert_us", "zero_copy_gbps", "device_expert_us", "device_read_gbps", "wait_spin_us",
              "wait_spin_cpu_us", "wait_block_us", "wait_block_cpu_us"}


def _nvcc() -> str | None:
    import shutil

    return shutil.which("nvcc") or next((str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.exists()), None)


@pytest.mark.skipif(_nvcc() is None, reason="no nvcc: the probe is compiled on the GPU machine by gpu_check")
def test_the_probe_compiles_and_says_what_it_measured_or_why_not(tmp_path: Path) -> None:
    """tools/gpu_probe.cu as gpu_check builds it: with a GPU, one JSON object of every measurement; without one (a
    build machine), exit 2 and one line naming the missing device, never a crash or a partial JSON."""
    exe = tmp_path / "gpu_probe"
    r = subprocess.run([_nvcc(), "-O2", "-arch=sm_90", str(ROOT / "tools" / "gpu_probe.cu"), "-o", str(exe)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
        assert PROBE_KEYS <= json.loads(r.stdout).keys()
    else:
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr.startswith("gpu_probe: no CUDA device 0") and r.stderr.count("\n") == 1
    bad = subprocess.run([str(exe), "--expert-bytes", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "bad argument --expert-bytes" in bad.stderr


def test_the_probe_row_names_every_measurement(gc, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "gpu_probe.json"
    f.write_text(json.dumps({**{k: 1.5 for k in PROBE_KEYS}, "sync_us": 7.25, "visit_us": 31.0}) + "\n")
    gc.probe_detail(str(f))
    row = capsys.readouterr().out
    assert row.startswith("sync 7.2 us, host visit 31.0 us;") and "zero-copy reads 1.5 GB/s" in row
    assert row.endswith("a landing waited 2 us (2 us CPU), with a blocking event 2 us (2 us CPU)\n")


def test_the_benches_fall_back_to_zero_slots_only_where_negative_ids_alone_failed(gc, tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture) -> None:
    """Patch 0008 never ran on a GPU before gpu_check: if only the negative-id verify cases fail and every zero-slot
    case passes, steps 5 and 6 run with SPECTER_ZERO_SLOTS=1 (the lease still measures speed); otherwise not."""
    def verdict(*rows: tuple[str, str]) -> list[str]:
        f = tmp_path / "v.row"
        f.write_text("".join(f"verify {name}\t{st}\t1\tdetail\n" for name, st in rows))
        gc.zero_fallback(str(f))
        return capsys.readouterr().out.rstrip("\n").split("\t")

    assert verdict(("a", "ok"), ("a (zero slots)", "ok"), ("b", "skip"))[::2] == ["ok", "0"]
    assert verdict(("a", "FAIL"), ("a (zero slots)", "ok"), ("b", "TIMEOUT"))[::2] == ["FAIL", "1"]
    assert verdict(("a", "FAIL"), ("a (zero slots)", "FAIL"))[::2] == ["FAIL", "0"]
    assert verdict(("a", "FAIL"), ("a (zero slots)", "skip"))[::2] == ["FAIL", "0"]  # nothing shows zero slots work
    # a mapped case failing is its own row (a GPU reading host memory), not a verdict on the negative ids
    assert verdict(("a slots=4 miss=mapped", "FAIL"), ("a", "ok"), ("a (zero slots)", "ok"))[::2] == ["ok", "0"]
    # and so is a static hot set's (verify --hot: no residency engine)
    assert verdict(("a slots=4 miss=cpu (hot set)", "FAIL"), ("a", "ok"), ("a (zero slots)", "ok"))[::2] == ["ok", "0"]
