"""Slow tiers: where an expert's bytes come from, and how the residency engine reaches them.

``ram`` copies from the model's own (mmap'd) expert tensors; ``emulated:GBPS`` is the same with the copies throttled
to a link speed (results are labelled emulated); ``disk`` reads the GGUF with O_DIRECT, so the page cache holds
nothing of the experts. The reads themselves are C's (csrc/io.cpp): a tier only says where the bytes are, opens the
file, and copies the slots ``ExpertCache.warm`` fills before the first token. A failed or short read never counts
as landed: the engine leaves the expert a miss (computed exactly on the host) and counts the failure.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

from pyspecter import native
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout


class Tier:
    """The slow tier. ``upload`` copies expert ``e`` of layer ``il`` into slot ``s`` now (warm starts)."""

    name = "?"
    emulated = False
    # where the experts' home copy is, as the miss modes see it (misses.default_miss): "host" RAM the host computes
    # from at full speed, "link" (RAM behind a throttled, emulated link), or "file" (read from disk)
    home = "link"
    # faults injected into every read the engine makes from this tier (tests: ``native.ReadFaults``); None: none
    faults: native.ReadFaults | None = None

    def bind(self, model: native.Model, layout: ModelLayout) -> None:
        self.model, self.layout, self.api = model, layout, native.slots()

    def upload(self, il: int, expert: int, slot: int) -> None:
        """Copy now and return when it has landed; raises SpecterError if it could not."""
        if self.api.load_expert(self.model.ptr, il, expert, slot) != 0:
            raise SpecterError(f"upload of expert {expert} of layer {il} failed")

    def close(self) -> None:
        pass


class RamTier(Tier):
    """Host RAM: the model's own (mmap'd) expert tensors are the host copy; an upload is a memcpy."""

    name = "ram"
    home = "host"

    def __init__(self, faults: native.ReadFaults | None = None) -> None:
        self.faults = faults


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


class DiskTier(Tier):
    """The GGUF file itself, read with O_DIRECT so the page cache holds nothing of the experts: the
    bigger-than-RAM case on CPU boxes. Falls back to buffered reads (with a warning) where O_DIRECT is refused.

    The engine reads each kind of an expert as aligned chunks of at most ``read_chunk`` bytes (0: C's 256 KiB) on
    ``2 * queue_depth`` readers, so a layer's one or two misses still keep several reads outstanding (an SSD serves
    one read at a time at about half its speed: 0.65 GB/s at queue depth 1, 1.14 at 2, 1.29 at 4, measured here),
    on pread threads (``io="threads"``, the default) or through io_uring where the kernel allows it (``io="auto"``,
    or SPECTER_DISK_IO=auto). io_uring is opt-in: on big-qwen3moe (disk tier, automatic fit, teacher-forced) its
    decode counted 276.8 MB per token against the threads' 149.8 for the same hit rate. The ring read no more per
    decision: the decode also counted the prompt's stale lookahead reads, left queued and read after it, as many as
    the readers had not drained (a share that moved with timing, on either backend); each layer's call now takes
    those back."""

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

    def _probe(self) -> None:
        mm = mmap.mmap(-1, self.ALIGN)
        try:
            os.preadv(self.fd, [mm], 0)
        finally:
            mm.close()

    def upload(self, il: int, expert: int, slot: int) -> None:
        # each kind read and copied in one C call, through a page-aligned buffer (anonymous mmap is page aligned,
        # as O_DIRECT needs)
        mm = mmap.mmap(-1, self.buf_size)
        try:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            for kind, t in self.layout.layer(il).tensors.items():
                rc = self.api.read_slot(self.model.ptr, il, native.KIND_NAMES[kind], slot, self.fd,
                                        t.expert_offset(expert), addr, self.buf_size, not self.direct)
                if rc == native.ERR_IO:
                    raise SpecterError(f"{self.layout.path}: read of {t.name} expert {expert} failed or came back "
                                       "short")
                if rc != 0:
                    raise SpecterError(f"write into slot {slot} of layer {il} failed ({native.status_name(rc)})")
        finally:
            mm.close()

    def close(self) -> None:
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
