"""One capped benchmark run, in a child process: ``python -m pyspecter.study.bench_child CGROUP_PROCS ARGS_JSON``.

``capped.child_main`` joins the memory cgroup before this imports llama.cpp or touches the model, so the cap holds
every page it maps; the run comes back as one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from pyspecter.study.capped import child_main


def run(args: dict) -> dict:
    from pyspecter.layout import read_layout
    from pyspecter.study.bench_runs import run_policy, run_specter

    p = Path(args["path"])
    # what every run shares (bench.run_bench wrote it): the prompts' tokens and static-hot's profile
    inputs = json.loads(Path(args["inputs"]).read_text())
    prompts, hot, forced = inputs["prompts"], inputs["hot"], inputs.get("forced")
    if args["fn"] == "run":
        r = run_policy(args["policy"], p, read_layout(p), args["slots"], "disk", prompts, args["n"],
                       args["n_threads"], args["surrogate_width"],
                       {int(il): c for il, c in hot.items()} if hot else None,  # JSON keys are strings
                       budget_bytes=args.get("budget_bytes", 0),
                       extra={int(il): n for il, n in args.get("extra", {}).items()}, forced=forced)
    else:
        r = run_specter(p, Path(args["draft"]) if args["draft"] else None, args["budget_bytes"], args["count_draft"],
                        "disk", prompts,
                        args["n"], args["n_threads"], args["k"], args["adaptive"],
                        forced=forced if not args["draft"] else None)
    return dataclasses.asdict(r)


if __name__ == "__main__":
    child_main(sys.argv[1:], run)
