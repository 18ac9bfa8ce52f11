// The routing op's native side (pyspecter_native_route, route.cpp's caller, R->mu held): a call's needed experts,
// its hits, and its misses by mode: waited for as reads into slots (wait), late experts read behind the layer's
// other rows (ordered), read in the background while the host computes them (cpu), or computed from their
// surrogates (surrogate, approximate). The slot table is residency.cpp's: every write goes through its
// residency_* functions, and a read lands whole before its slot is mapped (residency_reap).

#include "residency-impl.h"

// A slot for a miss the routing op is about to wait for; when every candidate is still being filled, let the
// reads of experts not needed now land first (waiting for a needed one gains no slot). -1: none.
static int32_t slot_for_miss(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<uint8_t> & needed,
                             const std::vector<uint8_t> & taken) {
    int32_t slot = victim(R, L, needed, &taken, true);
    if (slot >= 0) {
        return slot;
    }
    std::vector<pyspecter_read *> & landing = R->freeing;
    landing.clear();
    for (const auto & r : L->pending) {
        if (r && !needed[r->expert]) {
            landing.push_back(r.get());
        }
    }
    if (landing.empty()) {
        return -1;
    }
    R->wait_all(landing);
    residency_reap(R, L);
    return victim(R, L, needed, &taken, true);
}

static void miss_wait(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<int32_t> & missing) {
    auto & c = L->parent->counters;
    // queued prefetches of these experts are taken back and read now; started ones become demand reads
    std::vector<pyspecter_read *> & landing = R->landing;
    landing.clear();
    for (int32_t e : missing) {
        pyspecter_read * r = residency_inflight(L, e);
        if (!r) {
            continue;
        }
        if (!residency_take_back(R, L, r)) {
            landing.push_back(r);
        }
    }
    if (!landing.empty()) {
        R->wait_all(landing);
        c.waited += (int64_t) landing.size();
        residency_reap(R, L);
    }
    std::vector<uint8_t> & taken = R->taken;
    taken.assign(L->owner.size(), 0);
    auto & loads = R->loads; // (expert, slot)
    loads.clear();
    for (int32_t e : missing) {
        if (L->remap[e] >= 0) {
            continue;
        }
        const int32_t slot = slot_for_miss(R, L, L->mark, taken);
        if (slot < 0) { // more distinct experts in this ubatch than slots: the host computes the rest
            c.overflow++;
            continue;
        }
        residency_evict(L, slot);
        taken[slot] = 1;
        loads.emplace_back(e, slot);
    }
    if (loads.empty()) {
        return;
    }
    if (R->p.fd < 0) {
        // from RAM: a copy on this thread costs less than the hand-off to a reader it would wait for anyway; the
        // call's misses go out as one batch, one event awaited for all of them
        const int64_t t0 = pyspecter_now_ns(), cpu0 = pyspecter_op_cpu_ns();
        c.uploads += (int64_t) loads.size();
        pyspecter_load_batch(L, loads, R->landed, [&](int32_t slot, const pyspecter_load_fn & load) {
            return R->faults.apply(L, -1, slot, 0, 0, load);
        });
        for (size_t i = 0; i < loads.size(); ++i) {
            if (R->landed[i]) {
                residency_map(R, L, loads[i].first, loads[i].second);
            }
        }
        c.wait_ns += pyspecter_now_ns() - t0;
        if (cpu0 >= 0) {
            const int64_t cpu = pyspecter_thread_cpu_ns() - cpu0;
            c.copy_cpu_ns += cpu * PYSPECTER_CPU_SAMPLE;
            pyspecter_op_exclude(cpu);
        }
        return;
    }
    std::vector<pyspecter_read *> & reads = R->reads;
    reads.clear();
    for (auto [e, slot] : loads) {
        reads.push_back(residency_start_read(R, L, e, slot, CLS_DEMAND).get());
    }
    R->wait_all(reads);
    residency_reap(R, L);
}

// Ordered: every miss becomes a late expert (its read started or promoted here), computed from its slot after
// the layer's resident experts and host path; the wait op blocks for the reads (pyspecter_native_wait).
static void miss_ordered(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<int32_t> & missing) {
    auto & c = L->parent->counters;
    std::vector<uint8_t> & taken = R->taken;
    taken.assign(L->owner.size(), 0);
    for (int32_t e : missing) {
        int32_t slot;
        if (pyspecter_read * r = residency_inflight(L, e)) {
            {
                auto lk = R->qlock();
                r->cls = CLS_DEMAND; // first in line from here on
            }
            slot = r->slot;
            c.waited++;
        } else {
            slot = slot_for_miss(R, L, L->mark, taken);
            if (slot < 0) { // more distinct experts in this ubatch than slots: the host computes the rest
                c.overflow++;
                continue;
            }
            residency_evict(L, slot);
            residency_start_read(R, L, e, slot, CLS_DEMAND);
        }
        taken[slot] = 1;
        pyspecter_late_set(L, e, slot);
        c.late++;
    }
}

// a read already on the wire is due soon: wait for it; one still queued would stall longer than the host path
static void wait_due(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<int32_t> & missing) {
    auto & c = L->parent->counters;
    std::vector<pyspecter_read *> & due = R->landing;
    due.clear();
    {
        auto lk = R->qlock();
        for (int32_t e : missing) {
            pyspecter_read * r = residency_inflight(L, e);
            if (r && r->started) {
                due.push_back(r);
            }
        }
    }
    if (!due.empty()) {
        R->wait_all(due);
        c.waited += (int64_t) due.size();
        residency_reap(R, L);
    }
}

static void miss_cpu(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<int32_t> & missing) {
    for (int32_t e : missing) {
        if (L->remap[e] >= 0 || residency_inflight(L, e)) {
            continue;
        }
        const int32_t slot = victim(R, L, L->mark, nullptr, true);
        if (slot < 0) {
            break;
        }
        residency_evict(L, slot);
        residency_start_read(R, L, e, slot, CLS_BACKGROUND);
    }
}

// Surrogate (approximate): a miss whose read is on the wire is waited for (the exact expert is worth a short wait);
// every other is read in the background for next time and computed from its surrogate for this ubatch
static void miss_surrogate(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<int32_t> & missing) {
    wait_due(R, L, missing);
    for (int32_t e : missing) {
        if (L->remap[e] >= 0) {
            continue;
        }
        const int32_t slot = residency_inflight(L, e) ? -1 : victim(R, L, L->mark, nullptr, true);
        if (slot >= 0) {
            residency_evict(L, slot);
            residency_start_read(R, L, e, slot, CLS_BACKGROUND);
        }
        pyspecter_map_surrogate(R, L, e);
    }
}

void pyspecter_native_route(llama_pyspecter_layer * L, const int32_t * ids, int32_t n_tokens, int32_t n_used,
                            bool with_late, bool served, const float * x, int32_t n_embd, const float * raw) {
    pyspecter_residency * R = L->parent->res.get(); // R->mu held by the caller (pyspecter_native_lock)
    auto & c = L->parent->counters;
    // the call's reads are queued together, at its first wait or at its end
    struct batch_guard {
        pyspecter_residency * R;
        explicit batch_guard(pyspecter_residency * R) : R(R) { R->batching = true; }
        ~batch_guard() {
            R->batching = false;
            R->flush();
        }
    } batched(R);
    policy_call_begin(L, x, n_embd, raw);
    R->clock++;
    if (n_tokens == 1 && R->planner) {
        const int64_t now = pyspecter_now_ns(), gap = now - R->last_route_ns;
        const int64_t waited = c.wait_ns.load(), dw = std::max<int64_t>(0, waited - R->last_wait_ns);
        if (R->last_route_ns && gap < 500000000) { // between layers of one token, not across a pause
            const bool first = R->t_layer_ns == 0.0;
            R->t_layer_ns = first ? (double) gap : 0.9 * R->t_layer_ns + 0.1 * (double) gap;
            R->stall_ns = first ? (double) dw : 0.9 * R->stall_ns + 0.1 * (double) dw;
        }
        R->last_route_ns = now;
        R->last_wait_ns = waited;
    }
    residency_call_begin(R, L);
    residency_host_pages(R, L, n_tokens);
    std::vector<int32_t> & needed = R->needed;
    residency_needed(L, ids, n_tokens * n_used, needed);
    if (R->p.record) {
        R->trace.push_back(L->il);
        R->trace.push_back((int32_t) needed.size());
        R->trace.insert(R->trace.end(), needed.begin(), needed.end());
    }
    if (!L->ghost_held.empty()) {
        c.ghost_misses += held_ghost_observe(L, needed);
    }
    if (!R->sur.empty() && R->sur[L->il]) {
        pyspecter_unmap_surrogates(R, L);
    }
    residency_reap(R, L);
    residency_drop_stale_lookahead(R, L);
    std::vector<int32_t> & missing = R->missing;
    residency_hits(R, L, needed, missing);
    c.needed += (int64_t) needed.size();
    c.resident_at_need += (int64_t) (needed.size() - missing.size());
    const bool moves = R->p.miss != LLAMA_PYSPECTER_MISS_HOST; // host: every miss computed from home, in place
    if (n_tokens > 1 && R->p.lookahead && moves && R->p.miss != LLAMA_PYSPECTER_MISS_CPU) {
        residency_prefill_lookahead(R, L, (int32_t) needed.size());
    }
    if (!missing.empty() && moves) {
        if (R->p.miss == LLAMA_PYSPECTER_MISS_ORDERED && with_late) {
            miss_ordered(R, L, missing);
        } else if (R->p.miss == LLAMA_PYSPECTER_MISS_SURROGATE && n_tokens == 1) {
            miss_surrogate(R, L, missing);
        } else if (R->p.miss != LLAMA_PYSPECTER_MISS_CPU) {
            miss_wait(R, L, missing);
        } else if (n_tokens == 1) {
            if (!served) { // served: no landing serves its rows, so a wait only holds the thread or the next launch
                wait_due(R, L, missing);
            }
            miss_cpu(R, L, missing);
        }
        // (cpu, a prompt's ubatch: its misses are most experts, and the host computes them all anyway; reading them
        // into slots beside that compute would take the cores it runs on, and the first token waits for both)
    }
    if (!L->reuse_R.empty()) {
        if (R->duel) { // with this call's scores, before the call joins the layer's past
            duel_observe(R, L, needed, n_tokens == 1);
        }
        recency_observe(L, needed);
    }
    policy_call_end(L);
    // Decoding: the next layers of this token. Not while the link is the bottleneck: when waits for reads take
    // more than max_stall of a layer-time the link has no idle time for prefetches to fill, and every wrong one
    // takes it from the misses the compute thread waits for (on smol-moe's disk tier at 50% prefetching raised
    // the stall; tokens there are 70-78% stalled on reads).
    const bool link_bound = R->t_layer_ns > 0.0 && R->stall_ns > R->max_stall * R->t_layer_ns;
    if (n_tokens == 1 && R->planner && R->plan && moves && !L->ahead.empty() && !link_bound) {
        R->plan(L, x, n_embd);
    }
}
