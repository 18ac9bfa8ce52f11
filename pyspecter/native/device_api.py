"""The C API of layer plans and device remap tables (csrc/include/llama-pyspecter.h), declared like the rest of
``lib`` and bound with it (``slots()`` binds every declaration once this module is imported)."""

from __future__ import annotations

import ctypes
from typing import Any

from pyspecter.native.lib import ModelPtr, _i32, _model, ctypes_function, slots

# enum llama_pyspecter_layer_kind: what a MoE layer is in a layer plan
LAYER_SLOTS, LAYER_HOST, LAYER_FULL = 0, 1, 2
LAYER_KIND_NAMES = {LAYER_SLOTS: "slots", LAYER_HOST: "host", LAYER_FULL: "full"}


@ctypes_function("llama_pyspecter_slots_init_layers", [_model, _i32, ctypes.POINTER(_i32), _i32], _i32)
def llama_pyspecter_slots_init_layers(model: ModelPtr, n_slots: int, kinds: Any, n_kinds: int, /) -> int:
    """slots_init with a layer plan: kinds[il] (LAYER_*) for il < n_kinds; only LAYER_SLOTS layers get slots."""
    ...


@ctypes_function("llama_pyspecter_layer_kind", [_model, _i32], _i32)
def llama_pyspecter_layer_kind(model: ModelPtr, il: int, /) -> int:
    """LAYER_SLOTS, LAYER_HOST (experts in host memory), LAYER_FULL (on the device), or -1 (not a MoE layer)."""
    ...


class DeviceStats(ctypes.Structure):
    """struct llama_pyspecter_device_stats: the device remap tables' counters since the last stats_reset."""

    _fields_ = [
        ("fences", ctypes.c_int64),  # ubatches started with device tables
        ("table_pushes", ctypes.c_int64),  # fences that copied a table to its device
        ("table_bytes", ctypes.c_int64),  # bytes those copies sent
        ("eviction_writes", ctypes.c_int64),  # evictions written to a table at once
        ("upload_streams", ctypes.c_int64),  # devices whose uploads run on their own stream, ordered by events
        ("async_batches", ctypes.c_int64),  # upload batches sent on such a stream and awaited by their event
        ("compute_orders", ctypes.c_int64),  # upload batches ordered after the device work queued before them
        ("spec_ubatches", ctypes.c_int64),  # ubatches computed speculated: no host path, every row from a slot
        ("spec_redos", ctypes.c_int64),  # ... of which a row missed: computed again with host paths
        ("inflight_peak", ctypes.c_int64),  # most upload batches one stream held issued and not yet landed at once
        ("mapped_rows", ctypes.c_int64),  # rows a speculated mapped layer's device read from the host copy (misses)
        # the upload threads waiting for their batches' events, and their CPU time in it (near the wall: a spin)
        ("landing_wait_ns", ctypes.c_int64),
        ("landing_wait_cpu_ns", ctypes.c_int64),
    ]

    fences: int
    table_pushes: int
    table_bytes: int
    eviction_writes: int
    upload_streams: int
    async_batches: int
    compute_orders: int
    spec_ubatches: int
    spec_redos: int
    inflight_peak: int
    mapped_rows: int
    landing_wait_ns: int
    landing_wait_cpu_ns: int

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name, _ in self._fields_}


@ctypes_function("llama_pyspecter_get_device_stats", [_model, ctypes.POINTER(DeviceStats)], None)
def llama_pyspecter_get_device_stats(model: ModelPtr, out: Any, /) -> None:
    """Fill a DeviceStats (pass ctypes.byref(stats))."""
    ...


@ctypes_function("llama_pyspecter_set_route_weights", [_model, ctypes.c_bool], None)
def llama_pyspecter_set_route_weights(model: ModelPtr, enabled: bool, /) -> None:
    """Whether the routing hook gets the router weights (default on; off saves a read back per layer on a device,
    and the hook's weights are then null there); before creating a context."""
    ...


@ctypes_function("llama_pyspecter_set_speculate", [_model, ctypes.c_bool], ctypes.c_bool)
def llama_pyspecter_set_speculate(model: ModelPtr, enabled: bool, /) -> bool:
    """Speculate that ubatches hit (csrc/speculate.cpp): a ubatch after one that hit in every row of every device
    slot layer runs with no host path, and again with host paths if a row missed. Off by default. Returns whether
    it is on: never under SPECTER_SPECULATE=0, nor for a model with recurrent layers (a redo would advance their
    state twice)."""
    ...


@ctypes_function("llama_pyspecter_map_host_experts", [_model, _i32, ctypes.POINTER(ctypes.c_size_t)], _i32)
def llama_pyspecter_map_host_experts(model: ModelPtr, allow_copy: int, copy_bytes: Any, /) -> int:
    """Misses the device reads from the host copy (csrc/mapped.cpp): a device view of each device slot layer's host
    experts, read in place where the device can (CUDA, pinned host experts), else a device copy with allow_copy.
    Returns the layers mapped or a negative error; *copy_bytes: device bytes the copies took."""
    ...


def map_host_experts(model: ModelPtr, allow_copy: bool) -> tuple[int, int]:
    """``llama_pyspecter_map_host_experts``: (layers mapped or a negative error, device bytes the copies took)."""
    nbytes = ctypes.c_size_t(0)
    rc = slots().map_host_experts(model, int(allow_copy), ctypes.byref(nbytes))
    return rc, nbytes.value


@ctypes_function("llama_pyspecter_read_table", [_model, _i32, ctypes.POINTER(_i32), _i32], _i32)
def llama_pyspecter_read_table(model: ModelPtr, il: int, out: Any, n: int, /) -> int:
    """Layer il's row of its device remap table, read back from the device: a plane per row of a token, (slot,
    expert) per expert in each. Returns the ints written (2 * n_expert * n_used) or a negative error."""
    ...


def read_table(model: ModelPtr, il: int, n_expert: int, n_used: int) -> list[list[tuple[int, int]]]:
    """Device layer il's remap table as the device holds it: per row j of a token, (slot, expert) per expert (zero
    slot j, or -1 where the device takes negative ids, when the expert is not resident)."""
    buf = (_i32 * (2 * n_expert * n_used))()
    rc = slots().read_table(model, il, buf, len(buf))
    if rc != len(buf):
        raise RuntimeError(f"llama_pyspecter_read_table(layer {il}): {rc}")
    return [[(buf[2 * (j * n_expert + e)], buf[2 * (j * n_expert + e) + 1]) for e in range(n_expert)]
            for j in range(n_used)]


def device_stats(model: ModelPtr) -> DeviceStats:
    """The device remap tables' counters since the last stats_reset."""
    out = DeviceStats()
    slots().get_device_stats(model, ctypes.byref(out))
    return out


class SyncCounts(ctypes.Structure):
    """struct llama_pyspecter_sync_counts: host<->device synchronisations the scheduler actually took, on this
    thread, since the last sync_counts_reset (counted on devices passed to count_syncs)."""

    _fields_ = [
        ("syncs", ctypes.c_int64),  # backend synchronizes of a device: the host waited for its queue
        ("event_syncs", ctypes.c_int64),  # event synchronizes on a device
        ("device_computes", ctypes.c_int64),  # device splits computed
        ("host_computes", ctypes.c_int64),  # host (CPU) splits computed
        ("switches", ctypes.c_int64),  # consecutive splits on different kinds (host, device)
        # where the time went (for benchmarks): the host waiting in those syncs, computing its splits, launching the
        # device's (asynchronous on CUDA, a round trip on RPC)
        ("sync_ns", ctypes.c_int64),
        ("host_compute_ns", ctypes.c_int64),
        ("device_compute_ns", ctypes.c_int64),
        # after a speculated ubatch: the host's bookkeeping from its log, between ubatches (the device idles)
        ("settle_ns", ctypes.c_int64),
        # ggml-cuda's CUDA graphs (its debug log lines): a split's graph captured, a captured one dropped
        ("cuda_graph_warmups", ctypes.c_int64),
        ("cuda_graph_resets", ctypes.c_int64),
    ]

    syncs: int
    event_syncs: int
    device_computes: int
    host_computes: int
    switches: int
    sync_ns: int
    host_compute_ns: int
    device_compute_ns: int
    settle_ns: int
    cuda_graph_warmups: int
    cuda_graph_resets: int

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name, _ in self._fields_}


@ctypes_function("llama_pyspecter_count_syncs", [ctypes.c_void_p], _i32)
def llama_pyspecter_count_syncs(dev: int, /) -> int:
    """Count dev's (a ggml_backend_dev_t) synchronisations from now on: its backends made after this call."""
    ...


@ctypes_function("llama_pyspecter_zero_slots", [ctypes.c_void_p, _i32], _i32)
def llama_pyspecter_zero_slots(dev: int, n_used: int, /) -> int:
    """The all-zero slots a slot layer on dev (a ggml_backend_dev_t) holds besides its slots: 0 where its kernel
    takes a negative expert id as a zero row (CPU, CUDA, RPC), else n_used (SPECTER_ZERO_SLOTS=1: every device)."""
    ...


def zero_slots(dev: int, n_used: int) -> int:
    """``llama_pyspecter_zero_slots``: the rule lives in C, beside the allocation it sizes."""
    return slots().zero_slots(dev, n_used)


@ctypes_function("llama_pyspecter_pinned_buffer_type", [ctypes.c_void_p], ctypes.c_void_p)
def llama_pyspecter_pinned_buffer_type(dev: int, /) -> int | None:
    """Where a slot session keeps the routed experts on the host beside dev: its pinned host buffer type laid out
    as its own buffers (csrc/pinned.cpp), or None (no host buffer type: the CPU, RPC)."""
    ...


def pinned_buffer_type(dev: int) -> int | None:
    """``llama_pyspecter_pinned_buffer_type``."""
    return slots().pinned_buffer_type(dev) or None


@ctypes_function("llama_pyspecter_host_experts_buffer", [_model, _i32], ctypes.c_char_p)
def llama_pyspecter_host_experts_buffer(model: ModelPtr, il: int, /) -> bytes | None:
    """The name of the buffer type holding slot layer il's host experts, or None."""
    ...


def host_experts_buffer(model: ModelPtr, il: int) -> str | None:
    """``llama_pyspecter_host_experts_buffer``: e.g. CUDA_Host_experts (pinned), CPU_Mapped (the file's pages)."""
    name = slots().host_experts_buffer(model, il)
    return name.decode() if name else None


@ctypes_function("llama_pyspecter_get_sync_counts", [ctypes.POINTER(SyncCounts)], None)
def llama_pyspecter_get_sync_counts(out: Any, /) -> None:
    """Fill a SyncCounts with this thread's counts."""
    ...


@ctypes_function("llama_pyspecter_sync_counts_reset", [], None)
def llama_pyspecter_sync_counts_reset() -> None:
    """Zero this thread's counts."""
    ...


def count_syncs(*devs: int) -> None:
    """Count the synchronisations of these ggml devices (and the CPU's, whose splits are the host's) from now on:
    call before the contexts to be counted are made."""
    from pyspecter.native.devices import cpu_device

    for dev in (*devs, cpu_device()):
        rc = slots().count_syncs(dev)
        if rc != 0:
            raise RuntimeError(f"llama_pyspecter_count_syncs: {rc}")


def sync_counts(reset: bool = False) -> SyncCounts:
    """This thread's synchronisation counts since the last reset (``reset``: then zero them)."""
    out = SyncCounts()
    slots().get_sync_counts(ctypes.byref(out))
    if reset:
        slots().sync_counts_reset()
    return out
