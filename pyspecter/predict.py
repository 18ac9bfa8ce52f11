"""Predicting which experts the target will need.

The main predictor is the draft itself (Specter): a small quantized copy of the target with the same layers and
experts routes each token almost as the target will, one step earlier. Once per step the engine hands the step to
the target's planner in one call (``NativeResidency.handover``); the draft's routing op (csrc/route.cpp, the one
every MoE arch goes through) then turns each drafted token's experts and router weights into the target's
prefetches in C (csrc/draft.cpp). Nothing of it runs in Python inside a layer. The draft's slots exist only so
that its layers have the routing op: every expert stays on the host path, which is stock llama.cpp's computation.
"""

from __future__ import annotations

from pathlib import Path

from pyspecter import native
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout


class DraftRouting:
    """The draft model's routing op, ready to feed a target (``NativeResidency.handover``). Attach before the
    draft's Context is created."""

    def __init__(self, draft: native.Model, draft_layout: ModelLayout) -> None:
        draft_layout.require_moe()
        self.layout = draft_layout
        self.model = draft
        self.api = native.slots()
        # n_slots is per layer, allocated once, and never uploaded into: top-k, the minimum the op is built on
        rc = self.api.slots_init(draft.ptr, draft_layout.n_expert_used)
        if rc != 0:
            raise SpecterError(f"{draft.path}: could not enable the draft's routing op (slots_init returned {rc})")
        # its router weights are the confidence of each prediction it hands over
        self.api.set_route_weights(draft.ptr, True)

    def stop(self) -> None:
        """The draft's routing goes to no target from here on (the engine arms it per step: its ``handover``)."""
        if self.model.ptr:
            rc = self.api.draft_unlink(self.model.ptr)
            if rc != 0:
                raise SpecterError(f"could not stop the draft's routing ({native.status_name(rc)})")

    def close(self) -> None:
        self.stop()


def routing_counts(trace_path: str | Path, layout: ModelLayout) -> dict[int, list[int]]:
    """Per MoE layer, the times each expert was selected in a trace's target routing (``pyspecter trace``): what
    a hot set is chosen from and starts its scores with (``hotset.HotSet``)."""
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
        out[int(il)] = [int(c) for c in np.bincount(col[col >= 0], minlength=layout.n_expert)]
    return out


def routing_profile(trace_path: str | Path, layout: ModelLayout) -> dict[int, list[int]]:
    """Experts of each MoE layer, hottest first (ties: the lower id, so the profile is deterministic), from a
    trace's routing (``routing_counts``): what a fresh session should load before its first token instead of
    starting with a burst of misses."""
    from pyspecter.policies import hot_experts

    return {il: hot_experts(c, len(c)) for il, c in routing_counts(trace_path, layout).items()}
