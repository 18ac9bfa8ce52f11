"""The C API of a draft's handover to its target's planner (csrc/include/llama-pyspecter.h, csrc/draft.cpp),
declared like the rest of ``lib`` and bound with it (``slots()`` binds every declaration once this module is
imported)."""

from __future__ import annotations

import ctypes
from typing import Any

from pyspecter.native.lib import ModelPtr, _i32, _model, ctypes_function


class DraftStats(ctypes.Structure):
    """struct llama_pyspecter_draft_stats: a target's draft handovers (llama_pyspecter_draft_handover)."""

    _fields_ = [
        ("handovers", ctypes.c_int64),  # draft steps handed over
        ("picks", ctypes.c_int64),  # (token, layer, expert) rows the draft routed in them at min_conf or more
        ("predicted", ctypes.c_int64),  # distinct (layer, expert) of a window at min_conf or more
        ("resident", ctypes.c_int64),  # ... resident already at the handover
        ("prefetches", ctypes.c_int64),  # ... queued as prefetches
        ("refused", ctypes.c_int64),  # ... refused: no slot held an expert predicted less likely
        ("scored", ctypes.c_int64),  # prefetches of closed windows
        ("used", ctypes.c_int64),  # ... that the target needed at their layer within their window
        ("stale", ctypes.c_int64),  # ... unused and still queued when their window closed: taken back
        ("needed", ctypes.c_int64),  # the target's needs in windows (distinct experts per routing call)
        ("hits", ctypes.c_int64),  # ... resident at need
        ("recalled", ctypes.c_int64),  # ... that the draft predicted
        ("lru_hits", ctypes.c_int64),  # ... that plain LRU over the usable slots would have had resident
    ]


@ctypes_function("llama_pyspecter_draft_handover", [_model, _model, ctypes.c_float, _i32, _i32], _i32)
def llama_pyspecter_draft_handover(target: ModelPtr, draft: ModelPtr, min_conf: float, per_pass: int, n_tokens: int,
                                   /) -> int:
    """Close the target's draft window and arm the draft for its next n_tokens tokens, whose routing its routing op
    turns into the target's prefetches (draft None: only close the window). 0, or a negative status."""


@ctypes_function("llama_pyspecter_draft_unlink", [_model], _i32)
def llama_pyspecter_draft_unlink(draft: ModelPtr, /) -> int:
    """The draft's routing goes to no target from here on."""


@ctypes_function("llama_pyspecter_get_draft_stats", [_model, ctypes.POINTER(DraftStats)], _i32)
def llama_pyspecter_get_draft_stats(target: ModelPtr, out: Any, /) -> int:
    """The target's draft handover counters into out."""
