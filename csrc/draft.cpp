// A draft's routing in the target's planner, handed over once per draft step.
//
// One call between steps (llama_pyspecter_draft_handover) closes the target's previous window and arms the draft
// for the next step's tokens. From then on the draft's routing op (route.cpp, the op every MoE arch goes through)
// turns each drafted token's selected experts, at router weight >= min_conf (the confidence), into prefetches on
// the target as it routes them: due at the routing call where the verification pass needs them (token i of the
// window at MoE layer L), the most confident first among equals, queued behind every demand read through the
// native planner's prefetch rule (residency.cpp: a slot is taken only from an expert less likely to be needed).
// What the rule weighs a prediction by is the chance that the target uses it: the draft's precision measured over
// the windows so far (a router weight is no such chance: the top-2 weights of 16 experts sum to one whatever the
// draft's accuracy), so a draft whose predictions are used less often than an expert the layer just used stops
// evicting it. The reads so run while the draft is still drafting, and the queue serves them by deadline, whatever
// order they came in. Nothing runs in Python per layer or per expert.
//
// The target's routing op scores the window: which prefetches its verification pass used (precision), how many
// of its needs the draft named (recall) and found resident (coverage), and what plain LRU with the layer's usable
// slots would have had resident on the same calls (a ghost, for comparison in one run). A window closes at the
// next handover (or at a close: draft = null); its unused prefetches still queued are taken back then, their
// pass being over.

#include "pyspecter-impl.h"

#include <algorithm>

struct pyspecter_draft {
    std::mutex mu; // what follows; the compute thread's routing op and the control plane between decodes

    // a draft's side: the target its step goes to, and the step's tokens routed so far per layer
    llama_pyspecter_slots * target = nullptr;
    float min_conf = 0.0f;
    int32_t per_pass = 1, n_tok = 0; // tokens a verification pass takes; tokens of the step (later ones: not its)
    std::vector<int32_t> tokens;     // layer -> tokens of the step it has routed (the next one's index)

    // a target's side: the window in flight, per layer and expert (pf: 0 none, 1 prefetched and unused, 2 used)
    bool scoring = false; // a handover was made to this model
    bool open = false;
    std::vector<std::vector<uint8_t>> pf, pred;
    std::vector<std::vector<float>> prob; // the chance the target uses an expert the window named (0: not named)
    std::vector<int32_t> pos;             // layer -> forward position among the slot layers (-1: none)
    int32_t n_moe = 0;
    int64_t needed0 = 0, resident0 = 0; // the target's counters when the window opened
    // plain LRU over each layer's usable slots, in bookkeeping: expert -> stamp of its last use, -1 out
    std::vector<std::vector<int64_t>> ghost;
    int64_t stamp = 0;
    llama_pyspecter_draft_stats st = {};
};

static void free_draft(pyspecter_draft * d) noexcept {
    delete d;
}

static pyspecter_draft * draft_state(llama_pyspecter_slots * s) {
    if (!s->draft) {
        auto d = std::unique_ptr<pyspecter_draft, llama_pyspecter_slots::draft_free>(new pyspecter_draft(), free_draft);
        const size_t n = s->layers.size(), E = (size_t) s->n_expert;
        d->tokens.assign(n, 0);
        d->pf.resize(n);
        d->pred.resize(n);
        d->prob.resize(n);
        d->ghost.resize(n);
        d->pos.assign(n, -1);
        for (size_t il = 0; il < n; ++il) {
            if (s->layers[il]) {
                d->pf[il].assign(E, 0);
                d->pred[il].assign(E, 0);
                d->prob[il].assign(E, 0.0f);
                d->ghost[il].assign(E, -1);
                d->pos[il] = d->n_moe++; // a pass reaches the layer at forward position p in p + 1 routing calls
            }
        }
        s->draft = std::move(d);
    }
    return s->draft.get();
}

struct draft_row {
    int32_t tok, e;
    float w;
};

// The draft's rows of layer il into the target's window (its native residency's lock taken here: the target
// computes nothing while its draft drafts)
static void plan_rows(llama_pyspecter_slots * s, int32_t il, int32_t per_pass, const std::vector<draft_row> & rows) {
    auto native = pyspecter_native_lock(s);
    pyspecter_draft * d = s->draft.get();
    llama_pyspecter_layer * L = s->layer(il);
    if (!native.owns_lock() || !d || !L || il >= (int32_t) d->pos.size() || d->pos[il] < 0) {
        return; // a layer the target computes without slots
    }
    std::lock_guard<std::mutex> lk(d->mu);
    if (!d->open) {
        return;
    }
    // the draft's precision so far, one used prediction granted (1 before any window is scored)
    const float p = (float) (d->st.used + 1) / (float) (d->st.scored + 1);
    auto & prob = d->prob[il];
    for (const auto & r : rows) { // first the window's view of the layer: every row of this call named
        d->st.picks++;
        if (!d->pred[il][r.e]) {
            d->pred[il][r.e] = 1;
            d->st.predicted++;
        }
        prob[r.e] = p;
        policy_protect(L, r.e, true); // eviction spares the window's predictions unless a need wants the slot
    }
    for (const auto & r : rows) {
        if (L->remap[r.e] >= 0) {
            d->st.resident++;
            continue;
        }
        if (d->pf[il][r.e]) {
            continue; // an earlier token's prefetch of it, due no later
        }
        const int32_t h = r.tok / per_pass * d->n_moe + d->pos[il] + 1; // the verification call that needs it
        const int64_t refused = s->counters.ahead_refused.load();
        if (pyspecter_native_prefetch(L, r.e, p, h, prob.data())) {
            d->pf[il][r.e] = 1;
            d->st.prefetches++;
        } else if (s->counters.ahead_refused.load() != refused) {
            d->st.refused++;
        }
    }
}

void pyspecter_draft_observe(llama_pyspecter_layer * L, const int32_t * ids, const ggml_tensor * w, int32_t n_tokens,
                             int32_t n_used) {
    pyspecter_draft * d = L->parent->draft.get();
    if (!d) {
        return;
    }
    const int32_t il = L->il, E = L->parent->n_expert;
    llama_pyspecter_slots * target = nullptr;
    int32_t per_pass = 1;
    thread_local std::vector<draft_row> rows;
    rows.clear();
    {
        std::unique_lock<std::mutex> lk(d->mu);
        if (d->target && il < (int32_t) d->tokens.size()) {
            // a draft armed for a step: the rows of its tokens, their router weights as the confidence
            const int32_t t0 = d->tokens[il];
            for (int32_t t = 0; t < n_tokens && t0 + t < d->n_tok; ++t) {
                for (int32_t j = 0; j < n_used; ++j) {
                    const int32_t e = ids[t * n_used + j];
                    const float p = w ? *(const float *) ((const char *) w->data + t * w->nb[2] + j * w->nb[1]) : 1.0f;
                    if (e >= 0 && e < E && p >= d->min_conf) {
                        rows.push_back({ t0 + t, e, p });
                    }
                }
            }
            d->tokens[il] += n_tokens;
            target = d->target;
            per_pass = d->per_pass;
        }
        if (d->scoring && !d->pf[il].empty()) {
            // a target: this call's distinct needs against the window and the ghost (plain LRU over the layer's
            // usable slots, C's one simulated LRU: policy.cpp; it runs outside windows too, so that it is warm
            // when one opens)
            thread_local std::vector<uint8_t> seen;
            thread_local std::vector<int32_t> needed;
            seen.assign((size_t) E, 0);
            needed.clear();
            for (int32_t i = 0; i < n_tokens * n_used; ++i) {
                const int32_t e = ids[i];
                if (e >= 0 && e < E && !seen[e]) {
                    seen[e] = 1;
                    needed.push_back(e);
                }
            }
            if (d->open) {
                for (int32_t e : needed) {
                    d->st.lru_hits += d->ghost[il][e] >= 0;
                    d->st.recalled += d->pred[il][e] != 0;
                    if (d->pf[il][e] == 1) {
                        d->pf[il][e] = 2;
                        d->st.used++;
                    }
                }
            }
            lru_sim_call(d->ghost[il], needed, seen, L->n_usable, ++d->stamp);
        }
    }
    if (target && !rows.empty()) {
        // most confident first within the call: they take the free slots first, and the queue serves equal
        // deadlines in the order they came
        std::stable_sort(rows.begin(), rows.end(), [](const draft_row & a, const draft_row & b) {
            return a.tok != b.tok ? a.tok < b.tok : a.w > b.w;
        });
        plan_rows(target, il, per_pass, rows);
    }
}

// native residency's mu and d->mu held: the window in flight is scored and closed
static void close_window(llama_pyspecter_slots * s, pyspecter_draft * d) {
    if (!d->open) {
        return;
    }
    for (size_t il = 0; il < d->pf.size(); ++il) {
        auto * L = s->layers[il].get();
        if (!L || d->pf[il].empty()) {
            continue;
        }
        for (int32_t e = 0; e < s->n_expert; ++e) {
            if (d->pf[il][e]) {
                d->st.scored++;
                if (d->pf[il][e] == 1 && pyspecter_native_take_back_prefetch(L, e)) {
                    d->st.stale++;
                }
            }
            if (d->pred[il][e]) {
                policy_protect(L, e, false);
            }
        }
        std::fill(d->pf[il].begin(), d->pf[il].end(), 0);
        std::fill(d->pred[il].begin(), d->pred[il].end(), 0);
        std::fill(d->prob[il].begin(), d->prob[il].end(), 0.0f);
    }
    // (a stats reset inside the window: counted from the reset)
    const int64_t needed = s->counters.needed.load(), resident = s->counters.resident_at_need.load();
    d->st.needed += needed >= d->needed0 ? needed - d->needed0 : needed;
    d->st.hits += resident >= d->resident0 ? resident - d->resident0 : resident;
    d->open = false;
}

//
// API
//

int32_t llama_pyspecter_draft_handover(llama_model * target, llama_model * draft, float min_conf, int32_t per_pass,
                                       int32_t n_tokens) {
    auto * s = pyspecter_slots_of(target);
    auto * ds = draft ? pyspecter_slots_of(draft) : nullptr;
    if (!pyspecter_native_enabled(s)) {
        return s ? LLAMA_PYSPECTER_ERR_ARG : LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    if ((draft && (!ds || ds == s)) || per_pass < 1 || n_tokens < 0 || !(min_conf >= 0.0f)) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    return pyspecter_guarded(__func__, [&]() -> int32_t {
        {
            auto native = pyspecter_native_lock(s);
            pyspecter_draft * d = draft_state(s);
            std::lock_guard<std::mutex> lk(d->mu);
            d->scoring = true;
            close_window(s, d);
            if (draft) {
                d->st.handovers++;
                d->needed0 = s->counters.needed.load();
                d->resident0 = s->counters.resident_at_need.load();
                d->open = true;
            }
        }
        if (draft) { // the draft's next n_tokens tokens go to this window
            pyspecter_draft * dd = draft_state(ds);
            std::lock_guard<std::mutex> lk(dd->mu);
            dd->target = s;
            dd->min_conf = min_conf;
            dd->per_pass = per_pass;
            dd->n_tok = n_tokens;
            std::fill(dd->tokens.begin(), dd->tokens.end(), 0);
        }
        return LLAMA_PYSPECTER_OK;
    });
}

int32_t llama_pyspecter_draft_unlink(llama_model * draft) {
    auto * ds = pyspecter_slots_of(draft);
    if (!ds) {
        return LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    if (ds->draft) {
        std::lock_guard<std::mutex> lk(ds->draft->mu);
        ds->draft->target = nullptr;
        ds->draft->n_tok = 0;
    }
    return LLAMA_PYSPECTER_OK;
}

int32_t llama_pyspecter_get_draft_stats(llama_model * target, llama_pyspecter_draft_stats * out) {
    auto * s = pyspecter_slots_of(target);
    if (!s || !out) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    *out = {};
    if (s->draft) {
        std::lock_guard<std::mutex> lk(s->draft->mu);
        *out = s->draft->st;
    }
    return LLAMA_PYSPECTER_OK;
}
