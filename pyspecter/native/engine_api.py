"""The residency engine's test and approximate-mode inputs of the C API (csrc/include/llama-pyspecter.h): injected
read faults (tests) and surrogates (miss mode 'surrogate'). Declared like the rest of ``lib`` and bound with it."""

from __future__ import annotations

import ctypes
from typing import Any

from pyspecter.native.lib import ModelPtr, _i32, _i64, _model, _size, ctypes_function


class ReadFaults(ctypes.Structure):
    """struct llama_pyspecter_read_faults: faults injected into native residency's reads (tests). fail_every: every
    n-th read fails (0: none); torn: a failing read first fills its slot bytes with NaN; slow_us: every read waits
    first; land_us: every read NaN-fills its slot bytes and waits before landing."""

    _fields_ = [
        ("fail_every", ctypes.c_int32),
        ("torn", ctypes.c_bool),
        ("slow_us", ctypes.c_int32),
        ("land_us", ctypes.c_int32),
    ]


@ctypes_function("llama_pyspecter_set_surrogates", [_model, _i32, _i32, _i32, _i32, ctypes.c_void_p, _i32], _i32)
def llama_pyspecter_set_surrogates(model: ModelPtr, il: int, first: int, n_reserved: int, group: int, groups: int,
                                   n_keep: int, /) -> int:
    """int32_t llama_pyspecter_set_surrogates(llama_model *, int32_t il, int32_t first, int32_t n_reserved,
    int32_t group, const int32_t * groups, int32_t n_keep): layer il's reserved slots and each expert's kept neuron
    groups (groups: the address of int32 [n_expert][n_keep]); copied."""


@ctypes_function("llama_pyspecter_set_surrogate_bytes", [_model, _i32, _i32, ctypes.c_void_p, _size], _i32)
def llama_pyspecter_set_surrogate_bytes(model: ModelPtr, il: int, kind: int, data: int, nbytes: int, /) -> int:
    """int32_t llama_pyspecter_set_surrogate_bytes(llama_model *, int32_t il, int32_t kind, const void * data,
    size_t nbytes): the kept bytes of kind `kind` of every expert of layer il (surrogate.py's layout); copied."""


@ctypes_function("llama_pyspecter_surrogate_uses", [_model], _i64)
def llama_pyspecter_surrogate_uses(model: ModelPtr, /) -> int:
    """int64_t llama_pyspecter_surrogate_uses(const llama_model *): misses served by surrogates so far."""


@ctypes_function("llama_pyspecter_set_read_faults", [_model, ctypes.POINTER(ReadFaults)], _i32)
def llama_pyspecter_set_read_faults(model: ModelPtr, faults: Any, /) -> int:
    """int32_t llama_pyspecter_set_read_faults(llama_model *, const llama_pyspecter_read_faults *): every read of
    native residency goes through these faults from the next one on (between decodes)."""


@ctypes_function("llama_pyspecter_read_faults_injected", [_model], _i64)
def llama_pyspecter_read_faults_injected(model: ModelPtr, /) -> int:
    """int64_t llama_pyspecter_read_faults_injected(const llama_model *): reads failed by injection so far."""
