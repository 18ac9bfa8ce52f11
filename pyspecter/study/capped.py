"""Running one measurement in a child process under a memory cap, fairly: the child joins a memory cgroup (v1 or
v2) holding its memory, page cache included, to a cap, and the file's page cache is dropped first. That holds
stock llama.cpp's mmap and our host path alike to the same memory. Used by the bench and the demo.

Parent: ``run_capped(module, job, path, cap_bytes)`` runs ``python -m MODULE CGROUP_PROCS JOB_JSON`` and returns
its last stdout line as JSON. Child: ``child_main(argv, run)`` joins the cgroup before anything else (so the cap
holds every page it maps), calls ``run(job)`` and prints the result.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from pyspecter.errors import SpecterError

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory controller
CGROUP2_ROOT = Path("/sys/fs/cgroup")  # the unified (v2) hierarchy
RUNTIME_HEADROOM = 256 * 2**20  # Python, llama.cpp buffers and KV cache on top of the weights
CHILD_TIMEOUT_S = 1800  # one capped policy run; a stuck child must not hold the cgroup forever


def _raise_interrupt(_sig, _frame) -> None:
    raise KeyboardInterrupt


def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _make_cgroup(cap_bytes: int) -> tuple[Path | None, str]:
    """A child memory cgroup holding ``cap_bytes``, page cache included: cgroup v1 (``memory.limit_in_bytes`` under
    the memory controller's root) or v2 (``memory.max`` in a child of the unified root, where the memory
    controller is enabled for children, as systemd does). Returns (its folder, "v1" | "v2"), or (None, "none")
    when neither is writable."""
    name = f"pyspecter-bench-{os.getpid()}"
    for kind, root, limit in (("v1", CGROUP_ROOT, "memory.limit_in_bytes"),
                              ("v2", CGROUP2_ROOT, "memory.max")):
        if kind == "v2" and "memory" not in _read(root / "cgroup.subtree_control").split():
            continue
        if kind == "v1" and not root.is_dir():
            continue
        cg = root / name
        try:
            cg.mkdir()
        except OSError:
            continue
        try:
            (cg / limit).write_text(str(cap_bytes))
            return cg, kind
        except OSError:
            with contextlib.suppress(OSError):
                cg.rmdir()
    return None, "none"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _cap_hits(events: str, kind: str) -> int:
    """Times the cgroup ran into its cap: v1's failcnt, v2's memory.events "max" count (-1: unknown)."""
    if kind == "v1":
        return int(events.strip() or -1)
    for line in events.splitlines():
        key, _, val = line.partition(" ")
        if key == "max":
            return int(val)
    return -1


def run_capped(module: str, job: dict, path: Path, cap_bytes: int) -> tuple[dict, dict]:
    """``job`` (with "path") in ``python -m module`` under a ``cap_bytes`` memory cgroup, the file's page cache
    dropped first. Returns the child's JSON result and how the cap held. Without a writable cgroup the page cache
    is only dropped before the run, and the second dict says so."""
    cg, kind = _make_cgroup(cap_bytes)
    how = {"memory_cap": f"cgroup {kind} memory cap {cap_bytes / 2**20:.0f} MiB (page cache included), cold start"
           if cg else "no writable cgroup: page cache dropped before the run, not capped",
           "cap_bytes": cap_bytes, "capped": cg is not None, "cgroup": kind}
    _drop_page_cache(path)
    # a SIGTERM (a killed sweep) unwinds through the finally below like Ctrl-C does: the child is killed by
    # subprocess.run and the cgroup removed, instead of both outliving us
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        procs = str(cg / "cgroup.procs") if cg else "-"
        try:
            r = subprocess.run([sys.executable, "-m", module, procs, json.dumps({**job, "path": str(path)})],
                               capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SpecterError(f"a capped run took over {CHILD_TIMEOUT_S} s and was stopped") from None
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["killed (out of memory under the cap?)"])[-1]
            raise SpecterError(last.removeprefix("pyspecter: error: "))
        # how hard the cap pressed: times the cgroup hit its limit and reclaimed (a thrashing run shows here)
        events = _read(cg / ("memory.failcnt" if kind == "v1" else "memory.events")) if cg else ""
        how["cap_hits"] = _cap_hits(events, kind)
        return json.loads(r.stdout.strip().splitlines()[-1]), how
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if cg is not None:
            with contextlib.suppress(OSError):
                cg.rmdir()


def child_main(argv: list[str], run: Callable[[dict], dict]) -> None:
    """The child's side: join the cgroup (argv[0]; "-" for none) before the model is touched, run the job
    (argv[1]), print its result as one JSON line; a bad input is one line on stderr and exit code 2."""
    try:
        procs, job = argv[0], json.loads(argv[1])
        if procs != "-":
            Path(procs).write_text(str(os.getpid()))
        result = run(job)
        # major page faults: pages the child had to read back from the file (mmap'd weights evicted by the cap)
        result["major_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        print(json.dumps(result))
    except SpecterError as e:
        print(f"pyspecter: error: {e}", file=sys.stderr)
        sys.exit(2)
