"""Devices: where a model's layers and expert slots live, named as on the command line (``--device``).

``cpu`` is the default placement (everything in host memory). Any other device is a ggml backend device: ``cuda0``
(``CUDA0`` in ggml), or ``rpc:HOST:PORT``, llama.cpp's RPC backend, whose server (``pyspecter rpc-server``) may run
on this machine or another. With a device, every layer goes to it and the routed-expert tensors stay in host memory
through tensor buffer-type overrides, as llama.cpp's ``--cpu-moe`` does; expert slots are then allocated in the
device's memory (csrc/slots.cpp uses each layer's device), so the device tier is written once, against ggml's device
API, and tested everywhere on the RPC device.

ggml's registry functions live in libggml, the RPC client in libggml-rpc; both are already loaded beside the
libllama llama-cpp-python uses, so they are bound here on handles to those same files.
"""

from __future__ import annotations

import ctypes
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pyspecter.errors import SpecterError
from pyspecter.native.lib import llama_lib

# llama.cpp's --cpu-moe pattern (common/arg.cpp): every routed-expert weight, merged gate_up and channel scales too
EXPERT_PATTERN = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
DEVICE_TYPE_CPU, DEVICE_TYPE_GPU, DEVICE_TYPE_IGPU, DEVICE_TYPE_ACCEL = 0, 1, 2, 3
_SPEC = re.compile(r"(?:(cpu)|([a-z]+)(\d+)|rpc:(\[[0-9a-fA-F:.]+\]|[\w.-]+):(\d{1,5}))")


def parse_device(spec: str) -> tuple[str, str | None]:
    """``cpu`` -> ("cpu", None); ``cuda0`` -> ("ggml", "CUDA0"); ``rpc:HOST:PORT`` -> ("rpc", "HOST:PORT").
    Pure: the unit tests check it without a build."""
    s = spec.strip()
    m = _SPEC.fullmatch(s.lower()) if not s.lower().startswith("rpc:") else _SPEC.fullmatch(s)
    if not m:
        raise SpecterError(f"--device {spec!r}: expected cpu, a ggml device such as cuda0, or rpc:HOST:PORT")
    if m.group(1):
        return "cpu", None
    if m.group(2):
        return "ggml", f"{m.group(2).upper()}{m.group(3)}"
    port = int(m.group(5))
    if not 0 < port < 65536:
        raise SpecterError(f"--device {spec!r}: port {port} out of range")
    return "rpc", f"{m.group(4)}:{port}"


def _lib_dir() -> Path:
    return Path(llama_lib()._name).resolve().parent


@cache
def ggml() -> ctypes.CDLL:
    """libggml (registry and device functions), with the signatures used here."""
    lib = ctypes.CDLL(str(_lib_dir() / "libggml.so"))
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for name, args, res in [
        ("ggml_backend_dev_count", [], sz), ("ggml_backend_dev_get", [sz], vp),
        ("ggml_backend_dev_by_name", [ctypes.c_char_p], vp),
        ("ggml_backend_dev_name", [vp], ctypes.c_char_p), ("ggml_backend_dev_description", [vp], ctypes.c_char_p),
        ("ggml_backend_dev_type", [vp], ctypes.c_int),
        ("ggml_backend_dev_memory", [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
        ("ggml_backend_dev_host_buffer_type", [vp], vp), ("ggml_backend_dev_buffer_type", [vp], vp),
        ("ggml_backend_reg_dev_count", [vp], sz), ("ggml_backend_reg_dev_get", [vp, sz], vp),
        ("ggml_backend_buft_name", [vp], ctypes.c_char_p),
    ]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


@cache
def ggml_rpc() -> ctypes.CDLL:
    path = _lib_dir() / "libggml-rpc.so"
    if not path.exists():
        raise SpecterError("this llama.cpp build has no RPC backend (libggml-rpc.so); run `make build`")
    lib = ctypes.CDLL(str(path))
    lib.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    lib.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                                  ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
    lib.ggml_backend_rpc_start_server.restype = None
    return lib


def cpu_device() -> int:
    """The host CPU's ggml device."""
    g = ggml()
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)
        if g.ggml_backend_dev_type(dev) == DEVICE_TYPE_CPU:
            return dev
    raise SpecterError("ggml has no CPU device")


class BuftOverride(ctypes.Structure):
    """struct llama_model_tensor_buft_override (the bindings declare the params field but not the struct)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass
class Device:
    """An opened ggml device (never the CPU: ``open_device("cpu")`` is None)."""

    spec: str
    ptr: int  # ggml_backend_dev_t

    @property
    def name(self) -> str:
        return ggml().ggml_backend_dev_name(self.ptr).decode()

    @property
    def description(self) -> str:
        return ggml().ggml_backend_dev_description(self.ptr).decode()

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device's memory, as the device reports them."""
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        ggml().ggml_backend_dev_memory(self.ptr, ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def zero_slots(self, n_used: int) -> int:
        """All-zero slots a slot layer on this device holds besides its slots (0 where its kernel takes a miss's
        negative id, else one per expert a token uses): device memory a budget counts."""
        from pyspecter.native.device_api import zero_slots

        return zero_slots(self.ptr, n_used)

    def host_buffer_type(self) -> int | None:
        """The device's pinned host buffer type (CUDA_Host), or None (RPC has none)."""
        return ggml().ggml_backend_dev_host_buffer_type(self.ptr) or None

    def pinned_buffer_type(self) -> int | None:
        """Where a slot session keeps the routed experts on the host: the pinned host buffer type laid out as the
        device's own buffers (csrc/pinned.cpp), or None where the device has no host buffer type."""
        from pyspecter.native.device_api import pinned_buffer_type

        return pinned_buffer_type(self.ptr)


def _check_reachable(endpoint: str, timeout: float = 3.0) -> None:
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise SpecterError(f"rpc:{endpoint}: cannot connect ({e.strerror or e}); is `pyspecter rpc-server` "
                           "running there?") from None


_opened: dict[str, Device] = {}


def open_device(spec: str | None) -> Device | None:
    """The device for a ``--device`` value; None for cpu (or None). An RPC endpoint is checked for a listener
    first, so an unreachable one is a one-line error rather than ggml's abort. Opened once per process: ggml keeps
    one connection per RPC endpoint, and the server serves one client at a time."""
    if spec is None:
        return None
    kind, arg = parse_device(spec)
    if kind == "cpu":
        return None
    if spec in _opened:
        return _opened[spec]
    g = ggml()
    if kind == "rpc":
        _check_reachable(arg)
        reg = ggml_rpc().ggml_backend_rpc_add_server(arg.encode())
        if not reg or g.ggml_backend_reg_dev_count(reg) == 0:
            raise SpecterError(f"rpc:{arg}: the server offers no device")
        dev = g.ggml_backend_reg_dev_get(reg, 0)
    else:
        dev = g.ggml_backend_dev_by_name(arg.encode())
        if not dev:
            names = [g.ggml_backend_dev_name(g.ggml_backend_dev_get(i)).decode()
                     for i in range(g.ggml_backend_dev_count())]
            raise SpecterError(f"--device {spec}: no such device in this build (it has: {', '.join(names)}, "
                               "and rpc:HOST:PORT)")
    _opened[spec] = Device(spec, dev)
    return _opened[spec]


class Placement:
    """The llama_model_params fields that put every layer on ``device`` and the routed experts in host memory.
    ``n_cpu_moe``: only the first N layers' experts stay on the host (llama.cpp's --n-cpu-moe); ``host_layers``:
    only those layers' (a layer plan's host and slot layers; the others are full layers, all their experts on the
    device); neither: all of them (--cpu-moe). ``pinned``: in the device's pinned host memory, copied there at load
    (csrc/pinned.cpp), where the device has it (CUDA), as slots need: uploads then copy at the link's rate and
    ``--miss mapped`` reads them in place; else in the file's mapping, as stock's ``--cpu-moe`` leaves them
    (``self.pinned`` says which). Holds the ctypes arrays the params point to, so keep it alive until the model is
    loaded."""

    def __init__(self, device: Device, n_cpu_moe: int | None = None,
                 host_layers: Iterable[int] | None = None, pinned: bool = False) -> None:
        if n_cpu_moe is not None and host_layers is not None:
            raise SpecterError("give n_cpu_moe or host_layers, not both")
        self.devices = (ctypes.c_void_p * 2)(device.ptr, None)
        pinned_type = device.pinned_buffer_type() if pinned else None
        host = pinned_type or _cpu_buffer_type()
        if host_layers is not None:
            patterns = [rf"blk\.{i}{EXPERT_PATTERN}" for i in sorted(set(host_layers))]
        elif n_cpu_moe is None:
            patterns = [EXPERT_PATTERN]
        else:
            patterns = [rf"blk\.{i}{EXPERT_PATTERN}" for i in range(n_cpu_moe)]
        self._patterns = [p.encode() for p in patterns]
        self.overrides = (BuftOverride * (len(patterns) + 1))()
        for i, p in enumerate(self._patterns):
            self.overrides[i].pattern = p
            self.overrides[i].buft = host
        self.pinned = pinned_type is not None

    def apply(self, params) -> None:
        params.devices = ctypes.cast(self.devices, ctypes.c_void_p)
        params.tensor_buft_overrides = ctypes.cast(self.overrides, ctypes.c_void_p)
        params.n_gpu_layers = 999


@cache
def _cpu_buffer_type() -> int:
    lib = ctypes.CDLL(str(_lib_dir() / "libggml-cpu.so"))
    lib.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    return lib.ggml_backend_cpu_buffer_type()


def serve_rpc(host: str, port: int, threads: int, strict: bool = False) -> None:
    """Run ggml's RPC server on this machine's CPU until the process is stopped (it does not return).

    ``strict``: the server holds its clients to a GPU's contract instead of the CPU's leniency. Its CPU
    ``mul_mat_id`` aborts on an expert id outside the weight tensor or repeated within a token (a CUDA kernel
    corrupts memory or leaves rows unwritten on those; the CPU kernel would skip or compute them), so a suite run
    against it catches on every machine what only a GPU would show."""
    if strict:
        lib = ctypes.CDLL(str(_lib_dir() / "libggml-cpu.so"))
        lib.ggml_cpu_set_strict_ids.argtypes = [ctypes.c_bool]
        lib.ggml_cpu_set_strict_ids.restype = None
        lib.ggml_cpu_set_strict_ids(True)
    devs = (ctypes.c_void_p * 1)(cpu_device())
    ggml_rpc().ggml_backend_rpc_start_server(f"{host}:{port}".encode(), None, threads, 1, devs)
