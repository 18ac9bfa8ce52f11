"""The one line a session without a learned predictor says: that ``pyspecter fit-predictor`` would add
prefetching, and about how long that fit takes, the first time for each model file."""

from __future__ import annotations

import os

from pyspecter.learned import model_key, sidecar_path

# fit-predictor's defaults, and what a fit costs on two idle cores. Measured (1000 fit + 256 held-out tokens, on
# the 2-core machine under load, so CPU time stands for idle wall time): smol-moe (30 MoE layers, d 576, 16
# experts, 147 MB read per token, chat template) recorded at ~40 ms a token and fitted ~0.4 s a layer;
# bench-qwen3moe (16 layers, d 1024, 32 experts, 296 MB, random ids prefilled in 128-token batches) ~12 ms a
# token and ~2.2 s a layer. Recording decodes token by token with a Python hook at every layer (weights at
# ~7 GB/s, ~0.6 ms of hooks a layer; batched random ids about a quarter of that); the ridge and reuse fits grow
# with tokens x d^2 x experts.
FIT_TOKENS, FIT_EVAL_TOKENS = 12000, 2048
_READ_BPS, _HOOK_S_PER_LAYER, _BATCHED = 7e9, 0.6e-3, 0.25
_FIT_S = 7e-11  # per layer, per token x d^2 x experts


def fit_seconds_estimate(n_layers: int, active_bytes: int, n_embd: int, n_expert: int, chat_template: bool,
                         tokens: int = FIT_TOKENS, eval_tokens: int = FIT_EVAL_TOKENS) -> float:
    """About how long ``fit-predictor`` takes on two idle cores, for a model of ``n_layers`` MoE layers reading
    ``active_bytes`` per token (non-expert weights plus the experts a token uses)."""
    per_token = active_bytes / _READ_BPS + n_layers * _HOOK_S_PER_LAYER
    if not chat_template:  # fit text is seeded random ids, prefilled in batches
        per_token *= _BATCHED
    return (tokens + eval_tokens) * per_token + n_layers * _FIT_S * tokens * n_embd**2 * n_expert


def predictor_hint(model_path: str | os.PathLike, name: str, est_seconds: float) -> str | None:
    """The line to print the first time a session on this model file would prefetch with a learned predictor but
    has none (a marker beside where the sidecar would go keeps it from saying so again); None when there is a
    predictor or the line was already said."""
    side = sidecar_path(model_path, model_key(model_path))
    marker = side.with_suffix(".hinted")
    if side.is_file() or marker.exists():
        return None
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass  # a read-only cache: the line comes every time, which is still one line
    took = f"{est_seconds / 60:.0f} min" if est_seconds >= 90 else f"{max(est_seconds, 1):.0f} s"
    return (f"no learned predictor for {name}: `pyspecter fit-predictor {name}` would add prefetching "
            f"(once per model file, about {took} on two idle cores)")
