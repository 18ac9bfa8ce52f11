"""The pinned, patched build: cached by its inputs, loud about a patch that does not apply, never compiling what the
machine cannot run, and the native API's contract (versions, tickets that always finish)."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())


def _build_module():
    spec = importlib.util.spec_from_file_location("build_llama", ROOT / "tools" / "build_llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build_info() -> dict:
    import llama_cpp

    return json.loads((Path(llama_cpp.__file__).resolve().parent.parent / "BUILD_INFO.json").read_text())


def test_second_build_is_a_cache_hit() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "build_llama.py")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "cached" in r.stdout  # no timing asserted: these machines are shared


def test_loaded_library_is_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bindings load this checkout's build (its patches, its key), and refuse a library without our code."""
    import types

    import llama_cpp

    from pyspecter import native
    from pyspecter.errors import SpecterError

    info = _build_info()
    assert info["patches"] == sorted(p.name for p in (ROOT / "patches").glob("*.patch"))
    assert native.build_key() == info["key"]
    monkeypatch.setattr(llama_cpp.llama_cpp, "_lib", types.SimpleNamespace())  # a stock libllama: no symbol
    with pytest.raises(SpecterError, match="lacks pyspecter"):
        native.llama_lib()


def test_bindings_match_the_header() -> None:
    # the C header is the one place the API version lives; the bindings must be written against that version, and
    # every function they declare must exist in the loaded library
    from pyspecter import native
    from pyspecter.native import lib

    header = (ROOT / "csrc" / "include" / "llama-pyspecter.h").read_text()
    assert int(re.search(r"#define LLAMA_PYSPECTER_VERSION (\d+)", header).group(1)) == native.PATCH_SERIES_VERSION
    declared_in_header = set(re.findall(r"LLAMA_API\s+[\w ]+?\*?\s*(llama_pyspecter_\w+)\s*\(", header))
    assert {f.name for f in lib.DECLARED} == declared_in_header
    api = native.slots()
    assert api.n_slots(None) == 0
    assert api.upload_done.__name__ == "llama_pyspecter_upload_done"  # the typed stub's identity, on the C function
    stats_fields = re.search(r"struct llama_pyspecter_stats \{(.*?)\};", header, re.S).group(1)
    assert [n for n, _ in native.Stats._fields_] == re.findall(r"int64_t (\w+);", stats_fields)


def test_key_changes_with_patches_sources_and_options(tmp_path: Path) -> None:
    b = _build_module()
    pin = b.read_pin()
    p1 = tmp_path / "0001-a.patch"
    p1.write_text("one")
    p2 = tmp_path / "0001-a.patch.v2"
    p2.write_text("two")
    src = tmp_path / "slots.cpp"
    src.write_text("int a;")
    k1 = b.build_key(pin, [p1], ["-DX=1"], [src])
    assert k1 == b.build_key(pin, [p1], ["-DX=1"], [src])
    assert k1 != b.build_key(pin, [p2], ["-DX=1"], [src])
    assert k1 != b.build_key(pin, [p1], ["-DX=2"], [src])
    src.write_text("int b;")
    assert k1 != b.build_key(pin, [p1], ["-DX=1"], [src])
    # the default sources are ours: the top-level CMakeLists.txt and everything under csrc/
    names = {p.relative_to(ROOT).as_posix() for p in b.source_files()}
    assert "CMakeLists.txt" in names and "csrc/include/llama-pyspecter.h" in names and "csrc/slots.cpp" in names


def test_bad_patch_stops_with_its_name(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    b = _build_module()
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.txt").write_text("hello\n")
    bad = tmp_path / "0099-does-not-apply.patch"
    bad.write_text("--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-goodbye\n+world\n")
    with pytest.raises(SystemExit) as exc:
        b.apply_patches(tree, [bad])
    assert exc.value.code == 2
    assert "0099-does-not-apply.patch" in capsys.readouterr().err


def test_patches_are_numbered_documented_and_create_no_files() -> None:
    readme = (ROOT / "patches" / "README.md").read_text()
    patches = sorted((ROOT / "patches").glob("*.patch"))
    assert patches
    for i, p in enumerate(patches, 1):
        assert p.name.startswith(f"{i:04d}-"), p.name
        assert p.name in readme
        # our code lives in csrc/; a patch only edits upstream files
        assert "--- /dev/null" not in p.read_text(), p.name


def test_amx_is_off_unless_the_tiles_really_run(monkeypatch: pytest.MonkeyPatch) -> None:
    b = _build_module()
    monkeypatch.delenv("SPECTER_AMX", raising=False)
    monkeypatch.setattr(b.platform, "system", lambda: "Linux")
    monkeypatch.setattr(b.platform, "machine", lambda: "x86_64")
    # cpuid advertises AMX but the kernel refuses the tile state (the VM case that died with SIGILL)
    monkeypatch.setattr(b, "cpu_flags", lambda: {"avx512f", "amx_tile", "amx_int8", "amx_bf16"})
    monkeypatch.setattr(b, "_request_tile_state", lambda: "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) refused")
    allowed, why = b.amx_decision()
    assert not allowed and "refused" in why
    # the kernel agrees, but the instructions still fault
    monkeypatch.setattr(b, "_request_tile_state", lambda: None)
    monkeypatch.setattr(b, "_run_tile_probe", lambda: "a tile instruction killed the probe (SIGILL)")
    assert b.amx_decision() == (False, "a tile instruction killed the probe (SIGILL)")
    monkeypatch.setattr(b, "_run_tile_probe", lambda: None)
    assert b.amx_decision()[0]
    monkeypatch.setattr(b, "cpu_flags", lambda: {"avx512f"})
    assert not b.amx_decision()[0]
    # off reaches CMake (and so the build key) as flags that win over -march=native
    off, on = b.cmake_options(False, amx=False), b.cmake_options(False, amx=True)
    assert "-DPYSPECTER_AMX=OFF" in off and "-DGGML_AMX_INT8=OFF" in off and "-DPYSPECTER_AMX=ON" in on
    pin = b.read_pin()
    assert b.build_key(pin, [], off, []) != b.build_key(pin, [], on, [])


def test_the_amx_probe_is_valid_code_and_fails_where_the_compiler_drops_the_config(tmp_path: Path) -> None:
    # GCC 12's _tile_loadconfig lets -O2 drop the config's field stores (ggml's kernels then die in ldtilecfg):
    # unoptimised, the same probe must run wherever the tiles work, so a failing probe means the compiler, not the
    # probe's own code. On an AMX machine the two builds' outcomes and the build's decision are compared.
    b = _build_module()
    if "amx_tile" not in b.cpu_flags() or b._request_tile_state() is not None:
        pytest.skip("this machine has no usable AMX tile state")
    src = tmp_path / "probe.cpp"
    src.write_text(b.AMX_PROBE_CXX)
    ran = {}
    for opt in ("-O0", "-O2"):
        exe = tmp_path / f"probe{opt}"
        subprocess.run(["c++", opt, "-mamx-tile", "-pthread", str(src), "-o", str(exe)], check=True)
        ran[opt] = subprocess.run([str(exe)], timeout=20).returncode == 0
    assert ran["-O0"], "the probe itself is wrong: it fails unoptimised"
    assert _build_info()["amx"]["allowed"] == ran["-O2"]


def test_build_records_its_amx_decision() -> None:
    info = _build_info()
    assert isinstance(info["amx"]["allowed"], bool) and info["amx"]["why"]
    assert f"-DPYSPECTER_AMX={'ON' if info['amx']['allowed'] else 'OFF'}" in info["cmake"]


def test_llama_defaults_decode_a_q4_1_batch(tmp_path: Path) -> None:
    # llama_cpp.Llama as users run it (extra buffer types on: AMX/repack kernels) on a Q4_1 model, one decode of 48
    # tokens: where the build emitted instructions this machine cannot execute, the child dies (SIGILL)
    import llama_cpp

    from pyspecter import native
    from pyspecter.models.tiny import build_tiny

    native.llama_lib()
    native.quiet_logs()
    q4_1 = tmp_path / "tiny-q4_1.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1
    params.allow_requantize = True
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(build_tiny("tiny-mixtral")).encode(), str(q4_1).encode(),
                                          ctypes.byref(params)) == 0
    child = textwrap.dedent("""
        import sys
        import llama_cpp
        llm = llama_cpp.Llama(model_path=sys.argv[1], verbose=False)
        llm.eval(list(range(1, 49)))
        print("decoded", llm.n_tokens)
    """)
    r = subprocess.run([sys.executable, "-c", child, str(q4_1)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "decoded 48" in r.stdout


def test_upload_tickets_always_finish() -> None:
    from pyspecter import native
    from pyspecter.models.tiny import build_tiny
    from pyspecter.native import lib

    api = native.slots()
    with native.Model(build_tiny("tiny-qwen3moe")) as m:
        assert api.upload_wait(m.ptr, 1) == lib.ERR_NO_SLOTS  # no slots yet: an answer, not a hang
        assert api.slots_init(m.ptr, 4) == 0
        assert api.slots_init(m.ptr, 4) == lib.ERR_ENABLED
        il = next(i for i in range(m.n_layer) if api.is_moe_layer(m.ptr, i))
        # unknown tickets answer at once instead of blocking forever
        for t in (-1, 0, 1, 10**9):
            assert api.upload_status(m.ptr, t) == lib.ERR_UNKNOWN_TICKET
            assert api.upload_wait(m.ptr, t) == lib.ERR_UNKNOWN_TICKET
        assert api.upload_done(m.ptr, 0)  # the point before the first ticket
        # a refused copy returns a negative ticket that never counts as done, and issues none
        bad = api.load_expert_async(m.ptr, il, 0, 99)
        assert bad == lib.ERR_ARG and not api.upload_done(m.ptr, bad)
        t = api.load_expert_async(m.ptr, il, 3, 1)
        assert t == 1
        assert api.upload_wait(m.ptr, t) == 1 and api.upload_status(m.ptr, t) == 1 and api.upload_done(m.ptr, t)
        assert api.upload_status(m.ptr, t + 1) == lib.ERR_UNKNOWN_TICKET
        st = api.stats(m.ptr)
        assert st.upload_bytes > 0 and st.upload_failures == 0
        assert set(st.as_dict()) == {n for n, _ in native.Stats._fields_}
        # freeing the model with copies still queued on a slow link: they are cancelled, the thread joined first
        api.set_link_gbps(m.ptr, 0.001)
        tickets = [api.load_expert_async(m.ptr, il, e, e % 4) for e in range(16)]
        assert tickets == list(range(t + 1, t + 17))
    m.close()  # twice is fine
