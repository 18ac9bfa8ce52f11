#include "pyspecter-impl.h"

// the backends' and devices' function tables, to count what the scheduler does with them (see count_syncs below)
#include "ggml-backend-impl.h"

int32_t llama_pyspecter_get_layer_cpu_hist(const llama_model * model, int64_t * out, int32_t n) {
    if (!out || n < 2 * LLAMA_PYSPECTER_HIST_BINS) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    const auto * s = pyspecter_slots_of(model);
    for (int32_t r = 0; r < 2; ++r) {
        for (int32_t b = 0; b < LLAMA_PYSPECTER_HIST_BINS; ++b) {
            out[r * LLAMA_PYSPECTER_HIST_BINS + b] = s ? s->counters.layer_cpu_hist[r][b].load() : 0;
        }
    }
    return 2 * LLAMA_PYSPECTER_HIST_BINS;
}

void llama_pyspecter_get_stats(const llama_model * model, llama_pyspecter_stats * out) {
    if (!out) {
        return;
    }
    *out = {};
    if (auto * s = pyspecter_slots_of(model)) {
        const auto & c = s->counters;
        out->route_calls     = c.route_calls.load();
        out->hit_rows        = c.hit_rows.load();
        out->miss_rows       = c.miss_rows.load();
        out->route_ns        = c.route_ns.load();
        out->hook_ns         = c.hook_ns.load();
        out->upload_bytes    = c.upload_bytes.load();
        out->upload_ns       = c.upload_ns.load();
        out->upload_failures = c.upload_failures.load();
        out->needed           = c.needed.load();
        out->resident_at_need = c.resident_at_need.load();
        out->uploads          = c.uploads.load();
        out->prefetches       = c.prefetches.load();
        out->waited           = c.waited.load();
        out->overflow         = c.overflow.load();
        out->wait_ns          = c.wait_ns.load();
        out->stall_reads_ns   = c.stall_reads_ns.load();
        out->read_bytes       = c.read_bytes.load();
        out->read_busy_ns     = c.read_busy_ns.load();
        out->lookahead        = c.lookahead.load();
        out->late             = c.late.load();
        out->late_lost        = c.late_lost.load();
        out->route_cpu_ns     = c.route_cpu_ns.load();
        out->copy_cpu_ns      = c.copy_cpu_ns.load();
        out->ahead_maps       = c.ahead_maps.load();
        out->ahead_prefetches = c.ahead_prefetches.load();
        out->ahead_late       = c.ahead_late.load();
        out->ahead_refused    = c.ahead_refused.load();
        out->ghost_misses     = c.ghost_misses.load();
        out->read_ops         = c.read_ops.load();
        out->taken_back       = c.taken_back.load();
        out->queue_entries    = c.queue_entries.load();
        out->queue_scans      = c.queue_scans.load();
        out->queue_locks      = c.queue_locks.load();
        out->reader_wakes     = c.reader_wakes.load();
        out->waiter_wakes     = c.waiter_wakes.load();
        out->wait_cpu_ns      = c.wait_cpu_ns.load();
        out->io_uring         = pyspecter_native_io_uring(s) ? 1 : 0;
    }
}

void llama_pyspecter_stats_reset(llama_model * model) {
    if (auto * s = pyspecter_slots_of(model)) {
        auto & c = s->counters;
        for (auto * v : { &c.route_calls, &c.hit_rows, &c.miss_rows, &c.route_ns, &c.hook_ns, &c.upload_bytes,
                          &c.upload_ns, &c.upload_failures, &c.needed, &c.resident_at_need, &c.uploads,
                          &c.prefetches, &c.waited, &c.overflow, &c.wait_ns, &c.stall_reads_ns, &c.read_bytes,
                          &c.read_busy_ns, &c.lookahead, &c.late, &c.late_lost, &c.route_cpu_ns,
                          &c.copy_cpu_ns, &c.ahead_maps, &c.ahead_prefetches,
                          &c.ahead_late, &c.ahead_refused, &c.ghost_misses, &c.read_ops, &c.taken_back,
                          &c.queue_entries, &c.queue_scans, &c.queue_locks, &c.reader_wakes, &c.waiter_wakes,
                          &c.wait_cpu_ns }) {
            *v = 0;
        }
        for (auto * v : { &c.fences, &c.table_pushes, &c.table_bytes, &c.eviction_writes, &c.async_batches,
                          &c.compute_orders, &c.spec_ubatches, &c.spec_redos, &c.inflight_peak, &c.mapped_rows,
                          &c.landing_wait_ns, &c.landing_wait_cpu_ns }) {
            *v = 0;
        }
        for (auto & row : c.layer_cpu_hist) {
            for (auto & v : row) {
                v = 0;
            }
        }
    }
}

void llama_pyspecter_get_device_stats(const llama_model * model, llama_pyspecter_device_stats * out) {
    if (!out) {
        return;
    }
    *out = {};
    auto * s = pyspecter_slots_of(model);
    if (!s) {
        return;
    }
    out->fences          = s->counters.fences;
    out->table_pushes    = s->counters.table_pushes;
    out->table_bytes     = s->counters.table_bytes;
    out->eviction_writes = s->counters.eviction_writes;
    out->upload_streams  = (int64_t) s->streams.size();
    out->async_batches   = s->counters.async_batches;
    out->compute_orders  = s->counters.compute_orders;
    out->spec_ubatches   = s->counters.spec_ubatches;
    out->spec_redos      = s->counters.spec_redos;
    out->inflight_peak   = s->counters.inflight_peak;
    out->mapped_rows     = s->counters.mapped_rows;
    out->landing_wait_ns     = s->counters.landing_wait_ns;
    out->landing_wait_cpu_ns = s->counters.landing_wait_cpu_ns;
}

// ---------------------------------------------------------------------------------------------------------------
// Host<->device synchronisations actually taken (llama_pyspecter_count_syncs). llama.cpp's split count says how
// many times a graph switches backends when it is reserved; these count what the scheduler does when it runs: every
// split it computes, and every time the host waits for a device (a backend synchronize: cudaStreamSynchronize on
// CUDA, a round trip on RPC; an event synchronize). They are counted by wrapping the device's backend entry points,
// which are per-instance function tables (ggml-backend-impl.h), so stock placements are counted as ours are and no
// ggml source is patched. Counts are per thread: the decoding thread's (the scheduler runs on it), so the upload
// thread's own waits on its events are not mixed in.
namespace {

struct sync_wrap {
    ggml_backend_dev_t dev = nullptr;
    bool is_cpu = false;
    ggml_backend_t (*init_backend)(ggml_backend_dev_t, const char *) = nullptr;
    void (*event_synchronize)(ggml_backend_dev_t, ggml_backend_event_t) = nullptr;
    void (*synchronize)(ggml_backend_t) = nullptr;             // the device's backends', as the first one had it
    ggml_status (*graph_compute)(ggml_backend_t, ggml_cgraph *) = nullptr;
};

constexpr int MAX_SYNC_DEVS = 16;
sync_wrap g_wraps[MAX_SYNC_DEVS];
std::atomic<int> g_n_wraps{0};
std::mutex g_wrap_mu;

thread_local llama_pyspecter_sync_counts t_sync = {};
thread_local int t_last_kind = -1; // the kind (0 host, 1 device) of this thread's last graph compute; -1: none yet

const sync_wrap * wrap_of(ggml_backend_dev_t dev) {
    const int n = g_n_wraps.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i) {
        if (g_wraps[i].dev == dev) {
            return &g_wraps[i];
        }
    }
    return nullptr;
}

void counted_synchronize(ggml_backend_t backend) {
    const auto * w = wrap_of(backend->device);
    const bool counted = w && !w->is_cpu;
    const int64_t t0 = counted ? pyspecter_now_ns() : 0;
    if (w && w->synchronize) {
        w->synchronize(backend);
    }
    if (counted) {
        t_sync.syncs++;
        t_sync.sync_ns += pyspecter_now_ns() - t0;
    }
}

ggml_status counted_graph_compute(ggml_backend_t backend, ggml_cgraph * graph) {
    const auto * w = wrap_of(backend->device);
    const int kind = w && !w->is_cpu ? 1 : 0;
    (kind ? t_sync.device_computes : t_sync.host_computes)++;
    if (t_last_kind >= 0 && t_last_kind != kind) {
        t_sync.switches++;
    }
    t_last_kind = kind;
    const int64_t t0 = pyspecter_now_ns();
    const ggml_status st = w->graph_compute(backend, graph);
    (kind ? t_sync.device_compute_ns : t_sync.host_compute_ns) += pyspecter_now_ns() - t0;
    return st;
}

void counted_event_synchronize(ggml_backend_dev_t dev, ggml_backend_event_t event) {
    const auto * w = wrap_of(dev);
    const int64_t t0 = pyspecter_now_ns();
    w->event_synchronize(dev, event);
    t_sync.event_syncs++;
    t_sync.sync_ns += pyspecter_now_ns() - t0;
}

ggml_backend_t counted_init_backend(ggml_backend_dev_t dev, const char * params) {
    auto * w = const_cast<sync_wrap *>(wrap_of(dev));
    ggml_backend_t b = w->init_backend(dev, params);
    if (!b) {
        return b;
    }
    std::lock_guard<std::mutex> lk(g_wrap_mu);
    // every backend of one device has the same entry points (its implementation's table, copied per instance)
    if (!w->graph_compute) {
        w->synchronize = b->iface.synchronize;
        w->graph_compute = b->iface.graph_compute;
    }
    if (b->iface.graph_compute == w->graph_compute) {
        b->iface.graph_compute = counted_graph_compute;
        if (b->iface.synchronize) {
            b->iface.synchronize = counted_synchronize;
        }
    }
    return b;
}

} // namespace

int32_t llama_pyspecter_count_syncs(ggml_backend_dev_t dev) {
    if (!dev || !dev->iface.init_backend) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    std::lock_guard<std::mutex> lk(g_wrap_mu);
    if (wrap_of(dev)) {
        return LLAMA_PYSPECTER_OK;
    }
    const int n = g_n_wraps.load();
    if (n == MAX_SYNC_DEVS) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    auto & w = g_wraps[n];
    w.dev = dev;
    w.is_cpu = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    w.init_backend = dev->iface.init_backend;
    w.event_synchronize = dev->iface.event_synchronize;
    g_n_wraps.store(n + 1, std::memory_order_release); // published before any wrapper can look it up
    dev->iface.init_backend = counted_init_backend;
    if (w.event_synchronize && !w.is_cpu) {
        dev->iface.event_synchronize = counted_event_synchronize;
    }
    return LLAMA_PYSPECTER_OK;
}

void pyspecter_count_settle(int64_t ns) {
    t_sync.settle_ns += ns;
}

void llama_pyspecter_get_sync_counts(struct llama_pyspecter_sync_counts * out) {
    if (out) {
        *out = t_sync;
        pyspecter_cuda_graph_counts(&out->cuda_graph_warmups, &out->cuda_graph_resets, false);
    }
}

void llama_pyspecter_sync_counts_reset(void) {
    // the last kind stays: a token's first split switches from the previous token's last, so that a token of
    // steady decode counts every boundary it crosses, as many as the graph has splits
    t_sync = {};
    pyspecter_cuda_graph_counts(nullptr, nullptr, true);
}
