// Native residency's eviction (residency-impl.h, mu held): victim choice, the policies' ranks and the reuse
// scores, the simulated caches (the held slots' ghost, the LRU-versus-learned duel), and the API that sets
// them.

#include "residency-impl.h"

#include <algorithm>
#include <cstring>

// This call scores experts by the layer's reuse map: it has one, and the router input it reads.
static bool scores_live(const llama_pyspecter_layer * L) {
    return !L->reuse_R.empty() && L->x_cur;
}

static bool scores_rule(const pyspecter_residency * R, const llama_pyspecter_layer * L) {
    return R->p.policy == LLAMA_PYSPECTER_POLICY_SCORE && (L->reuse_R.empty() || !R->duel || R->use_scores);
}

static float score_of(llama_pyspecter_layer * L, int32_t e);

// Eviction order of a resident slot: lower goes first.
static std::pair<double, uint64_t> rank(const pyspecter_residency * R, llama_pyspecter_layer * L, int32_t slot) {
    const int32_t e = L->owner[slot];
    if (R->p.policy == LLAMA_PYSPECTER_POLICY_SCORE && !scores_rule(R, L)) {
        return { (double) L->last_use[slot], 0 }; // the duel has LRU ahead
    }
    switch (R->p.policy) {
        case LLAMA_PYSPECTER_POLICY_LFU:        return { (double) L->freq[e], L->last_use[slot] };
        case LLAMA_PYSPECTER_POLICY_PREV_TOKEN: return { L->last_use[slot] >= L->prev_call ? 1.0 : 0.0, L->loaded[slot] };
        case LLAMA_PYSPECTER_POLICY_SCORE:      return { (double) score_of(L, e), L->last_use[slot] };
        default:                                return { (double) L->last_use[slot], 0 };
    }
}

// The layer's recency features before this call, as learned.Recency makes them offline (fit and use agree):
// used by the previous call; share of the last 4 calls; of the last 16; 1 / (1 + calls since last use).
static void recency_features(const llama_pyspecter_layer * L, int32_t e, float f[4]) {
    const int64_t t = L->calls, W = 16;
    const int32_t E = (int32_t) L->remap.size();
    auto used = [&](int64_t call) { return call >= 0 && L->ring[(size_t) (call % W) * E + e] ? 1.0f : 0.0f; };
    f[0] = used(t - 1);
    f[1] = (used(t - 1) + used(t - 2) + used(t - 3) + used(t - 4)) / 4.0f;
    float all = 0.0f;
    for (int64_t c = t - W; c < t; ++c) {
        all += used(c);
    }
    f[2] = all / (float) W;
    f[3] = L->last_call_used[e] >= 0 ? 1.0f / (1.0f + (float) (t - L->last_call_used[e])) : 0.0f;
}

// map row e · x: expert e's raw reuse score. Here, for graphs built before the map was set; the others compute it
// for every expert as a matmul before the routing op (raw_cur).
static float reuse_dot(const llama_pyspecter_layer * L, int32_t e) {
    const int32_t D = L->reuse_embd;
    const float * x = L->x_cur;
    const float * w = L->reuse_R.data() + (size_t) e * D;
    float acc[8] = {};
    int32_t i = 0;
    for (; i + 8 <= D; i += 8) { // eight partial sums: the compiler may vectorize them without reassociating
        for (int32_t k = 0; k < 8; ++k) {
            acc[k] += x[i + k] * w[i + k];
        }
    }
    float sc = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < D; ++i) {
        sc += x[i] * w[i];
    }
    return sc;
}

// Expert e's reuse score for this call, blended on first need. Its raw score comes from the layer's graph: inside
// the routing op the map's 576 x 16 floats (36 KB, mostly not in cache after the layer's matmuls) took 8-10 us on
// the disk tier while the other compute thread spun at the op's barrier, most of what the engine's op cost above
// LRU's (2 cores). Without this call's router input: the score it had.
static float score_of(llama_pyspecter_layer * L, int32_t e) {
    if (!scores_live(L) || L->score_fresh[e]) {
        return L->score[e];
    }
    float sc = (L->raw_cur ? L->raw_cur[e] : reuse_dot(L, e)) + L->reuse_b[e];
    if (!L->blend.empty()) {
        const float * b = L->blend.data();
        float f[4];
        recency_features(L, e, f);
        sc = b[0] * sc + b[1] * f[0] + b[2] * f[1] + b[3] * f[2] + b[4] * f[3] + b[5];
    }
    L->score[e] = sc;
    L->score_fresh[e] = 1;
    return sc;
}

void recency_observe(llama_pyspecter_layer * L, const std::vector<int32_t> & needed) {
    const int32_t E = (int32_t) L->remap.size();
    uint8_t * row = L->ring.data() + (size_t) (L->calls % 16) * E;
    std::fill(row, row + E, 0);
    for (int32_t e : needed) {
        row[e] = 1;
        L->last_call_used[e] = L->calls;
    }
    L->calls++;
}

// One routing call of a cache simulated in bookkeeping (expert -> last use, -1 out): its misses. Victims: the least
// recently used (the lowest id among a call's equal stamps), or (scores) the lowest score, LRU among equals; the
// call's own experts (mark) are never victims, and what does not fit stays out, as in the engine. The one LRU of C:
// the duel's two caches, the held slots' ghost and the draft's ghost (lru_sim_call) all step through it.
static int32_t ghost_step(std::vector<int64_t> & res, const std::vector<int32_t> & needed, const std::vector<uint8_t> & mark,
                          int32_t capacity, int64_t clock, llama_pyspecter_layer * scored) {
    int32_t misses = 0, n_res = 0;
    for (int64_t v : res) {
        n_res += v >= 0;
    }
    for (int32_t e : needed) {
        if (res[e] >= 0) {
            continue;
        }
        ++misses;
        if (n_res >= capacity) {
            const bool by_score = scored && scores_live(scored);
            int32_t victim = -1;
            for (int32_t v = 0; v < (int32_t) res.size(); ++v) {
                if (res[v] < 0 || mark[v]) {
                    continue;
                }
                const bool better = victim < 0 || (by_score
                        ? std::make_pair(score_of(scored, v), res[v]) < std::make_pair(score_of(scored, victim), res[victim])
                        : res[v] < res[victim]);
                if (better) {
                    victim = v;
                }
            }
            if (victim < 0) {
                continue;
            }
            res[victim] = -1;
            --n_res;
        }
        res[e] = clock;
        ++n_res;
    }
    for (int32_t e : needed) {
        if (res[e] >= 0) {
            res[e] = clock;
        }
    }
    return misses;
}

int32_t lru_sim_call(std::vector<int64_t> & res, const std::vector<int32_t> & needed, const std::vector<uint8_t> & mark,
                     int32_t capacity, int64_t clock) {
    return ghost_step(res, needed, mark, capacity, clock, nullptr);
}

// The held slots' ghost: what plain LRU over the usable and the held slots together would miss (L->mark: needed).
int32_t held_ghost_observe(llama_pyspecter_layer * L, const std::vector<int32_t> & needed) {
    const int32_t misses = ghost_step(L->ghost_held, needed, L->mark, L->ghost_cap, ++L->ghost_stamp, nullptr);
    L->ghost_held_misses += misses;
    return misses;
}

std::pair<int32_t, int32_t> duel_observe(pyspecter_residency * R, llama_pyspecter_layer * L,
                                         const std::vector<int32_t> & needed, bool count) {
    R->duel_clock++;
    const int64_t clock = (int64_t) R->duel_clock;
    const int32_t a = ghost_step(L->ghost_lru, needed, L->mark, L->n_usable, clock, nullptr);
    const int32_t b = ghost_step(L->ghost_score, needed, L->mark, L->n_usable, clock, L);
    if (!count) {
        return { a, b };
    }
    R->recent[0] = R->recent[0] * R->decay + a;
    R->recent[1] = R->recent[1] * R->decay + b;
    const double lru = R->recent[0], learned = R->recent[1], m = R->margin;
    bool use; // the trusted side keeps a near-tie
    if (R->trust_scores) {
        use = R->use_scores ? lru >= (1 - m) * learned : learned <= lru;
    } else {
        use = !R->use_scores ? learned < (1 - m) * lru : learned <= lru;
    }
    if (use != R->use_scores) {
        R->use_scores = use;
        R->switches++;
    }
    return { a, b };
}

// A slot to reuse: a free one, else by policy among slots neither being filled, nor taken, nor holding an expert
// marked in `keep` (needed now). Experts predicted for the window in flight are spared unless `need`: an expert
// needed now outranks a prediction. -1: none.
int32_t victim(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<uint8_t> & keep,
               const std::vector<uint8_t> * taken, bool need) {
    int32_t best = -1, spared = -1;
    std::pair<double, uint64_t> best_key;
    for (int32_t s = 0; s < L->n_usable; ++s) {
        if (L->pending[s] || (taken && (*taken)[s])) {
            continue;
        }
        const int32_t e = L->owner[s];
        if (e < 0) {
            return s;
        }
        if (keep[e]) {
            continue;
        }
        if (L->prot[e]) {
            spared = s;
            continue;
        }
        const auto key = rank(R, L, s);
        if (best < 0 || key < best_key) {
            best = s;
            best_key = key;
        }
    }
    if (best < 0 && need && spared >= 0) {
        L->prot[L->owner[spared]] = 0;
        return spared;
    }
    return best;
}

//
// the section's writes from other files (residency-impl.h)
//

void policy_layer_init(llama_pyspecter_layer * L) {
    L->score.assign(L->remap.size(), 0.0f);
    L->prot.assign(L->remap.size(), 0);
}

void policy_call_begin(llama_pyspecter_layer * L, const float * x, int32_t n_embd, const float * raw) {
    L->x_cur = x && n_embd == L->reuse_embd ? x : nullptr;
    L->raw_cur = L->x_cur ? raw : nullptr;
    std::fill(L->score_fresh.begin(), L->score_fresh.end(), 0);
}

void policy_call_end(llama_pyspecter_layer * L) {
    L->x_cur = nullptr;
    L->raw_cur = nullptr;
}

// The scores stand for the layer's reuse map's, already computed for every expert (score_of reads them).
void policy_take_scores(llama_pyspecter_layer * L, const float * scores) {
    L->x_cur = scores ? L->score.data() : nullptr;
    if (scores) {
        if (L->reuse_R.empty()) {
            L->reuse_R.assign(1, 0.0f); // the layer has a map from here on, as for set_reuse_map (scores_rule)
        }
        std::copy(scores, scores + L->remap.size(), L->score.begin());
        std::fill(L->score_fresh.begin(), L->score_fresh.end(), 1);
    }
}

void policy_set_held(llama_pyspecter_layer * L, int32_t n_held) {
    L->n_held = n_held;
    L->ghost_cap = L->n_usable + n_held;
    L->ghost_held.assign(n_held ? L->remap.size() : 0, -1);
    L->ghost_stamp = L->ghost_held_misses = 0;
}

void policy_protect(llama_pyspecter_layer * L, int32_t e, bool on) {
    L->prot[e] = on ? 1 : 0;
}

void policy_release_held(llama_pyspecter_layer * L) {
    L->n_held = L->ghost_cap = 0;
    L->ghost_held.clear();
    std::fill(L->prot.begin(), L->prot.end(), 0);
}

void policy_map_init(llama_pyspecter_layer * L) {
    L->score_fresh.assign(L->remap.size(), 0);
    L->ghost_lru.assign(L->remap.size(), -1);
    L->ghost_score.assign(L->remap.size(), -1);
}

//
// API
//

int32_t llama_pyspecter_set_held(llama_model * model, int32_t il, int32_t n_held) {
    auto * R = residency_of(model);
    auto * L = pyspecter_layer_of(model, il);
    if (!R || !L || n_held < 0) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    try {
        std::lock_guard<std::mutex> lk(R->mu);
        if (L->n_usable + n_held > (int32_t) L->owner.size()) {
            return LLAMA_PYSPECTER_ERR_ARG;
        }
        policy_set_held(L, n_held);
        return LLAMA_PYSPECTER_OK;
    } catch (const std::bad_alloc &) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    }
}

int32_t llama_pyspecter_set_policy(llama_model * model, int32_t policy) {
    auto * R = residency_of(model);
    if (!R || policy < LLAMA_PYSPECTER_POLICY_LRU || policy > LLAMA_PYSPECTER_POLICY_SCORE) {
        return R ? LLAMA_PYSPECTER_ERR_ARG : LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    std::lock_guard<std::mutex> lk(R->mu);
    R->p.policy = policy;
    return LLAMA_PYSPECTER_OK;
}

int32_t llama_pyspecter_held(const llama_model * model, int32_t il, int64_t * ghost_misses) {
    auto * s = pyspecter_slots_of(model);
    auto * R = s ? s->res.get() : nullptr;
    const auto * L = R ? pyspecter_layer_of(model, il) : nullptr;
    if (!L) {
        return R ? LLAMA_PYSPECTER_ERR_ARG : LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    std::lock_guard<std::mutex> lk(R->mu);
    if (ghost_misses) {
        *ghost_misses = L->ghost_held_misses;
    }
    return L->n_held;
}

int32_t llama_pyspecter_set_scores(llama_model * model, int32_t il, const float * scores, int32_t n) {
    auto * R = residency_of(model);
    auto * L = pyspecter_layer_of(model, il);
    if (!R || !L || !scores || n != (int32_t) L->score.size()) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    std::lock_guard<std::mutex> lk(R->mu);
    std::copy(scores, scores + n, L->score.begin());
    return LLAMA_PYSPECTER_OK;
}

int32_t llama_pyspecter_set_reuse_map(llama_model * model, int32_t il, const float * Rm, const float * rb,
                                      int32_t n_embd, const float * blend) {
    auto * R = residency_of(model);
    auto * L = pyspecter_layer_of(model, il);
    if (!R || !L || !Rm || !rb || n_embd <= 0) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    try {
        std::lock_guard<std::mutex> lk(R->mu);
        const size_t E = L->remap.size();
        L->reuse_R.resize((size_t) n_embd * E); // given [n_embd][n_expert]; kept an expert a row (score_of)
        for (size_t e = 0; e < E; ++e) {
            for (int32_t i = 0; i < n_embd; ++i) {
                L->reuse_R[e * (size_t) n_embd + i] = Rm[(size_t) i * E + e];
            }
        }
        if (!L->reuse_t || L->reuse_t->ne[0] != n_embd) {
            ggml_init_params ip = { ggml_tensor_overhead(), nullptr, true };
            ggml_context * ctx = ggml_init(ip);
            if (!ctx) {
                return LLAMA_PYSPECTER_ERR_NO_MEMORY;
            }
            L->parent->ctxs.push_back(ctx);
            ggml_tensor * t = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd, (int64_t) E);
            ggml_format_name(t, "pyspecter.reuse.%d", il);
            ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_cpu_buffer_type());
            if (!buf) {
                return LLAMA_PYSPECTER_ERR_NO_MEMORY;
            }
            L->parent->bufs.push_back(buf);
            ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS); // the matmul runs where it lives
            L->reuse_t = t;
        }
        ggml_backend_tensor_set(L->reuse_t, L->reuse_R.data(), 0, L->reuse_R.size() * sizeof(float));
        policy_map_init(L); // (no score fresh, the duel's caches empty)
        L->reuse_b.assign(rb, rb + E);
        L->blend.assign(blend ? blend : rb, blend ? blend + 6 : rb); // empty without a blend
        L->reuse_embd = n_embd;
        L->ring.assign(16 * E, 0);
        L->last_call_used.assign(E, -1);
        L->calls = 0;
        return LLAMA_PYSPECTER_OK;
    } catch (const std::bad_alloc &) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    }
}

int32_t llama_pyspecter_set_duel(llama_model * model, bool enabled, bool start_learned, float decay, float margin) {
    auto * R = residency_of(model);
    if (!R || decay <= 0.0f || decay > 1.0f || margin < 0.0f || margin >= 1.0f) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    std::lock_guard<std::mutex> lk(R->mu);
    R->duel = enabled;
    R->use_scores = R->trust_scores = !enabled || start_learned;
    R->decay = decay;
    R->margin = margin;
    R->recent[0] = R->recent[1] = 0.0;
    R->switches = 0;
    return LLAMA_PYSPECTER_OK;
}

int32_t llama_pyspecter_duel_state(llama_model * model, int64_t * switches) {
    auto * R = residency_of(model);
    if (!R) {
        return LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    std::lock_guard<std::mutex> lk(R->mu);
    if (switches) {
        *switches = R->switches;
    }
    return R->use_scores ? 1 : 0;
}

int32_t llama_pyspecter_set_protected(llama_model * model, int32_t il, const int32_t * experts, int32_t n) {
    auto * R = residency_of(model);
    if (!R || n < 0 || (n > 0 && !experts)) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    std::lock_guard<std::mutex> lk(R->mu);
    if (il == -1) {
        for (auto * L : R->order) {
            std::fill(L->prot.begin(), L->prot.end(), 0);
        }
        return LLAMA_PYSPECTER_OK;
    }
    auto * L = pyspecter_layer_of(model, il);
    if (!L) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    if (n == 0) {
        std::fill(L->prot.begin(), L->prot.end(), 0);
    }
    for (int32_t i = 0; i < n; ++i) {
        if (experts[i] < 0 || experts[i] >= (int32_t) L->prot.size()) {
            return LLAMA_PYSPECTER_ERR_ARG;
        }
        L->prot[experts[i]] = 1;
    }
    return LLAMA_PYSPECTER_OK;
}
