"""The embedded model ships with its predictor: ``smol-moe`` resolves to its GGUF and the learned routing predictor
fitted for that file (models/predictor_fit.py, the fit ``pyspecter fit-predictor`` runs), fitted on first use and cached
as the model's sidecar, which is keyed by the file's content (``learned.sidecar_path``), so a fresh machine's
``generate smol-moe`` prefetches as the engine is meant to.

The fit here is smaller than ``fit-predictor``'s default (12000 fit and 2048 held-out tokens, about 10 minutes on
two idle cores), so that a fresh clone's ``make test`` stays cheap: recording runs the model token by token with a
Python hook at every layer, ~40 ms of CPU a token on smol-moe. Measured on the shared 2-core machine under load
(load average 12-15), fit + held-out tokens: 2000 + 256 took 544 s wall and 116 s of CPU, and recalled 68.2% of
the next MoE layer's top-2 on held-out text; 1500 + 256: 475 s, 91 s, 65.3%; 1000 + 256: 186 s, 68 s, 62.9%. The
full fit recalls 78.5% (docs/PREDICTION.md). ``pyspecter fit-predictor smol-moe`` replaces this one with the full
fit (the same sidecar).
"""

from __future__ import annotations

import contextlib
import fcntl
import sys
from pathlib import Path

from pyspecter.learned import LearnedPredictor, model_key, predictors_dir, sidecar_path

EMBEDDED_FIT_TOKENS = 1000
EMBEDDED_EVAL_TOKENS = 256
EMBEDDED_HORIZONS = 4


@contextlib.contextmanager
def _lock(path: Path):
    """One fit at a time per model file: a second process waits, then finds the sidecar the first wrote."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_predictor(model_path: Path, *, progress: bool = True) -> Path:
    """The sidecar predictor of ``model_path``, fitted now (EMBEDDED_FIT_TOKENS tokens) when there is none."""
    key = model_key(model_path)
    side = sidecar_path(model_path, key)
    if LearnedPredictor.for_model(model_path) is not None:
        return side
    with _lock(predictors_dir() / f".{side.stem}.lock"):
        if LearnedPredictor.for_model(model_path) is not None:  # another process fitted it while we waited
            return side
        from pyspecter.models.predictor_fit import fit_model

        if progress:
            print(f"{model_path.stem}: fitting its learned routing predictor on {EMBEDDED_FIT_TOKENS} tokens "
                  "(once per model file; about a minute on two idle cores)", file=sys.stderr, flush=True)
        r = fit_model(model_path, None, horizons=EMBEDDED_HORIZONS, n_tokens=EMBEDDED_FIT_TOKENS,
                      eval_tokens=EMBEDDED_EVAL_TOKENS, n_threads=1, progress=progress)
        if progress:
            h1 = r["held_out"].get("1", {}).get("recall")
            print(f"{model_path.stem}: predictor written to {r['out']} in {r['seconds']:.0f}s"
                  + (f" (held-out top-{r['n_expert_used']} recall one MoE layer ahead {100 * h1:.1f}%)"
                     if h1 is not None else ""), file=sys.stderr, flush=True)
    return side
