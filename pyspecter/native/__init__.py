"""pyspecter's native side: our C API compiled into the libllama that llama-cpp-python loads (``lib``), and the
models and contexts opened through those bindings (``model``), and llama.cpp's logs (``logs``)."""

from pyspecter.native.device_api import (
    LAYER_FULL,
    LAYER_HOST,
    LAYER_KIND_NAMES,
    LAYER_SLOTS,
    count_syncs,
    device_stats,
    map_host_experts,
    read_table,
    sync_counts,
)
from pyspecter.native.draft_api import DraftStats
from pyspecter.native.engine_api import ReadFaults
from pyspecter.native.lib import (
    ERR_ARG,
    ERR_IO,
    INPUT_CB,
    KIND_DOWN,
    KIND_GATE,
    KIND_GATE_UP,
    KIND_NAMES,
    KIND_UP,
    NATIVE_IO,
    NATIVE_MISS,
    NATIVE_POLICIES,
    PATCH_SERIES_VERSION,
    ROUTE_CB,
    WAIT_CB,
    ResidencyParams,
    SlotAPI,
    Stats,
    batch_invariant,
    build_key,
    llama_lib,
    patch_series_version,
    slots,
    status_name,
)
from pyspecter.native.logs import graph_splits, quiet_logs, recent_log_errors
from pyspecter.native.model import Context, Model
from pyspecter.native.replay_api import Replay
from pyspecter.native.stats_api import HIST_NS, layer_cpu_hist

__all__ = [
    "ERR_ARG", "ERR_IO", "HIST_NS", "KIND_DOWN", "KIND_GATE", "KIND_GATE_UP", "KIND_NAMES", "KIND_UP", "INPUT_CB",
    "NATIVE_IO", "NATIVE_MISS", "NATIVE_POLICIES", "PATCH_SERIES_VERSION", "ReadFaults", "ResidencyParams",
    "LAYER_FULL", "LAYER_HOST", "LAYER_KIND_NAMES", "LAYER_SLOTS", "count_syncs", "device_stats", "graph_splits",
    "map_host_experts", "read_table", "sync_counts",
    "ROUTE_CB", "WAIT_CB",
    "batch_invariant", "build_key",
    "Context", "DraftStats", "Model", "SlotAPI", "Stats", "llama_lib", "patch_series_version", "quiet_logs",
    "recent_log_errors",
    "slots", "status_name",
    "HIST_NS", "layer_cpu_hist", "Replay",
]
