// Replays a routing trace through native residency's own eviction code (policy.cpp: victim, the ranks, the duel,
// the held slots' ghost) on a private slot table: no model, no tensors, no reads. Reads land at once, so where the
// runtime's choice depends only on the trace (misses waited for, RAM tier, a prompt's read-ahead landing by its
// layer's next call) the replay makes the same choices; study/ and the tests judge policies offline with it rather
// than with a copy of the rules.
//
// The call rules are the routing op's (residency.cpp, pyspecter_native_route): the call's distinct experts in
// ascending order; hits refresh their slot; a prompt's batch reads the next layer's most used experts ahead; each
// miss takes a victim among slots neither taken by this call nor holding an expert it needs, and one with no slot
// left is computed on the host.

#include "residency-impl.h"

#include <algorithm>

struct llama_pyspecter_replay {
    llama_pyspecter_slots s;            // the private slot table (never allocated on a device: table -1, no tensors)
    pyspecter_residency * R = nullptr;  // its residency state, never started: no readers, no queue
    bool lookahead = false;
    std::vector<int64_t> expert_bytes;  // by layer
    std::vector<llama_pyspecter_replay_stats> stats; // by layer
    std::vector<std::vector<int32_t>> landing; // by layer: slots its read-ahead fills, mapped at its next call
    std::vector<uint8_t> keep;
    std::vector<int32_t> needed, missing;
};

static bool on_its_way(const llama_pyspecter_layer * L, int32_t expert) {
    for (const auto & r : L->pending) {
        if (r && r->expert == expert) {
            return true;
        }
    }
    return false;
}

// The routing op's prefill lookahead (upload_ahead into the next layer), its reads pending until that layer's call.
static int32_t read_ahead(llama_pyspecter_replay * rp, llama_pyspecter_layer * N, int32_t n_needed) {
    const int32_t E = (int32_t) N->remap.size();
    std::vector<int32_t> want((size_t) E);
    for (int32_t e = 0; e < E; ++e) {
        want[e] = e;
    }
    std::stable_sort(want.begin(), want.end(), [&](int32_t a, int32_t b) { return N->freq[a] > N->freq[b]; });
    want.resize(std::min<size_t>(want.size(), (size_t) n_needed));
    rp->keep.assign((size_t) E, 0);
    for (int32_t e : want) {
        rp->keep[e] = 1;
    }
    int32_t issued = 0;
    for (int32_t e : want) {
        if (N->remap[e] >= 0 || on_its_way(N, e)) {
            continue;
        }
        const int32_t slot = victim(rp->R, N, rp->keep, nullptr, false);
        if (slot < 0) {
            break;
        }
        if (N->owner[slot] >= 0) {
            pyspecter_remap_set(N, N->owner[slot], -1);
        }
        residency_pend(N, e, slot); // lands at N's next call (residency_land)
        rp->landing[N->il].push_back(slot);
        ++issued;
    }
    return issued;
}

static void replay_call(llama_pyspecter_replay * rp, llama_pyspecter_layer * L, const int32_t * ids, int32_t n_tokens,
                        int32_t n_used, const float * scores, bool counted) {
    pyspecter_residency * R = rp->R;
    auto & st = rp->stats[L->il];
    R->clock++;
    residency_call_begin(R, L);
    for (int32_t slot : rp->landing[L->il]) { // its read-ahead has landed (reap)
        residency_land(R, L, slot);
    }
    rp->landing[L->il].clear();
    auto & needed = rp->needed;
    residency_needed(L, ids, n_tokens * n_used, needed);
    policy_take_scores(L, scores); // this call's scores stand for the layer's reuse map's
    if (!L->ghost_held.empty()) {
        st.held_ghost_misses += held_ghost_observe(L, needed);
    }
    auto & missing = rp->missing;
    residency_hits(R, L, needed, missing);
    if (n_tokens > 1 && rp->lookahead && L->next) {
        st.lookahead += read_ahead(rp, L->next, (int32_t) needed.size());
    }
    std::vector<uint8_t> taken(L->owner.size(), 0);
    int32_t reads = 0, evictions = 0;
    for (int32_t e : missing) {
        const int32_t slot = victim(R, L, L->mark, &taken, true);
        if (slot < 0) {
            continue; // more distinct experts in this call than slots: the host computes the rest
        }
        evictions += L->owner[slot] >= 0;
        if (L->owner[slot] >= 0) {
            pyspecter_remap_set(L, L->owner[slot], -1);
        }
        residency_map(R, L, e, slot);
        taken[slot] = 1;
        ++reads;
    }
    if (R->duel) { // with this call's scores, before the call joins the layer's past
        const auto ab = duel_observe(R, L, needed, counted);
        if (counted) {
            st.ghost_lru_misses += ab.first;
            st.ghost_score_misses += ab.second;
        }
    }
    policy_call_end(L);
    if (!counted) {
        return;
    }
    st.calls++;
    st.needed += (int64_t) needed.size();
    st.hits += (int64_t) (needed.size() - missing.size());
    st.misses += (int64_t) missing.size();
    st.reads += reads;
    st.evictions += evictions;
    st.bytes += reads * rp->expert_bytes[L->il];
}

//
// API
//

llama_pyspecter_replay * llama_pyspecter_replay_init(const llama_pyspecter_replay_params * p) {
    if (!p || p->n_layer <= 0 || p->n_expert <= 0 || !p->slots || p->held < 0 ||
            p->policy < LLAMA_PYSPECTER_POLICY_LRU || p->policy > LLAMA_PYSPECTER_POLICY_SCORE ||
            (p->duel && (p->decay <= 0.0f || p->decay > 1.0f || p->margin < 0.0f || p->margin >= 1.0f))) {
        return nullptr;
    }
    for (int32_t il = 0; il < p->n_layer; ++il) {
        if (p->slots[il] < 0 || (p->expert_bytes && p->expert_bytes[il] < 0)) {
            return nullptr;
        }
    }
    try {
        auto rp = std::make_unique<llama_pyspecter_replay>();
        auto & s = rp->s;
        s.n_expert = p->n_expert;
        s.res = { new pyspecter_residency(), [](pyspecter_residency * r) noexcept { delete r; } };
        auto * R = rp->R = s.res.get();
        R->s = &s;
        R->p.policy = p->policy;
        R->duel = p->duel;
        R->use_scores = R->trust_scores = !p->duel || p->start_learned; // set_duel's
        R->decay = p->decay;
        R->margin = p->margin;
        s.layers.resize((size_t) p->n_layer);
        for (int32_t il = 0; il < p->n_layer; ++il) {
            const int32_t n = p->slots[il];
            if (n == 0) {
                continue; // not replayed: a dense layer, or one without slots
            }
            auto L = std::make_unique<llama_pyspecter_layer>();
            pyspecter_table_init(L.get(), il, &s, p->n_expert, n + p->held);
            residency_layer_init(L.get(), n); // residency_init's
            policy_layer_init(L.get());
            if (p->held > 0) {
                policy_set_held(L.get(), p->held);
            }
            policy_map_init(L.get()); // set_reuse_map's: fresh flags, the duel's two simulated caches
            residency_append(R, L.get());
            s.layers[il] = std::move(L);
        }
        rp->lookahead = p->lookahead;
        rp->expert_bytes.assign((size_t) p->n_layer, 0);
        if (p->expert_bytes) {
            std::copy(p->expert_bytes, p->expert_bytes + p->n_layer, rp->expert_bytes.begin());
        }
        rp->stats.assign((size_t) p->n_layer, llama_pyspecter_replay_stats());
        rp->landing.resize((size_t) p->n_layer);
        return rp.release();
    } catch (...) {
        return nullptr;
    }
}

void llama_pyspecter_replay_free(llama_pyspecter_replay * rp) {
    delete rp;
}

int32_t llama_pyspecter_replay_call(llama_pyspecter_replay * rp, int32_t il, const int32_t * ids, int32_t n_tokens,
                                    int32_t n_used, const float * scores, bool counted) {
    llama_pyspecter_layer * L = rp ? rp->s.layer(il) : nullptr;
    if (!L || !ids || n_tokens <= 0 || n_used <= 0) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    return pyspecter_guarded(__func__, [&]() -> int32_t {
        replay_call(rp, L, ids, n_tokens, n_used, scores, counted);
        return LLAMA_PYSPECTER_OK;
    });
}

int32_t llama_pyspecter_replay_get_stats(const llama_pyspecter_replay * rp, int32_t il, llama_pyspecter_replay_stats * out) {
    if (!rp || !out || il < -1 || il >= (int32_t) rp->stats.size()) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    if (il >= 0) {
        *out = rp->stats[il];
    } else {
        *out = llama_pyspecter_replay_stats();
        for (const auto & st : rp->stats) {
            out->calls += st.calls;
            out->needed += st.needed;
            out->hits += st.hits;
            out->misses += st.misses;
            out->reads += st.reads;
            out->evictions += st.evictions;
            out->bytes += st.bytes;
            out->lookahead += st.lookahead;
            out->held_ghost_misses += st.held_ghost_misses;
            out->ghost_lru_misses += st.ghost_lru_misses;
            out->ghost_score_misses += st.ghost_score_misses;
        }
    }
    out->use_scores = rp->R->use_scores ? 1 : 0;
    out->switches = rp->R->switches;
    return LLAMA_PYSPECTER_OK;
}
