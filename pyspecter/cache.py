"""Expert slots on the fast tier: residency, eviction, and what happens on a miss.

The C side (patches/0003) owns the slot tensors and the remap table and calls ``ExpertCache._on_route`` once per
MoE layer per ubatch, before that layer's expert matmuls. Here we decide what to upload and what to evict. Any
expert still not resident when the hook returns is computed exactly on the host, so no decision made here can
change the model's output, only its speed.

Miss modes:
  wait       upload the missing experts now (the compute thread waits), then compute them from the slots;
  cpu        compute misses on the host now, and upload them in the background for next time;
  surrogate  APPROXIMATE, opt-in: compute a single-token miss with the expert's surrogate (its most important
             neurons, kept in RAM; see surrogate.py) from one of top-k reserved slots, and upload the full expert
             in the background for next time. Multi-token ubatches (prefill) wait, as in ``wait``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from pyspecter import native
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout

POLICIES = ("lru", "lfu")
MISS_MODES = ("wait", "cpu", "surrogate")


# --- slow tiers: where an expert's bytes come from -----------------------------------------------------------

class Tier:
    """The slow tier. ``upload`` copies expert ``e`` of layer ``il`` into slot ``s``; ``upload_async`` returns a
    handle with ``done()``/``wait()``."""

    name = "?"
    emulated = False

    def bind(self, model: native.Model, layout: ModelLayout) -> None:
        self.model, self.layout, self.api = model, layout, native.slots()

    def upload(self, il: int, expert: int, slot: int) -> None:
        raise NotImplementedError

    def upload_async(self, il: int, expert: int, slot: int):
        raise NotImplementedError

    def upload_now(self, il: int, expert: int, slot: int):
        """An async upload the compute thread will wait for soon (a miss): ahead of prefetches where the tier
        can do that."""
        return self.upload_async(il, expert, slot)

    def upload_many(self, il: int, loads: list[tuple[int, int]]) -> None:
        """Upload [(expert, slot)] of one layer and return when all are in."""
        for e, slot in loads:
            self.upload(il, e, slot)

    def readahead(self, il: int, experts) -> None:
        """The host path will read these experts soon (from the model's own mapping): start fetching them where
        that is slow. RAM is not."""

    def close(self) -> None:
        pass


class _Ticket:
    def __init__(self, api: native.SlotAPI, model_ptr, ticket: int) -> None:
        self.api, self.model_ptr, self.ticket = api, model_ptr, ticket

    def done(self) -> bool:
        return bool(self.api.upload_done(self.model_ptr, self.ticket))

    def cancel(self) -> bool:  # the C upload thread's queue has no take-back
        return False

    def started(self) -> bool:
        # uploads complete in FIFO order: once the previous one is done, this one is on the wire
        return bool(self.api.upload_done(self.model_ptr, self.ticket - 1))

    def wait(self) -> None:
        self.api.upload_wait(self.model_ptr, self.ticket)


class RamTier(Tier):
    """Host RAM: the model's own (mmap'd) expert tensors are the host copy; upload is a memcpy."""

    name = "ram"

    def upload(self, il: int, expert: int, slot: int) -> None:
        if self.api.load_expert(self.model.ptr, il, expert, slot) != 0:
            raise SpecterError(f"upload of expert {expert} of layer {il} failed")

    def upload_async(self, il: int, expert: int, slot: int) -> _Ticket:
        return _Ticket(self.api, self.model.ptr, self.api.load_expert_async(self.model.ptr, il, expert, slot))


class EmulatedTier(RamTier):
    """Host RAM with uploads throttled to a given bandwidth (PCIe-shaped experiments). Results are emulated."""

    emulated = True

    def __init__(self, gbps: float) -> None:
        if gbps <= 0:
            raise SpecterError(f"emulated tier needs a positive bandwidth, got {gbps}")
        self.gbps = gbps
        self.name = f"emulated:{gbps:g}"

    def bind(self, model: native.Model, layout: ModelLayout) -> None:
        super().bind(model, layout)
        self.api.set_link_gbps(model.ptr, self.gbps)


class _Group:
    """Handle over the parallel reads of one expert's tensors."""

    def __init__(self, futures: list[Future], jobs: list[tuple], retry: ThreadPoolExecutor) -> None:
        self.futures, self.jobs, self.retry = futures, jobs, retry

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def started(self) -> bool:
        return any(f.running() or f.done() for f in self.futures)

    def wait(self) -> None:
        for f in self.futures:
            f.result()

    def cancel(self) -> bool:
        """Take back reads not started yet. True if all were taken back (the slot was never touched); else the
        ones taken back are resubmitted to ``retry``, so the expert still arrives whole."""
        taken = [i for i, f in enumerate(self.futures) if f.cancel()]
        if len(taken) == len(self.futures):
            return True
        for i in taken:
            self.futures[i] = self.retry.submit(*self.jobs[i])
        return False


class DiskTier(Tier):
    """The GGUF file itself, read with O_DIRECT so the page cache holds nothing of the experts: the
    bigger-than-RAM case on CPU boxes. Falls back to buffered reads (with a warning) where O_DIRECT is refused.

    Reads go through a small pool, one tensor of one expert per read: an SSD serves one read at a time at about
    half its speed (measured here: 0.65 GB/s at queue depth 1, 1.14 at 2, 1.29 at 4), so an expert's tensors and
    a layer's misses are read side by side."""

    name = "disk"
    ALIGN = 4096

    def __init__(self, queue_depth: int = 4) -> None:
        self.queue_depth = max(1, queue_depth)

    def bind(self, model: native.Model, layout: ModelLayout) -> None:
        super().bind(model, layout)
        self.direct = True
        try:
            self.fd = os.open(layout.path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            self._probe()
        except OSError:
            self.direct = False
            self.fd = os.open(layout.path, os.O_RDONLY)
            print(f"pyspecter: warning: {layout.path}: filesystem refuses O_DIRECT; disk tier reads go through "
                  "the page cache (dropped after each read)", file=sys.stderr)
        # mmap loading pre-faulted the whole file: drop the experts from this process and from the page cache,
        # so they really live on disk (and in slots) from here on
        self.released = self.api.release_host_experts(model.ptr)
        for L in layout.layers:
            for t in L.tensors.values():
                os.posix_fadvise(self.fd, t.offset, t.expert_bytes * layout.n_expert, os.POSIX_FADV_DONTNEED)
        biggest = max(t.expert_bytes for layer in layout.layers for t in layer.tensors.values())
        self.buf_size = (biggest + 2 * self.ALIGN) // self.ALIGN * self.ALIGN
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=self.queue_depth, thread_name_prefix="specter-disk")
        # Misses the compute thread is waiting for get their own readers: in the prefetch pool they would queue
        # behind every prediction already issued (for later layers too) — a demand read must not wait for those.
        self._demand = ThreadPoolExecutor(max_workers=self.queue_depth, thread_name_prefix="specter-disk-miss")
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specter-disk-ahead")
        self._lock = threading.Lock()
        self._active = 0
        self._busy_since = 0
        self.read_bytes = 0
        # wall time with at least one read in flight: with read_bytes, the link speed as the engine sees it
        self.busy_ns = 0

    def _probe(self) -> None:
        mm = mmap.mmap(-1, self.ALIGN)
        try:
            os.preadv(self.fd, [mm], 0)
        finally:
            mm.close()

    def _buffer(self) -> tuple[mmap.mmap, int]:
        # one page-aligned buffer per thread (anonymous mmap is page aligned, as O_DIRECT needs)
        if not hasattr(self._local, "mm"):
            self._local.mm = mmap.mmap(-1, self.buf_size)
            self._local.addr = ctypes.addressof(ctypes.c_char.from_buffer(self._local.mm))
        return self._local.mm, self._local.addr

    def _read_tensor(self, il: int, kind: str, expert: int, slot: int) -> None:
        with self._lock:
            if self._active == 0:
                self._busy_since = time.perf_counter_ns()
            self._active += 1
        t = self.layout.layer(il).tensors[kind]
        try:
            mm, addr = self._buffer()
            off = t.expert_offset(expert)
            start = off // self.ALIGN * self.ALIGN
            end = -(-(off + t.expert_bytes) // self.ALIGN) * self.ALIGN
            view = memoryview(mm)[: end - start]
            got = os.preadv(self.fd, [view], start)
            view.release()
            if got < off - start + t.expert_bytes:
                raise SpecterError(f"{self.layout.path}: short read of {t.name} expert {expert}")
            if not self.direct:
                os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_DONTNEED)
            rc = self.api.write_slot(self.model.ptr, il, native.KIND_NAMES[kind], slot,
                                     ctypes.c_void_p(addr + off - start), t.expert_bytes)
            if rc != 0:
                raise SpecterError(f"write into slot {slot} of layer {il} failed ({rc})")
        finally:
            with self._lock:
                self.read_bytes += t.expert_bytes
                self._active -= 1
                if self._active == 0:
                    self.busy_ns += time.perf_counter_ns() - self._busy_since

    def upload_many(self, il: int, loads: list[tuple[int, int]]) -> None:
        for h in [self._submit(self._demand, il, e, slot) for e, slot in loads]:
            h.wait()

    def upload(self, il: int, expert: int, slot: int) -> None:
        self._submit(self._demand, il, expert, slot).wait()

    def upload_async(self, il: int, expert: int, slot: int) -> _Group:
        return self._submit(self._pool, il, expert, slot)

    def upload_now(self, il: int, expert: int, slot: int) -> _Group:
        return self._submit(self._demand, il, expert, slot)

    def readahead(self, il: int, experts) -> None:
        # the kernel reads the ranges into the page cache; the host path's page faults on llama.cpp's mapping
        # of the file then find them there instead of reading a little at a time. The advice itself blocks
        # until the reads are queued (~6 ms a layer here), so it is given on a thread of its own, not the
        # compute thread
        ranges = [(t.expert_offset(e), t.expert_bytes) for t in self.layout.layer(il).tensors.values()
                  for e in experts]
        if ranges:
            self._ahead.submit(self._advise, ranges)

    def _advise(self, ranges: list[tuple[int, int]]) -> None:
        for off, n in ranges:
            os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_WILLNEED)

    def _submit(self, pool: ThreadPoolExecutor, il: int, expert: int, slot: int) -> _Group:
        jobs = [(self._read_tensor, il, kind, expert, slot) for kind in self.layout.layer(il).tensors]
        return _Group([pool.submit(*j) for j in jobs], jobs, self._demand)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._demand.shutdown(wait=True)
        self._ahead.shutdown(wait=True)
        os.close(self.fd)


def make_tier(spec: str) -> Tier:
    """'ram', 'disk', 'emulated:GBPS' or 'gpu'."""
    if spec == "ram":
        return RamTier()
    if spec == "disk":
        return DiskTier()
    if spec.startswith("emulated:"):
        try:
            return EmulatedTier(float(spec.split(":", 1)[1]))
        except ValueError:
            raise SpecterError(f"cannot parse tier {spec!r}: expected emulated:GBPS, e.g. emulated:16") from None
    if spec == "gpu":
        raise SpecterError("tier 'gpu' needs a CUDA build of the library (SPECTER_CUDA=1 make build) and a GPU")
    raise SpecterError(f"unknown tier {spec!r}: use ram, disk, emulated:GBPS or gpu")


# --- the cache -------------------------------------------------------------------------------------------------

@dataclass
class _Layer:
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
    late: set = field(default_factory=set)  # ordered mode: experts of this ubatch computed after the resident ones
    ghost: OrderedDict | None = None  # held slots: the experts plain LRU would hold with them too (oldest first)


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


class ExpertCache:
    """Budgeted expert slots for one model. Create it after loading the model and before its context."""

    def __init__(self, model: native.Model, layout: ModelLayout, n_slots: int, *, policy: str = "lru",
                 miss: str = "wait", tier: Tier | None = None, hook: bool = True, record: bool = False,
                 surrogates=None, ordered: bool = False, lookahead: bool = True, held: int = 0) -> None:
        """hook=False leaves residency static (no Python on the compute path: what 'all-resident' measures);
        record=True keeps the routing trace [(layer, needed experts)] for offline analysis (e.g. Belady MIN);
        lookahead=False turns off reading the next layer's experts during a multi-token ubatch (prefill);
        held=N allocates N more slots per layer than it uses until ``release_held()``: memory that a draft holds
        now and the slots get once the draft is dropped (CPU slots never written take no memory, patch 0006)."""
        layout.require_moe()
        if policy not in POLICIES:
            raise SpecterError(f"unknown policy {policy!r}: use one of {', '.join(POLICIES)}")
        if miss not in MISS_MODES:
            raise SpecterError(f"unknown miss mode {miss!r}: use one of {', '.join(MISS_MODES)}")
        if n_slots < layout.n_expert_used:
            raise SpecterError(f"{n_slots} slots per layer is below top-{layout.n_expert_used}: one token's experts "
                               "would not fit")
        if ordered and miss != "wait":
            raise SpecterError("ordered (late experts after resident ones) is a refinement of miss mode 'wait'")
        if (miss == "surrogate") != (surrogates is not None):
            raise SpecterError("miss mode 'surrogate' needs surrogates (and they are used by no other mode)")
        n_slots = min(n_slots, layout.n_expert)
        # surrogate mode reserves top-k slots per layer to expand surrogates into; the rest cache full experts
        self.n_reserved = layout.n_expert_used if surrogates is not None else 0
        self.n_regular = n_slots - self.n_reserved
        if self.n_regular < layout.n_expert_used:
            raise SpecterError(f"{n_slots} slots per layer: surrogate mode needs {2 * layout.n_expert_used} "
                               f"(top-{layout.n_expert_used} for full experts, as many for surrogates)")
        if held and (surrogates is not None or n_slots - held < layout.n_expert_used):
            raise SpecterError("held slots need a usable top-k without them, and no surrogates")
        # slots eviction may use now: the regular ones less those held back for later
        self.n_usable = self.n_regular - held
        self.totals = Totals()
        self.surrogates = surrogates
        self.model, self.layout, self.n_slots = model, layout, n_slots
        self.policy, self.miss = policy, miss
        self.api = native.slots()
        rc = self.api.slots_init(model.ptr, n_slots)
        if rc != 0:
            raise SpecterError(f"could not allocate {n_slots} expert slots per layer (code {rc})")
        self.tier = tier or RamTier()
        self.tier.bind(model, layout)
        self.expert_bytes = {L.index: L.expert_bytes for L in layout.layers}
        self.layer_pos = {L.index: j for j, L in enumerate(layout.layers)}  # order in the forward pass
        E = layout.n_expert
        self.layers = {
            L.index: _Layer(owner=[-1] * n_slots, where=[-1] * E, last_use=[0] * n_slots, freq=[0] * E,
                            ghost=OrderedDict() if held else None)
            for L in layout.layers
        }
        self.clock = 0
        self.stats = CacheStats()
        self.error: BaseException | None = None
        self.trace: list[tuple[int, tuple[int, ...]]] | None = [] if record else None
        self._cb = native.ROUTE_CB(self._on_route)  # keep a reference: C holds the pointer
        if hook:
            self.api.set_route_cb(model.ptr, self._cb, None)
        # ordered: a miss is not waited for in the routing hook; its upload starts, it is marked late, and the
        # layer's resident experts (and the host path) are computed while it lands (patch 0005); the wait hook
        # then blocks until it has
        self.ordered = ordered
        self.lookahead = lookahead and miss != "cpu"
        self._next_layer = {a.index: b.index for a, b in zip(layout.layers, layout.layers[1:], strict=False)}
        self._wcb = native.WAIT_CB(self._on_wait)
        if ordered:
            self.api.set_wait_cb(model.ptr, self._wcb, None)

    # residency bookkeeping mirrored on both sides
    def _assign(self, il: int, expert: int, slot: int) -> None:
        st = self.layers[il]
        prev = st.owner[slot]
        if prev >= 0:
            st.where[prev] = -1
        st.owner[slot] = expert
        st.where[expert] = slot
        st.last_use[slot] = self.clock
        self.api.set_slot(self.model.ptr, il, expert, slot)

    def _evict(self, il: int, slot: int) -> None:
        st = self.layers[il]
        prev = st.owner[slot]
        if prev >= 0:
            st.where[prev] = -1
            st.owner[slot] = -1
            self.api.set_slot(self.model.ptr, il, prev, -1)

    def _victim(self, il: int, protected: set[int], taken: frozenset[int] | set[int] = frozenset(),
                need: bool = False) -> int:
        """A slot to reuse: a free one, else by policy among slots not holding an expert needed right now (and
        not in ``taken``: slots already chosen for this batch of uploads). Experts predicted for the window in
        flight are spared too, unless ``need``: an expert needed now outranks a prediction, which only ever
        advises (without this, a window predicting more experts than there are slots starved the current token
        and sent it to the host path)."""
        st = self.layers[il]
        best, best_key, spared = -1, None, -1
        for s in range(self.n_usable):
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
            key = (st.last_use[s],) if self.policy == "lru" else (st.freq[e], st.last_use[s])
            if best_key is None or key < best_key:
                best, best_key = s, key
        if best < 0 and need and spared >= 0:
            st.protected.discard(st.owner[spared])
            return spared
        return best

    def _slot_for_miss(self, il: int, needed: set[int], taken: frozenset[int] | set[int] = frozenset()) -> int:
        """A slot for an expert the compute thread is about to wait for; when every candidate is still being
        filled, let those uploads land first. -1: more distinct experts in this ubatch than slots."""
        slot = self._victim(il, needed, taken, need=True)
        st = self.layers[il]
        # only an upload of an expert not needed now can free a victim: waiting for a needed one (prefill's
        # lookahead fills every slot with those) would stall the hook and gain no slot
        landing = {x for x, _ in st.pending.values() if x not in needed}
        if slot < 0 and landing:
            self._reap(il, block_for=landing)
            slot = self._victim(il, needed, taken, need=True)
        return slot

    def _reap(self, il: int, block_for: set[int] | None = None) -> None:
        st = self.layers[il]
        for slot, (expert, handle) in list(st.pending.items()):
            if block_for is not None and expert in block_for:
                handle.wait()
            if handle.done():
                del st.pending[slot]
                self._assign(il, expert, slot)

    def _count_upload(self, il: int) -> None:
        self.stats.uploads += 1
        self.stats.upload_bytes += self.expert_bytes[il]

    def _on_route(self, _ud, il, n_tokens, n_used, ids_p, _weights_p) -> None:
        # Runs on llama.cpp's compute thread. An exception must not unwind into C: remember it, and leave the
        # layer to the host path, which is always exact.
        t0 = time.perf_counter_ns()
        try:
            self.clock += 1
            self.stats.hook_calls += 1
            st = self.layers.get(il)
            if st is None:
                return
            needed = set(ids_p[: n_tokens * n_used])
            if self.trace is not None:
                self.trace.append((il, tuple(sorted(needed))))
            for e in needed:
                st.freq[e] += 1
            if st.sur_mapped:  # last ubatch's surrogate routing must not outlive it
                for e in st.sur_mapped:
                    if st.where[e] < 0:
                        self.api.set_slot(self.model.ptr, il, e, -1)
                st.sur_mapped.clear()
            if st.pending:
                self._reap(il)
            missing = []
            for e in needed:
                s = st.where[e]
                if s >= 0:
                    st.last_use[s] = self.clock
                else:
                    missing.append(e)
            self.stats.needed += len(needed)
            self.stats.resident_at_need += len(needed) - len(missing)
            self.totals.misses += len(missing)
            if st.ghost is not None:
                self._ghost_lru(st, needed)
            if n_tokens > 1 and self.lookahead:
                self._prefill_lookahead(il, len(needed))
            if not missing:
                return
            inflight = {e: h for e, h in st.pending.values()}
            if self.miss == "surrogate" and n_tokens == 1:
                self._serve_surrogates(il, st, needed, missing, inflight)
            elif self.miss in ("wait", "surrogate"):
                # a prefetch still queued behind others is taken back and read now as a demand read
                for slot, (e, h) in list(st.pending.items()):
                    if e in inflight and e in missing and h.cancel():
                        del st.pending[slot]
                        del inflight[e]
                if self.ordered:
                    self._mark_late(il, st, needed, missing)
                    return
                self._reap(il, block_for=set(inflight) & set(missing))
                self.stats.waited += len(set(inflight) & set(missing))
                loads = []
                for e in missing:
                    if st.where[e] >= 0:
                        continue
                    slot = self._slot_for_miss(il, needed, {s for _, s in loads})
                    if slot < 0:  # more distinct experts in this ubatch than slots: the host computes the rest
                        self.stats.overflow_rows += 1
                        continue
                    self._evict(il, slot)
                    loads.append((e, slot))
                self.tier.upload_many(il, loads)  # side by side where the tier serves parallel reads faster
                for e, slot in loads:
                    self._count_upload(il)
                    self._assign(il, e, slot)
            else:
                # an upload already on the wire is due soon: wait for it; one still queued behind others would
                # stall longer than computing the expert on the host
                due = {e for e in missing if e in inflight and inflight[e].started()}
                if due:
                    self._reap(il, block_for=due)
                    self.stats.waited += len(due)
                for e in missing:
                    if e in inflight:
                        continue
                    slot = self._victim(il, needed, need=True)
                    if slot < 0:
                        break
                    self._evict(il, slot)
                    st.pending[slot] = (e, self.tier.upload_async(il, e, slot))
                    self._count_upload(il)
        except BaseException as e:  # noqa: BLE001
            self.error = e
        finally:
            self.totals.hook_ns += time.perf_counter_ns() - t0

    def _ghost_lru(self, st: _Layer, needed: set[int]) -> None:
        """Plain LRU over every allocated slot, held ones included, on the same routing, in bookkeeping only:
        the misses it would have had. What dropping the draft would buy is estimated from it."""
        g = st.ghost
        self.totals.ghost_misses += sum(1 for e in needed if e not in g)
        for e in needed:
            g[e] = None
            g.move_to_end(e)
        while len(g) > self.n_regular:
            g.popitem(last=False)

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
        inflight = {e for e, _ in st.pending.values()}
        self.tier.readahead(nxt, [e for e in want if st.where[e] < 0 and e not in inflight])

    def _mark_late(self, il: int, st: _Layer, needed: set[int], missing: list[int]) -> None:
        slot_of = {e: slot for slot, (e, _) in st.pending.items()}
        for e in missing:
            slot = slot_of.get(e)
            if slot is None:
                slot = self._slot_for_miss(il, needed)
                if slot < 0:  # more distinct experts in this ubatch than slots: the host computes the rest
                    self.stats.overflow_rows += 1
                    continue
                self._evict(il, slot)
                st.pending[slot] = (e, self.tier.upload_now(il, e, slot))
                self._count_upload(il)
            else:
                self.stats.waited += 1
            if self.api.set_late(self.model.ptr, il, e, slot) != 0:
                raise SpecterError(f"could not mark expert {e} of layer {il} late (no wait hook?)")
            st.late.add(e)
            self.stats.late += 1

    def _on_wait(self, _ud, il) -> None:
        # Runs on the compute thread after layer il's resident and host matmuls, before the late ones.
        t0 = time.perf_counter_ns()
        try:
            st = self.layers.get(il)
            if st is not None and st.late:
                self._reap(il, block_for=st.late)
                st.late.clear()
        except BaseException as e:  # noqa: BLE001 - never unwind into C
            self.error = e
        finally:
            self.totals.hook_ns += time.perf_counter_ns() - t0

    def _serve_surrogates(self, il: int, st: _Layer, needed: set[int], missing: list[int], inflight: dict) -> None:
        due = {e for e in missing if e in inflight and inflight[e].started()}
        if due:  # an upload already on the wire is due soon: the exact expert is worth the short wait
            self._reap(il, block_for=due)
            self.stats.waited += len(due)
        free = list(range(self.n_regular, self.n_slots))
        for e in missing:
            if st.where[e] >= 0:
                continue
            if e not in inflight:  # the full expert, in the background, for next time
                slot = self._victim(il, needed, need=True)
                if slot >= 0:
                    self._evict(il, slot)
                    st.pending[slot] = (e, self.tier.upload_async(il, e, slot))
                    self._count_upload(il)
            if not free:
                continue  # more misses than reserved slots: the host path computes this one exactly
            r = next((x for x in free if st.sur_in.get(x) == e), free[0])
            free.remove(r)
            if st.sur_in.get(r) != e:
                self.surrogates.write(self.api, self.model.ptr, il, e, r)
                st.sur_in[r] = e
            self.api.set_slot(self.model.ptr, il, e, r)
            st.sur_mapped.add(e)
            self.stats.surrogate_uses += 1

    # --- prediction-driven residency (the speculative engine) ---------------------------------------------------

    def protect(self, il: int, experts) -> None:
        """Experts predicted for the window in flight: eviction skips them until unprotect_all()."""
        st = self.layers.get(il)
        if st is not None:
            st.protected.update(experts)

    def unprotect_all(self) -> None:
        for st in self.layers.values():
            st.protected.clear()

    def prefetch(self, il: int, experts) -> int:
        """Start async uploads of predicted experts that are neither resident nor on their way. Victims are never
        protected or pending. Returns how many uploads were issued."""
        issued = self._upload_ahead(il, experts)
        self.stats.prefetches += issued
        return issued

    def _upload_ahead(self, il: int, experts) -> int:
        st = self.layers.get(il)
        if st is None:
            return 0
        inflight = {e for e, _ in st.pending.values()}
        issued = 0
        for e in experts:
            if st.where[e] >= 0 or e in inflight:
                continue
            slot = self._victim(il, set(experts))
            if slot < 0:
                break
            self._evict(il, slot)
            st.pending[slot] = (e, self.tier.upload_async(il, e, slot))
            self._count_upload(il)
            issued += 1
        return issued

    def release_held(self) -> None:
        """The memory held back (a draft's) is free now: every allocated slot may be used from here on."""
        self.n_usable = self.n_regular
        for st in self.layers.values():
            st.ghost = None

    def check(self) -> None:
        """Re-raise an error the hook swallowed (call after each decode)."""
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def drain(self) -> None:
        """Finish uploads in flight (cpu mode) and make them resident."""
        for il in self.layers:
            self._reap(il, block_for={e for e, _ in self.layers[il].pending.values()})

    def warm(self, experts_by_layer: dict[int, list[int]]) -> None:
        """Fill slots before the first token (e.g. from a routing profile), hottest first."""
        for il, experts in experts_by_layer.items():
            for slot, e in enumerate(experts[: self.n_usable]):
                self.tier.upload(il, e, slot)
                self._count_upload(il)
                self._assign(il, e, slot)

    def counters(self) -> dict:
        c = self.api.stats(self.model.ptr)
        rows = c["hit_rows"] + c["miss_rows"]
        st = self.stats
        return {
            # experts already resident when their layer asked for them (before any upload the hook made)
            # (with no hook, residency is static and the C row counters tell the same thing)
            "hit_rate": st.resident_at_need / st.needed if st.needed else (c["hit_rows"] / rows if rows else 0.0),
            # rows computed from slots rather than on the host (after the hook's uploads)
            "slot_row_rate": c["hit_rows"] / rows if rows else 0.0,
            "hit_rows": c["hit_rows"], "miss_rows": c["miss_rows"], "route_calls": c["route_calls"],
            "needed": st.needed, "resident_at_need": st.resident_at_need,
            "hook_ms": c["hook_ns"] / 1e6, "upload_ns": c["upload_ns"],
            "uploads": self.stats.uploads, "upload_bytes": self.stats.upload_bytes,
            "overflow_rows": self.stats.overflow_rows, "prefetches": self.stats.prefetches,
            "waited": self.stats.waited, "surrogate_uses": self.stats.surrogate_uses, "late": self.stats.late,
            "lookahead": self.stats.lookahead,
            "route_us_per_call": c["route_ns"] / 1e3 / c["route_calls"] if c["route_calls"] else 0.0,
            "hook_us_per_call": c["hook_ns"] / 1e3 / c["route_calls"] if c["route_calls"] else 0.0,
        }

    def link_gbps(self) -> float | None:
        """The slow tier's speed as measured on this session's uploads so far (None before any)."""
        if isinstance(self.tier, DiskTier):
            return self.tier.read_bytes / self.tier.busy_ns if self.tier.busy_ns else None
        c = self.api.stats(self.model.ptr)
        return c["upload_bytes"] / c["upload_ns"] if c["upload_ns"] else None

    def reset_counters(self) -> None:
        self.stats = CacheStats()
        self.api.stats_reset(self.model.ptr)

    def close(self) -> None:
        self.drain()
        self.api.set_route_cb(self.model.ptr, native.ROUTE_CB(), None)
        if self.ordered:
            self.api.set_wait_cb(self.model.ptr, native.WAIT_CB(), None)
        self.tier.close()
