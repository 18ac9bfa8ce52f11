"""What happens to an expert a layer needs that is not resident. One handler object per miss mode.

  cpu        compute misses on the host now, and upload them in the background for next time;
  host       compute misses on the host from their home copy, in place, and never move an expert: where the
             slots are host memory and the home copy is host RAM too (the RAM tier, CPU compute) a copy into a
             slot is pure cost, a memcpy on the compute threads' cores for rows the host computes as fast from
             home (``computes_in_place``; the session's default there);
  wait       upload the missing experts now (the compute thread waits), then compute them from the slots;
  ordered    wait, refined: start the uploads, mark the experts *late*, and let the layer's resident experts
             (and the host path) compute while they land; the wait hook then blocks until they have;
  surrogate  APPROXIMATE, opt-in: compute a single-token miss with the expert's surrogate (its most important
             neurons, kept in RAM; see surrogate.py) from one of top-k reserved slots, and upload the full expert
             in the background for next time. Multi-token ubatches (prefill) wait, as in ``wait``.

Handlers run inside the routing hook (on llama.cpp's compute thread). Whatever is still not resident when they
return is computed exactly on the host, so no decision here can change the model's output, only its speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pyspecter.errors import SpecterError
from pyspecter.residency import LayerSlots, Residency
from pyspecter.surrogate import Surrogates
from pyspecter.tiers import Tier

MISS_MODES = ("wait", "cpu", "host", "surrogate")


def computes_in_place(tier: Tier, host_slots: bool) -> bool:
    """Whether a miss is best computed from its home copy and never copied: the slots are host memory and the home
    copy is host RAM (the plain RAM tier on the CPU; not a device's slots, the disk, or the emulated link). A copy
    into a slot buys nothing there: on smol-moe at 50% the "cpu" mode's background copies came to 34 MB per token,
    on a reader thread that took a core from the two compute threads."""
    return tier.home == "host" and host_slots


def default_miss(tier: Tier, host_slots: bool) -> str:
    """What a miss does when nobody said: wait on the disk tier (its home copy is on disk too), host where
    ``computes_in_place``, else cpu."""
    if tier.home == "file":
        return "wait"
    return "host" if computes_in_place(tier, host_slots) else "cpu"


@dataclass
class CacheStats:
    """What the Python decision path counts (``ExpertCache.counters``; C counts its own under native residency)."""

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


class MissHost(Protocol):
    """What a handler uses of the cache that runs it (``cache.ExpertCache``), named here so that the handlers
    import nothing above them. ``stats`` is read at each use: a counter reset replaces it."""

    residency: Residency
    tier: Tier
    stats: CacheStats
    n_reserved: int  # surrogate mode: reserved slots per layer
    surrogates: Surrogates | None

    def count_upload(self, il: int) -> None: ...


def upload_into(host: MissHost, il: int, expert: int, slot: int, *, now: bool = False) -> None:
    """Give ``slot`` of layer il to ``expert``: evict what it holds, start the read (``now``: ahead of queued
    ones, for an expert the compute thread waits for) and count it. The slot is pending until the read lands."""
    res, tier = host.residency, host.tier
    res.evict(il, slot)
    read = tier.upload_now if now else tier.upload_async
    res.start_upload(il, expert, slot, read(il, expert, slot))
    host.count_upload(il)


def upload_to_victim(host: MissHost, il: int, expert: int, keep: set[int], *, need: bool) -> bool:
    """Read ``expert`` in the background into a victim's slot of layer il (never one holding an expert of ``keep``;
    ``need``: a protected expert may yield, as for an expert needed now). False: no slot to give."""
    slot = host.residency.victim(il, keep, need=need)
    if slot < 0:
        return False
    upload_into(host, il, expert, slot)
    return True


class MissHandler:
    name = "?"
    wants_wait_hook = False

    def __init__(self, cache: MissHost) -> None:
        self.cache = cache
        self.res = cache.residency

    def begin(self, il: int, st: LayerSlots) -> None:
        """Start of a layer's ubatch, before anything else looks at residency."""

    def handle(self, il: int, st: LayerSlots, needed: set[int], missing: list[int], n_tokens: int) -> None:
        raise NotImplementedError

    def on_wait(self, il: int) -> None:
        """Ordered mode's wait hook: after the layer's resident and host matmuls, before its late ones."""

    def _slot_for_miss(self, il: int, needed: set[int], taken: frozenset[int] | set[int] = frozenset()) -> int:
        """A slot for an expert the compute thread is about to wait for; when every candidate is still being
        filled, let those uploads land first. -1: more distinct experts in this ubatch than slots."""
        res = self.res
        slot = res.victim(il, needed, taken, need=True)
        st = res.layers[il]
        # only an upload of an expert not needed now can free a victim: waiting for a needed one (prefill's
        # lookahead fills every slot with those) would stall the hook and gain no slot
        landing = {x for x, _ in st.pending.values() if x not in needed}
        if slot < 0 and landing:
            res.reap(il, block_for=landing)
            slot = res.victim(il, needed, taken, need=True)
        return slot

    def _wait_for_due(self, il: int, missing: list[int], inflight: dict) -> None:
        # an upload already on the wire is due soon: wait for it; one still queued behind others would stall
        # longer than the alternative
        due = {e for e in missing if e in inflight and inflight[e].started()}
        if due:
            self.res.reap(il, block_for=due)
            self.cache.stats.waited += len(due)

    def _take_back_queued(self, il: int, st: LayerSlots, missing: list[int], inflight: dict) -> None:
        # a prefetch still queued behind others is taken back and read now as a demand read
        for slot, (e, h) in list(st.pending.items()):
            if e in inflight and e in missing and h.cancel():
                self.res.take_back(il, slot)
                del inflight[e]


class CpuMisses(MissHandler):
    name = "cpu"

    def handle(self, il: int, st: LayerSlots, needed: set[int], missing: list[int], n_tokens: int) -> None:
        inflight = st.inflight()
        self._wait_for_due(il, missing, inflight)
        for e in missing:
            if e not in inflight and not upload_to_victim(self.cache, il, e, needed, need=True):
                break


class HostMisses(MissHandler):
    """Nothing moves: every miss is computed from its home copy (what the host path does with whatever is not
    resident); the slots keep what they were given (``warm``)."""

    name = "host"

    def handle(self, il: int, st: LayerSlots, needed: set[int], missing: list[int], n_tokens: int) -> None:
        pass


class WaitMisses(MissHandler):
    name = "wait"

    def handle(self, il: int, st: LayerSlots, needed: set[int], missing: list[int], n_tokens: int) -> None:
        inflight = st.inflight()
        self._take_back_queued(il, st, missing, inflight)
        landing = set(inflight) & set(missing)
        self.res.reap(il, block_for=landing)
        self.cache.stats.waited += len(landing)
        loads = []
        for e in missing:
            if st.where[e] >= 0:
                continue
            slot = self._slot_for_miss(il, needed, {s for _, s in loads})
            if slot < 0:  # more distinct experts in this ubatch than slots: the host computes the rest
                self.cache.stats.overflow_rows += 1
                continue
            self.res.evict(il, slot)
            loads.append((e, slot))
        failed = self.cache.tier.upload_many(il, loads)  # side by side where the tier reads faster that way
        for e, slot in loads:
            self.cache.count_upload(il)
            if e in failed:  # the slot holds garbage: leave it free, the host path computes the expert
                self.res.failed_uploads += 1
            else:
                self.res.assign(il, e, slot)


class OrderedWaitMisses(MissHandler):
    name = "wait"
    wants_wait_hook = True

    def handle(self, il: int, st: LayerSlots, needed: set[int], missing: list[int], n_tokens: int) -> None:
        inflight = st.inflight()
        self._take_back_queued(il, st, missing, inflight)
        slot_of = {e: slot for slot, (e, _) in st.pending.items()}
        for e in missing:
            slot = slot_of.get(e)
            if slot is None:
                slot = self._slot_for_miss(il, needed)
                if slot < 0:  # more distinct experts in this ubatch than slots: the host computes the rest
                    self.cache.stats.overflow_rows += 1
                    continue
                upload_into(self.cache, il, e, slot, now=True)
            else:
                self.cache.stats.waited += 1
            self.res.mark_late(il, e, slot)
            self.cache.stats.late += 1

    def on_wait(self, il: int) -> None:
        st = self.res.layers.get(il)
        if st is None or not st.late:
            return
        self.res.reap(il, block_for=set(st.late))
        # A late expert whose upload failed is not resident, yet the graph computes its rows from the slot it
        # was marked late in. Read it again into that slot (it is free: a failed upload never maps); if that
        # fails too, nothing exact can be done for this ubatch, so fail loudly rather than emit a wrong token.
        failed = []
        for e, slot in st.late.items():
            if st.where[e] >= 0:
                continue
            try:
                self.cache.tier.upload(il, e, slot)
                self.res.assign(il, e, slot)
            except SpecterError:
                failed.append(e)
        self.res.clear_late(il)
        if failed:
            raise SpecterError(f"upload of late expert(s) {sorted(failed)} of layer {il} failed; "
                               "this token's output would be wrong")


class SurrogateMisses(MissHandler):
    name = "surrogate"

    def __init__(self, cache: MissHost) -> None:
        super().__init__(cache)
        self.wait = WaitMisses(cache)  # multi-token ubatches (prefill)

    def begin(self, il: int, st: LayerSlots) -> None:
        if st.sur_mapped:  # last ubatch's surrogate routing must not outlive it
            self.res.unmap_surrogates(il)

    def handle(self, il: int, st: LayerSlots, needed: set[int], missing: list[int], n_tokens: int) -> None:
        if n_tokens > 1:
            self.wait.handle(il, st, needed, missing, n_tokens)
            return
        inflight = st.inflight()
        self._wait_for_due(il, missing, inflight)  # the exact expert is worth a short wait
        cache = self.cache
        sur = cache.surrogates
        free = list(self.res.reserved(il, cache.n_reserved))  # after this layer's regular slots
        for e in missing:
            if st.where[e] >= 0:
                continue
            if e not in inflight:  # the full expert, in the background, for next time
                upload_to_victim(self.cache, il, e, needed, need=True)
            if not free:
                continue  # more misses than reserved slots: the host path computes this one exactly
            r = next((x for x in free if st.sur_in.get(x) == e), free[0])
            free.remove(r)
            self.res.map_surrogate(il, e, r, lambda e=e, r=r: sur.write(self.res.api, self.res.model.ptr, il, e, r))
            cache.stats.surrogate_uses += 1


def make_miss_handler(cache: MissHost, miss: str, ordered: bool) -> MissHandler:
    if miss not in MISS_MODES:
        raise SpecterError(f"unknown miss mode {miss!r}: use one of {', '.join(MISS_MODES)}")
    if ordered and miss != "wait":
        raise SpecterError("ordered (late experts after resident ones) is a refinement of miss mode 'wait'")
    if miss == "cpu":
        return CpuMisses(cache)
    if miss == "host":
        return HostMisses(cache)
    if miss == "surrogate":
        return SurrogateMisses(cache)
    return OrderedWaitMisses(cache) if ordered else WaitMisses(cache)
