"""tools/build_llama.py's check of what the built libraries export, on fixture libraries compiled here with the
system C++ compiler: a library that exports only its C API passes; one that also exports C++ (an std::string
function of its own, the std:: template instances it used, or a whole static libstdc++, which is what broke every
model load on the first GPU machine) fails, naming the symbol."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the fixture libraries")

# ggml_foo is the API; leaky_name is ours but C++; the ostringstream and to_string pull std:: instances in.
LEAKY = r"""
#include <sstream>
#include <string>
extern "C" int ggml_foo(long x) { std::ostringstream s; s << x; return (int) s.str().size(); }
std::string leaky_name(int x) { return std::to_string(x); }
"""
CLEAN = 'extern "C" int ggml_foo(long x) { return (int) x; }\n'
# what CMakeLists.txt links the ggml libraries with (their map, less ggml-base's quantize families)
GGML_MAP = "{\n  global:\n    ggml_*;\n    gguf_*;\n  local:\n    *;\n};\n"


@pytest.fixture(scope="module")
def b():
    spec = importlib.util.spec_from_file_location("build_llama", ROOT / "tools" / "build_llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    """Compiles a fixture library: (source, its file name, extra link arguments) -> its path."""
    tmp = tmp_path_factory.mktemp("exports")
    (tmp / "ggml.map").write_text(GGML_MAP)

    def build(source: str, name: str, *link: str) -> Path:
        src = tmp / f"{name}.cpp"
        src.write_text(source)
        lib = tmp / name
        r = subprocess.run([CXX, "-O2", "-fPIC", "-shared", str(src), "-o", str(lib), *link], cwd=tmp,
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"{CXX} cannot build the fixture {name}: {r.stderr.strip()[:300]}")
        return lib

    build.map = f"-Wl,--version-script={tmp / 'ggml.map'}"
    return build


def nm_exports(lib: Path) -> set[str] | None:
    nm = shutil.which("nm")
    if nm is None:
        return None
    out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def test_a_library_exporting_only_its_api_passes(b, built) -> None:
    lib = built(CLEAN, "libggml-clean.so")
    assert b.exported_symbols(lib) == ["ggml_foo"]
    assert b.export_problems(lib) == []
    b.check_exports(lib.parent.joinpath("none-such"))  # an empty folder: nothing to check, no failure


def test_cxx_exports_fail_naming_the_symbol(b, built, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lib = built(LEAKY, "libggml-leaky.so")
    bad = b.export_problems(lib)
    assert "_Z10leaky_nameB5cxx11i" in bad  # ours, but C++: not API
    assert "ggml_foo" not in bad
    # the checker reads what nm reads
    assert (nm := nm_exports(lib)) is None or set(b.exported_symbols(lib)) == nm

    libdir = tmp_path / "lib"
    libdir.mkdir()
    shutil.copy(lib, libdir / "libggml-leaky.so")
    shutil.copy(lib, libdir / "libggml-leaky.so.0")  # a copy of the same library: checked once
    report = tmp_path / "exports.txt"
    with pytest.raises(SystemExit) as e:
        b.check_exports(libdir, report)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("build_llama: error: libggml-leaky.so exports ")
    assert err.count("\n") == 1  # one line, like the script's other errors
    assert "leaky_name" in err
    assert "_Z10leaky_nameB5cxx11i" in report.read_text()


def test_a_static_libstdcxx_is_caught_and_the_version_script_hides_it(b, built) -> None:
    """The first GPU machine's libggml-cuda: libstdc++'s objects linked in (std::ostream's members, the locale
    facets' GNU-unique ids) and exported. -static-libstdc++ reproduces that with any GCC; the map hides it all."""
    lib = built(LEAKY, "libggml-static.so", "-static-libstdc++")
    bad = b.export_problems(lib)
    runtime = [s for s in bad if b.CXX_RUNTIME.match(s)]
    assert any(s.startswith("_ZNSo") for s in runtime)  # std::ostream
    assert any(s.startswith("_ZGVNSt") for s in runtime)  # guard variables of std:: statics (facet ids)
    assert "__cxa_guard_acquire" in runtime
    assert set(bad) - set(runtime) == {"_Z10leaky_nameB5cxx11i"}  # all else is the runtime's
    line = b.describe_export_problems(lib, bad)
    assert f"{len(bad)} symbol(s) outside its API" in line
    assert f"{len(runtime)} of them std:: or C++ runtime symbols" in line
    assert bad[0] in runtime and bad[0] in line  # it leads with a runtime symbol
    assert (nm := nm_exports(lib)) is None or set(b.exported_symbols(lib)) == nm

    hidden = built(LEAKY, "libggml-static-mapped.so", "-static-libstdc++", built.map, "-Wl,--exclude-libs,ALL")
    assert b.exported_symbols(hidden) == ["ggml_foo"]
    assert b.export_problems(hidden) == []


def test_the_version_script_hides_std_instances_compiled_in(b, built) -> None:
    """Without any static library: the std:: instances a library's own code instantiates are exported by default
    (libstdc++ declares namespace std with default visibility), and the map hides them."""
    plain = built(LEAKY, "libggml-plain.so")
    assert b.export_problems(plain)
    mapped = built(LEAKY, "libggml-mapped.so", built.map)
    assert b.export_problems(mapped) == []


def test_which_api_each_library_has(b) -> None:
    assert b.export_api("libggml-base.so.0").match("dequantize_row_q4_0")  # ggml-quants.h: GGML_API
    assert not b.export_api("libggml-cpu.so").match("quantize_row_q4_0")  # ggml-cpu's own, not API
    assert b.export_api("libggml-cuda.so.0.25.3").match("ggml_backend_cuda_init")
    assert b.export_api("libggml-rpc.so").match("ggml_backend_rpc_start_server")
    assert b.export_api("libllama.so.0").match("llama_pyspecter_version")
    assert not b.export_api("libllama.so").match("ggml_init")
    assert b.export_api("libmtmd.so") is None  # not built here: not checked


@pytest.mark.parametrize("name, runtime", [
    ("_ZNSo9_M_insertIlEERSoT_", True),  # std::ostream::_M_insert<long>
    ("_ZNKSt7codecvtIDsc11__mbstate_tE10do_unshiftERS0_PcS3_RS3_", True),
    ("_ZGVNSt7__cxx1110moneypunctIcLb0EE2idE", True),  # guard variable for moneypunct<char,false>::id
    ("_ZSt4cout", True),
    ("_ZTVSt9bad_alloc", True),
    ("_ZTv0_n24_NSt9basic_iosIcSt11char_traitsIcEED1Ev", True),  # virtual thunk
    ("_ZZNSt8__detail18__to_chars_10_implIjEEvPcjjE8__digits", True),  # a local static of a std function
    ("_ZN9__gnu_cxx18stdio_sync_filebufIcSt11char_traitsIcEE4syncEv", True),
    ("_Znwm", True),
    ("__cxa_guard_acquire", True),
    ("_Z24gguf_read_emplace_helperINSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEEEbRK11gguf_reader", False),
    ("_ZN26ggml_backend_meta_contextD2Ev", False),
    ("_Z5StateP6Stuff", False),
    ("ggml_init", False),
])
def test_the_runtime_is_told_by_mangled_name(b, name: str, runtime: bool) -> None:
    assert bool(b.CXX_RUNTIME.match(name)) is runtime


def test_a_file_that_is_not_elf_fails_in_one_line(b, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "libggml.so").write_text("not a library")
    with pytest.raises(SystemExit) as e:
        b.check_exports(tmp_path)
    assert e.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
