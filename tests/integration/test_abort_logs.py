"""A fatal ggml abort says what happened: the error and warning lines llama.cpp and ggml logged just before it (on a
GPU: the CUDA error string, the function, the failing statement and the op) are printed ahead of the abort message,
though the quiet log sink keeps them off stderr while the process lives (issue 41, item 6)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from pyspecter import native
from pyspecter.models.tiny import build_tiny

HEADER = "llama.cpp's last errors and warnings before it aborted:"

# A failed model load (an error through llama.cpp's logging, not fatal), then a real fatal one: a tensor bigger than
# its ggml context, which ggml reports as a warning ("not enough space in the context's memory pool") and then
# GGML_ASSERT(obj_new). libggml-base is bound by its soname, so that ctypes finds the copy libllama loaded (a
# second copy, by another file name, would have its own log and abort state).
SCRIPT = textwrap.dedent("""
    import ctypes, os, sys
    import llama_cpp
    from pyspecter import native

    native.quiet_logs()
    assert not llama_cpp.llama_model_load_from_file(b"/nonexistent/model.gguf",
                                                    llama_cpp.llama_model_default_params())
    print("remembered:", native.recent_log_errors(), flush=True)
    if sys.argv[1] == "abort":
        class Params(ctypes.Structure):
            _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]
        base = ctypes.CDLL("libggml-base.so.0", mode=os.RTLD_NOLOAD)
        base.ggml_init.restype, base.ggml_init.argtypes = ctypes.c_void_p, [Params]
        base.ggml_new_tensor_1d.restype = ctypes.c_void_p
        base.ggml_new_tensor_1d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
        ctx = base.ggml_init(Params(1024, None, False))
        base.ggml_new_tensor_1d(ctx, 0, 1 << 20)  # GGML_TYPE_F32, 4 MiB in a 1 KiB context
        print("not reached", flush=True)
""")


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)


def test_non_fatal_errors_stay_quiet_and_are_remembered() -> None:
    r = _run("quiet")
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr  # the failed load printed nothing: callers report their own one-line error
    assert "failed to load model" in r.stdout, r.stdout


def test_fatal_abort_prints_the_last_error_lines_before_its_message() -> None:
    r = _run("abort")
    assert r.returncode == -signal.SIGABRT, (r.returncode, r.stderr)
    assert "not reached" not in r.stdout
    err = r.stderr
    assert err.startswith(HEADER), err  # nothing reached stderr before the abort
    remembered = err.index("llama_model_load_from_file_impl: failed to load model")
    warning = err.index("ggml_new_object: not enough space in the context's memory pool")
    message = err.index("GGML_ASSERT(obj_new) failed")
    assert remembered < warning < message, err
    assert err.count(HEADER) == 1


def test_split_counts_still_read_from_the_quiet_sink() -> None:
    # graph_splits (bench, verify) reads llama_context's "splits = " line, which the native sink now keeps
    with native.Model(build_tiny("tiny-mixtral")) as m, native.Context(m):
        splits = native.graph_splits()
    assert splits is not None and splits[0] >= 1 and splits[1] >= 1, splits
    assert all("splits = " not in line for line in native.recent_log_errors())  # an info line, not an error
