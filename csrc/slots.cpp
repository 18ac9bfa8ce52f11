// Slot allocation, the residency (remap) table and the queries on it.

#include "pyspecter-impl.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <new>
#include <string>

llama_pyspecter_slots::~llama_pyspecter_slots() {
    res.reset(); // before any buffer goes: its readers' queued or running copies write into them
    uploads.stop();
    streams.clear(); // every batch has been awaited: nothing is in flight on them
    for (auto * b : bufs) {
        ggml_backend_buffer_free(b);
    }
    for (auto * b : mapped_bufs) {
        ggml_backend_buffer_free(b);
    }
    for (auto & tab : tables) {
        if (tab.log_host) {
            ggml_backend_buffer_free(tab.log_host);
        }
    }
    for (auto * c : ctxs) {
        ggml_free(c);
    }
}

llama_pyspecter_slots * pyspecter_slots_of(const llama_model * model) {
    return model ? model->pyspecter_slots.get() : nullptr;
}

llama_pyspecter_layer * pyspecter_layer_of(const llama_model * model, int32_t il) {
    auto * s = pyspecter_slots_of(model);
    return s && il >= 0 && il < (int32_t) s->layers.size() ? s->layers[il].get() : nullptr;
}

void pyspecter_host_experts(const llama_model * model, int32_t il, ggml_tensor * out[LLAMA_PYSPECTER_N_KINDS]) {
    const llama_layer & l = model->layers[il];
    out[LLAMA_PYSPECTER_KIND_GATE]    = l.ffn_gate_exps;
    out[LLAMA_PYSPECTER_KIND_UP]      = l.ffn_up_exps;
    out[LLAMA_PYSPECTER_KIND_DOWN]    = l.ffn_down_exps;
    out[LLAMA_PYSPECTER_KIND_GATE_UP] = l.ffn_gate_up_exps;
}

bool pyspecter_is_repacked(const ggml_tensor * t) {
    if (!t->buffer || ggml_backend_buffer_is_host(t->buffer)) {
        return false;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
    return dev && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
}

//
// upload streams: one per device, made with its first slots (uploads.cpp issues the copies on them)
//

pyspecter_upload_stream::~pyspecter_upload_stream() {
    for (auto * ev : events) {
        ggml_backend_event_free(ev);
    }
    if (after_compute) {
        ggml_backend_event_free(after_compute);
    }
    if (backend) {
        ggml_backend_free(backend);
    }
}

pyspecter_upload_stream * pyspecter_upload_stream_for(llama_pyspecter_slots * s, ggml_backend_dev_t dev) {
    if (!dev || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
        return nullptr;
    }
    for (auto & st : s->streams) {
        if (st->dev == dev) {
            return st.get();
        }
    }
    const char * sync = std::getenv("SPECTER_SYNC_UPLOADS");
    if (sync && *sync && std::string(sync) != "0") {
        return nullptr;
    }
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    if (!props.caps.async || !props.caps.events) {
        return nullptr; // checked at run time: a device without them keeps synchronous copies
    }
    auto st = std::make_unique<pyspecter_upload_stream>();
    st->dev     = dev;
    st->backend = ggml_backend_dev_init(dev, nullptr);
    bool made = st->backend != nullptr;
    for (int32_t i = 0; made && i < PYSPECTER_UPLOADS_IN_FLIGHT; ++i) {
        ggml_backend_event_t ev = ggml_backend_event_new(dev);
        made = ev != nullptr;
        if (made) {
            st->events.push_back(ev);
        }
    }
    st->free_events = st->events;
    st->after_compute = made ? ggml_backend_event_new(dev) : nullptr;
    if (!st->after_compute) {
        LLAMA_LOG_WARN("pyspecter: %s: no upload stream of its own, uploads stay synchronous\n",
                ggml_backend_dev_name(dev));
        return nullptr; // st frees what it got
    }
    s->streams.push_back(std::move(st));
    return s->streams.back().get();
}

// The per-expert tensors of layer il the expert FFN reads beside the matmul weights (biases, scales).
static void layer_small_tensors(const llama_model * model, int32_t il, std::vector<ggml_tensor *> & out) {
    const llama_layer & l = model->layers[il];
    for (ggml_tensor * t : { l.ffn_gate_exps_b, l.ffn_up_exps_b, l.ffn_down_exps_b, l.ffn_gate_up_exps_b,
                             l.ffn_gate_exps_s, l.ffn_up_exps_s, l.ffn_down_exps_s }) {
        if (t) {
            out.push_back(t);
        }
    }
}

static bool in_host_memory(const ggml_tensor * t) {
    return t->buffer && ggml_backend_buffer_is_host(t->buffer);
}

int32_t llama_pyspecter_zero_slots(ggml_backend_dev_t dev, int32_t n_used) {
    if (!dev || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
        return 0; // its kernel (patch 0001) makes every negative id a zero row
    }
    const char * env = std::getenv("SPECTER_ZERO_SLOTS"); // the zero-slot path on any device, for tests and A/B runs
    if (env && std::string(env) == "1") {
        return n_used;
    }
    // CUDA's kernels take a negative id in a marked op (patch 0008); an RPC server's are the CPU's (pyspecter
    // rpc-server: patch 0001). Any other backend's kernel would read out of bounds
    const std::string reg = ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev));
    return reg == "CUDA" || reg.rfind("RPC", 0) == 0 ? 0 : n_used;
}

// One MoE layer's slots: a tensor per expert kind, n_alloc experts deep, in one buffer of the layer's device; on a
// device also a copy of the layer's small per-expert tensors that stay in host memory (the slot path reads them).
static int32_t alloc_layer(llama_model * model, llama_pyspecter_slots * s, int32_t il,
                           ggml_tensor * const host[LLAMA_PYSPECTER_N_KINDS]) {
    ggml_backend_dev_t dev = model->dev_layer(il);
    const bool on_cpu = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    // where a kernel takes neither a negative id nor an id twice in a token, misses point at zero slots, one per
    // row of a token; elsewhere at a negative id, which computes nothing (pyspecter_miss_id)
    const int32_t n_zero  = llama_pyspecter_zero_slots(dev, s->n_used);
    const int32_t n_alloc = s->n_slots + n_zero;
    std::vector<ggml_tensor *> small;
    if (!on_cpu) {
        layer_small_tensors(model, il, small);
        small.erase(std::remove_if(small.begin(), small.end(), [](ggml_tensor * t) { return !in_host_memory(t); }),
                    small.end());
    }

    ggml_init_params ip = { ggml_tensor_overhead() * (LLAMA_PYSPECTER_N_KINDS + small.size()), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    if (!ctx) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    }
    s->ctxs.push_back(ctx);

    auto L = std::make_unique<llama_pyspecter_layer>();
    pyspecter_table_init(L.get(), il, s, s->n_expert, s->n_slots);
    L->miss_slot = on_cpu ? -1 : s->n_slots;
    L->n_zero = n_zero;
    L->stream = on_cpu ? nullptr : pyspecter_upload_stream_for(s, dev);
    L->dev = dev;
    for (int k = 0; k < LLAMA_PYSPECTER_N_KINDS; ++k) {
        ggml_tensor * h = host[k];
        if (!h) {
            continue;
        }
        if (pyspecter_is_repacked(h)) {
            LLAMA_LOG_ERROR("%s: %s is in a repacked CPU buffer; load the model with use_extra_bufts = false\n",
                    __func__, h->name);
            return LLAMA_PYSPECTER_ERR_REPACKED;
        }
        if (h->ne[2] != s->n_expert || h->ne[3] != 1) {
            LLAMA_LOG_ERROR("%s: %s has %lld experts, expected %d\n", __func__, h->name, (long long) h->ne[2],
                    s->n_expert);
            return LLAMA_PYSPECTER_ERR_LAYOUT;
        }
        ggml_tensor * t = ggml_new_tensor_3d(ctx, h->type, h->ne[0], h->ne[1], n_alloc);
        ggml_format_name(t, "%s.slots", h->name);
        L->host[k] = h;
        L->slot[k] = t;
        s->slot_of_host[h] = { L.get(), k };
    }
    std::vector<std::pair<ggml_tensor *, ggml_tensor *>> copies;
    for (ggml_tensor * h : small) {
        ggml_tensor * t = ggml_dup_tensor(ctx, h);
        ggml_format_name(t, "%s.dev", h->name);
        copies.emplace_back(h, t);
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_dev_buffer_type(dev));
    if (!buf) {
        LLAMA_LOG_ERROR("%s: cannot allocate expert slots for layer %d\n", __func__, il);
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    }
    s->bufs.push_back(buf);
    // weights usage makes the scheduler run the slot matmul where the slots live
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    // A device layer's zero slots are written zero explicitly; its other slots are read only once an upload wrote
    // them, so they start as zeros, or as NaN under SPECTER_POISON_SLOTS=1, where any read of a slot before its
    // upload turns the logits NaN (a GPU's fresh memory is garbage; the RPC server's starts zeroed and hides it).
    // CPU slots are left untouched, so slots never written take no memory: the engine allocates as many as the
    // budget buys without the draft and uses them only once the draft is gone.
    if (!on_cpu) {
        ggml_backend_buffer_clear(buf, s->poison ? 0xFF : 0);
        for (ggml_tensor * t : L->slot) {
            if (t && n_zero > 0) {
                ggml_backend_tensor_memset(t, 0, (size_t) s->n_slots * t->nb[2], (size_t) n_zero * t->nb[2]);
            }
        }
    }
    for (auto & [h, t] : copies) {
        ggml_backend_tensor_set(t, h->data, 0, ggml_nbytes(h));
        s->on_device[h] = t;
    }
    s->layers[il] = std::move(L);
    return LLAMA_PYSPECTER_OK;
}

// Layer L's row of its table (pyspecter-impl.h) from its remap: plane j holds (slot, expert) per expert, and where
// not resident what a miss reads (pyspecter_miss_id: zero slot j, or ~expert). Returns whether anything changed.
// Every id written is checked against the slot tensor here, where the device's ids are made: a kernel must never
// see one outside it.
static bool fill_row(llama_pyspecter_layer * L, int32_t * row) {
    const int32_t E = L->parent->n_expert;
    // the planes differ only in which zero slot a non-resident expert reads, so plane 0 says whether anything
    // changed: at a fence with nothing landed (most decode steps) this costs n_expert compares per layer, not more
    bool changed = false;
    for (int32_t j = 0; j < L->parent->n_used && (j == 0 || changed); ++j) {
        for (int32_t e = 0; e < E; ++e) {
            const int32_t v = L->remap[e] >= 0 ? L->remap[e] : pyspecter_miss_id(L, j, e);
            GGML_ASSERT(pyspecter_valid_slot_id(L, v));
            int32_t * pair = row + 2 * ((size_t) j * E + e);
            changed |= pair[0] != v || pair[1] != e;
            pair[0] = v;
            pair[1] = e;
        }
    }
    return changed;
}

static size_t row_len(const llama_pyspecter_slots * s) {
    return (size_t) 2 * s->n_expert * s->n_used;
}

// The remap tables of device layers: one per device buffer type (pyspecter-impl.h), nothing resident at first.
static int32_t alloc_tables(llama_model * model, llama_pyspecter_slots * s) {
    std::vector<ggml_backend_buffer_type_t> bufts;
    for (int32_t il = 0; il < (int32_t) s->layers.size(); ++il) {
        auto * L = s->layers[il].get();
        if (!L || L->miss_slot < 0) {
            continue;
        }
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(model->dev_layer(il));
        auto it = std::find(bufts.begin(), bufts.end(), buft);
        L->table = (int32_t) (it - bufts.begin());
        L->table_row = il;
        if (it == bufts.end()) {
            bufts.push_back(buft);
        }
    }
    for (auto * buft : bufts) {
        ggml_init_params ip = { 2 * ggml_tensor_overhead(), nullptr, true };
        ggml_context * ctx = ggml_init(ip);
        if (!ctx) {
            return LLAMA_PYSPECTER_ERR_NO_MEMORY;
        }
        s->ctxs.push_back(ctx);
        llama_pyspecter_table tab;
        tab.t = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, (int64_t) row_len(s), (int64_t) s->layers.size());
        ggml_format_name(tab.t, "pyspecter.remap.%zu", s->tables.size());
        tab.spec_log = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) 2 * s->n_used * PYSPECTER_LOG_MAX_TOKENS *
                                                                  (int64_t) s->layers.size());
        ggml_format_name(tab.spec_log, "pyspecter.spec_log.%zu", s->tables.size());
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
        if (!buf) {
            return LLAMA_PYSPECTER_ERR_NO_MEMORY;
        }
        s->bufs.push_back(buf);
        ggml_backend_buffer_clear(buf, 0);
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS); // get_rows runs on the device
        tab.image.assign(row_len(s) * s->layers.size(), 0);
        s->tables.push_back(std::move(tab));
    }
    for (auto & L : s->layers) {
        if (L && L->table >= 0) {
            fill_row(L.get(), s->tables[L->table].image.data() + row_len(s) * L->table_row);
        }
    }
    for (auto & tab : s->tables) {
        ggml_backend_tensor_set(tab.t, tab.image.data(), 0, tab.image.size() * sizeof(int32_t));
    }
    return LLAMA_PYSPECTER_OK;
}

static int32_t alloc_cpu_anchor(llama_pyspecter_slots * s) {
    ggml_init_params ip = { ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    if (!ctx) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    }
    s->ctxs.push_back(ctx);
    s->cpu_anchor = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 1);
    ggml_set_name(s->cpu_anchor, "pyspecter.cpu_anchor");
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_cpu_buffer_type());
    if (!buf) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    }
    s->bufs.push_back(buf);
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_buffer_clear(buf, 0);
    return LLAMA_PYSPECTER_OK;
}

int32_t llama_pyspecter_slots_init(llama_model * model, int32_t n_slots) {
    return llama_pyspecter_slots_init_layers(model, n_slots, nullptr, 0);
}

int32_t llama_pyspecter_slots_init_layers(llama_model * model, int32_t n_slots, const int32_t * kinds,
                                          int32_t n_kinds) {
    if (!model || n_slots <= 0 || n_kinds < 0 || (n_kinds > 0 && !kinds)) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    for (int32_t i = 0; i < n_kinds; ++i) {
        if (kinds[i] < LLAMA_PYSPECTER_LAYER_SLOTS || kinds[i] > LLAMA_PYSPECTER_LAYER_FULL) {
            return LLAMA_PYSPECTER_ERR_ARG;
        }
    }
    if (model->pyspecter_slots) {
        return LLAMA_PYSPECTER_ERR_ENABLED;
    }
    const int32_t n_expert = (int32_t) model->hparams.n_expert;
    if (n_expert <= 0) {
        return LLAMA_PYSPECTER_ERR_DENSE;
    }
    return pyspecter_guarded(__func__, [&]() -> int32_t {
        auto s = std::make_shared<llama_pyspecter_slots>();
        s->n_slots  = std::min(n_slots, n_expert);
        s->n_expert = n_expert;
        s->n_used   = std::max<int32_t>(1, (int32_t) model->hparams.n_expert_used_max());
        const char * poison = std::getenv("SPECTER_POISON_SLOTS");
        s->poison   = poison && *poison && std::string(poison) != "0";
        const char * fault = std::getenv("SPECTER_UPLOAD_FAULT_US");
        s->upload_fault_us = fault ? std::max<int64_t>(0, std::atoll(fault)) : 0;
        s->layers.resize(model->layers.size());

        for (int32_t il = 0; il < (int32_t) model->layers.size(); ++il) {
            if (!llama_pyspecter_is_moe_layer(model, il) ||
                    (il < n_kinds && kinds[il] != LLAMA_PYSPECTER_LAYER_SLOTS)) {
                continue; // host and full layers keep stock's graph: their experts are where the model put them
            }
            ggml_tensor * host[LLAMA_PYSPECTER_N_KINDS];
            pyspecter_host_experts(model, il, host);
            const int32_t rc = alloc_layer(model, s.get(), il, host);
            if (rc != LLAMA_PYSPECTER_OK) {
                return rc; // s frees what was allocated so far
            }
        }
        const bool any_device = std::any_of(s->layers.begin(), s->layers.end(), [](const auto & L) {
            return L && L->miss_slot >= 0; // a zero slot: the layer's slots are not on the CPU
        });
        if (any_device) {
            int32_t rc = alloc_cpu_anchor(s.get());
            if (rc == LLAMA_PYSPECTER_OK) {
                rc = alloc_tables(model, s.get());
            }
            if (rc != LLAMA_PYSPECTER_OK) {
                return rc;
            }
        }
        s->uploads.start();
        model->pyspecter_slots = std::move(s);
        return LLAMA_PYSPECTER_OK;
    });
}

int32_t llama_pyspecter_n_slots(const llama_model * model) {
    auto * s = pyspecter_slots_of(model);
    return s ? s->n_slots : 0;
}

bool llama_pyspecter_is_moe_layer(const llama_model * model, int32_t il) {
    if (!model || il < 0 || il >= (int32_t) model->layers.size()) {
        return false;
    }
    ggml_tensor * host[LLAMA_PYSPECTER_N_KINDS];
    pyspecter_host_experts(model, il, host);
    return std::any_of(host, host + LLAMA_PYSPECTER_N_KINDS, [](const ggml_tensor * t) { return t != nullptr; });
}

size_t llama_pyspecter_expert_nbytes(const llama_model * model, int32_t il, int32_t kind) {
    if (!llama_pyspecter_is_moe_layer(model, il) || kind < 0 || kind >= LLAMA_PYSPECTER_N_KINDS) {
        return 0;
    }
    ggml_tensor * host[LLAMA_PYSPECTER_N_KINDS];
    pyspecter_host_experts(model, il, host);
    return host[kind] ? host[kind]->nb[2] : 0;
}

size_t llama_pyspecter_slots_nbytes(const llama_model * model) {
    auto * s = pyspecter_slots_of(model);
    size_t n = 0;
    if (s) {
        for (auto * b : s->bufs) {
            n += ggml_backend_buffer_get_size(b);
        }
    }
    return n;
}

int32_t llama_pyspecter_slot_of(const llama_model * model, int32_t il, int32_t expert) {
    auto * L = pyspecter_layer_of(model, il);
    return L && expert >= 0 && expert < (int32_t) L->remap.size() ? L->remap[expert] : -1;
}

int32_t llama_pyspecter_expert_in(const llama_model * model, int32_t il, int32_t slot) {
    auto * L = pyspecter_layer_of(model, il);
    return L && slot >= 0 && slot < (int32_t) L->owner.size() ? L->owner[slot] : -1;
}

// An expert leaves the device's view of layer L: if the layer's slot path may still run in this ubatch (its route op
// has not started since the last fence), its table entry goes to the zero slot now, before anything can overwrite
// the slot it held. Called with table_mu held.
static void unmap_on_device(llama_pyspecter_layer * L, int32_t expert) {
    auto * s = L->parent;
    if (L->table < 0 || !s->split_built || L->passed) {
        return; // not read from a table, or not again before the next fence, which pushes the change
    }
    auto & tab = s->tables[L->table];
    const size_t row = row_len(s) * L->table_row;
    if (pyspecter_is_zero_slot(L, tab.image[row + 2 * (size_t) expert])) {
        return;
    }
    for (int32_t j = 0; j < s->n_used; ++j) { // one write of the span of the planes the expert is in
        tab.image[row + 2 * ((size_t) j * s->n_expert + expert)] = pyspecter_miss_id(L, j, expert);
    }
    const size_t first = row + 2 * (size_t) expert;
    const size_t n = 2 * (size_t) (s->n_used - 1) * s->n_expert + 1;
    ggml_backend_tensor_set(tab.t, &tab.image[first], first * sizeof(int32_t), n * sizeof(int32_t));
    s->counters.eviction_writes++;
}

void pyspecter_table_init(llama_pyspecter_layer * L, int32_t il, llama_pyspecter_slots * s, int32_t n_expert,
                          int32_t n_slots) {
    L->il = il;
    L->parent = s;
    L->remap.assign((size_t) n_expert, -1);
    L->late.assign((size_t) n_expert, -1);
    L->owner.assign((size_t) n_slots, -1);
    L->read_queued.reset(new std::atomic<bool>[(size_t) n_slots]);
    for (int32_t i = 0; i < n_slots; ++i) {
        L->read_queued[i].store(false, std::memory_order_relaxed);
    }
}

void pyspecter_late_set(llama_pyspecter_layer * L, int32_t expert, int32_t slot) {
    L->late[expert] = slot;
}

void pyspecter_late_reset(llama_pyspecter_layer * L) {
    std::fill(L->late.begin(), L->late.end(), -1);
    L->late_settled.store(false, std::memory_order_relaxed);
}

void pyspecter_late_settle(llama_pyspecter_layer * L, bool settled) {
    L->late_settled.store(settled, std::memory_order_release);
}

void pyspecter_mark_passed(llama_pyspecter_layer * L) {
    L->passed = true;
}

static thread_local bool device_drained = false;

pyspecter_drained_scope::pyspecter_drained_scope() {
    device_drained = true;
}

pyspecter_drained_scope::~pyspecter_drained_scope() {
    device_drained = false;
}

int32_t pyspecter_remap_set(llama_pyspecter_layer * L, int32_t expert, int32_t slot) {
    if (!L || expert < 0 || expert >= (int32_t) L->remap.size() || slot < -1 || slot >= (int32_t) L->owner.size()) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    auto * s = L->parent;
    std::lock_guard<std::mutex> lk(s->table_mu);
    const int32_t old_slot = L->remap[expert];
    if (old_slot >= 0) {
        L->owner[old_slot] = -1;
        if (old_slot != slot) {
            unmap_on_device(L, expert);
        }
        // passed: the slot path has run and no table maps the slot again before the next fence, so nothing queued
        // or to be queued reads these bytes; otherwise the slot path may be queued already with the old table,
        // unless this runs in a route op (device_drained): nothing is queued, and the table was just written. An
        // upload then never records an event on the compute stream from its own thread, which on CUDA could land
        // in a graph being captured there (the capture would abort)
        L->read_queued[old_slot].store(!L->passed && !device_drained, std::memory_order_release);
    }
    if (slot >= 0) {
        const int32_t prev = L->owner[slot];
        if (prev >= 0 && prev != expert) {
            L->remap[prev] = -1;
            unmap_on_device(L, prev);
        }
        L->owner[slot] = expert;
        L->read_queued[slot].store(true, std::memory_order_release);
    }
    L->remap[expert] = slot;
    if (L->table >= 0) {
        s->tables[L->table].dirty = true;
    }
    return LLAMA_PYSPECTER_OK;
}

int32_t llama_pyspecter_set_slot(llama_model * model, int32_t il, int32_t expert, int32_t slot) {
    return pyspecter_remap_set(pyspecter_layer_of(model, il), expert, slot);
}

// The scheduler's backend per device of a device layer. The first time a backend is taken it is synchronised here
// on the compute thread, so its stream exists before an upload thread records an event on it (CUDA makes a
// backend's stream on first use).
ggml_backend_t pyspecter_sched_backend(ggml_backend_sched * sched, ggml_backend_dev_t dev) {
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
        ggml_backend_t b = ggml_backend_sched_get_backend(sched, i);
        if (ggml_backend_get_device(b) == dev) {
            return b;
        }
    }
    return nullptr;
}

static void take_compute_backends(llama_pyspecter_slots * s, ggml_backend_sched * sched) {
    std::lock_guard<std::mutex> lk(s->compute_mu);
    if (s->compute_sched == sched) {
        return;
    }
    s->compute.clear();
    for (auto & L : s->layers) {
        if (!L || L->miss_slot < 0 || std::any_of(s->compute.begin(), s->compute.end(),
                                                  [&](const auto & c) { return c.first == L->dev; })) {
            continue;
        }
        if (ggml_backend_t b = pyspecter_sched_backend(sched, L->dev)) {
            ggml_backend_synchronize(b);
            s->compute.emplace_back(L->dev, b);
        }
    }
    s->compute_sched = sched;
}

void pyspecter_compute_gone(llama_pyspecter_slots * s, const void * sched) {
    std::lock_guard<std::mutex> lk(s->compute_mu);
    if (s->compute_sched == sched) {
        s->compute.clear();
        s->compute_sched = nullptr;
    }
}

void llama_pyspecter_fence(llama_pyspecter_slots * s, ggml_backend_sched * sched) {
    if (!s || s->tables.empty()) {
        return;
    }
    if (sched) {
        take_compute_backends(s, sched);
    }
    std::lock_guard<std::mutex> lk(s->table_mu);
    s->counters.fences++;
    for (auto & tab : s->tables) {
        if (!tab.dirty) {
            continue;
        }
        tab.dirty = false;
        bool changed = false;
        for (auto & L : s->layers) {
            if (!L || L->table < 0 || &s->tables[L->table] != &tab) {
                continue;
            }
            changed |= fill_row(L.get(), tab.image.data() + row_len(s) * L->table_row);
        }
        if (changed) {
            // the device is idle here (the previous ubatch's slot paths have all run): a plain copy is ordered
            ggml_backend_tensor_set(tab.t, tab.image.data(), 0, tab.image.size() * sizeof(int32_t));
            s->counters.table_pushes++;
            s->counters.table_bytes += (int64_t) (tab.image.size() * sizeof(int32_t));
        }
    }
    for (auto & L : s->layers) {
        if (L) {
            L->passed = false;
        }
    }
}

int32_t llama_pyspecter_read_table(const llama_model * model, int32_t il, int32_t * out, int32_t n) {
    auto * s = pyspecter_slots_of(model);
    if (!s) {
        return model ? LLAMA_PYSPECTER_ERR_NO_SLOTS : LLAMA_PYSPECTER_ERR_ARG;
    }
    auto * L = s->layer(il);
    const int32_t len = (int32_t) row_len(s);
    if (!L || L->table < 0 || !out || n < len) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    std::lock_guard<std::mutex> lk(s->table_mu);
    const auto & tab = s->tables[L->table];
    ggml_backend_tensor_get(tab.t, out, (size_t) L->table_row * len * sizeof(int32_t), (size_t) len * sizeof(int32_t));
    return len;
}

int32_t llama_pyspecter_layer_kind(const llama_model * model, int32_t il) {
    if (!llama_pyspecter_is_moe_layer(model, il)) {
        return -1;
    }
    if (pyspecter_layer_of(model, il)) {
        return LLAMA_PYSPECTER_LAYER_SLOTS;
    }
    ggml_tensor * host[LLAMA_PYSPECTER_N_KINDS];
    pyspecter_host_experts(model, il, host);
    for (ggml_tensor * t : host) {
        if (t) {
            return in_host_memory(t) ? LLAMA_PYSPECTER_LAYER_HOST : LLAMA_PYSPECTER_LAYER_FULL;
        }
    }
    return LLAMA_PYSPECTER_LAYER_HOST;
}
