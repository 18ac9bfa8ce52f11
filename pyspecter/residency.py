"""The slot table: which expert each slot of each MoE layer holds, and which uploads are landing.

On the Python decision path (the configurations ``native_residency.native_reason`` leaves to Python) this table
is the one source of truth for residency, and this module writes it: the cache, the miss handlers and the
surrogates call the methods below.
The C remap table (expert -> slot) that the routing op reads is a mirror, written only from here
(``assign``/``evict``), between decodes or from inside the routing hook. Under native residency C owns the
table and this one only carries each layer's slot counts. An upload in flight is *pending*: its slot is neither
free nor mapped until the upload has landed whole; one that failed leaves its slot free and its expert a miss,
which the host path computes exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from pyspecter import native
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout
from pyspecter.policies import Policy, Scores


@dataclass
class LayerSlots:
    # plain lists, not numpy: the hook does a handful of scalar reads and writes per call, where list indexing
    # is several times cheaper than numpy scalar indexing
    owner: list[int]  # slot -> expert (-1 free)
    where: list[int]  # expert -> slot (-1 not resident)
    last_use: list[int]  # slot -> clock of last hit
    freq: list[int]  # expert -> times selected
    pending: dict = field(default_factory=dict)  # slot -> (expert, handle): uploads in flight
    protected: set = field(default_factory=set)  # experts predicted for the window in flight: never evicted
    sur_in: dict = field(default_factory=dict)  # reserved slot -> expert whose surrogate it holds
    sur_mapped: set = field(default_factory=set)  # experts routed to a reserved slot for the current ubatch
    late: dict = field(default_factory=dict)  # ordered mode: expert -> slot, computed after the resident ones
    loaded: list[int] = field(default_factory=list)  # slot -> clock its expert was mapped (FIFO order)
    prev_call: int = 0  # clock of this layer's previous routing call (the previous token's, in decode)
    last_call: int = 0  # ... and of its latest
    scores: Scores = field(default_factory=list)  # expert -> predicted reuse, policy 'predicted' (set_scores)
    # Slots [0, n_usable) are handed out; [n_usable, n_regular) are held (a draft's memory, native residency's:
    # C holds them and runs their ghost LRU) until release_held;
    # the reserved ones (surrogates) follow from n_regular. Per layer: layers may have different counts
    n_usable: int = 0
    n_regular: int = 0

    def inflight(self) -> dict[int, object]:
        """expert -> handle of its upload in flight."""
        return {e: h for e, h in self.pending.values()}


class Residency:
    """Slot tables of every MoE layer of one model, with the policy that picks victims. A layer hands out its
    slots below its own ``n_usable``; the rest are not handed out: held ones (a draft's memory, until it is
    dropped) and reserved ones (surrogates)."""

    def __init__(self, model: native.Model, layout: ModelLayout, n_slots: int, n_usable: int, policy: Policy,
                 api=None, *, held: int = 0, extra: Mapping[int, int] | None = None,
                 held_extra: Mapping[int, int] | None = None) -> None:
        """n_slots: slots allocated per layer (the C side's count); n_usable: regular slots every layer uses from
        the start, and ``held`` more once ``release_held`` is called; extra: layer -> regular slots that layer uses
        beyond the others (a budget spread by layer), numbered before its held and reserved ones; held_extra: layer
        -> slots that layer holds beyond ``held``. api: the C slot functions (``native.slots()``); tests pass a
        stand-in that records the mirror."""
        self.model, self.policy = model, policy
        self.api = api if api is not None else native.slots()
        self.n_slots, self.held = n_slots, held
        extra, held_extra = dict(extra or {}), dict(held_extra or {})
        unknown = (set(extra) | set(held_extra)) - {L.index for L in layout.layers}
        if unknown:
            raise SpecterError(f"extra slots for layers that are not MoE layers: {sorted(unknown)}")
        E = layout.n_expert
        self.layers: dict[int, LayerSlots] = {}
        for L in layout.layers:
            x, h = extra.get(L.index, 0), held + held_extra.get(L.index, 0)
            if x < 0 or h < held or n_usable + h + x > n_slots:
                raise SpecterError(f"layer {L.index}: {n_usable + h + x} regular slots do not fit in the "
                                   f"{n_slots} allocated")
            self.layers[L.index] = LayerSlots(
                owner=[-1] * n_slots, where=[-1] * E, last_use=[0] * n_slots, freq=[0] * E,
                loaded=[0] * n_slots,
                n_usable=n_usable + x, n_regular=n_usable + h + x)
        self.clock = 0
        self.failed_uploads = 0

    @property
    def n_usable(self) -> int:
        """The fewest slots any layer hands out now (every layer's, when the budget is not spread by layer)."""
        return min((st.n_usable for st in self.layers.values()), default=0)

    def usable(self, il: int) -> int:
        """Slots layer il hands out now."""
        return self.layers[il].n_usable

    def reserved(self, il: int, n_reserved: int) -> range:
        """Layer il's ``n_reserved`` reserved (surrogate) slots: right after its regular ones."""
        n = self.layers[il].n_regular
        return range(n, n + n_reserved)

    def begin_call(self, il: int) -> LayerSlots | None:
        """A routing call of layer il starts: tick the clock and note the call (None: not a MoE layer)."""
        self.clock += 1
        st = self.layers.get(il)
        if st is not None:
            st.prev_call, st.last_call = st.last_call, self.clock
        return st

    def note_needed(self, il: int, needed: set[int]) -> None:
        """Layer il's routing call needs ``needed``: count the uses (LFU, prefill's lookahead)."""
        st = self.layers[il]
        for e in needed:
            st.freq[e] += 1

    def split(self, il: int, needed: set[int]) -> list[int]:
        """Let landed uploads map, stamp the resident experts of ``needed`` as used now, and return the others
        (in expert order, as C serves them: one answer for one routing)."""
        st = self.layers[il]
        if st.pending:
            self.reap(il)
        missing = []
        for e in sorted(needed):
            s = st.where[e]
            if s >= 0:
                st.last_use[s] = self.clock
            else:
                missing.append(e)
        return missing

    def set_scores(self, il: int, scores: Scores) -> None:
        """Layer il's predicted reuse per expert, which policy 'predicted' evicts by (empty: LRU)."""
        st = self.layers.get(il)
        if st is not None:
            st.scores = scores

    def protect(self, il: int, experts: Iterable[int]) -> None:
        """Experts predicted for the window in flight: ``victim`` spares them until ``unprotect_all``."""
        st = self.layers.get(il)
        if st is not None:
            st.protected.update(experts)

    def unprotect_all(self) -> None:
        for st in self.layers.values():
            st.protected.clear()

    def take_back(self, il: int, slot: int) -> None:
        """The upload into ``slot`` was cancelled before it started: the slot is free again."""
        del self.layers[il].pending[slot]

    def mark_late(self, il: int, expert: int, slot: int) -> None:
        """Ordered wait: ``expert`` (landing in ``slot``) is computed after the layer's resident experts."""
        if self.api.set_late(self.model.ptr, il, expert, slot) != 0:
            raise SpecterError(f"could not mark expert {expert} of layer {il} late (no wait hook?)")
        self.layers[il].late[expert] = slot

    def clear_late(self, il: int) -> None:
        """The wait hook has served the layer's late experts."""
        self.layers[il].late.clear()

    def map_surrogate(self, il: int, expert: int, slot: int, expand: Callable[[], None]) -> None:
        """Route ``expert`` to reserved ``slot`` for the current ubatch, first expanding its surrogate there
        (``expand``) unless the slot holds it already."""
        st = self.layers[il]
        if st.sur_in.get(slot) != expert:
            expand()
            st.sur_in[slot] = expert
        self.api.set_slot(self.model.ptr, il, expert, slot)
        st.sur_mapped.add(expert)

    def unmap_surrogates(self, il: int) -> None:
        """The previous ubatch's surrogate routing ends: its experts not resident since are misses again."""
        st = self.layers[il]
        for e in st.sur_mapped:
            if st.where[e] < 0:
                self.api.set_slot(self.model.ptr, il, e, -1)
        st.sur_mapped.clear()

    def assign(self, il: int, expert: int, slot: int) -> None:
        st = self.layers[il]
        prev = st.owner[slot]
        if prev >= 0:
            st.where[prev] = -1
        st.owner[slot] = expert
        st.where[expert] = slot
        st.last_use[slot] = st.loaded[slot] = self.clock
        self.api.set_slot(self.model.ptr, il, expert, slot)

    def evict(self, il: int, slot: int) -> None:
        st = self.layers[il]
        prev = st.owner[slot]
        if prev >= 0:
            st.where[prev] = -1
            st.owner[slot] = -1
            self.api.set_slot(self.model.ptr, il, prev, -1)

    def victim(self, il: int, protected: set[int], taken: frozenset[int] | set[int] = frozenset(),
               need: bool = False) -> int:
        """A slot to reuse: a free one, else by policy among slots not holding an expert needed right now (and
        not in ``taken``: slots already chosen for this batch of uploads). Experts predicted for the window in
        flight are spared too, unless ``need``: an expert needed now outranks a prediction, which only ever
        advises (without this, a window predicting more experts than there are slots starved the current token
        and sent it to the host path). -1: none."""
        st = self.layers[il]
        best, best_key, spared = -1, None, -1
        for s in range(st.n_usable):
            if s in st.pending or s in taken:
                continue
            e = st.owner[s]
            if e < 0:
                return s
            if e in protected:
                continue
            if e in st.protected:
                spared = s
                continue
            key = self.policy.rank(st, s)
            if best_key is None or key < best_key:
                best, best_key = s, key
        if best < 0 and need and spared >= 0:
            st.protected.discard(st.owner[spared])
            return spared
        return best

    def start_upload(self, il: int, expert: int, slot: int, handle) -> None:
        """``slot`` (already evicted) is receiving ``expert``: pending until ``reap`` sees it land."""
        self.layers[il].pending[slot] = (expert, handle)

    def reap(self, il: int, block_for: set[int] | None = None) -> None:
        """Map every upload of layer il that has landed (first waiting for those of ``block_for``). A failed one
        frees its slot and leaves its expert a miss."""
        st = self.layers[il]
        for slot, (expert, handle) in list(st.pending.items()):
            if block_for is not None and expert in block_for:
                handle.wait()
            if handle.done():
                del st.pending[slot]
                if handle.ok():
                    self.assign(il, expert, slot)
                else:
                    self.failed_uploads += 1

    def drain(self) -> None:
        """Wait for every upload in flight and map those that landed."""
        for il, st in self.layers.items():
            self.reap(il, block_for={e for e, _ in st.pending.values()})

    def release_held(self) -> None:
        """The memory held back (a draft's) is free now: every allocated regular slot may be used."""
        for st in self.layers.values():
            st.n_usable = st.n_regular

    def retire(self) -> None:
        """C owns residency from here (native residency): drop this table, keeping each layer's slot counts, so
        that nothing can read a stale copy of C's (a read fails loudly instead). Uploads in flight must have
        landed (``drain``)."""
        for st in self.layers.values():
            if st.pending:
                raise SpecterError("uploads still in flight: drain before handing residency to C")
            st.owner, st.where, st.last_use, st.freq, st.loaded = [], [], [], [], []
            st.protected.clear()
