"""One capped benchmark run, in a child process: ``python -m pyspecter.study.bench_child CGROUP_PROCS ARGS_JSON``.

``capped.child_main`` joins the memory cgroup before this imports llama.cpp or touches the model, so the cap holds
every page it maps; the run comes back as one JSON line.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from pyspecter.study.capped import child_main


def run(args: dict) -> dict:
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
    return dataclasses.asdict(r)


if __name__ == "__main__":
    child_main(sys.argv[1:], run)
