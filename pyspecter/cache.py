"""Expert slots for one model: the routing hook that ties residency, the miss handler and the tier together.

The C side owns the slot tensors and calls ``ExpertCache._on_route`` once per MoE layer per ubatch, before that
layer's expert matmuls. Here we count what the layer needed, let prediction-driven uploads land, and hand the
misses to the miss handler (``misses.py``). Any expert still not resident when the hook returns is computed
exactly on the host, so no decision made here can change the model's output, only its speed.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pyspecter import native
from pyspecter import native as _native_api  # for __init__, whose `native` argument shadows the module
from pyspecter.budget import check_slots
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout
from pyspecter.misses import MISS_MODES, make_miss_handler
from pyspecter.native.hooks import Hooks
from pyspecter.policies import POLICIES, make_policy
from pyspecter.residency import Residency
from pyspecter.tiers import DiskTier, EmulatedTier, RamTier, Tier

__all__ = ["MISS_MODES", "POLICIES", "CacheStats", "ExpertCache", "Totals", "native_reason"]


@dataclass
class Totals:
    """Since the cache was made (reset_counters leaves them): what the engine compares its steps by."""

    misses: int = 0  # experts not resident when their layer asked
    ghost_misses: int = 0  # misses plain LRU over all allocated slots, held ones included, would have had
    hook_ns: int = 0  # time in the routing and wait hooks, waits for uploads included


@dataclass
class CacheStats:
    uploads: int = 0
    upload_bytes: int = 0
    overflow_rows: int = 0  # wait mode: rows left to the host because one ubatch needed more experts than slots
    hook_calls: int = 0
    prefetches: int = 0  # uploads issued ahead of need (from a prediction)
    surrogate_uses: int = 0  # misses served approximately by a surrogate (miss="surrogate")
    lookahead: int = 0  # prefill: next layer's experts uploaded while this layer computes
    late: int = 0  # ordered wait mode: misses computed after the layer's resident experts
    waited: int = 0  # misses that waited for an upload already in flight
    needed: int = 0  # distinct experts asked for, summed over (layer, ubatch)
    resident_at_need: int = 0  # ... of which already resident when the layer asked: the cache's hit rate


class _NativeLayer:
    """One layer's residency as C holds it, read on each access (never on the hot path)."""

    def __init__(self, api, model, il: int, n_expert: int, n_slots: int, n_usable: int) -> None:
        self.api, self.model, self.il, self.n_expert, self.n_slots = api, model, il, n_expert, n_slots
        self.n_usable = n_usable

    @property
    def where(self) -> list[int]:
        return [self.api.slot_of(self.model.ptr, self.il, e) for e in range(self.n_expert)]

    @property
    def owner(self) -> list[int]:
        return [self.api.expert_in(self.model.ptr, self.il, s) for s in range(self.n_slots)]


def native_reason(policy: str, miss: str, tier: Tier, *, hook: bool = True, held: int = 0,
                  surrogates: bool = False, reuse: bool = False) -> str:
    """Why the routing op cannot own residency in C for this configuration ('' when it can). What stays in Python:
    eviction by the Python prefetch plan's table ('predicted' without reuse maps: C applies the maps themselves),
    surrogates (approximate, opt-in), a draft's held slots (their ghost LRU) and tiers C does not know (tests'
    fault-injecting ones)."""
    if not hook:
        return "no routing hook (static residency)"
    if policy == "predicted" and not reuse:
        return "policy 'predicted' without reuse maps reads the Python prefetch plan"
    if policy not in native.NATIVE_POLICIES and policy != "predicted":
        return f"policy {policy!r} is decided in Python"
    if miss not in ("cpu", "wait"):
        return f"miss mode {miss!r} is Python's"
    if surrogates:
        return "surrogates are expanded from Python"
    if held:
        return "held slots (a draft's memory) keep a Python ghost LRU"
    if type(tier) not in (RamTier, EmulatedTier, DiskTier):
        return f"tier {type(tier).__name__} has no native reader"
    return ""


class ExpertCache:
    """Budgeted expert slots for one model. Create it after loading the model and before its context."""

    def __init__(self, model: native.Model, layout: ModelLayout, n_slots: int, *, policy: str = "lru",
                 miss: str = "wait", tier: Tier | None = None, hook: bool = True, record: bool = False,
                 surrogates=None, ordered: bool = False, lookahead: bool = True, held: int = 0,
                 on_input=None, extra: Mapping[int, int] | None = None, native: bool | None = None,
                 reuse=None, duel: bool = True) -> None:
        """hook=False leaves residency static (no Python on the compute path: what 'all-resident' measures);
        record=True keeps the routing trace [(layer, needed experts)] for offline analysis (e.g. Belady MIN);
        lookahead=False turns off reading the next layer's experts during a multi-token ubatch (prefill);
        held=N allocates N more slots per layer than it uses until ``release_held()``: memory that a draft holds
        now and the slots get once the draft is dropped (CPU slots never written take no memory); on_input(il, x):
        each MoE layer's router input before its routing call (learned predictors); ``route_observer``, when
        set, hears ``on_route(il, needed, n_tokens)`` after each routing call; extra: layer -> regular slots that
        layer uses beyond ``n_slots`` (a budget spread by layer: ``budget.allocate_slots``/``split_counts``);
        native=None: the routing op decides in C wherever this configuration allows it (``native_reason``),
        False: always the Python hook (tests of that path), True: refuse a configuration C cannot run; reuse: a
        ``LearnedPredictor`` whose reuse maps C applies to each layer's router input for policy 'predicted'
        (``duel``: only while they miss less than LRU, ``policies.EvictionDuel``'s rule)."""
        layout.require_moe()
        pol = make_policy(policy)
        if miss not in MISS_MODES:
            raise SpecterError(f"unknown miss mode {miss!r}: use one of {', '.join(MISS_MODES)}")
        if (miss == "surrogate") != (surrogates is not None):
            raise SpecterError("miss mode 'surrogate' needs surrogates (and they are used by no other mode)")
        n_slots = min(n_slots, layout.n_expert)
        # surrogate mode reserves top-k slots per layer to expand surrogates into; the rest cache full experts
        self.n_reserved = layout.n_expert_used if surrogates is not None else 0
        check_slots(layout, n_slots, reserved=self.n_reserved, held=held)
        self.n_regular = n_slots - self.n_reserved
        self.extra = self._check_extra(model, layout, n_slots, extra)
        self._totals = Totals()
        self.surrogates = surrogates
        self.model, self.layout, self.n_slots = model, layout, n_slots
        self.policy, self.miss = policy, miss
        self.api = _native_api.slots()
        # the C side allocates one count in every layer: the largest. On the CPU a slot never written takes no
        # memory, and a layer never writes past its own count, so the spread costs only what it uses
        self.n_alloc = n_slots + max(self.extra.values(), default=0)
        rc = self.api.slots_init(model.ptr, self.n_alloc)
        if rc != 0:
            raise SpecterError(f"could not allocate {self.n_alloc} expert slots per layer (code {rc})")
        self.tier = tier or RamTier()
        why_not = native_reason(policy, miss, self.tier, hook=hook, held=held, surrogates=surrogates is not None,
                                reuse=reuse is not None and reuse.has_reuse)
        if native and why_not:
            raise SpecterError(f"native residency cannot run this configuration: {why_not}")
        self.native = native is not False and not why_not
        # slots eviction may use now: the regular ones less those held back for later
        self.residency = Residency(model, layout, self.n_alloc, self.n_regular - held, pol,
                                   ghost_capacity=self.n_regular if held else None, held=held, extra=self.extra)
        self.tier.bind(model, layout)
        self.expert_bytes = {L.index: L.expert_bytes for L in layout.layers}
        self.layer_pos = {L.index: j for j, L in enumerate(layout.layers)}  # order in the forward pass
        self.stats = CacheStats()
        self._trace: list[tuple[int, tuple[int, ...]]] | None = [] if record else None
        self.ordered = ordered
        self.misses = make_miss_handler(self, miss, ordered)
        self.lookahead = lookahead and miss != "cpu"
        self._next_layer = {a.index: b.index for a, b in zip(layout.layers, layout.layers[1:], strict=False)}
        self.hooks = None
        self._observer = None
        self._native_trace: list[tuple[int, tuple[int, ...]]] | None = None
        self._native_base = _native_api.Stats()  # native counters from before the last reset_counters
        self._pre_native: dict[str, int] = {}  # counts of the Python hook before a running cache went native
        self._pre_totals = Totals()
        if self.native:
            self._init_native(record, reuse if policy == "predicted" else None, duel)
            if on_input is not None:
                self.hooks = Hooks(model, None, on_input=on_input)
        elif hook:
            wait = self._on_wait if self.misses.wants_wait_hook else None
            self.hooks = Hooks(model, self._on_route, wait, on_input=on_input)
        self._reported_failures = 0
        self._late_lost = 0
        self._closed = False
        self._prev_tokens = 0  # ubatch size of the latest routing call

    def _init_native(self, record: bool, reuse, duel: bool) -> None:
        """Hand the slot table to the routing op (C). The Python table stays empty: nothing mirrors it."""
        miss = native.NATIVE_MISS["ordered" if self.ordered else self.miss]
        policy = native.NATIVE_POLICIES["score" if self.policy == "predicted" else self.policy]
        p = native.ResidencyParams(policy=policy, miss=miss,
                                   n_readers=1, fd=-1, drop_cache=False, lookahead=self.lookahead, record=record)
        if isinstance(self.tier, DiskTier):
            # as many readers as the Python path's demand and prefetch pools together: misses of one layer and
            # the kinds of one expert are read side by side, so the disk's queue stays several deep
            p.fd, p.drop_cache, p.n_readers = self.tier.fd, not self.tier.direct, 2 * self.tier.queue_depth
        rc = self.api.residency_init(self.model.ptr, ctypes.byref(p))
        if rc != 0:
            raise SpecterError(f"could not enable native residency ({native.status_name(rc)})")
        for L in self.layout.layers:
            self.api.set_usable(self.model.ptr, L.index, self.residency.usable(L.index))
            if isinstance(self.tier, DiskTier):
                for kind, t in L.tensors.items():
                    if self.api.set_file_offset(self.model.ptr, L.index, native.KIND_NAMES[kind], t.offset) != 0:
                        raise SpecterError(f"layer {L.index}: could not set where {t.name} is in the file")
        if reuse is not None:
            self._set_reuse_maps(reuse, duel)
        if record:  # the same list: a cache that went native mid-run keeps what the Python hook recorded
            self._native_trace = self._trace if self._trace is not None else []

    def _set_reuse_maps(self, predictor, duel: bool) -> None:
        """The learned reuse maps (and their recency blend), applied by C to each layer's router input."""
        for L in self.layout.layers:
            j = predictor.pos.get(L.index)
            if j is None or predictor.R[j] is None:
                continue
            # contiguous float32 copies for C, which copies them in turn
            arrs = [np.ascontiguousarray(predictor.R[j], np.float32), np.ascontiguousarray(predictor.rb[j], np.float32)]
            if predictor.blend is not None:
                arrs.append(np.ascontiguousarray(predictor.blend[j], np.float32))
            rc = self.api.set_reuse_map(self.model.ptr, L.index, arrs[0].ctypes.data, arrs[1].ctypes.data,
                                        arrs[0].shape[0], arrs[2].ctypes.data if len(arrs) > 2 else None)
            if rc != 0:
                raise SpecterError(f"layer {L.index}: the reuse map does not fit the model ({native.status_name(rc)})")
        # a blended predictor was weighed against recency when it was fitted: the duel starts on its scores
        rc = self.api.set_duel(self.model.ptr, duel, predictor.blend is not None, 0.998, 0.03)
        if rc != 0:
            raise SpecterError(f"could not set the eviction duel ({native.status_name(rc)})")

    def duel_state(self) -> tuple[bool, int] | None:
        """(evicting by the reuse scores now, switches so far) under native reuse maps; None otherwise."""
        if not self.native:
            return None
        sw = ctypes.c_int64()
        st = self.api.duel_state(self.model.ptr, ctypes.byref(sw))
        return (st == 1, sw.value) if st >= 0 else None

    @property
    def trace(self) -> list[tuple[int, tuple[int, ...]]] | None:
        """The routing trace [(layer, needed experts)] when recording (None otherwise)."""
        if self._native_trace is not None:
            n = self.api.trace_take(self.model.ptr, None, 0)
            if n:
                buf = (ctypes.c_int32 * n)()
                got = self.api.trace_take(self.model.ptr, buf, n)
                flat, i = list(buf[:got]), 0
                while i < got:
                    k = flat[i + 1]
                    self._native_trace.append((flat[i], tuple(flat[i + 2: i + 2 + k])))
                    i += 2 + k
            return self._native_trace
        return self._trace

    @trace.setter
    def trace(self, value) -> None:
        self._trace = value

    @property
    def totals(self) -> Totals:
        """Since the cache was made: misses, ghost misses, time deciding (C's counters under native residency)."""
        if not self.native:
            return self._totals
        c, b, p = self.api.stats(self.model.ptr), self._native_base, self._pre_totals
        return Totals(misses=p.misses + (c.needed + b.needed) - (c.resident_at_need + b.resident_at_need),
                      ghost_misses=p.ghost_misses, hook_ns=p.hook_ns + c.route_ns + b.route_ns)

    @property
    def route_observer(self):
        """Hears ``on_route(il, needed, n_tokens)`` after each routing call (set it before the context exists)."""
        return self._observer

    @route_observer.setter
    def route_observer(self, obs) -> None:
        self._observer = obs
        if self.native and obs is not None and self.hooks is None:
            # the decision stays in C; the hook only observes
            self.hooks = Hooks(self.model, self._observe_route)

    def _observe_route(self, il: int, n_tokens: int, n_used: int, ids_p, _weights_p) -> None:
        if self._observer is not None:
            self._observer.on_route(il, set(ids_p[: n_tokens * n_used]), n_tokens)

    @staticmethod
    def _check_extra(model: native.Model, layout: ModelLayout, n_slots: int,
                     extra: Mapping[int, int] | None) -> dict[int, int]:
        """Layer -> extra regular slots, checked (each layer's count within n_expert; the floor, ``n_slots``, is
        checked against top-k by check_slots); empty on a device."""
        extra = {il: x for il, x in (extra or {}).items() if x}
        moe = {L.index for L in layout.layers}
        for il, x in extra.items():
            if il not in moe:
                raise SpecterError(f"extra slots for layer {il}, which is not a MoE layer")
            if x < 0 or n_slots + x > layout.n_expert:
                raise SpecterError(f"layer {il}: {n_slots} slots {x:+d} extra is outside "
                                   f"[{n_slots}, {layout.n_expert}] (n_expert)")
        if getattr(model, "device", None) is not None:
            # device slots are real memory, allocated at the largest count in every layer: a spread would pay
            # for slots that only some layers use, so the counts stay uniform (the floor, n_slots)
            return {}
        return extra

    @property
    def layers(self):
        """Layer -> its slot table (under native residency a read-only view of C's: for tests and stats)."""
        if self.native:
            return {il: _NativeLayer(self.api, self.model, il, self.layout.n_expert, self.n_alloc, st.n_usable)
                    for il, st in self.residency.layers.items()}
        return self.residency.layers

    @property
    def n_usable(self) -> int:
        """Slots every layer hands out now (a layer with extra slots hands out more: ``usable(il)``)."""
        return self.residency.n_usable

    def usable(self, il: int) -> int:
        """Slots layer il hands out now."""
        return self.residency.usable(il)

    def usable_per_layer(self) -> dict[int, int]:
        """Layer -> slots it hands out now, in forward order (stats: not in ``counters``, whose every value is a
        count that merges by summing)."""
        return {il: st.n_usable for il, st in self.layers.items()}

    def usable_mean(self) -> float:
        """Slots a layer hands out now, on average over the MoE layers."""
        return sum(st.n_usable for st in self.layers.values()) / len(self.layers)

    def count_upload(self, il: int) -> None:
        self.stats.uploads += 1
        self.stats.upload_bytes += self.expert_bytes[il]

    def _on_route(self, il: int, n_tokens: int, n_used: int, ids_p, _weights_p) -> None:
        t0 = time.perf_counter_ns()
        try:
            res = self.residency
            st = res.begin_call(il)
            self.stats.hook_calls += 1
            if st is None:
                return
            if n_tokens != self._prev_tokens:
                if n_tokens == 1 and self._prev_tokens > 1:
                    self.tier.after_batch()  # a prompt is done: its host-path pages go back (disk tier)
                self._prev_tokens = n_tokens
            if n_tokens > 1:
                self.tier.in_batch()
            needed = set(ids_p[: n_tokens * n_used])
            if self.trace is not None:
                self.trace.append((il, tuple(sorted(needed))))
            for e in needed:
                st.freq[e] += 1
            self.misses.begin(il, st)
            if st.pending:
                res.reap(il)
            missing = []
            for e in sorted(needed):  # in expert order, as C serves them: one answer for one routing
                s = st.where[e]
                if s >= 0:
                    st.last_use[s] = res.clock
                else:
                    missing.append(e)
            self.stats.needed += len(needed)
            self.stats.resident_at_need += len(needed) - len(missing)
            self._totals.misses += len(missing)
            if st.ghost is not None:
                self._totals.ghost_misses += st.ghost.observe(needed)
            if n_tokens > 1 and self.lookahead:
                self._prefill_lookahead(il, len(needed))
            if missing:
                self.misses.handle(il, st, needed, missing, n_tokens)
            if self.route_observer is not None:
                self.route_observer.on_route(il, needed, n_tokens)
        finally:
            self._totals.hook_ns += time.perf_counter_ns() - t0

    def _on_wait(self, il: int) -> None:
        t0 = time.perf_counter_ns()
        try:
            self.misses.on_wait(il)
        finally:
            self._totals.hook_ns += time.perf_counter_ns() - t0

    def _prefill_lookahead(self, il: int, n_needed: int) -> None:
        """A prompt's ubatch routes its many tokens to most experts of every layer, so the next layer will want
        about as many as this one: start reading them now, while this layer computes. Without this, prefill
        read each layer's experts only when that layer asked, with nothing to overlap them (0.71x stock's prefill
        at 50% on disk, where stock's page faults at least overlap with its compute). The most used experts of
        the next layer go to its free (or unneeded) slots; what does not fit is read ahead for the host path."""
        nxt = self._next_layer.get(il)
        if nxt is None:
            return
        st = self.layers[nxt]
        want = sorted(range(self.layout.n_expert), key=lambda e: -st.freq[e])[:n_needed]
        self.stats.lookahead += self._upload_ahead(nxt, want)
        inflight = st.inflight()
        self.tier.readahead(nxt, [e for e in want if st.where[e] < 0 and e not in inflight])

    # --- prediction-driven residency (the speculative engine) ---------------------------------------------------

    def protect(self, il: int, experts) -> None:
        """Experts predicted for the window in flight: eviction skips them until unprotect_all()."""
        if self.native:
            ids = list(experts)
            self.api.set_protected(self.model.ptr, il, (ctypes.c_int32 * len(ids))(*ids), len(ids))
            return
        st = self.layers.get(il)
        if st is not None:
            st.protected.update(experts)

    def unprotect_all(self) -> None:
        if self.native:
            self.api.set_protected(self.model.ptr, -1, None, 0)
            return
        for st in self.layers.values():
            st.protected.clear()

    def prefetch(self, il: int, experts) -> int:
        """Start async uploads of predicted experts that are neither resident nor on their way. Victims are never
        protected or pending. Returns how many uploads were issued."""
        if self.native:
            return sum(self.api.schedule(self.model.ptr, il, e, 1.0, 0) == 1 for e in experts)
        issued = self._upload_ahead(il, experts)
        self.stats.prefetches += issued
        return issued

    def _upload_ahead(self, il: int, experts) -> int:
        st = self.layers.get(il)
        if st is None:
            return 0
        res = self.residency
        inflight = st.inflight()
        issued = 0
        for e in experts:
            if st.where[e] >= 0 or e in inflight:
                continue
            slot = res.victim(il, set(experts))
            if slot < 0:
                break
            res.evict(il, slot)
            res.start_upload(il, e, slot, self.tier.upload_async(il, e, slot))
            self.count_upload(il)
            issued += 1
        return issued

    def release_held(self) -> None:
        """The memory held back (a draft's) is free now: every allocated slot may be used from here on. The held
        slots were what kept residency in Python (their ghost LRU): it moves to C now where it can."""
        self.residency.release_held()
        self._go_native()

    def _go_native(self) -> bool:
        """Hand a running cache's residency to C (between decodes). The C remap already holds Python's table (every
        change was mirrored); uploads in flight land first. The graphs built so far keep their shape: a late path
        or a router input they were built with serve C the same way."""
        if self.native or self.hooks is None or native_reason(self.policy, self.miss, self.tier,
                                                              surrogates=self.surrogates is not None):
            return False
        self.residency.drain()
        c = self.counters()
        # what the Python hook counted so far, carried into C's counts (C's own row and byte counters ran all along)
        self._pre_native = {k: c[k] for k in ("needed", "resident_at_need", "uploads", "prefetches", "waited",
                                              "overflow_rows", "late", "lookahead")}
        self._pre_totals = self._totals
        self.hooks.close()
        self.hooks = None
        self.native = True
        self._init_native(self._trace is not None, None, True)
        return True

    def check(self) -> None:
        """Re-raise an error a hook parked (call after each decode); report failed uploads once, in one line."""
        if self.hooks is not None:
            self.hooks.check()
        if self.native:
            lost = self._native_base.late_lost + self.api.stats(self.model.ptr).late_lost
            if lost > self._late_lost:
                self._late_lost = lost
                raise SpecterError(f"{lost} late expert read(s) failed twice ({self.tier.name} tier); the output of "
                                   "that decode is wrong")
        failed = self.failed_uploads()
        if failed > self._reported_failures:
            import sys

            print(f"pyspecter: warning: {failed - self._reported_failures} expert upload(s) failed "
                  f"({self.tier.name} tier); those experts were computed exactly on the host", file=sys.stderr)
            self._reported_failures = failed

    def drain(self) -> None:
        """Finish uploads in flight and make those that landed resident."""
        if self.native:
            self.api.drain(self.model.ptr)
        else:
            self.residency.drain()

    def failed_uploads(self) -> int:
        """Uploads that did not land since the cache was made (their experts were computed on the host)."""
        if self.native:
            return self._native_base.upload_failures + self.api.stats(self.model.ptr).upload_failures
        return self.residency.failed_uploads

    def warm(self, experts_by_layer: dict[int, list[int]]) -> None:
        """Fill slots before the first token (e.g. from a routing profile), hottest first."""
        for il, experts in experts_by_layer.items():
            for slot, e in enumerate(experts[: self.usable(il)]):
                self.tier.upload(il, e, slot)
                self.count_upload(il)
                if self.native:  # the C table is the only one
                    self.api.set_slot(self.model.ptr, il, e, slot)
                else:
                    self.residency.assign(il, e, slot)

    def counters(self) -> dict:
        if self.native:
            return self._native_counters()
        c = self.api.stats(self.model.ptr)
        rows = c.hit_rows + c.miss_rows
        st = self.stats
        return {
            # experts already resident when their layer asked for them (before any upload the hook made)
            # (with no hook, residency is static and the C row counters tell the same thing)
            "hit_rate": st.resident_at_need / st.needed if st.needed else (c.hit_rows / rows if rows else 0.0),
            # rows computed from slots rather than on the host (after the hook's uploads)
            "slot_row_rate": c.hit_rows / rows if rows else 0.0,
            "hit_rows": c.hit_rows, "miss_rows": c.miss_rows, "route_calls": c.route_calls,
            "needed": st.needed, "resident_at_need": st.resident_at_need,
            "hook_ms": c.hook_ns / 1e6, "upload_ns": c.upload_ns,
            "uploads": st.uploads, "upload_bytes": st.upload_bytes,
            "overflow_rows": st.overflow_rows, "prefetches": st.prefetches,
            "waited": st.waited, "surrogate_uses": st.surrogate_uses, "late": st.late,
            "lookahead": st.lookahead, "failed_uploads": self.residency.failed_uploads,
            "route_us_per_call": c.route_ns / 1e3 / c.route_calls if c.route_calls else 0.0,
            "hook_us_per_call": c.hook_ns / 1e3 / c.route_calls if c.route_calls else 0.0,
        }

    def _native_counters(self) -> dict:
        """counters() of native residency: the C counters, in the same names (plus what the Python hook counted
        before a cache went native, since the last reset)."""
        out = self._native_counts()
        for k, v in self._pre_native.items():
            out[k] += v
        out["hit_rate"] = out["resident_at_need"] / out["needed"] if out["needed"] else 0.0
        return out

    def _native_counts(self) -> dict:
        c = self.api.stats(self.model.ptr)
        rows = c.hit_rows + c.miss_rows
        calls = c.route_calls
        return {
            "hit_rate": c.resident_at_need / c.needed if c.needed else 0.0,
            "slot_row_rate": c.hit_rows / rows if rows else 0.0,
            "hit_rows": c.hit_rows, "miss_rows": c.miss_rows, "route_calls": calls,
            "needed": c.needed, "resident_at_need": c.resident_at_need,
            # the stall a token sees from residency: the routing op's time, its waits for reads included (the
            # Python hook's time is the same measure there)
            "hook_ms": c.route_ns / 1e6, "upload_ns": c.upload_ns,
            "uploads": c.uploads, "upload_bytes": c.upload_bytes, "native": 1,
            "overflow_rows": c.overflow, "prefetches": c.prefetches,
            "waited": c.waited, "surrogate_uses": 0, "late": c.late, "lookahead": c.lookahead,
            "failed_uploads": c.upload_failures,
            "route_us_per_call": c.route_ns / 1e3 / calls if calls else 0.0,
            "hook_us_per_call": c.route_ns / 1e3 / calls if calls else 0.0,
            # the routing op's own time, its waits for reads left out: what deciding costs per MoE layer
            "route_us_per_layer": (c.route_ns - c.wait_ns) / 1e3 / calls if calls else 0.0,
            "wait_ms": c.wait_ns / 1e6,
            # mean reads outstanding while the routing op waited (a deep queue keeps the disk busy)
            "reads_in_flight": c.stall_reads_ns / c.wait_ns if c.wait_ns else 0.0,
            "read_bytes": c.read_bytes,
        }

    def link_gbps(self) -> float | None:
        """The slow tier's speed as measured on this session's uploads so far (None before any)."""
        if self.native:
            c = self.api.stats(self.model.ptr)
            if c.read_busy_ns and c.read_bytes:
                return c.read_bytes / c.read_busy_ns
            return c.upload_bytes / c.upload_ns if c.upload_ns else None
        if isinstance(self.tier, DiskTier):
            return self.tier.read_bytes / self.tier.busy_ns if self.tier.busy_ns else None
        c = self.api.stats(self.model.ptr)
        return c.upload_bytes / c.upload_ns if c.upload_ns else None

    def reset_counters(self) -> None:
        self.stats = CacheStats()
        self._pre_native = {}
        if self.native:  # totals and failures count from the cache's start: keep what the reset takes away
            c = self.api.stats(self.model.ptr)
            for name, _ in native.Stats._fields_:
                setattr(self._native_base, name, getattr(self._native_base, name) + getattr(c, name))
        self.api.stats_reset(self.model.ptr)

    def close(self) -> None:
        """Unhook and let every upload finish. Call before the model is freed: uploads write into its slots."""
        if self._closed:
            return
        self._closed = True
        try:
            self.drain()
        finally:
            if self.hooks is not None:
                self.hooks.close()
                self.hooks = None
            self.tier.close()

    def __enter__(self) -> ExpertCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
