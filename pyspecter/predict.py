"""Predicting which experts the target will need.

The main predictor is the draft itself (Specter): a small quantized copy of the target with the same layers and
experts routes each token almost as the target will, one step earlier. We read its routing with the same
per-layer hook the target's slots use; with every expert on the host path that hook changes nothing about the
draft's numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pyspecter import native
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout
from pyspecter.native.hooks import Hooks

# on_layer(il, {expert: confidence}) is called as soon as the draft has routed a layer
LayerSink = Callable[[int, dict[int, float]], None]


class DraftRouting:
    """Watches the draft model's routing. Attach before the draft's Context is created."""

    def __init__(self, draft: native.Model, draft_layout: ModelLayout, on_layer: LayerSink | None = None) -> None:
        draft_layout.require_moe()
        self.layout = draft_layout
        self.on_layer = on_layer
        self.window: dict[int, dict[int, float]] = {}
        self.recording = False
        # every expert stays on the host path: only the hook matters here (no slot memory: n_slots is per layer,
        # allocated once, and we never upload into them, so keep it at top-k, the minimum)
        self.hooks = Hooks(draft, self._on_route, n_slots=draft_layout.n_expert_used)

    def _on_route(self, il, n_tokens, n_used, ids_p, w_p) -> None:
        if not self.recording:
            return
        n = n_tokens * n_used
        ids, ws = ids_p[:n], w_p[:n]
        got = self.window.setdefault(il, {})
        fresh: dict[int, float] = {}
        for e, w in zip(ids, ws, strict=True):
            if w > got.get(e, -1.0):
                got[e] = w
                fresh[e] = w
        if self.on_layer is not None and fresh:
            self.on_layer(il, fresh)

    def start(self) -> None:
        self.window = {}
        self.recording = True

    def stop(self) -> dict[int, dict[int, float]]:
        self.recording = False
        self.hooks.check()
        return self.window

    def close(self) -> None:
        self.hooks.close()


def routing_profile(trace_path: str | Path, layout: ModelLayout) -> dict[int, list[int]]:
    """Experts of each MoE layer, hottest first, from a trace's target routing (``pyspecter trace``): what a
    fresh session should load before its first token instead of starting with a burst of misses."""
    import numpy as np

    from pyspecter.tracefile import load_trace

    tr = load_trace(trace_path)
    if tr.n_expert != layout.n_expert or len(tr.meta["moe_layers"]) != len(layout.layers):
        raise SpecterError(f"{trace_path}: profile is for a model with {tr.n_expert} experts in "
                           f"{len(tr.meta['moe_layers'])} MoE layers, this one has {layout.n_expert} in "
                           f"{len(layout.layers)}")
    ids = tr["target_ids"]  # [T, L, U], -1 for none
    out = {}
    for j, il in enumerate(tr.meta["moe_layers"]):
        col = ids[:, j, :].ravel()
        counts = np.bincount(col[col >= 0], minlength=layout.n_expert)
        # stable: ties keep expert order, so the profile is deterministic
        out[int(il)] = [int(e) for e in np.argsort(-counts, kind="stable")]
    return out
