// Speculating that a ubatch hits: a device slot layer's split form visits the host every ubatch (its CPU split
// reads back the looked-up pairs and computes the misses), even when every row hits. A speculated graph has no host
// path: each slot path reads its ids from the device's table as before (zero slots where an expert is not
// resident) and copies the pairs it looked up into a log on the device. After the ubatch the host reads the log
// once: if every row hit, the output is the split form's bit for bit (the host path would only have added zeros)
// and the layers' host-side routing runs now, from the log; if a row missed, the ubatch is computed again with its
// host paths, which rewrites its KV cells and outputs.
//
// When to speculate: when the scheduler's previous ubatch hit in every row, and not for a while after a miss
// (1, 2, 4 ... 64 ubatches). A miss costs the speculated compute and two graph rebuilds; at a hit rate where whole
// tokens rarely hit, the backoff keeps that to one try in 64 ubatches.

#include "pyspecter-impl.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

constexpr int32_t MAX_BACKOFF = 64;

// A row a slot path computed from a zero slot: its expert was not resident (the log's row starts with the slots).
bool any_zero(const llama_pyspecter_layer * L, const int32_t * slots, int32_t n_rows) {
    for (int32_t i = 0; i < n_rows; ++i) {
        if (pyspecter_is_zero_slot(L, slots[i])) {
            return true;
        }
    }
    return false;
}

} // namespace

// the device a table's speculation log is written on
static ggml_backend_dev_t log_device(const llama_pyspecter_table & tab) {
    return ggml_backend_buft_get_device(ggml_backend_buffer_get_type(tab.spec_log->buffer));
}

bool llama_pyspecter_set_speculate(llama_model * model, bool enabled) {
    // SPECTER_SPECULATE=0 keeps it off whatever the caller asks: the same run with and without, for benchmarks
    const char * env = std::getenv("SPECTER_SPECULATE");
    auto * s = pyspecter_slots_of(model);
    if (!s) {
        return false;
    }
    // a redo reruns the ubatch on the memory its first pass left: a recurrent layer's state would advance twice
    const bool recurrent = llama_model_is_recurrent(model) || llama_model_is_hybrid(model);
    s->speculate = enabled && !(env && std::string(env) == "0") && !recurrent;
    // where each table's log is read back into (redo): pinned memory where the device has a host type, so that CUDA
    // copies it behind the ubatch and the scheduler's one wait covers it (into pageable memory the copy is staged
    // and blocks the caller until the ubatch ends: a wait no counter sees); else pageable. Freed with the tables.
    for (auto & tab : s->tables) {
        auto * pinned = s->speculate && !tab.log_host ? llama_pyspecter_pinned_buffer_type(log_device(tab)) : nullptr;
        if (pinned) {
            tab.log_host = ggml_backend_buft_alloc_buffer(pinned, ggml_nbytes(tab.spec_log));
        }
    }
    return s->speculate;
}

void llama_pyspecter_context_gone(llama_pyspecter_slots * s, ggml_backend_sched * sched) {
    if (!s) {
        return;
    }
    pyspecter_compute_gone(s, sched);
    std::lock_guard<std::mutex> lk(s->spec_mu);
    auto it = s->spec.find(sched);
    if (it != s->spec.end()) {
        if (pyspecter_build_state() == &it->second) { // an aborted ubatch never reached redo
            pyspecter_build_for(nullptr, false);
        }
        s->spec.erase(it);
    }
}

bool llama_pyspecter_begin_ubatch(llama_pyspecter_slots * s, ggml_backend_sched * sched, int n_tokens) {
    pyspecter_build_for(nullptr, false);
    if (!s || s->tables.empty()) {
        return false;
    }
    const bool on = s->speculate;
    pyspecter_spec * st = nullptr;
    {
        std::lock_guard<std::mutex> lk(s->spec_mu); // the map only: a state is its decoding thread's
        auto it = s->spec.find(sched);
        if (it != s->spec.end()) {
            st = &it->second; // turned off since: its graph may still be speculated, and is built again below
        } else if (on) {
            st = &s->spec[sched];
        }
    }
    if (!st) {
        return false;
    }
    st->owner = s;
    st->ubatch++;
    st->n_tokens = n_tokens;
    st->miss_rows0 = s->counters.miss_rows;
    bool want = false;
    if (st->redo) {
        st->redo = false;
    } else if (st->skip > 0) {
        st->skip--;
    } else {
        // with every layer mapped a speculation never redoes, whatever the last ubatch hit, prompts included
        want = on && ((st->last_hit && n_tokens <= PYSPECTER_SPEC_MAX_TOKENS) ||
                      (s->mapped_all && n_tokens <= PYSPECTER_LOG_MAX_TOKENS));
    }
    pyspecter_build_for(st, want);
    return want != st->built;
}

bool llama_pyspecter_redo(llama_pyspecter_slots * s, ggml_backend_sched * sched) {
    pyspecter_spec * st = pyspecter_build_state();
    pyspecter_build_for(nullptr, false);
    if (!s || !st) {
        return false;
    }
    if (!st->built || st->layers.empty()) {
        // host paths: whether this ubatch hit everywhere says whether the next one speculates
        st->last_hit = s->counters.miss_rows == st->miss_rows0;
        return false;
    }
    const int32_t n_used = s->n_used, n_rows = n_used * st->n_tokens;
    // each table's log is copied on its device's stream behind the ubatch, so that the one wait for the scheduler
    // covers the copy too (a get after it would wait on the device a second time: on CUDA a copy and a stream sync)
    // (into the table's pinned log_host where it has one, else pageable memory here)
    thread_local std::vector<std::vector<int32_t>> logs;
    thread_local std::vector<int32_t *> into;
    thread_local std::vector<ggml_backend_t> from;
    const size_t n_log = (size_t) 2 * n_rows * s->layers.size(); // what this ubatch wrote: every layer's rows
    logs.resize(s->tables.size());
    into.assign(s->tables.size(), nullptr);
    from.assign(s->tables.size(), nullptr);
    for (size_t t = 0; t < s->tables.size(); ++t) {
        const auto & tab = s->tables[t];
        if (tab.log_host) {
            into[t] = (int32_t *) ggml_backend_buffer_get_base(tab.log_host);
        } else {
            logs[t].resize(n_log);
            into[t] = logs[t].data();
        }
        if ((from[t] = pyspecter_sched_backend(sched, log_device(tab)))) {
            ggml_backend_tensor_get_async(from[t], tab.spec_log, into[t], 0, n_log * sizeof(int32_t));
        }
    }
    ggml_backend_sched_synchronize(sched);
    for (size_t t = 0; t < s->tables.size(); ++t) {
        if (!from[t]) {
            ggml_backend_tensor_get(s->tables[t].spec_log, into[t], 0, n_log * sizeof(int32_t));
        }
    }
    bool missed = false;
    for (auto * L : st->layers) { // a mapped layer's device read its misses from the host copy: nothing to redo
        const int32_t * slots = into[L->table] + pyspecter_log_offset(L, st->n_tokens);
        missed = missed || (!pyspecter_is_mapped(L) && any_zero(L, slots, n_rows));
    }
    s->counters.spec_ubatches++;
    st->last_hit = !missed;
    if (missed) {
        s->counters.spec_redos++;
        st->backoff = std::min(MAX_BACKOFF, std::max(1, 2 * st->backoff));
        st->skip = st->backoff;
        st->redo = true;
        return true;
    }
    st->backoff = 0;
    // every row hit, or a mapped layer's device read it: the host-side routing of each layer, in forward order, from
    // the logs read above. The ubatch has run (the wait above), so no slot path reads a table again before the next
    // fence pushes it: an eviction decided now need not reach the device at once (pyspecter_mark_passed), which
    // would put a copy to the device (queued behind uploads in flight) between this ubatch and the next
    const int64_t t0 = pyspecter_now_ns();
    for (auto * L : st->layers) {
        pyspecter_mark_passed(L);
    }
    for (auto * L : st->layers) {
        pyspecter_route_settled(L, into[L->table] + pyspecter_log_offset(L, st->n_tokens),
                                st->n_tokens, n_used);
    }
    pyspecter_count_settle(pyspecter_now_ns() - t0);
    return false;
}
