// Native residency: inside a MoE layer the routing op looks up residency, picks victims, starts reads and hands
// misses to the host path without leaving C. This file keeps the slot table (every write to it goes through the
// residency_* functions here), the planner's side and the API: the control plane configures it, schedules
// prefetches and writes eviction scores between decodes, and reads counters.
//
// Exactness does not depend on anything here: a slot is mapped only once its read has landed whole, so every
// (token, expert) row is computed either from a complete slot or from the host copy, exactly.
//
// The routing call itself (its hits, and its misses by mode) is native_route.cpp's, the read queue and its readers
// io.cpp's, eviction policy.cpp's; their shared state is residency-impl.h's.

#include "residency-impl.h"

#include "llama-impl.h"

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>

//
// the slot table (mu held)
//

// Through pyspecter_remap_set, like every residency change: on a device layer an eviction reaches the device's
// table at once when the layer's slot path may still run in the ubatch in flight.
void residency_map(pyspecter_residency * R, llama_pyspecter_layer * L, int32_t expert, int32_t slot) {
    pyspecter_remap_set(L, expert, slot);
    L->last_use[slot] = L->loaded[slot] = R->clock;
}

void residency_layer_init(llama_pyspecter_layer * L, int32_t n_usable) {
    const size_t n_slots = L->owner.size(), E = L->remap.size();
    L->last_use.assign(n_slots, 0);
    L->loaded.assign(n_slots, 0);
    L->pending.assign(n_slots, nullptr);
    L->freq.assign(E, 0);
    L->mark.assign(E, 0);
    L->n_usable = n_usable;
}

void residency_append(pyspecter_residency * R, llama_pyspecter_layer * L) {
    if (!R->order.empty()) {
        R->order.back()->next = L;
    }
    R->order.push_back(L);
}

void residency_call_begin(pyspecter_residency * R, llama_pyspecter_layer * L) {
    L->prev_call = L->last_call;
    L->last_call = R->clock;
}

// The call's distinct experts, in ascending order (misses are served in expert order: one answer for one routing),
// marked in L->mark and counted in L->freq.
void residency_needed(llama_pyspecter_layer * L, const int32_t * ids, int32_t n, std::vector<int32_t> & needed) {
    const int32_t E = (int32_t) L->remap.size();
    std::fill(L->mark.begin(), L->mark.end(), 0);
    needed.clear();
    for (int32_t i = 0; i < n; ++i) {
        const int32_t e = ids[i];
        if (e >= 0 && e < E && !L->mark[e]) {
            L->mark[e] = 1;
            needed.push_back(e);
        }
    }
    std::sort(needed.begin(), needed.end());
    for (int32_t e : needed) {
        L->freq[e]++;
    }
}

// Hits refresh their slot's last use; the rest are the call's misses.
void residency_hits(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<int32_t> & needed,
                   std::vector<int32_t> & missing) {
    missing.clear();
    for (int32_t e : needed) {
        const int32_t slot = L->remap[e];
        if (slot >= 0) {
            L->last_use[slot] = R->clock;
        } else {
            missing.push_back(e);
        }
    }
    L->route_missed = !missing.empty();
}

std::shared_ptr<pyspecter_read> residency_pend(llama_pyspecter_layer * L, int32_t expert, int32_t slot) {
    auto r = std::make_shared<pyspecter_read>();
    r->L = L;
    r->expert = expert;
    r->slot = slot;
    L->pending[slot] = r;
    return r;
}

void residency_land(pyspecter_residency * R, llama_pyspecter_layer * L, int32_t slot) {
    const auto r = L->pending[slot];
    L->pending[slot].reset();
    residency_map(R, L, r->expert, slot);
}

void residency_evict(llama_pyspecter_layer * L, int32_t slot) {
    const int32_t prev = L->owner[slot];
    if (prev >= 0) {
        pyspecter_remap_set(L, prev, -1);
    }
}

// Maps every read of L that has landed; a failed one leaves its slot free and its expert a miss.
void residency_reap(pyspecter_residency * R, llama_pyspecter_layer * L) {
    for (int32_t slot = 0; slot < (int32_t) L->pending.size(); ++slot) {
        auto & r = L->pending[slot];
        if (r && r->done) {
            if (!r->failed) {
                residency_map(R, L, r->expert, slot);
            } else if (!r->dropped) {
                L->parent->counters.upload_failures++;
            }
            r.reset();
        }
    }
}

pyspecter_read * residency_inflight(const llama_pyspecter_layer * L, int32_t expert) {
    for (const auto & r : L->pending) {
        if (r && r->expert == expert && !r->dropped) { // a dropped one never lands: read the expert anew
            return r.get();
        }
    }
    return nullptr;
}

std::shared_ptr<pyspecter_read> residency_start_read(pyspecter_residency * R, llama_pyspecter_layer * L,
                                                     int32_t expert, int32_t slot, int32_t cls, float priority,
                                                     int64_t deadline) {
    auto r = residency_pend(L, expert, slot);
    r->cls = cls;
    r->priority = priority;
    r->deadline = deadline;
    L->parent->counters.uploads++;
    R->push(r);
    return r;
}

// Reads `want` of L ahead of need into slots not holding any of them; returns how many reads it started.
static int32_t upload_ahead(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<int32_t> & want,
                            int32_t cls, float priority = 0.0f, int64_t deadline = 0) {
    std::vector<uint8_t> & keep = R->keep;
    keep.assign(L->remap.size(), 0);
    for (int32_t e : want) {
        keep[e] = 1;
    }
    int32_t issued = 0;
    for (int32_t e : want) {
        if (L->remap[e] >= 0 || residency_inflight(L, e)) {
            continue;
        }
        const int32_t slot = victim(R, L, keep, nullptr, false);
        if (slot < 0) {
            break;
        }
        residency_evict(L, slot);
        // in the background: only the prefill lookahead reads ahead so (schedule's reads are prefetches)
        residency_start_read(R, L, e, slot, cls, priority, deadline)->lookahead = cls == CLS_BACKGROUND;
        ++issued;
    }
    L->parent->counters.prefetches += issued;
    return issued;
}

// A prompt's ubatch routes its many tokens to most experts of every layer, so the next layer will want about as
// many as this one: start reading its most used ones now, while this layer computes, and have the kernel read
// ahead what does not fit for the host path's page faults.
void residency_prefill_lookahead(pyspecter_residency * R, llama_pyspecter_layer * L, int32_t n_needed) {
    llama_pyspecter_layer * N = L->next;
    if (!N) {
        return;
    }
    std::vector<int32_t> want(N->remap.size());
    for (int32_t e = 0; e < (int32_t) want.size(); ++e) {
        want[e] = e;
    }
    std::stable_sort(want.begin(), want.end(), [&](int32_t a, int32_t b) { return N->freq[a] > N->freq[b]; });
    want.resize(std::min<size_t>(want.size(), (size_t) n_needed));
    N->parent->counters.lookahead += upload_ahead(R, N, want, CLS_BACKGROUND);
    if (R->p.fd >= 0) {
        for (int32_t e : want) {
            if (N->remap[e] < 0 && !residency_inflight(N, e)) {
                auto r = std::make_shared<pyspecter_read>();
                r->L = N;
                r->expert = e;
                r->cls = CLS_ADVISE;
                R->push(r, /*advise=*/true);
            }
        }
    }
}

// The prefill lookahead's reads for this call (started at the layer before, in the same ubatch) of experts the call
// does not need are stale: their queued chunks are taken back; one none of whose chunks started frees its slot now,
// one partly read when its last chunk on the wire has finished (unmapped). Left queued they were read after the
// ubatch, into slots for wrong guesses, taking the link from the next calls' misses; and a prompt's leftovers landed
// in the decode after it and counted there, as many as the readers had not drained yet: the decode's bytes then
// moved with timing, from run to run and from one I/O backend to the other.
void residency_drop_stale_lookahead(pyspecter_residency * R, llama_pyspecter_layer * L) {
    for (auto & r : L->pending) {
        if (r && r->lookahead && !r->dropped && !L->mark[r->expert] && R->drop(r.get())) {
            r.reset(); // its slot was evicted when the read was scheduled: free again
            L->parent->counters.uploads--;
        }
    }
}

// Disk tier: a change from prompt to decode gives every layer's expert pages back in one queued advice; during a
// prompt the layers routed since their pages last went give theirs back; this call's host rows may fault L's in.
void residency_host_pages(pyspecter_residency * R, llama_pyspecter_layer * L, int32_t n_tokens) {
    if (n_tokens != R->prev_tokens) {
        if (n_tokens == 1 && R->prev_tokens > 1 && R->p.fd >= 0) {
            // on a reader: the page-cache drop over every layer's experts (smol-moe: 90 fadvise calls, tens of ms
            // of system time) made this op the first decode token's stall
            auto r = std::make_shared<pyspecter_read>();
            r->cls = CLS_ADVISE;
            R->push(r, /*advise=*/false, /*release=*/true);
        }
        R->prev_tokens = n_tokens;
    }
    if (n_tokens > 1 && R->p.fd >= 0) {
        // the earlier layers' host matmuls of this prompt are done: their faulted-in expert pages go again; only
        // layers routed since their pages last went can have any (a prompt's layer call: one or two layers'
        // madvise calls, not every layer's)
        for (auto * M : R->order) {
            if (M->host_touched) {
                pyspecter_release_layer_experts(M);
                M->host_touched = false;
            }
        }
    }
    L->host_touched = true; // this call's host rows may fault its pages in
}

// A queued read of L taken back before any of its chunks started: its slot, evicted when the read was scheduled,
// is free again. False: it has started, and will land.
bool residency_take_back(pyspecter_residency * R, llama_pyspecter_layer * L, pyspecter_read * r) {
    if (!R->take_back(r)) {
        return false;
    }
    auto & c = L->parent->counters;
    L->pending[r->slot].reset(); // r is freed here
    c.uploads--;
    c.taken_back++;
    return true;
}

bool pyspecter_native_enabled(const llama_pyspecter_slots * s) {
    return s && s->res;
}

std::unique_lock<std::mutex> pyspecter_native_lock(llama_pyspecter_slots * s) {
    return s && s->res ? std::unique_lock<std::mutex>(s->res->mu) : std::unique_lock<std::mutex>();
}

//
// the planner's side (planner.cpp calls these from the routing op, R->mu held)
//

static constexpr float RECENCY = 0.5f; // chance an expert a layer just used is needed at its next call (plan floor)

bool pyspecter_native_room(const llama_pyspecter_layer * D) {
    int32_t held = 0; // resident or on their way
    bool slot = false;
    for (int32_t s = 0; s < (int32_t) D->owner.size(); ++s) {
        const int32_t e = D->owner[s];
        held += e >= 0 || D->pending[s] != nullptr;
        slot = slot || (s < D->n_usable && !D->pending[s] && (e < 0 || !D->prot[e]));
    }
    return slot && held < (int32_t) D->remap.size();
}

bool pyspecter_native_prefetch(llama_pyspecter_layer * D, int32_t e, float p, int32_t h, const float * probs) {
    pyspecter_residency * R = D->parent->res.get();
    if (D->remap[e] >= 0 || residency_inflight(D, e)) {
        return false;
    }
    // the victim: a free slot, else the resident least likely to be needed (an expert D used at its latest call
    // keeps the recency floor), least recently used among equals; never one at least as likely as e
    int32_t best = -1;
    float best_v = 0.0f;
    for (int32_t s = 0; s < D->n_usable; ++s) {
        if (D->pending[s]) {
            continue;
        }
        const int32_t o = D->owner[s];
        if (o < 0) {
            best = s;
            best_v = -1.0f;
            break;
        }
        if (D->prot[o]) {
            continue;
        }
        const float v = std::max(probs[o], D->last_call && D->last_use[s] == D->last_call ? RECENCY : 0.0f);
        if (best < 0 || v < best_v || (v == best_v && D->last_use[s] < D->last_use[best])) {
            best = s;
            best_v = v;
        }
    }
    if (best < 0 || best_v >= p) {
        D->parent->counters.ahead_refused++;
        return false;
    }
    residency_evict(D, best);
    residency_start_read(R, D, e, best, CLS_PREFETCH, p, (int64_t) R->clock + h);
    D->parent->counters.prefetches++;
    return true;
}

void pyspecter_set_native_plan(llama_pyspecter_slots * s, pyspecter_plan_fn plan) {
    if (s && s->res) {
        s->res->plan = plan;
    }
}

bool pyspecter_native_take_back_prefetch(llama_pyspecter_layer * D, int32_t e) {
    pyspecter_read * r = residency_inflight(D, e);
    if (!r || r->cls != CLS_PREFETCH || !D->parent->res->cancel(r)) {
        return false;
    }
    D->pending[r->slot].reset(); // its slot was evicted when the read was scheduled: free again
    D->parent->counters.uploads--;
    return true;
}

float pyspecter_native_min_prob(const llama_pyspecter_slots * s) {
    return s && s->res && s->res->planner ? s->res->min_prob : -1.0f;
}

bool pyspecter_native_wants_input(const llama_pyspecter_slots * s) {
    if (!s || !s->res) {
        return false;
    }
    for (auto * L : s->res->order) {
        if (!L->reuse_R.empty() || !L->ahead.empty()) {
            return true;
        }
    }
    return false;
}

static void free_residency(pyspecter_residency * r) noexcept {
    delete r; // stops the readers first (~pyspecter_residency)
}

bool pyspecter_native_late(const llama_pyspecter_slots * s) {
    return s && s->res && s->res->p.miss == LLAMA_PYSPECTER_MISS_ORDERED;
}

void pyspecter_native_wait(llama_pyspecter_layer * L) {
    pyspecter_residency * R = L->parent->res.get();
    auto & c = L->parent->counters;
    pyspecter_op_timer timer(c, PYSPECTER_OP_WAIT); // the wait op is routing work too: its time joins the routing op's
    std::lock_guard<std::mutex> lk(R->mu);
    auto & late = R->loads; // (expert, slot)
    std::vector<pyspecter_read *> & reads = R->reads;
    late.clear();
    reads.clear();
    for (int32_t e = 0; e < (int32_t) L->late.size(); ++e) {
        const int32_t slot = L->late[e];
        if (slot >= 0) {
            late.emplace_back(e, slot);
            if (L->pending[slot]) {
                reads.push_back(L->pending[slot].get());
            }
        }
    }
    R->wait_all(reads);
    residency_reap(R, L);
    // A late expert whose read failed is not resident, yet the graph computes its rows from its slot: read it
    // again, here; if that fails too, this ubatch's output is wrong, which the control plane reports as an error.
    bool settled = true;
    for (auto [e, slot] : late) {
        if (L->remap[e] == slot) {
            continue;
        }
        int32_t rc = LLAMA_PYSPECTER_OK;
        if (R->p.fd < 0) {
            rc = pyspecter_run_copy(c, [&] {
                return R->faults.apply(L, -1, slot, 0, 0, [&] { return pyspecter_load_one(L, e, slot); });
            });
        } else {
            void * buf = nullptr;
            if (posix_memalign(&buf, 4096, R->buf_size) != 0) {
                rc = LLAMA_PYSPECTER_ERR_NO_MEMORY;
            }
            for (int k = 0; k < LLAMA_PYSPECTER_N_KINDS && rc == LLAMA_PYSPECTER_OK; ++k) {
                if (L->host[k]) {
                    const int64_t off = L->file_off[k] + (int64_t) (L->host[k]->nb[2] * e);
                    rc = pyspecter_run_copy(c, [&] {
                        return R->faults.apply(L, k, slot, 0, (int64_t) L->host[k]->nb[2], [&] {
                            return pyspecter_read_one(L, k, slot, R->p.fd, off, buf, R->buf_size, R->p.drop_cache);
                        });
                    });
                }
            }
            free(buf);
        }
        if (rc == LLAMA_PYSPECTER_OK) {
            residency_map(R, L, e, slot);
        } else {
            c.late_lost++;
            settled = false; // the next kind's wait op tries again
        }
    }
    pyspecter_late_settle(L, settled);
}

//
// API
//

int32_t llama_pyspecter_residency_init(llama_model * model, const llama_pyspecter_residency_params * params) {
    auto * s = pyspecter_slots_of(model);
    if (!s || !params) {
        return s ? LLAMA_PYSPECTER_ERR_ARG : LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    if (s->res) {
        return LLAMA_PYSPECTER_ERR_ENABLED;
    }
    if (params->policy < LLAMA_PYSPECTER_POLICY_LRU || params->policy > LLAMA_PYSPECTER_POLICY_SCORE ||
            params->miss < LLAMA_PYSPECTER_MISS_CPU || params->miss > LLAMA_PYSPECTER_MISS_SURROGATE ||
            params->io < LLAMA_PYSPECTER_IO_AUTO || params->io > LLAMA_PYSPECTER_IO_THREADS) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    return pyspecter_guarded(__func__, [&]() -> int32_t {
        std::unique_ptr<pyspecter_residency, llama_pyspecter_slots::residency_free> R(new pyspecter_residency(),
                                                                                free_residency);
        R->s = s;
        R->p = *params;
        size_t biggest = 0;
        for (auto & L : s->layers) {
            if (!L) {
                continue;
            }
            const size_t n_slots = L->owner.size();
            residency_layer_init(L.get(), (int32_t) n_slots);
            policy_layer_init(L.get());
            L->host_touched = true; // loading may have faulted its pages in (mmap pre-faults): a prompt frees them
            for (int32_t slot = 0; slot < (int32_t) n_slots; ++slot) {
                if (L->owner[slot] >= 0) { // set_slot before: keep it (a warm start)
                    L->loaded[slot] = 0;
                }
            }
            residency_append(R.get(), L.get());
            for (auto * h : L->host) {
                biggest = std::max(biggest, h ? (size_t) h->nb[2] : (size_t) 0);
            }
        }
        R->buf_size = (biggest + 2 * 4096 + 4095) / 4096 * 4096;
        const int64_t chunk = params->read_chunk > 0 ? params->read_chunk : 256 * 1024;
        R->chunk = (chunk + PYSPECTER_IO_ALIGN - 1) / PYSPECTER_IO_ALIGN * PYSPECTER_IO_ALIGN;
        R->read_buf = std::min(R->buf_size, (size_t) R->chunk);
        R->max_chunks = LLAMA_PYSPECTER_N_KINDS * ((R->buf_size + (size_t) R->chunk - 1) / (size_t) R->chunk);
        // from RAM to a device's upload stream, a reader per batch in flight: each awaits its batch's landing
        R->start(std::max(params->fd < 0 && !s->streams.empty() ? PYSPECTER_UPLOADS_IN_FLIGHT : 1, params->n_readers));
        s->res = std::move(R);
        return LLAMA_PYSPECTER_OK;
    });
}

bool llama_pyspecter_residency_enabled(const llama_model * model) {
    return pyspecter_native_enabled(pyspecter_slots_of(model));
}

int32_t llama_pyspecter_set_usable(llama_model * model, int32_t il, int32_t n) {
    auto * R = residency_of(model);
    auto * L = pyspecter_layer_of(model, il);
    if (!R || !L || n < 0 || n > (int32_t) L->owner.size()) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    std::lock_guard<std::mutex> lk(R->mu);
    for (int32_t slot = n; slot < (int32_t) L->owner.size(); ++slot) {
        if (!L->pending[slot]) { // one being filled stays until it lands; it is then simply not handed out again
            residency_evict(L, slot);
        }
    }
    L->n_usable = n;
    return LLAMA_PYSPECTER_OK;
}

int32_t llama_pyspecter_release_held(llama_model * model) {
    auto * R = residency_of(model);
    if (!R) {
        return LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    std::lock_guard<std::mutex> lk(R->mu);
    int32_t released = 0;
    for (auto * L : R->order) {
        released += L->n_held;
        L->n_usable += L->n_held;
        policy_release_held(L); // the draft's slots, its ghost and its predictions go
        // the dropped draft's predictions still queued were for windows already verified: what the next tokens
        // need is read on demand, ahead of nothing stale
        for (auto & r : L->pending) {
            if (r && r->cls == CLS_PREFETCH && R->cancel(r.get())) {
                r.reset(); // its slot was evicted when the read was scheduled: free again
                L->parent->counters.uploads--;
            }
        }
    }
    return released;
}

int32_t llama_pyspecter_schedule(llama_model * model, int32_t il, int32_t expert, float priority, int32_t deadline) {
    auto * R = residency_of(model);
    auto * L = pyspecter_layer_of(model, il);
    if (!R || !L || expert < 0 || expert >= (int32_t) L->remap.size()) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    if (R->p.miss == LLAMA_PYSPECTER_MISS_HOST) {
        return 0; // a prefetch into a slot the host computes no faster from: nothing queued
    }
    try {
        std::lock_guard<std::mutex> lk(R->mu);
        residency_reap(R, L);
        return upload_ahead(R, L, { expert }, CLS_PREFETCH, priority, (int64_t) R->clock + deadline);
    } catch (const std::bad_alloc &) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    }
}

int32_t llama_pyspecter_drain(llama_model * model) {
    auto * R = residency_of(model);
    if (!R) {
        return LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    try {
        std::lock_guard<std::mutex> lk(R->mu);
        std::vector<pyspecter_read *> all;
        for (auto * L : R->order) {
            for (auto & r : L->pending) {
                if (r) {
                    all.push_back(r.get());
                }
            }
        }
        R->wait_all(all, /*stall=*/false);
        for (auto * L : R->order) {
            residency_reap(R, L);
        }
        return LLAMA_PYSPECTER_OK;
    } catch (const std::bad_alloc &) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    }
}
