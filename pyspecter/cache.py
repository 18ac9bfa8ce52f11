"""Expert slots for one model, and the one face the engine, the session and the bench talk to.

Inside a layer C alone decides (csrc/native_route.cpp and residency.cpp, through ``NativeResidency``): the
routing op looks residency up, picks victims, starts reads and hands misses to the host path, in every policy and
miss mode. This class allocates the slots, configures that engine, and reads it between decodes. With
``hook=False`` no engine runs: residency is static (what 'all-resident' and a hot set measure), the routing op maps
ids through the table ``warm`` fills and never evicts (a hot set is re-chosen between decodes by ``adapt``, never
inside a layer). Either way an expert not resident when its layer runs is computed exactly on the host, so no
decision can change the model's output, only its speed (surrogates, opt-in, are the exception).
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from pyspecter import native
from pyspecter.budget import check_slots
from pyspecter.errors import SpecterError
from pyspecter.hotset import HotSet
from pyspecter.layout import ModelLayout
from pyspecter.misses import MISS_MODES
from pyspecter.native.hooks import Hooks
from pyspecter.native_residency import NativeLayer, NativeResidency
from pyspecter.policies import POLICIES, check_policy, hot_experts
from pyspecter.tiers import RamTier, Tier

__all__ = ["MISS_MODES", "POLICIES", "ExpertCache", "Totals"]


@dataclass
class Totals:
    """Since the cache was made (reset_counters leaves them): what the engine compares its steps by."""

    misses: int = 0  # experts not resident when their layer asked
    ghost_misses: int = 0  # misses plain LRU over all allocated slots, held ones included, would have had
    hook_ns: int = 0  # time in the routing op, waits for reads included


class ExpertCache:
    """Budgeted expert slots for one model. Create it after loading the model and before its context."""

    def __init__(self, model: native.Model, layout: ModelLayout, n_slots: int, *, policy: str = "lru",
                 miss: str = "wait", tier: Tier | None = None, hook: bool = True, record: bool = False,
                 surrogates=None, ordered: bool = False, lookahead: bool = True, held: int = 0,
                 on_input=None, extra: Mapping[int, int] | None = None,
                 kinds: Mapping[int, int] | None = None,
                 reuse=None, duel: bool = True, ahead=None, held_extra: Mapping[int, int] | None = None,
                 speculate: bool = True) -> None:
        """hook=False leaves residency static (no decision on the compute path: what 'all-resident' measures);
        record=True keeps the routing trace [(layer, needed experts)] for offline analysis (e.g. Belady MIN);
        lookahead=False turns off reading the next layer's experts during a multi-token ubatch (prefill);
        held=N allocates N more slots per layer than it uses until ``release_held()``: memory that a draft holds
        now and the slots get once the draft is dropped (CPU slots never written take no memory); C holds them and
        runs their ghost LRU; held_extra: layer -> slots it holds beyond ``held`` (numbered after them);
        on_input(il, x): each MoE layer's router input before its routing call (learned predictors);
        ``route_observer``, when set, hears ``on_route(il, needed, n_tokens)`` after each routing call; extra:
        layer -> regular slots that layer uses beyond ``n_slots`` (a budget spread by layer:
        ``budget.allocate_slots``/``split_counts``); kinds: a layer plan (``layerplan``), MoE layer ->
        native.LAYER_SLOTS / LAYER_HOST / LAYER_FULL, slots where not named: only slot layers get slots and a
        routing op, the others run stock's graph (and the cache's layout and tier see only the slot layers);
        surrogates: a ``surrogate.Surrogates`` for miss mode 'surrogate' (approximate), handed to C once here;
        reuse: a ``LearnedPredictor`` whose reuse maps C applies to each layer's router input for policy
        'predicted' (``duel``: only while they miss less than LRU); ahead: a ``LearnedPredictor`` whose
        layer-ahead maps the native planner applies; speculate: on a device, a ubatch after one that hit in every
        row runs with no host visit, and again with its host paths if a row missed (csrc/speculate.cpp: exact
        either way; off, every device slot layer visits the host every ubatch). Miss mode 'mapped' (a device, with
        speculation): a speculated ubatch's misses are read by the device from the host copy instead of redoing the
        ubatch (csrc/mapped.cpp), in place where it can (CUDA, pinned host experts), else from a device copy that
        stands in (the RPC device: the experts' bytes of device memory beyond the budget, ``mapped_copy_bytes``);
        residency then moves experts as in 'cpu'."""
        layout.require_moe()
        if kinds:
            slot_layers = [L for L in layout.layers if kinds.get(L.index, native.LAYER_SLOTS) == native.LAYER_SLOTS]
            layout = dataclasses.replace(layout, layers=slot_layers)
            if not layout.layers:
                raise SpecterError("the layer plan has no slot layer: nothing for expert slots to do")
        check_policy(policy)
        if miss not in MISS_MODES:
            raise SpecterError(f"unknown miss mode {miss!r}: use one of {', '.join(MISS_MODES)}")
        if ordered and miss != "wait":
            raise SpecterError("ordered (late experts after resident ones) is a refinement of miss mode 'wait'")
        if (miss == "surrogate") != (surrogates is not None):
            raise SpecterError("miss mode 'surrogate' needs surrogates (and they are used by no other mode)")
        n_slots = min(n_slots, layout.n_expert)
        # surrogate mode reserves top-k slots per layer to expand surrogates into; the rest cache full experts
        self.n_reserved = layout.n_expert_used if surrogates is not None else 0
        check_slots(layout, n_slots, reserved=self.n_reserved, held=held)
        self.n_regular = n_slots - self.n_reserved
        self.extra = self._check_extra(model, layout, n_slots, extra)
        held_extra = {il: x for il, x in (held_extra or {}).items() if x}
        unknown = set(held_extra) - {L.index for L in layout.layers}
        if unknown:
            raise SpecterError(f"extra slots for layers that are not MoE layers: {sorted(unknown)}")
        self._held = {L.index: held + held_extra.get(L.index, 0) for L in layout.layers}
        if not hook and any(self._held.values()):
            raise SpecterError("held slots (a draft's memory) need the residency engine (hook=True)")
        # slots each layer hands out now: the regular ones less those held back for later, plus its extra ones
        self._usable = {L.index: self.n_regular - held + self.extra.get(L.index, 0) for L in layout.layers}
        self.surrogates = surrogates
        self.model, self.layout, self.n_slots = model, layout, n_slots
        self.policy, self.miss, self.ordered = policy, miss, ordered
        self.api = native.slots()
        # the C side allocates one count in every layer: the largest. On the CPU a slot never written takes no
        # memory, and a layer never writes past its own count, so the spread costs only what it uses
        self.n_alloc = n_slots + max(self.extra.get(il, 0) + self._held[il] - held for il in self._held)
        if kinds:
            arr = (ctypes.c_int32 * model.n_layer)(*[kinds.get(il, native.LAYER_SLOTS) for il in range(model.n_layer)])
            rc = self.api.slots_init_layers(model.ptr, self.n_alloc, arr, model.n_layer)
        else:
            rc = self.api.slots_init(model.ptr, self.n_alloc)
        if rc != 0:
            raise SpecterError(f"could not allocate {self.n_alloc} expert slots per layer (code {rc})")
        speculating = bool(self.api.set_speculate(model.ptr, speculate))  # C may refuse it (see _map_host_experts)
        self.mapped_copy_bytes = self._map_host_experts(model, speculating) if miss == "mapped" else 0
        self.tier = tier or RamTier()
        self.tier.bind(model, layout)
        self.expert_bytes = {L.index: L.expert_bytes for L in layout.layers}
        self.layer_pos = {L.index: j for j, L in enumerate(layout.layers)}  # order in the forward pass
        self.hooks = None
        self._observer = None
        self._warm_uploads = self._warm_bytes = 0  # what warm() and adapt() copied (static residency's uploads)
        self._hot: HotSet | None = None  # a hot set re-chosen between decodes (warm_hot(adapt=True))
        self.nat: NativeResidency | None = None
        self._recording = record
        if hook:
            # mapped: residency moves experts as in cpu (the device reads the misses; mapped.cpp)
            moves = "cpu" if miss == "mapped" else miss
            self.nat = NativeResidency(model, layout, self.tier, dict(self._usable), policy=policy, miss=moves,
                                       ordered=ordered,
                                       lookahead=lookahead and moves not in ("cpu", "host"),  # host: nothing moves
                                       trace=[] if record else None, reuse=reuse, duel=duel, ahead=ahead,
                                       held=self._held)
            if surrogates is not None:
                for L in layout.layers:
                    first = self._usable[L.index] + self._held[L.index]  # after the layer's regular slots
                    surrogates.install(self.api, model.ptr, L.index, first, self.n_reserved)
            if on_input is not None:
                self.hooks = Hooks(model, None, on_input=on_input)
        elif on_input is not None or record:
            raise SpecterError("router inputs and routing traces come from the residency engine (hook=True)")
        self._reported_failures = 0
        self._late_lost = 0
        self._closed = False

    @property
    def native(self) -> bool:
        """Residency is decided by the engine in C; False: static (hook=False)."""
        return self.nat is not None

    def duel_state(self) -> tuple[bool, int] | None:
        """(evicting by the reuse scores now, switches so far) under native reuse maps; None otherwise."""
        return self.nat.duel_state() if self.nat is not None else None

    @property
    def trace(self) -> list[tuple[int, tuple[int, ...]]] | None:
        """The routing trace [(layer, needed experts)] when recording (None otherwise)."""
        return self.nat.trace() if self.nat is not None and self._recording else None

    @property
    def recording(self) -> bool:
        """The routing calls are recorded (record=True): take_calls hands them out."""
        return self._recording

    def stop_recording(self) -> None:
        """No routing call is recorded from here on, and those not taken yet are forgotten: their reader (a draft's
        prefetch scoring) is done, and nothing else of a session reads them (between decodes)."""
        if self._recording and self.nat is not None:
            self.nat.stop_recording()
        self._recording = False

    def take_calls(self) -> list[tuple[int, tuple[int, ...]]]:
        """The routing calls recorded since the last take (record=True; else none), handed out and forgotten: what
        a draft's prefetches are checked against."""
        return self.nat.take_calls() if self.nat is not None and self._recording else []

    @property
    def totals(self) -> Totals:
        """Since the cache was made: misses, ghost misses, time deciding (C's counters)."""
        if self.nat is None:
            return Totals()
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
        if obs is not None and self.hooks is None:
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
        """Layer -> a read-only view of its slot table as C holds it (tests and stats)."""
        n_slots = self.api.n_slots(self.model.ptr)
        return {il: NativeLayer(self.api, self.model, il, self.layout.n_expert, n_slots, n)
                for il, n in self._usable.items()}

    @property
    def n_usable(self) -> int:
        """The fewest slots any layer hands out now (every layer's, when the budget is not spread by layer)."""
        return min(self._usable.values(), default=0)

    def usable(self, il: int) -> int:
        """Slots layer il hands out now."""
        return self._usable[il]

    def usable_per_layer(self) -> dict[int, int]:
        """Layer -> slots it hands out now, in forward order (stats: not in ``counters``, whose every value is a
        count that merges by summing)."""
        return dict(self._usable)

    def usable_mean(self) -> float:
        """Slots a layer hands out now, on average over the MoE layers."""
        return sum(self._usable.values()) / len(self._usable)

    # --- prediction-driven residency (the speculative engine) ---------------------------------------------------

    def protect(self, il: int, experts) -> None:
        """Experts predicted for the window in flight: eviction skips them until unprotect_all()."""
        if self.nat is not None:
            self.nat.protect(il, experts)

    def unprotect_all(self) -> None:
        if self.nat is not None:
            self.nat.unprotect_all()

    def prefetch(self, il: int, experts, priority: float = 1.0, deadline: int = 0) -> int:
        """Queue reads of predicted experts that are neither resident nor on their way, behind every demand read
        (lower deadline, in routing calls from now, first; then higher priority). How many were queued (miss mode
        host queues none; static residency moves nothing)."""
        return self.nat.schedule(il, experts, priority, deadline) if self.nat is not None else 0

    def release_held(self) -> None:
        """The memory held back (a draft's) is free now: every allocated slot may be used from here on. C releases
        them between decodes (and drops the draft's queued prefetches); nothing is handed over."""
        if self.nat is not None:
            self.nat.release_held()
        self._usable = {il: u + self._held[il] for il, u in self._usable.items()}
        self._held = dict.fromkeys(self._held, 0)

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
            print(f"pyspecter: warning: {failed - self._reported_failures} expert upload(s) failed "
                  f"({self.tier.name} tier); those experts were computed exactly on the host", file=sys.stderr)
            self._reported_failures = failed

    def drain(self) -> None:
        """Finish reads in flight and make those that landed resident."""
        if self.nat is not None:
            self.nat.drain()

    def failed_uploads(self) -> int:
        """Uploads that did not land since the cache was made (their experts were computed on the host)."""
        if self.nat is not None:
            return self.nat.since_start("upload_failures")
        return self.api.stats(self.model.ptr).upload_failures

    @staticmethod
    def _map_host_experts(model: native.Model, speculating: bool) -> int:
        """Miss mode 'mapped': the device's view of the host experts (see __init__); the device bytes a copy took.
        It is built on the speculated graph: ``speculating`` is whether C turned speculation on."""
        if model.device is None or not speculating:
            raise SpecterError("miss mode 'mapped' needs a device (--device) and speculation (off where not asked for, "
                               "SPECTER_SPECULATE=0, or recurrent layers, which a redo would advance twice)")
        if model.device.zero_slots(1):
            raise SpecterError(f"miss mode 'mapped': {model.device.spec} takes no negative expert ids")
        # where the device cannot read host memory a device copy of every expert stands in: taken on the RPC
        # device (the tests' stand-in for a GPU, its memory a process's), refused elsewhere, where it would be a
        # GPU's memory beyond the budget (the whole model's experts)
        stand_in = model.device.spec.startswith("rpc:")
        rc, nbytes = native.map_host_experts(model.ptr, stand_in)
        if rc == 0:
            raise SpecterError("miss mode 'mapped': no slot layer is on the device")
        if rc == native.ERR_ARG and not stand_in:
            raise SpecterError(f"miss mode 'mapped': {model.device.spec} cannot read the host experts in "
                               f"{model.host_experts()} (pinned host memory, CUDA only); use --miss cpu")
        if rc < 0:
            raise SpecterError(f"miss mode 'mapped': could not map the host experts (code {rc})")
        return nbytes

    def faults_injected(self) -> int:
        """Reads the tier's injected faults failed so far (``Tier.faults``; 0 under static residency)."""
        return self.nat.faults_injected() if self.nat is not None else 0

    def warm(self, experts_by_layer: dict[int, list[int]]) -> None:
        """Fill slots before the first token (e.g. from a routing profile), hottest first. C's table is the only
        one: the engine, if any, starts from it."""
        for il, experts in experts_by_layer.items():
            for slot, e in enumerate(experts[: self.usable(il)]):
                self._load(il, e, slot)

    def _load(self, il: int, e: int, slot: int) -> None:
        self.tier.upload(il, e, slot)
        self._landed(il)
        if self.api.set_slot(self.model.ptr, il, e, slot) != 0:
            raise SpecterError(f"layer {il}: could not map expert {e} to slot {slot}")

    def _landed(self, il: int) -> None:
        self._warm_uploads += 1
        self._warm_bytes += self.expert_bytes[il]

    def warm_hot(self, profile: Mapping[int, list[int]], adapt: bool = False) -> None:
        """The static hot set: each slot layer's usable slots get its experts selected most often in ``profile``
        (per MoE layer, the times each expert was selected: ``hitrates.hot_profile``), once; adapt=True (static
        residency): then re-chosen from the text's own routing by ``adapt`` between decodes (``hotset``)."""
        if adapt and self.nat is None:
            self._hot = HotSet(profile, self._usable, self.layout.n_expert_used, self.layout.n_expert)
        self.warm({il: hot_experts(profile[il], self.usable(il)) for il in self.layers})

    def adapt(self) -> int:
        """Call between decodes: an adaptive hot set is re-chosen once ``hotset.EVERY`` tokens were routed since
        the last time (``HotSet.step``). Exact either way. Returns the experts uploaded."""
        if self._hot is None:
            return 0
        return self._hot.step(self.model, self._load, self._landed, queue=self.tier.home != "file")

    def counters(self) -> dict:
        out = self._residency_counters()
        # speculated ubatches (device slot layers): computed with no host path, and those a missed row redid; the
        # most upload batches a device stream held in flight at once, and those that first waited for the device's
        # queued compute; the bytes the fences pushed to the devices' remap tables (a synchronous copy before a
        # ubatch, when anything changed); the upload threads' waits for their batches to land, and their CPU time
        d = native.device_stats(self.model.ptr)
        out.update(spec_ubatches=d.spec_ubatches, spec_redos=d.spec_redos, upload_inflight_peak=d.inflight_peak,
                   compute_orders=d.compute_orders, mapped_rows=d.mapped_rows, table_bytes=d.table_bytes,
                   landing_wait_ns=d.landing_wait_ns, landing_wait_cpu_ns=d.landing_wait_cpu_ns)
        return out

    def _residency_counters(self) -> dict:
        if self.nat is not None:
            return self.nat.counters()
        c = self.api.stats(self.model.ptr)
        rows = c.hit_rows + c.miss_rows
        calls = c.route_calls
        # static residency: the routing op only maps ids, so the rows tell what was resident
        return {
            "hit_rate": c.hit_rows / rows if rows else 0.0, "slot_row_rate": c.hit_rows / rows if rows else 0.0,
            "hit_rows": c.hit_rows, "miss_rows": c.miss_rows, "route_calls": calls,
            "needed": 0, "resident_at_need": 0, "hook_ms": c.route_ns / 1e6, "upload_ns": c.upload_ns,
            "uploads": self._warm_uploads, "upload_bytes": self._warm_bytes, "native": 0,
            "overflow_rows": 0, "prefetches": 0, "waited": 0, "surrogate_uses": 0, "late": 0, "lookahead": 0,
            "failed_uploads": c.upload_failures,
            "route_us_per_call": c.route_ns / 1e3 / calls if calls else 0.0,
            "hook_us_per_call": c.route_ns / 1e3 / calls if calls else 0.0,
        }

    def link_gbps(self) -> float | None:
        """The slow tier's speed as measured on this session's uploads so far (None before any)."""
        if self.nat is not None:
            return self.nat.link_gbps()
        c = self.api.stats(self.model.ptr)
        return c.upload_bytes / c.upload_ns if c.upload_ns else None

    def reset_counters(self) -> None:
        if self.nat is not None:  # totals and failures count from the cache's start: keep what the reset takes
            self.nat.reset()
        self._warm_uploads = self._warm_bytes = 0
        self.api.stats_reset(self.model.ptr)

    def close(self) -> None:
        """Unhook and let every read finish. Call before the model is freed: reads write into its slots."""
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
