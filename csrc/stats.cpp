#include "pyspecter-impl.h"

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
                          &c.compute_orders }) {
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
}
