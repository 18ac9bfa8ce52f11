"""A hot set that follows the text: a static hot set (slots loaded from a routing profile, no residency engine, a
miss computed on the host or read from the host copy) re-chosen between decodes from what the session's own routing
selected. Its few uploads are queued between tokens, land beside the next decodes, and never wait inside a layer.

The counts come from C (``llama_pyspecter_take_uses``: counted where the host already has a slot layer's ids, its
split route op or a speculated ubatch's settling); the rule is here. Each layer's scores start from the profile,
scaled to one window's selections, and every ``EVERY`` routed tokens become ``DECAY`` * scores + the window's
counts; the hot set is the top of the scores (``policies.hot_experts``), and only the experts that enter it are
uploaded, into the slots of those that left.

Why these values (``python tools/hotset_study.py smol-moe -n 160``: smol-moe's router follows real activations; the
12 packaged eval chat prompts, 160 greedy tokens each, 8 of 16 slots a layer): the tune prompts' hot set, pinned,
held 53.0% of the answers' rows; re-chosen this way 67.4%, loading 0.07 experts a layer a token; LRU 64.3%,
uploading every miss (0.71 a layer a token). Every 32 tokens read a point lower with half the loads, decay 0.5 within
a point of 0.8, and the prompt's counts alone, never re-chosen, 60.0% (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from pyspecter import native
from pyspecter.errors import SpecterError
from pyspecter.policies import hot_experts

EVERY, DECAY = 16, 0.8


class HotSet:
    """Each slot layer's decayed expert counts and the hot set they choose (``n`` slots a layer)."""

    def __init__(self, profile: Mapping[int, Sequence[int]], slots: Mapping[int, int], n_used: int, n_expert: int,
                 every: int = EVERY, decay: float = DECAY) -> None:
        """profile: per MoE layer, the times each expert was selected (``hitrates.hot_profile``); slots: layer ->
        slots its hot set fills."""
        self.every, self.decay, self.n_expert = every, decay, n_expert
        self._slots = dict(slots)
        self.scores = {il: _scaled(profile[il], every * n_used) for il in slots}
        self.chosen = {il: hot_experts(self.scores[il], n) for il, n in slots.items()}
        self._buf: ctypes.Array | None = None  # C's counts, read into the same buffer after every decode
        self._due: set[int] = set()  # layers whose set changed, moved once none of their uploads is in flight
        self._queued: list[tuple[int, int, int, int]] = []  # (ticket, layer, expert, slot) of uploads in flight

    def update(self, uses: np.ndarray) -> dict[int, list[int]]:
        """Hear a window's counts (``uses[il, e]``: times layer il selected expert e since the last window); the
        layers whose hot set changed, with the new set, most used first."""
        changed = {}
        for il, n in self._slots.items():
            self.scores[il] = self.decay * self.scores[il] + uses[il]
            new = hot_experts(self.scores[il], n)
            if set(new) != set(self.chosen[il]):
                changed[il] = new
            self.chosen[il] = new
        return changed

    def step(self, model: native.Model, load: Callable[[int, int, int], None], landed: Callable[[int], None],
             queue: bool = True) -> int:
        """Between decodes: once ``every`` tokens were routed since the last window, hear the window's counts from
        C, and load each expert that entered a layer's hot set into the slot of one that left, unmapped first, so
        that no table maps a slot while its bytes change. queue: the copy is queued on C's upload thread from the
        model's host copy (it overlaps the next decodes, and the expert is mapped at the first call after it
        landed, ``landed(il)``); else ``load(il, expert, slot)`` uploads and maps it now (the disk tier, whose
        copy is the file). A layer with uploads in flight moves again only once they have landed; a failed one
        leaves its slot empty (its expert's rows are misses, computed exactly). Returns the experts loaded."""
        api = native.slots()
        while self._queued:  # tickets finish in order
            ticket, il, e, slot = self._queued[0]
            status = api.upload_status(model.ptr, ticket)
            if status == 0:
                break
            self._queued.pop(0)
            if status == 1:
                if api.set_slot(model.ptr, il, e, slot) != 0:
                    raise SpecterError(f"layer {il}: could not map expert {e} to slot {slot}")
                landed(il)
        if self._buf is None:
            self._buf = (ctypes.c_uint32 * (model.n_layer * self.n_expert))()
        if api.take_uses(model.ptr, self.every, self._buf, len(self._buf)) > 0:
            self._due.update(self.update(np.frombuffer(self._buf, np.uint32).reshape(-1, self.n_expert)))
        busy = {il for _, il, _, _ in self._queued}
        n = 0
        for il in sorted(self._due - busy):
            owner = [api.expert_in(model.ptr, il, slot) for slot in range(self._slots[il])]
            for slot, e in moves(owner, self.chosen[il]):
                if owner[slot] >= 0 and api.set_slot(model.ptr, il, owner[slot], -1) != 0:
                    raise SpecterError(f"layer {il}: could not unmap expert {owner[slot]}")
                if not queue:
                    load(il, e, slot)
                elif (ticket := api.load_expert_async(model.ptr, il, e, slot)) > 0:
                    self._queued.append((ticket, il, e, slot))
                else:
                    raise SpecterError(f"layer {il}: the upload of expert {e} was refused "
                                       f"({native.status_name(ticket)})")
                n += 1
            self._due.discard(il)
        return n


def curves(profile: Sequence[int], ids: np.ndarray, n_used: int, every: int = EVERY, decay: float = DECAY,
           prompt: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """What the adaptive hot set does on one layer's routing ``ids`` [n, k] (-1: none), starting from ``profile``,
    for every slot count s = 0..E at once: the share of the rows it holds, and the experts it loads a token. Each
    window of ``every`` tokens meets the set the windows before it chose, as the session's decodes do. The set of s
    slots is the top s of one ranking, so a row hits with s slots iff its expert ranks below s, and the experts
    loaded are the s of the new top s less those also in the old. ``prompt``: the first ``prompt`` rows are a
    prefill, one window (as ``take_uses`` hands it over after one), not scored: the rest are its answer."""
    E = len(profile)
    h = HotSet({0: profile}, {0: E}, n_used, E, every, decay)
    held, loaded, rows = np.zeros(E + 1), np.zeros(E + 1), 0

    def ranks() -> np.ndarray:
        r = np.empty(E, np.int64)
        r[h.chosen[0]] = np.arange(E)
        return r

    starts = ([0] if prompt else []) + list(range(prompt, len(ids), every))
    for i, w in enumerate(starts):
        win = ids[w:starts[i + 1] if i + 1 < len(starts) else len(ids)]
        used = win[win >= 0]
        old = ranks()
        if w >= prompt:  # the answer's windows (all of them without a prompt)
            held[1:] += np.cumsum(np.bincount(old[used], minlength=E))
            rows += len(used)
        h.update(np.bincount(used, minlength=E)[None, :])
        if i + 1 < len(starts):  # a move after the last window loads nothing the text meets
            both = np.cumsum(np.bincount(np.maximum(old, ranks()), minlength=E))
            loaded[1:] += np.arange(1, E + 1) - both
    return held / max(rows, 1), loaded / max(len(ids) - prompt, 1)


def moves(owner: Sequence[int], want: Sequence[int]) -> list[tuple[int, int]]:
    """The (slot, expert) uploads that make slots holding ``owner`` (slot -> expert, -1: empty) hold ``want``: a
    wanted expert already resident stays where it is; the others go, hottest first, into the empty slots and then
    those of experts no longer wanted."""
    wanted = set(want)
    resident = {e for e in owner if e >= 0}
    free = [s for s, e in enumerate(owner) if e < 0] + [s for s, e in enumerate(owner) if e >= 0 and e not in wanted]
    return list(zip(free, [e for e in want if e not in resident], strict=False))


def _scaled(counts: Sequence[int], total: float) -> np.ndarray:
    c = np.asarray(counts, np.float64)
    s = c.sum()
    return c * (total / s) if s > 0 else c
