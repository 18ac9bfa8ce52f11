"""How cost grows with the model: load time, peak memory, bytes read and time per token, stock llama.cpp against
the disk tier at several budgets, each configuration in a fresh child process (so load time, peak RSS and the
bytes read are that configuration's alone).

Made for models bigger than the machine (``big-qwen3moe``: 32.7 GB on 24 GiB) and run as-is on small ones
(``bench-qwen3moe``) for the scale curve. Nothing is capped: stock gets all the page cache the machine has, which
is what "bigger than RAM" means. Stock is llama.cpp's mmap load with default settings except weight repacking,
which copies every expert into anonymous memory (a model bigger than RAM cannot load that way).

Decode is teacher-forced by default on the random-weight built-ins (``forced.py``: each step fed the next token
of a held-out text, identity checked on the logits), whose greedy text cycles through a few tokens.

Child: ``python -m pyspecter.study.scale JOB_JSON`` prints one JSON line.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from pyspecter.errors import SpecterError
from pyspecter.study.capped import _drop_page_cache
from pyspecter.study.forced import FORCED, default_mode, digest, forced_tokens, same_logits

CHILD_TIMEOUT_S = 3600


def _read_bytes() -> int:
    """Bytes this process has caused to be read from storage (O_DIRECT reads and page faults alike)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _child(job: dict) -> dict:
    """One configuration: load, prefill the prompt, decode n tokens (greedy, or the job's "forced" text, each
    step's logits digested before its timer starts); what each phase cost."""
    import numpy as np

    from pyspecter import native

    path, n = Path(job["model"]), job["n"]
    t0, r0 = time.perf_counter(), _read_bytes()
    out: dict = {"config": job["config"]}
    if job["config"] == "stock":
        model = native.Model(path)  # mmap, pre-faulted; no repacking (see the module docstring)
        ctx = native.Context(model, n_ctx=len(job["prompt"]) + n + 8, n_threads=job["threads"])
        ctx.warmup()
        decode, cache, session = ctx.decode, None, None
    else:
        from pyspecter.session import Session, SessionConfig

        session = Session(SessionConfig(model=path, budget=job["budget"], tier="disk", n_threads=job["threads"],
                                        force=True, n_ctx=len(job["prompt"]) + n + 8))
        decode, cache = session.tctx.decode, session.cache
        out.update(slots_per_layer=session.n_slots)
    out.update(load_s=time.perf_counter() - t0, load_read_bytes=_read_bytes() - r0,
               rss_after_load=_rss())
    t1, r1 = time.perf_counter(), _read_bytes()
    logits = decode(job["prompt"])
    out.update(prefill_s=time.perf_counter() - t1, prefill_read_bytes=_read_bytes() - r1)
    if cache is not None:
        cache.check()
        cache.reset_counters()
    tokens, tpots, forced = [], [], job.get("forced")
    digests: list[str] = []
    r2 = _read_bytes()
    for i in range(n):
        if forced is None:
            tokens.append(int(np.argmax(logits)))
        else:
            digests.append(digest(logits))
            tokens.append(forced[i])
        t = time.perf_counter()
        logits = decode([tokens[-1]])
        tpots.append(time.perf_counter() - t)
    out.update(tokens=tokens, tpot_s=sorted(tpots)[len(tpots) // 2], tpots=tpots, digests=digests or None,
               decode_read_bytes_per_token=(_read_bytes() - r2) / n)
    if cache is not None:
        cache.check()
        c = cache.counters()
        out.update(hit_rate=c["hit_rate"], hook_us_per_call=c["hook_us_per_call"],
                   route_us_per_call=c["route_us_per_call"], hook_ms_per_token=c["hook_ms"] / n,
                   upload_bytes_per_token=c["upload_bytes"] / n, route_calls_per_token=c["route_calls"] / n)
        session.close()
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def run_scale(model: str | Path, budgets: list[str], *, n: int = 8, prompt_len: int = 16, threads: int = 2,
              stock: bool = True, cold: bool = True, progress=None, forced: bool | None = None) -> dict:
    """Every configuration in its own child, stock first; ``cold`` drops the file's page cache before each.
    ``forced``: teacher-forced decode (None: on the random-weight built-ins, ``forced.default_mode``)."""
    from pyspecter.layout import read_layout
    from pyspecter.native import Model

    path = Path(model)
    lay = read_layout(path).require_moe()
    with Model(path, lazy_experts=True) as m:  # tokenizing must not read a file bigger than RAM
        prompt = m.tokenize("The quick brown fox jumps over the lazy dog. " * 8)[:prompt_len]
        mode = default_mode(path, forced)
        text = forced_tokens(m, 1, n)[0] if mode == FORCED else None
    configs = (["stock"] if stock else []) + budgets
    runs = []
    for cfg in configs:
        if progress:
            progress(cfg)
        if cold:
            _drop_page_cache(path)
        job = {"model": str(path), "config": cfg, "budget": None if cfg == "stock" else cfg, "n": n,
               "prompt": prompt, "threads": threads, "forced": text}
        r = subprocess.run([sys.executable, "-m", "pyspecter.study.scale", json.dumps(job)], capture_output=True,
                           text=True, timeout=CHILD_TIMEOUT_S)
        if r.returncode != 0:
            runs.append({"config": cfg, "error": (r.stderr.strip().splitlines() or ["no output"])[-1]})
            continue
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    ref = next((x for x in runs if x.get("config") == "stock" and "tokens" in x), None)
    for x in runs:
        if "tokens" in x:
            x["decode"] = mode
            # free: stock's greedy tokens; teacher-forced: stock's logits at every step of the same text
            x["same_tokens_as_stock"] = None if ref is None or text is not None else x["tokens"] == ref["tokens"]
            x["same_logits_as_stock"] = None if ref is None else same_logits(ref.get("digests"), x.get("digests"))
    return {"model": str(path), "file_bytes": lay.file_bytes, "expert_bytes": lay.expert_total_bytes,
            "nonexpert_bytes": lay.nonexpert_bytes, "n_expert": lay.n_expert, "n_expert_used": lay.n_expert_used,
            "n_moe_layers": len(lay.layers), "prompt_tokens": len(prompt), "decode_tokens": n, "decode": mode,
            "threads": threads,
            "ram_bytes": _total_ram(), "cold": cold, "runs": runs}


def _total_ram() -> int:
    import psutil

    return psutil.virtual_memory().total


def main() -> None:
    try:
        print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
    except SpecterError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
