"""One capped benchmark run, in a child process: ``python -m pyspecter.study.bench_child CGROUP_PROCS ARGS_JSON``.

The child joins the memory cgroup (CGROUP_PROCS; '-' for none) before it imports llama.cpp or touches the
model, so the cap holds every page it maps, then prints the run as one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    procs, args = argv[0], json.loads(argv[1])
    if procs != "-":
        Path(procs).write_text(str(os.getpid()))
    from pyspecter.layout import read_layout
    from pyspecter.study import bench

    p = Path(args["path"])
    if args["fn"] == "run":
        r = bench._run(args["policy"], p, read_layout(p), args["slots"], "disk", args["prompt_len"], args["n"],
                       args["n_threads"], args["surrogate_width"])
    else:
        r = bench._run_specter(p, Path(args["draft"]), args["budget_bytes"], args["count_draft"], "disk",
                               args["prompt_len"], args["n"], args["n_threads"], args["k"], args["adaptive"],
                               args["cutoff"])
    print(json.dumps(dataclasses.asdict(r)))


if __name__ == "__main__":
    from pyspecter.errors import SpecterError

    try:
        main(sys.argv[1:])
    except SpecterError as e:
        print(f"pyspecter: error: {e}", file=sys.stderr)
        sys.exit(2)
