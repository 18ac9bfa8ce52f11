"""Slow tiers: where an expert's bytes come from, and how they reach a slot.

``ram`` copies from the model's own (mmap'd) expert tensors on the C upload thread; ``emulated:GBPS`` is the same
with the copies throttled to a link speed (results are labelled emulated); ``disk`` reads the GGUF with O_DIRECT on
small thread pools, so the page cache holds nothing of the experts (each read and its copy into the slot is one C
call, ``read_slot``, with the GIL released).

Every upload returns a handle: ``done()`` once it has finished, ``ok()`` whether it finished whole. A failed or
short read never counts as landed: the cache then leaves the expert a miss (computed exactly on the host) and
counts the failure. ``upload_many`` waits for every read it started, failed or not, before it returns, so no
read is still writing into a slot the cache may hand out again.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from pyspecter import native
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout


class Tier:
    """The slow tier. ``upload`` copies expert ``e`` of layer ``il`` into slot ``s``; ``upload_async`` returns a
    handle with ``done()``/``wait()``."""

    name = "?"
    emulated = False
    # where the experts' home copy is, as the miss modes see it (misses.default_miss): "host" RAM the host computes
    # from at full speed, "link" (RAM behind a throttled, emulated link), or "file" (read from disk)
    home = "link"
    # faults injected into every read the engine makes from this tier (tests: ``native.ReadFaults``); None: none
    faults: native.ReadFaults | None = None

    def bind(self, model: native.Model, layout: ModelLayout) -> None:
        self.model, self.layout, self.api = model, layout, native.slots()
        self.failures = 0  # uploads that did not land (counted by the cache, reported once)

    def after_batch(self) -> None:
        """Called once decoding follows a multi-token ubatch (a prompt); nothing to do for most tiers."""

    def in_batch(self) -> None:
        """Called at each layer's routing call of a multi-token ubatch; nothing to do for most tiers."""

    def upload(self, il: int, expert: int, slot: int) -> None:
        """Upload now and return when it has landed; raises SpecterError if it could not."""
        if not self.upload_now(il, expert, slot).wait():
            raise SpecterError(f"upload of expert {expert} of layer {il} failed")

    def upload_async(self, il: int, expert: int, slot: int):
        raise NotImplementedError

    def upload_now(self, il: int, expert: int, slot: int):
        """An async upload the compute thread will wait for soon (a miss): ahead of prefetches where the tier
        can do that."""
        return self.upload_async(il, expert, slot)

    def upload_many(self, il: int, loads: list[tuple[int, int]]) -> set[int]:
        """Upload [(expert, slot)] of one layer side by side and return when every one has finished; returns the
        experts whose upload failed (their slots hold garbage and must not be mapped)."""
        handles = [(e, self.upload_now(il, e, slot)) for e, slot in loads]
        return {e for e, h in handles if not h.wait()}

    def readahead(self, il: int, experts) -> None:
        """The host path will read these experts soon (from the model's own mapping): start fetching them where
        that is slow. RAM is not."""

    def close(self) -> None:
        pass


class _Ticket:
    """An upload queued on the C upload thread (FIFO)."""

    def __init__(self, api, model_ptr, ticket: int) -> None:
        self.api, self.model_ptr, self.ticket = api, model_ptr, ticket

    def _status(self) -> int:
        # 1 landed, 0 pending, < 0 failed (a refused enqueue gives a negative ticket: failed at once)
        return -1 if self.ticket <= 0 else int(self.api.upload_status(self.model_ptr, self.ticket))

    def done(self) -> bool:
        return self._status() != 0

    def ok(self) -> bool:
        return self._status() == 1

    def cancel(self) -> bool:  # the C upload thread's queue has no take-back
        return False

    def started(self) -> bool:
        # uploads complete in FIFO order: once the previous one is done, this one is on the wire
        return self.ticket <= 1 or self.api.upload_status(self.model_ptr, self.ticket - 1) != 0

    def wait(self) -> bool:
        """Block until finished; True if the expert landed whole."""
        return self.ticket > 0 and int(self.api.upload_wait(self.model_ptr, self.ticket)) == 1


class RamTier(Tier):
    """Host RAM: the model's own (mmap'd) expert tensors are the host copy; upload is a memcpy."""

    name = "ram"
    home = "host"

    def __init__(self, faults: native.ReadFaults | None = None) -> None:
        self.faults = faults

    def upload(self, il: int, expert: int, slot: int) -> None:
        # on the compute thread itself: no hand-off to the upload thread for a copy it waits for anyway
        if self.api.load_expert(self.model.ptr, il, expert, slot) != 0:
            raise SpecterError(f"upload of expert {expert} of layer {il} failed")

    def upload_many(self, il: int, loads: list[tuple[int, int]]) -> set[int]:
        return {e for e, slot in loads if self.api.load_expert(self.model.ptr, il, e, slot) != 0}

    def upload_async(self, il: int, expert: int, slot: int) -> _Ticket:
        return _Ticket(self.api, self.model.ptr, self.api.load_expert_async(self.model.ptr, il, expert, slot))


class EmulatedTier(RamTier):
    """Host RAM with uploads throttled to a given bandwidth (PCIe-shaped experiments). Results are emulated."""

    emulated = True
    home = "link"  # the link is what is emulated: the host computes from its end of it only at the link's speed

    def __init__(self, gbps: float, faults: native.ReadFaults | None = None) -> None:
        if gbps <= 0:
            raise SpecterError(f"emulated tier needs a positive bandwidth, got {gbps}")
        super().__init__(faults)
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

    def ok(self) -> bool:
        """Finished, and every read landed whole (a read that raised or was cancelled did not)."""
        return all(f.done() and not f.cancelled() and f.exception() is None for f in self.futures)

    def started(self) -> bool:
        return any(f.running() or f.done() for f in self.futures)

    def wait(self) -> bool:
        """Block until every read has finished, failed ones included; True if all landed."""
        for f in self.futures:
            try:
                f.result()
            except Exception:  # noqa: BLE001 - a failed read leaves the expert a miss; ok() tells
                pass
        return self.ok()

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
    a layer's misses are read side by side.

    Native residency reads each kind of an expert as aligned chunks of at most ``read_chunk`` bytes (0: C's
    256 KiB), so a layer's one or two misses still keep several reads outstanding, on pread threads (``io="threads"``,
    the default) or through io_uring where the kernel allows it (``io="auto"``, or SPECTER_DISK_IO=auto). io_uring is
    opt-in: on big-qwen3moe (disk tier, automatic fit, teacher-forced) its decode counted 276.8 MB per token against
    the threads' 149.8 for the same hit rate. The ring read no more per decision: the decode also counted the
    prompt's stale lookahead reads, left queued and read after it, as many as the readers had not drained (a share
    that moved with timing, on either backend); each layer's call now takes those back."""

    name = "disk"
    home = "file"
    ALIGN = 4096

    def __init__(self, queue_depth: int = 4, read_chunk: int = 0, io: str | None = None,
                 faults: native.ReadFaults | None = None) -> None:
        self.faults = faults
        self.queue_depth = max(1, queue_depth)
        self.read_chunk = read_chunk
        self.io = io or os.environ.get("SPECTER_DISK_IO") or "threads"
        if self.io not in native.NATIVE_IO:
            raise SpecterError(f"disk reads: unknown io {self.io!r}: use {' or '.join(native.NATIVE_IO)}")

    def _release(self) -> int:
        released = self.api.release_host_experts(self.model.ptr)
        for L in self.layout.layers:
            for t in L.tensors.values():
                os.posix_fadvise(self.fd, t.offset, t.expert_bytes * self.layout.n_expert, os.POSIX_FADV_DONTNEED)
        return released

    def in_batch(self) -> None:
        """A prompt's ubatch computes misses on the host path, faulting expert pages into this process's mapping:
        on a model bigger than RAM its peak RSS went to 9.2 GB at a 10% budget of 2.8 GB. At each layer's routing
        call the earlier layers' host matmuls are done, so their pages are unmapped again (they stay in the page
        cache, which the kernel reclaims; the current layer's are faulted in as it computes)."""
        self.api.release_host_experts(self.model.ptr)

    def after_batch(self) -> None:
        """The prompt is done: drop its expert pages from the page cache too."""
        self._release()

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
        self.released = self._release()
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

    def _buffer(self) -> int:
        """The address of this thread's page-aligned buffer (anonymous mmap is page aligned, as O_DIRECT needs);
        the mapping lives in the thread-local, so the address stays valid."""
        if not hasattr(self._local, "mm"):
            self._local.mm = mmap.mmap(-1, self.buf_size)
            self._local.addr = ctypes.addressof(ctypes.c_char.from_buffer(self._local.mm))
        return self._local.addr

    def _read_tensor(self, il: int, kind: str, expert: int, slot: int) -> None:
        with self._lock:
            if self._active == 0:
                self._busy_since = time.perf_counter_ns()
            self._active += 1
        t = self.layout.layer(il).tensors[kind]
        try:
            addr = self._buffer()
            # read and copy in one foreign call (the GIL released throughout): a read in Python held the GIL for
            # its view, pread wrapper and second call, which the compute thread's hooks then waited for
            rc = self.api.read_slot(self.model.ptr, il, native.KIND_NAMES[kind], slot, self.fd,
                                    t.expert_offset(expert), addr, self.buf_size, not self.direct)
            if rc == native.ERR_IO:
                raise SpecterError(f"{self.layout.path}: read of {t.name} expert {expert} failed or came back short")
            if rc != 0:
                raise SpecterError(f"write into slot {slot} of layer {il} failed ({native.status_name(rc)})")
        finally:
            with self._lock:
                self.read_bytes += t.expert_bytes
                self._active -= 1
                if self._active == 0:
                    self.busy_ns += time.perf_counter_ns() - self._busy_since

    def _write(self, il: int, kind: str, slot: int, addr: int, nbytes: int) -> int:
        return self.api.write_slot(self.model.ptr, il, native.KIND_NAMES[kind], slot, ctypes.c_void_p(addr), nbytes)

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
        # reads write into the model's slots: every one must have finished before the model can be freed
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._demand.shutdown(wait=True, cancel_futures=True)
        self._ahead.shutdown(wait=True, cancel_futures=True)
        os.close(self.fd)


def make_tier(spec: str) -> Tier:
    """'ram', 'disk' or 'emulated:GBPS': where the experts that are not in slots live. Where the slots live is the
    device's business (``--device``)."""
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
        raise SpecterError("tier 'gpu' is now --device (cuda0, rpc:HOST:PORT): slots go to the device, experts stay "
                           "in host RAM (--tier ram)")
    raise SpecterError(f"unknown tier {spec!r}: use ram, disk or emulated:GBPS")
