"""Two builds of one key at once deleted each other's work tree (seen: a build failed with llama.h missing while
a second build of the same key re-extracted the sdist). The key's lock makes the second wait."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def test_a_second_build_of_the_same_key_waits(tmp_path: Path) -> None:
    sys.path.insert(0, str(TOOLS))
    try:
        import build_llama
    finally:
        sys.path.remove(str(TOOLS))
    held = build_llama.hold_key_lock(tmp_path / "KEY")
    probe = ("import fcntl, sys; f = open(sys.argv[1], 'w')\n"
             "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)\n")
    lock_file = str(tmp_path / "KEY" / ".lock")
    assert subprocess.run([sys.executable, "-c", probe, lock_file]).returncode == 3  # held: another build waits
    held.close()
    assert subprocess.run([sys.executable, "-c", probe, lock_file]).returncode == 0  # released with the process
