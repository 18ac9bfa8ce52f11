"""The decode layers' routing CPU histogram of the C API (csrc/include/llama-pyspecter.h), declared like the rest
of ``lib`` and bound with it."""

from __future__ import annotations

import ctypes
from typing import Any

from pyspecter.native.lib import ModelPtr, _i32, _model, ctypes_function, slots

# LLAMA_PYSPECTER_HIST_BINS / _NS: bins of a decode layer's routing CPU (its routing op and wait ops, read waits
# and copies left out; one layer in 8 sampled), row 0 layers with every needed expert resident, row 1 with a miss
HIST_BINS = 257
HIST_NS = 250


@ctypes_function("llama_pyspecter_get_layer_cpu_hist", [_model, ctypes.POINTER(ctypes.c_int64), _i32], _i32)
def llama_pyspecter_get_layer_cpu_hist(model: ModelPtr, out: Any, n: int, /) -> int:
    """Copy the two rows of HIST_BINS counts into out (n >= 2 * HIST_BINS); their count or a negative status."""
    ...


def layer_cpu_hist(model: ModelPtr) -> tuple[list[int], list[int]]:
    """The histogram since the last stats_reset: (all resident, with a miss), HIST_BINS counts each."""
    out = (ctypes.c_int64 * (2 * HIST_BINS))()
    if slots().get_layer_cpu_hist(model, out, 2 * HIST_BINS) != 2 * HIST_BINS:
        return [0] * HIST_BINS, [0] * HIST_BINS
    return list(out[:HIST_BINS]), list(out[HIST_BINS:])
