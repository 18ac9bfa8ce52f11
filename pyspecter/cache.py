"""Expert slots for one model: who decides residency inside a layer, and the one face the engine talks to.

Wherever the configuration allows it (``native_residency.native_reason``) the routing op decides in C and this
class only configures it and reads it between decodes (``NativeResidency``). Otherwise the C side calls
``ExpertCache._on_route`` once per MoE layer per ubatch, before that layer's expert matmuls: it counts what the
layer needed, lets prediction-driven uploads land, and hands the misses to the miss handler (``misses.py``).
Either way an expert still not resident when the decision is made is computed exactly on the host, so no decision
can change the model's output, only its speed.

Why this module is long: one class serves both paths behind the same methods (prefetch, protect, warm, drain,
counters, a draft's held slots), so that the engine, the session and the bench never ask which one runs.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass

from pyspecter import native
from pyspecter import native as _native  # for __init__, whose `native` argument shadows the module
from pyspecter.budget import check_slots
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout
from pyspecter.misses import MISS_MODES, CacheStats, make_miss_handler, upload_to_victim
from pyspecter.native.hooks import Hooks
from pyspecter.native_residency import NativeResidency, native_reason
from pyspecter.policies import POLICIES, make_policy
from pyspecter.residency import Residency
from pyspecter.tiers import DiskTier, RamTier, Tier

__all__ = ["MISS_MODES", "POLICIES", "CacheStats", "ExpertCache", "Totals", "native_reason"]


@dataclass
class Totals:
    """Since the cache was made (reset_counters leaves them): what the engine compares its steps by."""

    misses: int = 0  # experts not resident when their layer asked
    ghost_misses: int = 0  # misses plain LRU over all allocated slots, held ones included, would have had (C's)
    hook_ns: int = 0  # time in the routing and wait hooks, waits for uploads included


class ExpertCache:
    """Budgeted expert slots for one model. Create it after loading the model and before its context."""

    def __init__(self, model: native.Model, layout: ModelLayout, n_slots: int, *, policy: str = "lru",
                 miss: str = "wait", tier: Tier | None = None, hook: bool = True, record: bool = False,
                 surrogates=None, ordered: bool = False, lookahead: bool = True, held: int = 0,
                 on_input=None, extra: Mapping[int, int] | None = None,
                 kinds: Mapping[int, int] | None = None, native: bool | None = None,
                 reuse=None, duel: bool = True, ahead=None, held_extra: Mapping[int, int] | None = None) -> None:
        """hook=False leaves residency static (no Python on the compute path: what 'all-resident' measures);
        record=True keeps the routing trace [(layer, needed experts)] for offline analysis (e.g. Belady MIN);
        lookahead=False turns off reading the next layer's experts during a multi-token ubatch (prefill);
        held=N allocates N more slots per layer than it uses until ``release_held()``: memory that a draft holds
        now and the slots get once the draft is dropped (CPU slots never written take no memory); C holds them and
        runs their ghost LRU, so held slots need native residency; held_extra: layer -> slots it holds beyond
        ``held`` (numbered after them); on_input(il, x):
        each MoE layer's router input before its routing call (learned predictors); ``route_observer``, when
        set, hears ``on_route(il, needed, n_tokens)`` after each routing call; extra: layer -> regular slots that
        layer uses beyond ``n_slots`` (a budget spread by layer: ``budget.allocate_slots``/``split_counts``); kinds:
        a layer plan (``layerplan``), MoE layer -> native.LAYER_SLOTS / LAYER_HOST / LAYER_FULL, slots where not
        named: only slot layers get slots and a routing hook, the others run stock's graph (and the cache's layout,
        residency and tier see only the slot layers); native=None: the routing op decides in C wherever this
        configuration allows it (``native_reason``), False: always the Python hook (tests of that path), True:
        refuse a configuration C cannot run; reuse: a ``LearnedPredictor`` whose reuse maps C applies to each
        layer's router input for policy 'predicted' (``duel``: only while they miss less than LRU,
        ``study.simulate.EvictionDuel``'s rule); ahead: a ``LearnedPredictor`` whose layer-ahead maps the native planner
        applies (native residency only: ignored on the Python hook)."""
        layout.require_moe()
        if kinds:
            slot_layers = [L for L in layout.layers if kinds.get(L.index, _native.LAYER_SLOTS) == _native.LAYER_SLOTS]
            layout = dataclasses.replace(layout, layers=slot_layers)
            if not layout.layers:
                raise SpecterError("the layer plan has no slot layer: nothing for expert slots to do")
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
        held_extra = {il: x for il, x in (held_extra or {}).items() if x}
        held_by = {L.index: held + held_extra.get(L.index, 0) for L in layout.layers}
        self._totals = Totals()
        self.surrogates = surrogates
        self.model, self.layout, self.n_slots = model, layout, n_slots
        self.policy, self.miss = policy, miss
        self.api = _native.slots()
        # the C side allocates one count in every layer: the largest. On the CPU a slot never written takes no
        # memory, and a layer never writes past its own count, so the spread costs only what it uses
        self.n_alloc = n_slots + max(self.extra.get(il, 0) + held_by[il] - held for il in held_by)
        if kinds:
            arr = (ctypes.c_int32 * model.n_layer)(*[kinds.get(il, _native.LAYER_SLOTS) for il in range(model.n_layer)])
            rc = self.api.slots_init_layers(model.ptr, self.n_alloc, arr, model.n_layer)
        else:
            rc = self.api.slots_init(model.ptr, self.n_alloc)
        if rc != 0:
            raise SpecterError(f"could not allocate {self.n_alloc} expert slots per layer (code {rc})")
        self.tier = tier or RamTier()
        why_not = native_reason(policy, miss, self.tier, hook=hook, surrogates=surrogates is not None,
                                reuse=reuse is not None and reuse.has_reuse)
        if native and why_not:
            raise SpecterError(f"native residency cannot run this configuration: {why_not}")
        use_c = native is not False and not why_not
        if any(held_by.values()) and not use_c:
            raise SpecterError(f"held slots (a draft's memory) need native residency: {why_not or 'native=False'}")
        # slots eviction may use now: the regular ones less those held back for later
        self.residency = Residency(model, layout, self.n_alloc, self.n_regular - held, pol, held=held,
                                   extra=self.extra, held_extra=held_extra)
        self.tier.bind(model, layout)
        self.expert_bytes = {L.index: L.expert_bytes for L in layout.layers}
        self.layer_pos = {L.index: j for j, L in enumerate(layout.layers)}  # order in the forward pass
        self.stats = CacheStats()
        self._trace: list[tuple[int, tuple[int, ...]]] | None = [] if record else None
        self.ordered = ordered
        self.misses = make_miss_handler(self, miss, ordered)
        self.lookahead = lookahead and miss not in ("cpu", "host")  # host: nothing moves, not even ahead
        self._next_layer = {a.index: b.index for a, b in zip(layout.layers, layout.layers[1:], strict=False)}
        self.hooks = None
        self._observer = None
        self.nat: NativeResidency | None = None
        if use_c:
            self.nat = NativeResidency(model, layout, self.tier, self._usable(), policy=policy, miss=miss,
                                       ordered=ordered, lookahead=self.lookahead, trace=self._trace, reuse=reuse,
                                       duel=duel, ahead=ahead, held=held_by)
            self.residency.retire()  # C's slot table is the only one
            if on_input is not None:
                self.hooks = Hooks(model, None, on_input=on_input)
        elif hook:
            wait = self._on_wait if self.misses.wants_wait_hook else None
            self.hooks = Hooks(model, self._on_route, wait, on_input=on_input, weights=False)  # it reads ids only
        self._reported_failures = 0
        self._late_lost = 0
        self._closed = False
        self._prev_tokens = 0  # ubatch size of the latest routing call

    @property
    def native(self) -> bool:
        """Residency is decided in C (``native_residency``); False: by the Python hook."""
        return self.nat is not None

    def _usable(self) -> dict[int, int]:
        return {il: self.residency.usable(il) for il in self.residency.layers}

    def duel_state(self) -> tuple[bool, int] | None:
        """(evicting by the reuse scores now, switches so far) under native reuse maps; None otherwise."""
        return self.nat.duel_state() if self.nat is not None else None

    @property
    def trace(self) -> list[tuple[int, tuple[int, ...]]] | None:
        """The routing trace [(layer, needed experts)] when recording (None otherwise)."""
        return self.nat.trace() if self.nat is not None else self._trace

    @trace.setter
    def trace(self, value) -> None:
        self._trace = value

    @property
    def recording(self) -> bool:
        """The routing calls are recorded (record=True): take_calls hands them out."""
        return self._trace is not None

    def stop_recording(self) -> None:
        """No routing call is recorded from here on, and those not taken yet are forgotten: their reader (a draft's
        prefetch scoring) is done, and nothing else of a session reads them (between decodes)."""
        if self._trace is None:
            return
        if self.nat is not None:
            self.nat.stop_recording()
        self._trace = None

    def take_calls(self) -> list[tuple[int, tuple[int, ...]]]:
        """The routing calls recorded since the last take (record=True; else none), handed out and forgotten: what
        a draft's prefetches are checked against."""
        if self.nat is not None:
            return self.nat.take_calls() if self._trace is not None else []
        calls = list(self._trace or ())
        if self._trace:
            self._trace.clear()
        return calls

    @property
    def totals(self) -> Totals:
        """Since the cache was made: misses, ghost misses, time deciding (C's counters under native residency)."""
        if self.nat is None:
            return self._totals
        n = self.nat.since_start
        return Totals(misses=n("needed") - n("resident_at_need"), ghost_misses=n("ghost_misses"),
                      hook_ns=n("route_ns"))

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
        if self.nat is not None:
            return self.nat.layers()
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
            res.note_needed(il, needed)
            self.misses.begin(il, st)
            missing = res.split(il, needed)
            self.stats.needed += len(needed)
            self.stats.resident_at_need += len(needed) - len(missing)
            self._totals.misses += len(missing)
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
        if self.nat is not None:
            self.nat.protect(il, experts)
            return
        self.residency.protect(il, experts)

    def unprotect_all(self) -> None:
        if self.nat is not None:
            self.nat.unprotect_all()
            return
        self.residency.unprotect_all()

    def prefetch(self, il: int, experts, priority: float = 1.0, deadline: int = 0) -> int:
        """Start async uploads of predicted experts that are neither resident nor on their way. Victims are never
        protected or pending. Returns how many uploads were issued. Under native residency they join C's prefetch
        queue (lower deadline, in routing calls from now, first; then higher priority); the Python hook uploads
        them in order."""
        if self.nat is not None:
            return self.nat.schedule(il, experts, priority, deadline)  # miss mode host: C queues none
        if self.miss == "host":  # a slot buys nothing over the home copy: nothing moves
            return 0
        issued = self._upload_ahead(il, experts)
        self.stats.prefetches += issued
        return issued

    def _upload_ahead(self, il: int, experts) -> int:
        st = self.layers.get(il)
        if st is None:
            return 0
        inflight = st.inflight()
        keep = set(experts)
        issued = 0
        for e in experts:
            if st.where[e] >= 0 or e in inflight:
                continue
            if not upload_to_victim(self, il, e, keep, need=False):
                break
            issued += 1
        return issued

    def release_held(self) -> None:
        """The memory held back (a draft's) is free now: every allocated slot may be used from here on. C releases
        them between decodes (and drops the draft's queued prefetches); nothing is handed over."""
        self.residency.release_held()
        if self.nat is not None:
            self.nat.release_held()

    def check(self) -> None:
        """Re-raise an error a hook parked (call after each decode); report failed uploads once, in one line."""
        if self.hooks is not None:
            self.hooks.check()
        if self.nat is not None:
            lost = self.nat.since_start("late_lost")
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
        if self.nat is not None:
            self.nat.drain()
        else:
            self.residency.drain()

    def failed_uploads(self) -> int:
        """Uploads that did not land since the cache was made (their experts were computed on the host)."""
        if self.nat is not None:
            return self.nat.since_start("upload_failures")
        return self.residency.failed_uploads

    def faults_injected(self) -> int:
        """Reads the tier's injected faults failed so far (``Tier.faults``; 0 without native residency)."""
        return self.nat.faults_injected() if self.nat is not None else 0

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
        """counters() of native residency: C's since the last reset."""
        return self.nat.counters()

    def link_gbps(self) -> float | None:
        """The slow tier's speed as measured on this session's uploads so far (None before any)."""
        if self.nat is not None:
            return self.nat.link_gbps()
        if isinstance(self.tier, DiskTier):
            return self.tier.read_bytes / self.tier.busy_ns if self.tier.busy_ns else None
        c = self.api.stats(self.model.ptr)
        return c.upload_bytes / c.upload_ns if c.upload_ns else None

    def reset_counters(self) -> None:
        self.stats = CacheStats()
        if self.nat is not None:  # totals and failures count from the cache's start: keep what the reset takes
            self.nat.reset()
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
