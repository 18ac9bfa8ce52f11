"""Patch 0006's strict ids, checked on ggml's CPU mul_mat_id itself: a GPU's MUL_MAT_ID contract (every id in range,
none twice in a token, a token's ids contiguous) makes the CPU kernel abort where it would otherwise compute, so
the RPC device (`rpc-server --strict`) fails where a GPU would corrupt memory or assert. The RPC suites rely on it;
this checks each rule alone, and that the same graphs compute the reference product without it.

Each case runs in its own process (an abort ends it), building one mul_mat_id with ggml's C API through ctypes from
the libraries `import llama_cpp` loaded (bound by soname, so it is the patched copy)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import ctypes, os, sys
    import numpy as np
    import llama_cpp  # noqa: F401  (loads the patched ggml libraries)

    case, strict = sys.argv[1], sys.argv[2] == "strict"
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    base = ctypes.CDLL("libggml-base.so.0", mode=os.RTLD_NOLOAD)
    cpu = ctypes.CDLL("libggml-cpu.so.0", mode=os.RTLD_NOLOAD)

    class Params(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", vp), ("no_alloc", ctypes.c_bool)]

    for name, res, args in [("ggml_init", vp, [Params]), ("ggml_new_tensor_2d", vp, [vp, ctypes.c_int, i64, i64]),
                            ("ggml_new_tensor_3d", vp, [vp, ctypes.c_int, i64, i64, i64]),
                            ("ggml_mul_mat_id", vp, [vp, vp, vp, vp]), ("ggml_transpose", vp, [vp, vp]),
                            ("ggml_new_graph", vp, [vp]), ("ggml_build_forward_expand", None, [vp, vp]),
                            ("ggml_get_data", vp, [vp]), ("ggml_nbytes", ctypes.c_size_t, [vp])]:
        f = getattr(base, name)
        f.restype, f.argtypes = res, args
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
    cpu.ggml_cpu_set_strict_ids.argtypes = [ctypes.c_bool]
    cpu.ggml_cpu_init()
    cpu.ggml_cpu_set_strict_ids(strict)

    F32, I32 = 0, 26
    K, N, n_as, n_used, n_tok = 32, 8, 4, 2, 3
    rng = np.random.default_rng(0)
    A = rng.standard_normal((n_as, N, K), dtype=np.float32)      # ggml [K, N, n_as]
    B = rng.standard_normal((n_tok, n_used, K), dtype=np.float32)  # ggml [K, n_used, n_tok]
    ids = np.array([[0, 1], [2, 3], [1, 2]], dtype=np.int32)       # ggml [n_used, n_tok]
    if case == "range":
        ids[1, 0] = n_as
    elif case == "twice":
        ids[2] = [3, 3]
    elif case.startswith("negative"):  # rows computed elsewhere: zero rows, as many in a token as it has
        ids[1, 0] = -1
        ids[2] = [-1, -1]

    def put(t, arr):
        arr = np.ascontiguousarray(arr)
        assert base.ggml_nbytes(t) == arr.nbytes
        ctypes.memmove(base.ggml_get_data(t), arr.ctypes.data, arr.nbytes)

    ctx = base.ggml_init(Params(16 << 20, None, False))
    a = base.ggml_new_tensor_3d(ctx, F32, K, N, n_as)
    b = base.ggml_new_tensor_3d(ctx, F32, K, n_used, n_tok)
    put(a, A)
    put(b, B)
    if case == "strided":  # the same ids, stored token-minor and seen through a transpose: 4 * n_tok bytes apart
        t = base.ggml_new_tensor_2d(ctx, I32, n_tok, n_used)
        put(t, ids.T)
        t = base.ggml_transpose(ctx, t)
    else:
        t = base.ggml_new_tensor_2d(ctx, I32, n_used, n_tok)
        put(t, ids)
    out = base.ggml_mul_mat_id(ctx, a, b, t)  # ggml [N, n_used, n_tok]
    if case == "negative-marked":  # op_params[GGML_MUL_MAT_ID_NEGATIVE_ZERO], the last (patch 0001's ggml.h)
        class Head(ctypes.Structure):  # struct ggml_tensor up to its op_params
            _fields_ = [("type", ctypes.c_int), ("buffer", vp), ("ne", i64 * 4), ("nb", ctypes.c_size_t * 4),
                        ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16)]
        Head.from_address(out).op_params[15] = 1
    g = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(g, out)
    assert cpu.ggml_graph_compute_with_ctx(ctx, g, 2) == 0
    got = np.ctypeslib.as_array(ctypes.cast(base.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)),
                                shape=(n_tok, n_used, N))
    want = np.einsum("tjnk,tjk->tjn", A[np.maximum(ids, 0)], B) * (ids >= 0)[..., None]
    print("max_err", float(np.abs(got - want).max()), flush=True)
""")


def _run(case: str, mode: str) -> subprocess.CompletedProcess:
    # an abort is what some cases expect: ggml's backtrace on abort (it attaches a debugger) adds nothing to that,
    # and under AddressSanitizer (make asan-test) it hung past the timeout
    return subprocess.run([sys.executable, "-c", SCRIPT, case, mode], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GGML_NO_BACKTRACE": "1"})


def _max_err(r: subprocess.CompletedProcess) -> float:
    assert r.returncode == 0, r.stderr
    return float(r.stdout.split("max_err")[1])


@pytest.mark.parametrize("mode", ["strict", "lenient"])
def test_valid_ids_compute_the_product(mode: str) -> None:
    assert _max_err(_run("ok", mode)) < 1e-4


def test_strided_ids_compute_the_product_when_lenient() -> None:
    # the CPU kernel reads ids through their strides, so only the strict check stops them
    assert _max_err(_run("strided", "lenient")) < 1e-4


def test_negative_ids_are_zero_rows_where_the_op_says_so() -> None:
    """Patch 0001: a negative id is a zero row on the CPU, marked or not; strict (0006) accepts one only in an op
    marked GGML_MUL_MAT_ID_NEGATIVE_ZERO, what CUDA's kernels honour (0008), several in a token included."""
    for mode in ("strict", "lenient"):
        assert _max_err(_run("negative-marked", mode)) < 1e-4
    assert _max_err(_run("negative", "lenient")) < 1e-4


@pytest.mark.parametrize(("case", "message"), [
    ("range", "expert id 4 (token 1, row 0) outside [0, 4)"),
    ("negative", "expert id -1 (token 1, row 0) outside [0, 4)"),
    ("twice", "expert id 3 twice in token 2 (rows 0 and 1)"),
    ("strided", "a token's expert ids are 12 bytes apart, not contiguous"),
])
def test_strict_aborts_where_a_gpu_kernel_would_not_survive(case: str, message: str) -> None:
    r = _run(case, "strict")
    assert r.returncode == -signal.SIGABRT, (r.returncode, r.stdout, r.stderr)
    assert "strict ids:" in r.stderr and message in r.stderr, r.stderr
    assert "max_err" not in r.stdout


def test_mmid_check_holds_on_the_strict_rpc_device() -> None:
    """tools/mmid_check.py, gpu_check's probe of patch 0008 on a GPU's own kernels, run here against the strict RPC
    device (the CPU's kernels, 0001, held to CUDA's contract by 0006): every case it has holds, so on a GPU a failing
    case is the kernel's, not the harness's. Its marks are what strict accepts (an unmarked negative id aborts)."""
    import json
    from pathlib import Path

    from test_device import free_port, start_server, stop_server

    port = free_port()
    proc = start_server(port)
    try:
        r = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "tools" / "mmid_check.py"), "--device",
                            f"rpc:127.0.0.1:{port}", "--json"], capture_output=True, text=True, timeout=300)
    finally:
        stop_server(proc)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"] and len(out["cases"]) == 19
    assert all(c["negative_rows"] > 0 and c["negative_rows_zero"] for c in out["cases"])
