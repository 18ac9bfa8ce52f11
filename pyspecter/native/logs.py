"""llama.cpp's and ggml's logs, through the native sink of csrc/logs.cpp: off stderr, except that a fatal abort
prints the last error and warning lines first; the graph split counts are read from the line it keeps."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from typing import Any

from pyspecter.native.lib import (
    llama_pyspecter_logs_quiet,
    llama_pyspecter_logs_recent,
    llama_pyspecter_logs_splits_line,
)

# llama_context's line at context creation: "graph: nodes = N, splits = S, ..." or, when the prompt (pp) and the
# one-token (tg) graphs differ, "graph (pp bs=.., tg bs=..): nodes = N / n, splits = S / s, ..."
_SPLITS = re.compile(r"graph[^:]*: nodes = \d+(?: / \d+)?, splits = (\d+)(?: / (\d+))?")
_quiet = False  # quiet_logs ran: the native sink holds the lines read below


def quiet_logs() -> None:
    """Silence llama.cpp's stderr chatter (model loading prints hundreds of lines); keep the graph split counts
    (``graph_splits``) and the last error and warning lines, which a fatal ggml abort (a CUDA error, a failed
    GGML_ASSERT) prints before its own message, so that it says what failed, where, and in which op."""
    global _quiet
    llama_pyspecter_logs_quiet()
    _quiet = True


def graph_splits() -> tuple[int, int] | None:
    """(prompt graph, one-token graph) splits of the latest context created in this process, as llama.cpp's
    scheduler counted them at its reserve (each split boundary is a switch between backends: on a device, a host
    round trip); None before any context. Read from the log line the native sink keeps (``quiet_logs``)."""
    if not _quiet:
        return None
    m = _SPLITS.search(_native_text(llama_pyspecter_logs_splits_line))
    if m is None:
        return None
    pp = int(m.group(1))
    return pp, int(m.group(2) or pp)


def recent_log_errors() -> list[str]:
    """llama.cpp's and ggml's latest error and warning lines (at most LLAMA_PYSPECTER_LOG_LINES), oldest first, as
    the native sink remembered them since ``quiet_logs``; what a fatal abort prints before its message."""
    if not _quiet:
        return []
    return _native_text(llama_pyspecter_logs_recent).splitlines()


def _native_text(fn: Callable[[Any, int], int]) -> str:
    """The text a ``(char * buf, int32_t size) -> bytes needed`` function of the C API copies out."""
    size = 4096
    while True:
        buf = ctypes.create_string_buffer(size)
        need = fn(buf, size)
        if need < size:
            return buf.value.decode("utf-8", "replace")
        size = need + 1
