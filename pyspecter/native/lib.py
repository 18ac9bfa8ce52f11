"""ctypes bindings of pyspecter's C API (csrc/include/llama-pyspecter.h), on the libllama llama-cpp-python loads.

Our ``extern "C"`` functions are compiled into the same libllama as llama.cpp's, so they are bound on the handle the
bindings already hold (as ``llama_cpp/llama_cpp_ext.py`` does) instead of loading a second copy of the library.
Each C function has one typed stub below, declared the way ``llama_cpp/llama_cpp.py`` declares its own; unlike
there, binding waits for first use, so importing pyspecter works before ``make build``.

Why this module is long: it is the C API's one declaration, a typed stub per function of the header (a unit test
checks the two name the same functions and counters), and splitting it would split that one list.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from pyspecter.errors import SpecterError

# LLAMA_PYSPECTER_VERSION of csrc/include/llama-pyspecter.h: the C API these bindings are written against
PATCH_SERIES_VERSION = 32
PREFIX = "llama_pyspecter_"

ModelPtr = int | ctypes.c_void_p | None  # a llama_model *, as llama_cpp hands it out


def llama_lib() -> ctypes.CDLL:
    """The loaded libllama; refuses a stock or stale build with a clear message."""
    os.environ.setdefault("GGML_LOG_LEVEL", "error")
    from pyspecter.native.install import fix_command, missing_native

    try:
        import llama_cpp
    except (ImportError, RuntimeError, FileNotFoundError) as e:
        raise SpecterError(missing_native(e) or str(e)) from None
    lib = llama_cpp.llama_cpp._lib
    try:
        fn = lib.llama_pyspecter_version
    except AttributeError:
        raise SpecterError(f"the loaded libllama lacks pyspecter's native code; run `{fix_command()}`") from None
    fn.restype = ctypes.c_int32
    fn.argtypes = []
    got = fn()
    if got != PATCH_SERIES_VERSION:
        raise SpecterError(f"libllama has pyspecter C API v{got}, these bindings need v{PATCH_SERIES_VERSION}; "
                           f"run `{fix_command()}`")
    return lib


def build_key() -> str:
    """The cache key of the loaded llama.cpp build (tools/build_llama.py writes BUILD_INFO.json beside it)."""
    import json
    from pathlib import Path

    import llama_cpp

    info = Path(llama_cpp.__file__).resolve().parent.parent / "BUILD_INFO.json"
    try:
        return str(json.loads(info.read_text())["key"])
    except (OSError, ValueError, KeyError):
        return "unknown"


def patch_series_version() -> int:
    return int(llama_lib().llama_pyspecter_version())


# --- declarations --------------------------------------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


class CFunction:
    """One C function of libllama: its declared stub until first use, then the bound ctypes function."""

    def __init__(self, name: str, argtypes: list[Any], restype: Any, stub: Callable[..., Any]) -> None:
        self.name, self.argtypes, self.restype, self.stub = name, argtypes, restype, stub
        self._fn: Any = None
        functools.update_wrapper(self, stub)

    def bind(self) -> Any:
        if self._fn is None:
            fn = getattr(llama_lib(), self.name)
            fn.argtypes = self.argtypes
            fn.restype = self.restype
            self._fn = functools.wraps(self.stub)(fn)
        return self._fn

    def __call__(self, *args: Any) -> Any:
        return self.bind()(*args)


DECLARED: list[CFunction] = []


def ctypes_function(name: str, argtypes: list[Any], restype: Any) -> Callable[[F], F]:
    """Declare the decorated stub as C function ``name`` with these ctypes types (bound on first call)."""

    def decorator(stub: F) -> F:
        cfn = CFunction(name, argtypes, restype, stub)
        DECLARED.append(cfn)
        return cfn  # type: ignore[return-value]  # calls like the stub it wraps

    return decorator


# --- types ---------------------------------------------------------------------------------------------------------

KIND_GATE, KIND_UP, KIND_DOWN, KIND_GATE_UP = 0, 1, 2, 3
KIND_NAMES = {"gate": KIND_GATE, "up": KIND_UP, "down": KIND_DOWN, "gate_up": KIND_GATE_UP}

# llama_pyspecter_route_cb(user_data, il, n_tokens, n_used, ids, weights)
ROUTE_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                            ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float))
# llama_pyspecter_wait_cb(user_data, il): the layer's late uploads must have landed when it returns
WAIT_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)
# llama_pyspecter_input_cb(user_data, il, n_tokens, n_embd, x): the layer's router input, [n_tokens][n_embd] f32
# (x arrives as a plain address: wrapping it in numpy from there costs 1 us a layer, from a ctypes pointer 4)
INPUT_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p)

# enum llama_pyspecter_status
OK = 0
ERR_ARG = -1
ERR_ENABLED = -2
ERR_DENSE = -3
ERR_NO_MEMORY = -4
ERR_LAYOUT = -5
ERR_REPACKED = -6
ERR_NO_SLOTS = -7
ERR_STOPPED = -8
ERR_UPLOAD_FAILED = -9
ERR_UNKNOWN_TICKET = -10
ERR_INTERNAL = -11
ERR_IO = -12
STATUS_NAMES = {
    ERR_ARG: "bad argument", ERR_ENABLED: "slots already enabled", ERR_DENSE: "the model has no experts",
    ERR_NO_MEMORY: "out of memory", ERR_LAYOUT: "an expert tensor does not hold n_expert experts",
    ERR_REPACKED: "expert tensors are repacked (load with extra_bufts=False)", ERR_NO_SLOTS: "slots not enabled",
    ERR_STOPPED: "the model is being freed", ERR_UPLOAD_FAILED: "the upload failed",
    ERR_UNKNOWN_TICKET: "unknown upload ticket", ERR_INTERNAL: "internal error",
    ERR_IO: "the read failed or came back short",
}


def status_name(rc: int) -> str:
    return STATUS_NAMES.get(rc, f"status {rc}")


class Stats(ctypes.Structure):
    """struct llama_pyspecter_stats: counters since the last stats_reset."""

    _fields_ = [
        ("route_calls", ctypes.c_int64),  # routing op runs (one per MoE layer per ubatch)
        ("hit_rows", ctypes.c_int64),  # (token, expert) rows computed from slots
        ("miss_rows", ctypes.c_int64),  # rows computed from the host copy
        ("route_ns", ctypes.c_int64),  # time in the routing op, hook included
        ("hook_ns", ctypes.c_int64),  # time in the routing and wait hooks
        ("upload_bytes", ctypes.c_int64),  # bytes copied into slots
        ("upload_ns", ctypes.c_int64),  # time some copy was in flight, overlapping ones once (throttle included)
        ("upload_failures", ctypes.c_int64),  # accepted uploads whose copy failed
        # native residency
        ("needed", ctypes.c_int64),  # distinct experts asked for, summed over routing calls
        ("resident_at_need", ctypes.c_int64),  # ... of which resident when asked
        ("uploads", ctypes.c_int64),  # experts read into slots
        ("prefetches", ctypes.c_int64),  # ... of which ahead of need
        ("waited", ctypes.c_int64),  # misses that waited for a read already in flight
        ("overflow", ctypes.c_int64),  # misses left to the host: every slot was needed at once
        ("wait_ns", ctypes.c_int64),  # time the routing op waited for reads
        ("stall_reads_ns", ctypes.c_int64),  # reads in flight integrated over that wait
        ("read_bytes", ctypes.c_int64),  # bytes the reader threads read
        ("read_busy_ns", ctypes.c_int64),  # wall time with at least one read in flight
        ("lookahead", ctypes.c_int64),  # reads the prefill lookahead started (in prefetches too)
        ("late", ctypes.c_int64),  # misses computed late (ordered)
        ("late_lost", ctypes.c_int64),  # late experts whose read failed twice: that ubatch's output is wrong
        ("route_cpu_ns", ctypes.c_int64),  # the compute thread's CPU time in the routing and wait ops (1 in 8 sampled)
        ("copy_cpu_ns", ctypes.c_int64),  # ... of which copying experts into slots (RAM-tier misses)
        # the native planner
        ("ahead_maps", ctypes.c_int64),  # layer-ahead maps applied in routing ops
        ("ahead_prefetches", ctypes.c_int64),  # prefetches they queued (in prefetches too)
        ("ahead_late", ctypes.c_int64),  # predictions >= min_prob the link could not land by their deadline
        ("ahead_refused", ctypes.c_int64),  # ... with no slot holding a less likely expert
        ("ghost_misses", ctypes.c_int64),  # misses of the held slots' ghost LRU (set_held), summed over layers
        # file reads
        ("read_ops", ctypes.c_int64),  # chunk reads the readers finished
        ("taken_back", ctypes.c_int64),  # queued prefetches a demand took back whole (read again as demand)
        ("io_uring", ctypes.c_int64),  # not a counter: 1 while file reads go through io_uring, 0 on pread threads
        ("queue_entries", ctypes.c_int64),  # read-queue entries queued (one per expert read, whatever its chunks)
        ("queue_scans", ctypes.c_int64),  # queue entries examined by searches (readers' and the routing op's)
        ("queue_locks", ctypes.c_int64),  # acquisitions of the queue's lock, every thread
        ("reader_wakes", ctypes.c_int64),  # notifications sent to idle readers (and the ring's thread)
        ("waiter_wakes", ctypes.c_int64),  # a routing or wait op waiting for reads woke to look again
        ("wait_cpu_ns", ctypes.c_int64),  # the part of route_cpu_ns inside read waits (sleep and wake-up)
    ]

    route_calls: int
    needed: int
    resident_at_need: int
    uploads: int
    prefetches: int
    waited: int
    overflow: int
    wait_ns: int
    stall_reads_ns: int
    read_bytes: int
    read_busy_ns: int
    lookahead: int
    late: int
    late_lost: int
    route_cpu_ns: int
    copy_cpu_ns: int
    wait_cpu_ns: int
    hit_rows: int
    miss_rows: int
    route_ns: int
    hook_ns: int
    upload_bytes: int
    upload_ns: int
    upload_failures: int

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name, _ in self._fields_}


# enum llama_pyspecter_policy / llama_pyspecter_miss
NATIVE_POLICIES = {"lru": 0, "lfu": 1, "prev-token": 2, "score": 3}
NATIVE_MISS = {"cpu": 0, "wait": 1, "ordered": 2, "host": 3, "surrogate": 4}
NATIVE_IO = {"auto": 0, "threads": 1}  # enum llama_pyspecter_io


class ResidencyParams(ctypes.Structure):
    """struct llama_pyspecter_residency_params."""

    _fields_ = [
        ("policy", ctypes.c_int32),
        ("miss", ctypes.c_int32),
        ("n_readers", ctypes.c_int32),
        ("fd", ctypes.c_int32),
        ("drop_cache", ctypes.c_bool),
        ("lookahead", ctypes.c_bool),
        ("record", ctypes.c_bool),
        ("read_chunk", ctypes.c_int32),  # bytes per file read at most (<= 0: 256 KiB)
        ("io", ctypes.c_int32),  # NATIVE_IO
    ]


# --- the C API -----------------------------------------------------------------------------------------------------

_model = ctypes.c_void_p
_i32, _i64, _size = ctypes.c_int32, ctypes.c_int64, ctypes.c_size_t


@ctypes_function("llama_pyspecter_version", [], _i32)
def llama_pyspecter_version() -> int:
    """LLAMA_PYSPECTER_VERSION of the loaded library."""


@ctypes_function("llama_pyspecter_logs_quiet", [], None)
def llama_pyspecter_logs_quiet() -> None:
    """Route llama.cpp's and ggml's logs to the native sink and set ggml's abort callback (csrc/logs.cpp)."""


@ctypes_function("llama_pyspecter_logs_recent", [ctypes.c_char_p, _i32], _i32)
def llama_pyspecter_logs_recent(buf: Any, size: int, /) -> int:
    """Copy the remembered error and warning lines into buf; the bytes they need."""


@ctypes_function("llama_pyspecter_logs_splits_line", [ctypes.c_char_p, _i32], _i32)
def llama_pyspecter_logs_splits_line(buf: Any, size: int, /) -> int:
    """Copy the latest graph split-count line into buf; the bytes it needs (0: none yet)."""


@ctypes_function("llama_pyspecter_slots_init", [_model, _i32], _i32)
def llama_pyspecter_slots_init(model: ModelPtr, n_slots: int, /) -> int:
    """Allocate n_slots expert slots in every MoE layer; before creating a context. 0 or a negative status."""


@ctypes_function("llama_pyspecter_n_slots", [_model], _i32)
def llama_pyspecter_n_slots(model: ModelPtr, /) -> int:
    """Slots per MoE layer; 0 when slots are not enabled."""


@ctypes_function("llama_pyspecter_is_moe_layer", [_model, _i32], ctypes.c_bool)
def llama_pyspecter_is_moe_layer(model: ModelPtr, il: int, /) -> bool:
    ...


@ctypes_function("llama_pyspecter_expert_nbytes", [_model, _i32, _i32], _size)
def llama_pyspecter_expert_nbytes(model: ModelPtr, il: int, kind: int, /) -> int:
    """Bytes of one expert in one kind of weight of layer il; 0 if the layer has no such tensor."""


@ctypes_function("llama_pyspecter_slots_nbytes", [_model], _size)
def llama_pyspecter_slots_nbytes(model: ModelPtr, /) -> int:
    """Total slot memory."""


@ctypes_function("llama_pyspecter_slot_of", [_model, _i32, _i32], _i32)
def llama_pyspecter_slot_of(model: ModelPtr, il: int, expert: int, /) -> int:
    """The slot expert is resident in, or -1."""


@ctypes_function("llama_pyspecter_expert_in", [_model, _i32, _i32], _i32)
def llama_pyspecter_expert_in(model: ModelPtr, il: int, slot: int, /) -> int:
    """The expert resident in slot, or -1."""


@ctypes_function("llama_pyspecter_set_slot", [_model, _i32, _i32, _i32], _i32)
def llama_pyspecter_set_slot(model: ModelPtr, il: int, expert: int, slot: int, /) -> int:
    """Make expert resident in slot (which must hold its bytes); slot -1 evicts it. 0 or a negative status."""


@ctypes_function("llama_pyspecter_take_uses", [_model, _i32, ctypes.POINTER(ctypes.c_uint32), _i32], _i32)
def llama_pyspecter_take_uses(model: ModelPtr, min_tokens: int, out: Any, n: int, /) -> int:
    """Each slot layer's expert uses since the last take, once min_tokens tokens were routed (out[il * n_expert +
    e]); the tokens routed, 0 when fewer (out untouched), or a negative status."""


@ctypes_function("llama_pyspecter_write_slot", [_model, _i32, _i32, _i32, ctypes.c_void_p, _size], _i32)
def llama_pyspecter_write_slot(model: ModelPtr, il: int, kind: int, slot: int, src: int | ctypes.c_void_p,
                               nbytes: int, /) -> int:
    """Copy one kind's bytes of one expert from src into slot. 0 or a negative status."""


@ctypes_function("llama_pyspecter_read_slot",
                 [_model, _i32, _i32, _i32, _i32, ctypes.c_int64, ctypes.c_void_p, _size, ctypes.c_bool], _i32)
def llama_pyspecter_read_slot(model: ModelPtr, il: int, kind: int, slot: int, fd: int, offset: int,
                              buf: int | ctypes.c_void_p, buf_size: int, drop_cache: bool, /) -> int:
    """Read one kind of one expert from fd at offset (through the caller's page-aligned buf of buf_size bytes)
    into slot, in one call with the GIL released. 0, ERR_IO (failed or short; the slot untouched) or another
    negative status."""


@ctypes_function("llama_pyspecter_slot_get", [_model, _i32, _i32, _i32, ctypes.c_void_p, _size], _i32)
def llama_pyspecter_slot_get(model: ModelPtr, il: int, kind: int, slot: int, out: int | ctypes.c_void_p,
                             nbytes: int, /) -> int:
    """Copy a slot's bytes of one kind (nbytes == expert_nbytes) into out: what a read landed there. 0 or a
    negative status."""


@ctypes_function("llama_pyspecter_load_expert", [_model, _i32, _i32, _i32], _i32)
def llama_pyspecter_load_expert(model: ModelPtr, il: int, expert: int, slot: int, /) -> int:
    """Copy every kind of expert from the model's host copy into slot. 0 or a negative status."""


@ctypes_function("llama_pyspecter_write_slot_async", [_model, _i32, _i32, _i32, ctypes.c_void_p, _size], _i64)
def llama_pyspecter_write_slot_async(model: ModelPtr, il: int, kind: int, slot: int, src: int | ctypes.c_void_p,
                                     nbytes: int, /) -> int:
    """Queue write_slot on the upload thread: a ticket > 0, or a negative status (refused, never done). src must
    stay valid until the ticket has finished."""


@ctypes_function("llama_pyspecter_load_expert_async", [_model, _i32, _i32, _i32], _i64)
def llama_pyspecter_load_expert_async(model: ModelPtr, il: int, expert: int, slot: int, /) -> int:
    """Queue load_expert on the upload thread: a ticket > 0, or a negative status (refused, never done)."""


@ctypes_function("llama_pyspecter_upload_status", [_model, _i64], _i32)
def llama_pyspecter_upload_status(model: ModelPtr, ticket: int, /) -> int:
    """1 landed, 0 queued or copying, ERR_UPLOAD_FAILED, or ERR_UNKNOWN_TICKET."""


@ctypes_function("llama_pyspecter_upload_wait", [_model, _i64], _i32)
def llama_pyspecter_upload_wait(model: ModelPtr, ticket: int, /) -> int:
    """Block until the ticket has finished; its status (1 or negative). An unknown ticket returns at once."""


@ctypes_function("llama_pyspecter_upload_done", [_model, _i64], ctypes.c_bool)
def llama_pyspecter_upload_done(model: ModelPtr, ticket: int, /) -> bool:
    """The ticket has landed (a failed, refused or unknown one never has); ticket 0, before the first, has."""


@ctypes_function("llama_pyspecter_set_link_gbps", [_model, ctypes.c_double], None)
def llama_pyspecter_set_link_gbps(model: ModelPtr, gbps: float, /) -> None:
    """Emulate a link of gbps GB/s for uploads; 0 = as fast as possible."""


@ctypes_function("llama_pyspecter_set_route_cb", [_model, ROUTE_CB, ctypes.c_void_p], None)
def llama_pyspecter_set_route_cb(model: ModelPtr, cb: Any, user_data: int | None, /) -> None:
    """The routing hook (a ROUTE_CB; keep a reference while it is set). ROUTE_CB() clears it."""


@ctypes_function("llama_pyspecter_set_input_cb", [_model, INPUT_CB, ctypes.c_void_p], None)
def llama_pyspecter_set_input_cb(model: ModelPtr, cb: Any, user_data: int | None, /) -> None:
    """The input hook (an INPUT_CB): each MoE layer's router input, before the routing hook; set before creating
    the context. INPUT_CB() clears it."""


@ctypes_function("llama_pyspecter_set_batch_invariant", [ctypes.c_bool], None)
def llama_pyspecter_set_batch_invariant(enabled: bool, /) -> None:
    """Process-wide: CPU matmuls give the same bits at any batch size (llamafile's sgemm off); between decodes."""


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Within: this process's CPU matmuls give the same bits for a batch as for its rows one at a time (and as
    stock gives for one row), so a K+1-token verification pass equals K+1 one-token decodes."""
    llama_pyspecter_set_batch_invariant(True)
    try:
        yield
    finally:
        llama_pyspecter_set_batch_invariant(False)


@ctypes_function("llama_pyspecter_exit_on_abort", [_i32], None)
def llama_pyspecter_exit_on_abort(code: int, /) -> None:
    """For the CLI: a fatal ggml error (a lost RPC server among them) prints one line and exits with code."""


@ctypes_function("llama_pyspecter_set_wait_cb", [_model, WAIT_CB, ctypes.c_void_p], None)
def llama_pyspecter_set_wait_cb(model: ModelPtr, cb: Any, user_data: int | None, /) -> None:
    """The wait hook of late experts (a WAIT_CB); set before creating the context. WAIT_CB() clears it."""


@ctypes_function("llama_pyspecter_set_late", [_model, _i32, _i32, _i32], _i32)
def llama_pyspecter_set_late(model: ModelPtr, il: int, expert: int, slot: int, /) -> int:
    """From the routing hook: expert's upload into slot has started; compute it from there after the wait hook."""


@ctypes_function("llama_pyspecter_release_host_experts", [_model], _size)
def llama_pyspecter_release_host_experts(model: ModelPtr, /) -> int:
    """Drop the host copy's expert pages of the file mapping from this process; the bytes released."""


@ctypes_function("llama_pyspecter_get_stats", [_model, ctypes.POINTER(Stats)], None)
def llama_pyspecter_get_stats(model: ModelPtr, out: Any, /) -> None:
    """Fill a Stats (pass ctypes.byref(stats))."""


@ctypes_function("llama_pyspecter_stats_reset", [_model], None)
def llama_pyspecter_stats_reset(model: ModelPtr, /) -> None:
    ...


@ctypes_function("llama_pyspecter_residency_init", [_model, ctypes.POINTER(ResidencyParams)], _i32)
def llama_pyspecter_residency_init(model: ModelPtr, params: Any, /) -> int:
    """The routing op owns residency from here on (after slots_init, before the context). 0 or a negative status."""


@ctypes_function("llama_pyspecter_residency_enabled", [_model], ctypes.c_bool)
def llama_pyspecter_residency_enabled(model: ModelPtr, /) -> bool:
    ...


@ctypes_function("llama_pyspecter_set_file_offset", [_model, _i32, _i32, _i64], _i32)
def llama_pyspecter_set_file_offset(model: ModelPtr, il: int, kind: int, offset: int, /) -> int:
    """Where expert 0 of layer il's kind tensor starts in the residency's file."""


@ctypes_function("llama_pyspecter_set_usable", [_model, _i32, _i32], _i32)
def llama_pyspecter_set_usable(model: ModelPtr, il: int, n: int, /) -> int:
    """Slots [0, n) of layer il are handed out."""


@ctypes_function("llama_pyspecter_set_held", [_model, _i32, _i32], _i32)
def llama_pyspecter_set_held(model: ModelPtr, il: int, n_held: int, /) -> int:
    """Layer il holds back n_held slots after its usable ones (a draft's memory), with a ghost LRU over both."""


@ctypes_function("llama_pyspecter_release_held", [_model], _i32)
def llama_pyspecter_release_held(model: ModelPtr, /) -> int:
    """The draft is dropped: every layer's held slots are handed out, ghosts end, queued prefetches are taken
    back. The slots released, or a negative status."""


@ctypes_function("llama_pyspecter_set_policy", [_model, _i32], _i32)
def llama_pyspecter_set_policy(model: ModelPtr, policy: int, /) -> int:
    """The eviction policy from the next routing call on (between decodes)."""


@ctypes_function("llama_pyspecter_held", [_model, _i32, ctypes.POINTER(_i64)], _i32)
def llama_pyspecter_held(model: ModelPtr, il: int, ghost_misses: Any, /) -> int:
    """Layer il's held slots now, and its ghost's misses since set_held into *ghost_misses (may be None)."""


@ctypes_function("llama_pyspecter_set_scores", [_model, _i32, ctypes.POINTER(ctypes.c_float), _i32], _i32)
def llama_pyspecter_set_scores(model: ModelPtr, il: int, scores: Any, n: int, /) -> int:
    """SCORE policy: n_expert eviction scores of layer il (higher: keep)."""


@ctypes_function("llama_pyspecter_set_reuse_map", [_model, _i32, ctypes.c_void_p, ctypes.c_void_p, _i32,
                                                   ctypes.c_void_p], _i32)
def llama_pyspecter_set_reuse_map(model: ModelPtr, il: int, R: int, rb: int, n_embd: int, blend: int | None, /) -> int:
    """SCORE policy from layer il's reuse map (R [n_embd][n_expert], rb [n_expert], blend [6] or None), applied to
    the router input in the routing op. Addresses of float32 arrays; copied. Before creating a context."""


@ctypes_function("llama_pyspecter_set_duel", [_model, ctypes.c_bool, ctypes.c_bool, ctypes.c_float, ctypes.c_float],
                 _i32)
def llama_pyspecter_set_duel(model: ModelPtr, enabled: bool, start_learned: bool, decay: float, margin: float,
                             /) -> int:
    """Set dueling between LRU and the reuse scores (study.simulate.EvictionDuel replays the same rule offline)."""


@ctypes_function("llama_pyspecter_duel_state", [_model, ctypes.POINTER(_i64)], _i32)
def llama_pyspecter_duel_state(model: ModelPtr, switches: Any, /) -> int:
    """1 while the duel evicts by the scores, 0 by LRU; switches so far into *switches."""


@ctypes_function("llama_pyspecter_set_protected", [_model, _i32, ctypes.POINTER(_i32), _i32], _i32)
def llama_pyspecter_set_protected(model: ModelPtr, il: int, experts: Any, n: int, /) -> int:
    """Experts eviction spares (predicted for the window in flight); n = 0 clears layer il, il = -1 every layer."""


@ctypes_function("llama_pyspecter_schedule", [_model, _i32, _i32, ctypes.c_float, _i32], _i32)
def llama_pyspecter_schedule(model: ModelPtr, il: int, expert: int, priority: float, deadline: int, /) -> int:
    """A prefetch behind every demand read: 1 queued, 0 nothing to do, negative: error."""


@ctypes_function("llama_pyspecter_set_ahead_map", [_model, _i32, _i32, ctypes.c_void_p, ctypes.c_void_p, _i32, _i32,
                                                   _i32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, _i32], _i32)
def llama_pyspecter_set_ahead_map(model: ModelPtr, il_src: int, il_dst: int, W: int, b: int, n_embd: int,
                                  n_used: int, gating: int, sel_bias: int | None, table: int, edges: int | None,
                                  n_bins: int, /) -> int:
    """The native planner's map from layer il_src's router input to layer il_dst's routing (W [n_embd][n_expert],
    b, sel_bias or None, table [n_bins][n_expert], edges [n_bins - 1]: addresses of float32 arrays; copied)."""


@ctypes_function("llama_pyspecter_set_planner", [_model, ctypes.c_bool, ctypes.c_float, ctypes.c_float], _i32)
def llama_pyspecter_set_planner(model: ModelPtr, enabled: bool, min_prob: float, max_stall: float, /) -> int:
    """The native planner on/off, the least probability it prefetches at, and the stall share (of a layer-time)
    above which it stands aside (link-bound)."""


@ctypes_function("llama_pyspecter_ahead_probs", [_model, _i32, _i32, ctypes.c_void_p, _i32, ctypes.c_void_p, _i32],
                 _i32)
def llama_pyspecter_ahead_probs(model: ModelPtr, il_src: int, il_dst: int, x: int, n_embd: int, out: int,
                                n_expert: int, /) -> int:
    """What il_src's map for il_dst predicts for router input x (float32 [n_embd]) into out (float32 [n_expert])."""


@ctypes_function("llama_pyspecter_drain", [_model], _i32)
def llama_pyspecter_drain(model: ModelPtr, /) -> int:
    """Wait for every read in flight and map what landed."""


@ctypes_function("llama_pyspecter_trace_take", [_model, ctypes.POINTER(_i32), _size], _size)
def llama_pyspecter_trace_take(model: ModelPtr, out: Any, cap: int, /) -> int:
    """Take whole routing calls [il, n, e...] of the trace into out (cap 0: how many ints wait)."""


@ctypes_function("llama_pyspecter_set_record", [_model, ctypes.c_bool], _i32)
def llama_pyspecter_set_record(model: ModelPtr, enabled: bool, /) -> int:
    """Routing trace recording on or off (between decodes); off forgets the calls not yet taken."""


class SlotAPI:
    """The bound C functions, named without the ``llama_pyspecter_`` prefix (``api.load_expert(ptr, il, e, s)``),
    plus ``stats``. The attributes are the ctypes functions themselves: routing hooks call them per layer."""

    def __init__(self) -> None:
        for cfn in DECLARED:
            setattr(self, cfn.name.removeprefix(PREFIX), cfn.bind())

    def stats(self, model: ModelPtr) -> Stats:
        """Counters kept by the C side since the last stats_reset."""
        out = Stats()
        self.get_stats(model, ctypes.byref(out))
        return out

    def __getattr__(self, name: str) -> Any:  # only reached for names no declaration bound
        raise AttributeError(f"libllama has no function {PREFIX}{name} declared in pyspecter.native.lib")


_slot_api: SlotAPI | None = None


def slots() -> SlotAPI:
    """The C API, bound (checks the library the first time)."""
    global _slot_api
    if _slot_api is None:
        _slot_api = SlotAPI()
    return _slot_api
