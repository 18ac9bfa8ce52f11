"""Patch 0008's contract, checked on a device's own MUL_MAT_ID kernels in seconds: an op marked
GGML_MUL_MAT_ID_NEGATIVE_ZERO gives an exact zero row for each negative expert id and, in every other row, what the
CPU backend gives (0001). It goes through each kernel path that patch touches, as CUDA picks them by type and batch:

    quantized (Q4_0), 1 token           mul_mat_vec_q (one token)
    quantized, 3 tokens                 mul_mat_vec_q_moe (several tokens; MMQ where its batch limit is lower)
    quantized, 40 tokens                MMQ, with its compact map (and broadcast activations: the dedup it turns off)
    float (F16), 1, 3 and 40 tokens     MMF (its per-expert scan, and mm_ids_helper)
    gate + up + SwiGLU, 1 and 3 tokens  the fused mmvq / mul_mat_vec_q_moe / mmvf kernels, where CUDA fuses them

and the shapes and types the fixtures and the big model bring: top-8 of 32 (mm_ids_helper's 8-wide instance, as
big-qwen3moe-q4 takes it from 9 tokens), 64 rows an expert (tiny n_ff), Q8_0 (tiny-mixtral), MXFP4 (tiny-gptoss,
MMQ from 8 tokens) and F32 (tiny-qwen2moe).

Each case has negative ids in some rows, a token whose rows are all negative, and activations shared by a token's
rows (as gate and up read them) or one per row (as down does). The ggml graph is built through ggml's C API (ctypes)
on the libraries `import llama_cpp` loads, so with a CUDA build first on PYTHONPATH it is that build's kernels.

    python tools/mmid_check.py --device cuda0            # on the GPU machine (tools/gpu_check.sh runs it)
    python tools/mmid_check.py --device rpc:HOST:PORT    # here: `pyspecter rpc-server --strict` stands in

Prints one line per case and a JSON summary with --json; exit 0 when every case holds, 1 when one does not, 2 on bad
arguments or a device that does not open. A kernel that reads through a negative id may also abort the process
(CUDA: an illegal memory access): that is a failure too, named by the last case line printed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

import numpy as np

F32, F16, Q4_0, Q8_0, I32, MXFP4 = 0, 1, 2, 8, 26, 39
NEGATIVE_ZERO = 15  # GGML_MUL_MAT_ID_NEGATIVE_ZERO: the last op_params slot (patch 0001's ggml.h)
K = 256  # row length


class Params(ctypes.Structure):
    """struct ggml_init_params (passed by value)."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class Head(ctypes.Structure):
    """struct ggml_tensor up to its op_params (ggml.h): where the mark goes."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16)]


def libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """libggml-base (tensors, graphs, backends) and libggml (the device registry), as llama_cpp loaded them."""
    import llama_cpp  # noqa: F401  (loads the patched ggml libraries)

    base = ctypes.CDLL("libggml-base.so.0", mode=os.RTLD_NOLOAD)
    reg = ctypes.CDLL("libggml.so.0", mode=os.RTLD_NOLOAD)
    vp, i64, sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
    for lib, name, res, args in [
        (base, "ggml_init", vp, [Params]),
        (base, "ggml_free", None, [vp]),
        (base, "ggml_tensor_overhead", sz, []), (base, "ggml_graph_overhead", sz, []),
        (base, "ggml_new_tensor_2d", vp, [vp, ctypes.c_int, i64, i64]),
        (base, "ggml_new_tensor_3d", vp, [vp, ctypes.c_int, i64, i64, i64]),
        (base, "ggml_mul_mat_id", vp, [vp, vp, vp, vp]), (base, "ggml_swiglu_split", vp, [vp, vp, vp]),
        (base, "ggml_new_graph", vp, [vp]), (base, "ggml_build_forward_expand", None, [vp, vp]),
        (base, "ggml_nbytes", sz, [vp]),
        (base, "ggml_quantize_chunk", sz, [ctypes.c_int, vp, vp, i64, i64, i64, vp]),
        (base, "ggml_backend_alloc_ctx_tensors", vp, [vp, vp]),
        (base, "ggml_backend_buffer_free", None, [vp]),
        (base, "ggml_backend_tensor_set", None, [vp, vp, sz, sz]),
        (base, "ggml_backend_tensor_get", None, [vp, vp, sz, sz]),
        (base, "ggml_backend_graph_compute", ctypes.c_int, [vp, vp]),
        (base, "ggml_backend_free", None, [vp]),
        (reg, "ggml_backend_dev_init", vp, [vp, ctypes.c_char_p]),
    ]:
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return base, reg


def weights(wtype: int, n_as: int, n: int, rng: np.random.Generator) -> bytes:
    """n_as experts of n x K weights as wtype's bytes (quantized by ggml itself)."""
    w = rng.standard_normal((n_as * n, K), dtype=np.float32) * 0.1
    if wtype in (F16, F32):
        return w.astype(np.float16 if wtype == F16 else np.float32).tobytes()
    base, _ = libs()
    out = ctypes.create_string_buffer(2 * n_as * n * K)  # more than any of the quantized types needs
    return out.raw[:base.ggml_quantize_chunk(wtype, w.ctypes.data, out, 0, n_as * n, K, None)]


def ids_for(n_tok: int, n_as: int, n_used: int) -> np.ndarray:
    """[n_tok, n_used] distinct experts a token, some rows negative, token 1 (where there is one) all negative. A
    negative row is ~expert (-1 - expert), as the runtime's slot path writes a miss (csrc pyspecter_miss_id), so
    a kernel that tested for -1 alone would fail here."""
    step = 3 if n_as % 3 else 5  # distinct within a token: coprime with n_as
    ids = np.array([[(t + step * j) % n_as for j in range(n_used)] for t in range(n_tok)], dtype=np.int32)
    for t in range(n_tok):
        for j in range(n_used):
            if (t + j) % 3 == 0 or t == 1:
                ids[t, j] = ~ids[t, j]
    return ids


def run(base, backend: int, w: list[bytes], wtype: int, x: np.ndarray, ids: np.ndarray, n_as: int,
        n: int) -> np.ndarray:
    """One marked MUL_MAT_ID on ``backend`` (two weights: gate and up, joined by SwiGLU): [n_tok, n_used, n]."""
    n_tok, n_used = ids.shape
    ctx = base.ggml_init(Params(16 * base.ggml_tensor_overhead() + base.ggml_graph_overhead(), None, True))
    ws = [base.ggml_new_tensor_3d(ctx, wtype, K, n, n_as) for _ in w]
    b = base.ggml_new_tensor_3d(ctx, F32, K, x.shape[1], n_tok)
    t = base.ggml_new_tensor_2d(ctx, I32, n_used, n_tok)
    mms = [base.ggml_mul_mat_id(ctx, a, b, t) for a in ws]
    for mm in mms:
        Head.from_address(mm).op_params[NEGATIVE_ZERO] = 1
    out = mms[0] if len(mms) == 1 else base.ggml_swiglu_split(ctx, mms[0], mms[1])
    g = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(g, out)
    buf = base.ggml_backend_alloc_ctx_tensors(ctx, backend)
    try:
        for tensor, data in (*zip(ws, w, strict=True), (b, x.tobytes()), (t, ids.tobytes())):
            assert base.ggml_nbytes(tensor) == len(data), (base.ggml_nbytes(tensor), len(data))
            base.ggml_backend_tensor_set(tensor, data, 0, len(data))
        if base.ggml_backend_graph_compute(backend, g) != 0:
            raise RuntimeError("graph compute failed")
        res = np.empty((n_tok, n_used, n), dtype=np.float32)
        base.ggml_backend_tensor_get(out, res.ctypes.data, 0, res.nbytes)
        return res
    finally:
        base.ggml_backend_buffer_free(buf)
        base.ggml_free(ctx)


# name, weight type, tokens, activations shared by a token's rows, gate+up+SwiGLU, experts, used a token, rows each
CASES = [
    ("Q4_0, 1 token (mul_mat_vec_q)", Q4_0, 1, False, False, 8, 4, 128),
    ("Q4_0, 3 tokens (mul_mat_vec_q_moe)", Q4_0, 3, False, False, 8, 4, 128),
    ("Q4_0, 40 tokens (MMQ)", Q4_0, 40, False, False, 8, 4, 128),
    ("Q4_0, 40 tokens, shared activations (MMQ, no dedup)", Q4_0, 40, True, False, 8, 4, 128),
    ("F16, 1 token (MMF scan)", F16, 1, True, False, 8, 4, 128),
    ("F16, 3 tokens (MMF scan)", F16, 3, True, False, 8, 4, 128),
    ("F16, 40 tokens (MMF, mm_ids_helper)", F16, 40, False, False, 8, 4, 128),
    ("Q4_0, gate+up+SwiGLU, 1 token (fused mmvq, where fused)", Q4_0, 1, True, True, 8, 4, 128),
    ("Q4_0, gate+up+SwiGLU, 3 tokens (fused mul_mat_vec_q_moe)", Q4_0, 3, True, True, 8, 4, 128),
    ("F16, gate+up+SwiGLU, 1 token (fused mmvf, where fused)", F16, 1, True, True, 8, 4, 128),
    ("Q4_0, top-8 of 32, 3 tokens (mul_mat_vec_q_moe)", Q4_0, 3, True, False, 32, 8, 128),
    ("Q4_0, top-8 of 32, 40 tokens (MMQ, mm_ids_helper's 8)", Q4_0, 40, False, False, 32, 8, 128),
    ("Q4_0, 64 rows an expert, 40 tokens (MMQ, a partial tile)", Q4_0, 40, False, False, 8, 4, 64),
    ("Q8_0, 1 token (mmvq)", Q8_0, 1, False, False, 16, 2, 128),
    ("Q8_0, 40 tokens (MMQ)", Q8_0, 40, False, False, 16, 2, 128),
    ("MXFP4, 3 tokens (mul_mat_vec_q_moe)", MXFP4, 3, False, False, 32, 4, 64),
    ("MXFP4, 8 tokens (MMQ)", MXFP4, 8, False, False, 32, 4, 64),
    ("F32, 1 token (mmvf / MMF)", F32, 1, True, False, 16, 4, 64),
    ("F32, 40 tokens (MMF, mm_ids_helper)", F32, 40, False, False, 16, 4, 64),
]


def check(device: str) -> list[dict]:
    from pyspecter.native.devices import cpu_device, open_device

    base, reg = libs()
    dev = open_device(device) if device != "cpu" else None
    target = reg.ggml_backend_dev_init(dev.ptr if dev else cpu_device(), None)
    cpu = reg.ggml_backend_dev_init(cpu_device(), None)
    if not target or not cpu:
        raise SystemExit(f"mmid_check: cannot start a backend on {device}")
    rng = np.random.default_rng(0)
    results = []
    try:
        for name, wtype, n_tok, shared, fused, n_as, n_used, n in CASES:
            print(f"mmid_check: {name} ...", file=sys.stderr, flush=True)  # the last one named, if it aborts
            w = [weights(wtype, n_as, n, rng) for _ in range(2 if fused else 1)]
            x = rng.standard_normal((n_tok, 1 if shared else n_used, K), dtype=np.float32)
            ids = ids_for(n_tok, n_as, n_used)
            got = run(base, target, w, wtype, x, ids, n_as, n)
            ref = run(base, cpu, w, wtype, x, ids, n_as, n)
            neg = ids < 0
            scale = float(np.abs(ref).max()) or 1.0
            err = float(np.abs(got[~neg] - ref[~neg]).max() / scale) if (~neg).any() else 0.0
            zero = bool((got[neg] == 0).all()) and bool((ref[neg] == 0).all())
            ok = bool(np.isfinite(got).all()) and zero and err <= 0.02
            results.append({"case": name, "ok": ok, "negative_rows_zero": zero, "finite": bool(np.isfinite(got).all()),
                            "max_rel_err_vs_cpu": err, "negative_rows": int(neg.sum()), "rows": int(neg.size)})
            print(f"{'ok  ' if ok else 'FAIL'} {name}: {int(neg.sum())}/{neg.size} negative rows "
                  f"{'zero' if zero else 'NOT ZERO'}, others within {err:.1e} of the CPU's", flush=True)
    finally:
        base.ggml_backend_free(target)
        base.ggml_backend_free(cpu)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda0", help="cuda0 (default), rpc:HOST:PORT, or cpu (the harness alone)")
    ap.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    a = ap.parse_args(argv)
    try:
        results = check(a.device)
    except Exception as e:  # a device that does not open, a library without the symbols: one line, exit 2
        print(f"mmid_check: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"device": a.device, "ok": all(r["ok"] for r in results), "cases": results}))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
