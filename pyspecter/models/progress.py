"""Progress of long builds on stderr: one line rewritten in place on a terminal; whole lines, about every 10%,
when stderr is a file or a pipe (CI logs, `make demo | tee`), where "\r" would run the steps together.

Kept out of the builders' own files: their source bytes are part of their cache keys, this one's are not.
"""

from __future__ import annotations

import sys


def step(msg: str, i: int, n: int) -> None:
    """Step ``i`` of ``n`` (1-based) is done; ``msg`` says so (it includes ``i/n``)."""
    if sys.stderr.isatty():
        print("\r" + msg, end="", file=sys.stderr, flush=True)
    elif i == n or i * 10 // max(n, 1) != (i - 1) * 10 // max(n, 1):
        print(msg, file=sys.stderr, flush=True)


def done() -> None:
    """After the last step: end the line a terminal was rewriting (nothing to do for whole lines)."""
    if sys.stderr.isatty():
        print(file=sys.stderr, flush=True)
