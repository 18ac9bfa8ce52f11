"""The control plane's side of native residency (csrc/residency.cpp): configure it, then, between decodes, hand it
prefetches and protected experts and read its counters and routing trace. Inside a layer C alone decides, in every
policy and miss mode; nothing here mirrors its slot table (``NativeLayer`` reads it on demand, for tests and stats).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

import numpy as np

from pyspecter import native
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout
from pyspecter.tiers import DiskTier, Tier

Trace = list[tuple[int, tuple[int, ...]]]


# the draft's rates, read from its counts (``NativeResidency.draft_counters``, summed or not)
DRAFT_RATES = ("draft_precision", "draft_coverage", "draft_recall", "draft_lru_hit_rate")


def draft_rates(c: Mapping[str, int]) -> dict[str, float | None]:
    """A draft's prefetches' precision (used / scored, over closed windows), and over the target's needs in its
    windows: coverage (resident at need), recall (named by the draft), and the hit rate plain LRU with the same
    slots would have had on the same calls (a ghost in C): side by side, from one run. None where nothing counted."""
    scored, needed = c.get("draft_scored", 0), c.get("draft_needed", 0)
    return {
        "draft_precision": c["draft_used"] / scored if scored else None,
        "draft_coverage": c["draft_hits"] / needed if needed else None,
        "draft_recall": c["draft_recalled"] / needed if needed else None,
        "draft_lru_hit_rate": c["draft_lru_hits"] / needed if needed else None,
    }


class NativeLayer:
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

    @property
    def pending(self) -> dict:
        """Slots being filled are C's alone (not mirrored): none visible here, their experts read as misses."""
        return {}


def layer_cpu_p50_us(counts: list[int]) -> float | None:
    """The median of one row of ``llama_pyspecter_get_layer_cpu_hist`` in µs, interpolated within its bin (None:
    no layer sampled). A mean of the op's thread CPU time adds whatever the kernel charged that thread while the op
    ran: where the kernel has no IRQ time accounting, the interrupts of the reads in flight landing on its CPU (the
    project's machines: every disk interrupt lands on CPU 1). 3% of calls above 100 µs carried the mean there."""
    total = sum(counts)
    if total == 0:
        return None
    half, below = total / 2, 0
    for b, n in enumerate(counts):
        if n and below + n >= half:
            return (b + (half - below) / n) * native.HIST_NS / 1e3
        below += n
    return None


class NativeResidency:
    """Residency owned by the routing op. Enable before the model's context exists (or between decodes: the graphs
    keep the shape they were built with, and a late path or a router input they carry serve C the same way)."""

    def __init__(self, model: native.Model, layout: ModelLayout, tier: Tier, usable: dict[int, int], *,
                 policy: str, miss: str, ordered: bool, lookahead: bool, trace: Trace | None,
                 reuse=None, duel: bool = True, ahead=None, min_prob: float = 0.5,
                 held: Mapping[int, int] | None = None) -> None:
        """usable: layer -> slots it hands out; held: layer -> slots it holds back after those (a draft's memory, until
        ``release_held``), with a ghost LRU over both counting what dropping the draft would leave; trace: a list to
        append the routing trace to (None: not recorded; a list already holding calls keeps them); reuse: a
        ``LearnedPredictor`` whose reuse maps C applies for policy 'predicted' (``duel``: only while they miss less than
        LRU); ahead: a ``LearnedPredictor`` whose layer-ahead maps the native planner applies in each routing op of
        decoding, prefetching what they predict at ``min_prob`` or more (below an even chance a prefetch costs a
        link-bound tier more than it saves: on smol-moe's disk tier at 50%, prefetching at p >= 0.25 read 47 MiB per
        token against LRU's 29 and ran 0.76x LRU)."""
        self.api, self.model, self.layout = native.slots(), model, layout
        self.policy_after = native.NATIVE_POLICIES["score" if policy == "predicted" else policy]
        # While a draft's predictions fill the slots they evict LRU: the reuse scores, fitted on the target's own
        # routing, gave the draft's prefetches up before their use (smol-moe, disk tier, 50%: 47.5 prefetches and
        # 144 MB read per token against LRU's 29.7 and 104 while the draft ran); the scores evict from the drop on
        held_lru = any((held or {}).values()) and policy == "predicted"
        p = native.ResidencyParams(
            policy=native.NATIVE_POLICIES["lru"] if held_lru else self.policy_after,
            miss=native.NATIVE_MISS["ordered" if ordered else miss], n_readers=1, fd=-1, drop_cache=False,
            lookahead=lookahead, record=trace is not None)
        if isinstance(tier, DiskTier):
            # two readers per queue slot: misses of one layer and the kinds of one expert are read side by side,
            # so the disk's queue stays several deep
            p.fd, p.drop_cache, p.n_readers = tier.fd, not tier.direct, 2 * tier.queue_depth
            p.read_chunk, p.io = tier.read_chunk, native.NATIVE_IO[tier.io]
        self._check(self.api.residency_init(model.ptr, ctypes.byref(p)), "could not enable native residency")
        for L in layout.layers:
            self._check(self.api.set_usable(model.ptr, L.index, usable[L.index]), f"layer {L.index}: slot count")
            h = (held or {}).get(L.index, 0)
            if h:
                self._check(self.api.set_held(model.ptr, L.index, h), f"layer {L.index}: {h} held slots")
            if isinstance(tier, DiskTier):
                for kind, t in L.tensors.items():
                    self._check(self.api.set_file_offset(model.ptr, L.index, native.KIND_NAMES[kind], t.offset),
                                f"layer {L.index}: where {t.name} is in the file")
        if tier.faults is not None:
            self._check(self.api.set_read_faults(model.ptr, ctypes.byref(tier.faults)), "could not inject read faults")
        if reuse is not None and policy == "predicted":
            self._set_reuse_maps(reuse, duel)
        self.ahead = ahead
        if ahead is not None:
            self._set_ahead_maps(ahead, min_prob)
        self.trace_list = trace
        self.base = native.Stats()  # counters from before the last reset
        self.surrogate_base = 0  # surrogate uses before the last reset (C counts them since init)
        self._draft_base = native.DraftStats()  # ... and the draft's
        self.usable = dict(usable)
        self.n_held = {il: (held or {}).get(il, 0) for il in usable}

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise SpecterError(f"{what} ({native.status_name(rc)})")

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
            self._check(self.api.set_reuse_map(self.model.ptr, L.index, arrs[0].ctypes.data, arrs[1].ctypes.data,
                                               arrs[0].shape[0], arrs[2].ctypes.data if len(arrs) > 2 else None),
                        f"layer {L.index}: the reuse map does not fit the model")
        # a blended predictor was weighed against recency when it was fitted: the duel starts on its scores
        self._check(self.api.set_duel(self.model.ptr, duel, predictor.blend is not None, 0.998, 0.03),
                    "could not set the eviction duel")

    def _set_ahead_maps(self, predictor, min_prob: float) -> None:
        """Each map of the predictor, source layer to target layer, with the calibration of that target and
        horizon (``LearnedPredictor.predict``'s math, applied by C to the source's router input)."""
        E, ptr = self.layout.n_expert, self.model.ptr
        slot_layers = {L.index for L in self.layout.layers}
        for j, il in enumerate(predictor.layers):
            if predictor.A[j] is None or il not in slot_layers:
                continue
            # a reduced-rank map is applied as its product: one matmul in the routing op
            A = predictor.A[j] if predictor.A2[j] is None else predictor.A[j] @ predictor.A2[j]
            for h in range(1, predictor.n_targets(j) + 1):
                dst = predictor.layers[j + h]
                if dst not in slot_layers:
                    continue
                cols = slice((h - 1) * E, h * E)
                W = np.ascontiguousarray(A[:, cols], np.float32)
                b = np.ascontiguousarray(predictor.b[j][cols], np.float32)
                sb = predictor.sel_bias[j + h]
                sb = None if sb is None else np.ascontiguousarray(sb, np.float32)
                table = np.ascontiguousarray(predictor.rank_prob[j + h, h - 1], np.float32)  # [B, E]
                edges = np.ascontiguousarray(predictor.gap_edges[j + h, h - 1], np.float32)  # [B - 1]
                self._check(self.api.set_ahead_map(ptr, il, dst, W.ctypes.data, b.ctypes.data, W.shape[0],
                                                   predictor.n_used, predictor.gating,
                                                   sb.ctypes.data if sb is not None else None, table.ctypes.data,
                                                   edges.ctypes.data if edges.size else None, table.shape[0]),
                            f"layer {il}: the layer-ahead map for layer {dst} does not fit the model")
        self.set_planner(True, min_prob)

    def set_planner(self, enabled: bool, min_prob: float = 0.5, max_stall: float = 0.5) -> None:
        """The native planner's layer-ahead prefetching on or off (its maps stay set); ``max_stall``: it stands
        aside while waits for reads take more than that share of a layer-time (link-bound; >= 1: never). The one
        on/off rule of prefetching from the maps, native; the draft's governor is ``governor.KGovernor``."""
        self._check(self.api.set_planner(self.model.ptr, enabled, min_prob, max_stall), "could not set the planner")

    def ahead_probs(self, il_src: int, il_dst: int, x: np.ndarray) -> np.ndarray:
        """What the native planner predicts for layer il_dst from router input x of layer il_src (the probabilities
        the routing op computes; tests compare them with ``LearnedPredictor.predict``)."""
        x = np.ascontiguousarray(x, np.float32)
        out = np.zeros(self.layout.n_expert, np.float32)
        self._check(self.api.ahead_probs(self.model.ptr, il_src, il_dst, x.ctypes.data, x.shape[0], out.ctypes.data,
                                         out.shape[0]), f"no layer-ahead map from layer {il_src} to {il_dst}")
        return out

    # --- between decodes ------------------------------------------------------------------------------------

    def schedule(self, il: int, experts, priority: float = 1.0, deadline: int = 0) -> int:
        """Prefetch experts of layer il behind every demand read, due in ``deadline`` routing calls (lower first,
        then higher priority), into the queue the native planner fills too; how many reads were queued."""
        return sum(self.api.schedule(self.model.ptr, il, e, priority, deadline) == 1 for e in experts)

    def handover(self, draft: native.Model | None, min_conf: float = 0.0, per_pass: int = 1,
                 n_tokens: int = 0) -> None:
        """One draft step to the native planner, in one call (``llama_pyspecter_draft_handover``): the previous
        window is scored and closed, and the draft's next ``n_tokens`` tokens become prefetches as its routing op
        routes them, due where the verification pass (``per_pass`` tokens a pass) needs them. draft None: only
        close the window."""
        rc = self.api.draft_handover(self.model.ptr, draft.ptr if draft is not None else None, min_conf, per_pass,
                                     n_tokens)
        self._check(rc, "could not hand the draft's routing over")

    def draft_stats(self) -> native.DraftStats:
        out = native.DraftStats()
        self._check(self.api.get_draft_stats(self.model.ptr, ctypes.byref(out)), "no draft counters")
        return out

    def protect(self, il: int, experts) -> None:
        ids = list(experts)
        self._check(self.api.set_protected(self.model.ptr, il, (ctypes.c_int32 * len(ids))(*ids), len(ids)),
                    f"layer {il}: protected experts")

    def unprotect_all(self) -> None:
        self.api.set_protected(self.model.ptr, -1, None, 0)

    def drain(self) -> None:
        self.api.drain(self.model.ptr)

    def faults_injected(self) -> int:
        """Reads failed by the tier's injected faults so far (``Tier.faults``)."""
        return max(self.api.read_faults_injected(self.model.ptr), 0)

    def release_held(self) -> int:
        """The draft is dropped (between decodes): C hands out every layer's held slots from here on, ends their
        ghosts and protections, and takes back the prefetches still queued. The slots released."""
        n = self.api.release_held(self.model.ptr)
        self._check(min(n, 0), "could not release the held slots")
        self._check(self.api.set_policy(self.model.ptr, self.policy_after), "could not set the eviction policy")
        self.usable = {il: u + self.n_held[il] for il, u in self.usable.items()}
        self.n_held = dict.fromkeys(self.usable, 0)
        return n

    def held(self, il: int) -> int:
        """Layer il's held slots now (0 once released)."""
        return max(self.api.held(self.model.ptr, il, None), 0)

    def ghost_misses(self, il: int) -> int:
        """Layer il's ghost LRU's misses since its slots were held."""
        g = ctypes.c_int64()
        self._check(min(self.api.held(self.model.ptr, il, ctypes.byref(g)), 0), f"layer {il}: no residency")
        return g.value

    def layers(self) -> dict[int, NativeLayer]:
        n_slots = self.api.n_slots(self.model.ptr)
        return {il: NativeLayer(self.api, self.model, il, self.layout.n_expert, n_slots, n)
                for il, n in self.usable.items()}

    def duel_state(self) -> tuple[bool, int] | None:
        """(evicting by the reuse scores now, switches so far); None without the duel's C state."""
        sw = ctypes.c_int64()
        st = self.api.duel_state(self.model.ptr, ctypes.byref(sw))
        return (st == 1, sw.value) if st >= 0 else None

    def trace(self) -> Trace | None:
        """The routing trace so far (C's calls taken from its buffer into the list)."""
        if self.trace_list is None:
            return None
        self.trace_list += self.take_calls()
        return self.trace_list

    def stop_recording(self) -> None:
        """C records no more routing calls and forgets those not taken (between decodes)."""
        self._check(self.api.set_record(self.model.ptr, False), "could not stop recording the routing")
        self.trace_list = None

    def take_calls(self) -> Trace:
        """The routing calls C recorded since the last take, taken from its buffer (not kept here)."""
        n = self.api.trace_take(self.model.ptr, None, 0)
        if not n:
            return []
        buf = (ctypes.c_int32 * n)()
        got = self.api.trace_take(self.model.ptr, buf, n)
        flat, i, out = list(buf[:got]), 0, []
        while i < got:
            k = flat[i + 1]
            out.append((flat[i], tuple(flat[i + 2: i + 2 + k])))
            i += 2 + k
        return out

    # --- counters -------------------------------------------------------------------------------------------

    def stats(self) -> native.Stats:
        return self.api.stats(self.model.ptr)

    def since_start(self, name: str) -> int:
        """One C counter since residency went native (resets included)."""
        return getattr(self.base, name) + getattr(self.stats(), name)

    def reset(self) -> None:
        self.surrogate_base = max(self.api.surrogate_uses(self.model.ptr), 0)
        self._draft_base = self.draft_stats()
        c = self.stats()
        for name, _ in native.Stats._fields_:
            setattr(self.base, name, getattr(self.base, name) + getattr(c, name))

    def counters(self) -> dict:
        """The C counters since the last reset, in ``ExpertCache.counters``' names."""
        resident, missed = native.layer_cpu_hist(self.model.ptr)
        c = self.stats()
        rows = c.hit_rows + c.miss_rows
        calls = c.route_calls
        return {
            "hit_rate": c.resident_at_need / c.needed if c.needed else 0.0,
            "slot_row_rate": c.hit_rows / rows if rows else 0.0,
            "hit_rows": c.hit_rows, "miss_rows": c.miss_rows, "route_calls": calls,
            "needed": c.needed, "resident_at_need": c.resident_at_need,
            # the stall a token sees from residency: the routing op's time, its waits for reads included
            "hook_ms": c.route_ns / 1e6, "upload_ns": c.upload_ns,
            "uploads": c.uploads, "upload_bytes": c.upload_bytes, "native": 1,
            "overflow_rows": c.overflow, "prefetches": c.prefetches,
            "waited": c.waited, "late": c.late, "lookahead": c.lookahead,
            "surrogate_uses": max(self.api.surrogate_uses(self.model.ptr), 0) - self.surrogate_base,
            "failed_uploads": c.upload_failures,
            "route_us_per_call": c.route_ns / 1e3 / calls if calls else 0.0,
            "hook_us_per_call": c.route_ns / 1e3 / calls if calls else 0.0,
            # the routing op's own time, its waits for reads left out: what deciding costs per MoE layer
            "route_us_per_layer": (c.route_ns - c.wait_ns) / 1e3 / calls if calls else 0.0,
            # ... and the CPU it took, its copies and its read waits (the kernel's sleep and wake-up) left out:
            # where this is far below route_us_per_layer, the op's thread was runnable but off its core, not deciding
            "route_cpu_us_per_layer": (c.route_cpu_ns - c.copy_cpu_ns - c.wait_cpu_ns) / 1e3 / calls if calls else 0.0,
            "wait_cpu_us_per_layer": c.wait_cpu_ns / 1e3 / calls if calls else 0.0,
            # ... and its median over decode layers, all resident and with a miss: the op's own work, where the
            # mean also holds what the kernel charged the thread meanwhile (its interrupts: see layer_cpu_p50_us)
            "layer_cpu_hist": (resident, missed),
            "route_cpu_us_p50_resident": layer_cpu_p50_us(resident),
            "route_cpu_us_p50_miss": layer_cpu_p50_us(missed),
            "wait_ms": c.wait_ns / 1e6,
            # wall time with a read on the wire; the routing op's waits lie inside it (what it waits for is in flight)
            "read_busy_ms": c.read_busy_ns / 1e6,
            # mean reads outstanding while the routing op waited (a deep queue keeps the disk busy); a disk
            # read is one chunk (DiskTier.read_chunk) of one kind of one expert
            "reads_in_flight": c.stall_reads_ns / c.wait_ns if c.wait_ns else 0.0,
            "read_bytes": c.read_bytes, "read_ops": c.read_ops, "taken_back": c.taken_back,
            # the read queue's own work: entries queued, entries its searches examined, acquisitions of its lock,
            # notifications to idle readers, wake-ups of a routing or wait op waiting for reads
            "queue_entries": c.queue_entries, "queue_scans": c.queue_scans, "queue_locks": c.queue_locks,
            "reader_wakes": c.reader_wakes, "waiter_wakes": c.waiter_wakes,
            # a flag, not a count: disk reads go through io_uring (1) or pread threads (0)
            "io_uring": c.io_uring,
            # the native planner: maps applied, prefetches they queued, predictions left to the miss path
            "ahead_maps": c.ahead_maps, "ahead_prefetches": c.ahead_prefetches, "ahead_late": c.ahead_late,
            "ahead_refused": c.ahead_refused,
            **(d := self.draft_counters()), **draft_rates(d),
        }

    def draft_counters(self) -> dict:
        """The draft's handovers since the last reset (none: zeros), as counts (``draft_rates`` reads them)."""
        d, base = self.draft_stats(), self._draft_base
        return {f"draft_{name}": getattr(d, name) - getattr(base, name) for name, _ in native.DraftStats._fields_}

    def link_gbps(self) -> float | None:
        c = self.stats()
        if c.read_busy_ns and c.read_bytes:
            return c.read_bytes / c.read_busy_ns
        return c.upload_bytes / c.upload_ns if c.upload_ns else None
