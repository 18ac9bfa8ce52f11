// The native planner: learned layer-ahead maps applied inside the routing op, so that predicting the next layers
// of the token being computed costs no call into the control plane. One planner, one queue: these predictions and
// whatever the control plane schedules between tokens (a draft's routing) all end as (layer, expert, priority,
// deadline) prefetches behind every demand read (residency.cpp).
//
// The math is learned.LearnedPredictor.predict's, map by map: selection scores from the router input, their
// ranking, and a calibration table by rank and by how confident the ranking is (the gap at the top-k boundary).
// A wrong prediction costs reads, never correctness: residency never changes the output.

#include "pyspecter-impl.h"
#include "residency-impl.h" // the planner's settings are kept in native residency, read under its lock

#include "llama-impl.h"

#include <algorithm>
#include <cmath>

// LLAMA_EXPERT_GATING_FUNC_TYPE_*, as learned.py names them
enum { GATING_SIGMOID = 2, GATING_SQRT_SOFTPLUS = 4 };

void pyspecter_ahead_probs(const pyspecter_ahead_map & m, const float * x, float * y_out, float * probs) {
    const int32_t E = (int32_t) m.b.size(), D = m.n_embd;
    float * __restrict y = y_out;
    std::copy(m.b.begin(), m.b.end(), y);
    for (int32_t i = 0; i < D; ++i) { // x W, row by row: the inner loop over experts vectorizes
        const float xi = x[i];
        const float * __restrict row = m.W.data() + (size_t) i * E;
        for (int32_t e = 0; e < E; ++e) {
            y[e] += xi * row[e];
        }
    }
    if (!m.sel_bias.empty()) { // learned.selection_scores: what build_moe_ffn ranks by when it has a bias
        if (m.gating == GATING_SIGMOID) {
            for (int32_t e = 0; e < E; ++e) {
                y[e] = 1.0f / (1.0f + std::exp(-y[e]));
            }
        } else if (m.gating == GATING_SQRT_SOFTPLUS) {
            for (int32_t e = 0; e < E; ++e) {
                y[e] = std::sqrt(std::max(y[e], 0.0f) + std::log1p(std::exp(-std::fabs(y[e]))));
            }
        } else {
            const float mx = *std::max_element(y, y + E);
            float sum = 0.0f;
            for (int32_t e = 0; e < E; ++e) {
                y[e] = std::exp(y[e] - mx);
                sum += y[e];
            }
            for (int32_t e = 0; e < E; ++e) {
                y[e] /= sum;
            }
        }
        for (int32_t e = 0; e < E; ++e) {
            y[e] += m.sel_bias[e];
        }
    }
    // rank by score (ties, which real scores do not have: lower id first), then the table row of the gap's bin
    int32_t order[256];
    std::vector<int32_t> big;
    int32_t * ord = order;
    if (E > 256) {
        big.resize((size_t) E);
        ord = big.data();
    }
    // insertion sort, descending, stable: a few dozen experts, no allocation inside the routing op
    for (int32_t e = 0; e < E; ++e) {
        int32_t j = e;
        for (; j > 0 && y[ord[j - 1]] < y[e]; --j) {
            ord[j] = ord[j - 1];
        }
        ord[j] = e;
    }
    const int32_t k = m.n_used;
    const float gap = k < E ? y[ord[k - 1]] - y[ord[k]] : 0.0f;
    int32_t bin = 0;
    for (float edge : m.edges) {
        bin += gap >= edge;
    }
    const float * row = m.table.data() + (size_t) bin * E;
    for (int32_t r = 0; r < E; ++r) {
        probs[ord[r]] = row[r];
    }
}

// From the routing op of L (R->mu held), one-token ubatches: L's maps' predictions queued as prefetches, through
// pyspecter_native_prefetch. Registered with residency by set_ahead_map.
static void plan_ahead(llama_pyspecter_layer * L, const float * x, int32_t n_embd) {
    auto * s = L->parent;
    const float min_prob = pyspecter_native_min_prob(s);
    if (min_prob < 0.0f || L->ahead.empty() || !x) {
        return;
    }
    const int32_t E = s->n_expert;
    struct cand {
        float p;
        int32_t h, e;
        size_t map;
    };
    // scratch kept by the compute thread: no allocation per routing op once warm
    thread_local std::vector<cand> cands;
    thread_local std::vector<float> y, probs;
    cands.clear();
    y.resize((size_t) E);
    probs.resize(L->ahead.size() * (size_t) E);
    for (size_t i = 0; i < L->ahead.size(); ++i) {
        const auto & m = L->ahead[i];
        // Each target is predicted from the latest source that can still have its experts land in time: a nearer
        // layer predicts better, and every source acting on its own guess would read one expert per source where
        // one is needed. So a map runs where its horizon is in time and the next nearer one would not be (or it
        // is the nearest), and only where a prefetch could follow (a slot to take, an expert to bring): the maps
        // cost the op time.
        if (m.n_embd != n_embd || !pyspecter_native_room(m.dst) || !pyspecter_native_in_time(m.dst, m.h) ||
                (m.h > 1 && pyspecter_native_in_time(m.dst, m.h - 1))) {
            continue;
        }
        float * p = probs.data() + i * (size_t) E;
        pyspecter_ahead_probs(m, x, y.data(), p);
        s->counters.ahead_maps++;
        for (int32_t e = 0; e < E; ++e) {
            if (p[e] >= min_prob && m.dst->remap[e] < 0) {
                cands.push_back({ p[e], m.h, e, i });
            }
        }
    }
    // most probable first, the nearest deadline among equals: as the queue serves them
    std::sort(cands.begin(), cands.end(), [](const cand & a, const cand & b) {
        return a.p != b.p ? a.p > b.p : a.h != b.h ? a.h < b.h : a.e < b.e;
    });
    for (const auto & c : cands) {
        const auto & m = L->ahead[c.map];
        if (!pyspecter_native_in_time(m.dst, m.h)) {
            s->counters.ahead_late++; // the miss path reads it, first in line
            continue;
        }
        if (pyspecter_native_prefetch(m.dst, c.e, c.p, c.h, probs.data() + c.map * (size_t) E)) {
            s->counters.ahead_prefetches++;
        }
    }
}

//
// API
//

int32_t llama_pyspecter_set_ahead_map(llama_model * model, int32_t il_src, int32_t il_dst, const float * W,
                                      const float * b, int32_t n_embd, int32_t n_used, int32_t gating,
                                      const float * sel_bias, const float * table, const float * edges,
                                      int32_t n_bins) {
    auto * s = pyspecter_slots_of(model);
    auto * L = pyspecter_layer_of(model, il_src);
    if (!s || !L || !pyspecter_native_enabled(s)) {
        return s && L ? LLAMA_PYSPECTER_ERR_ARG : LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    try {
        auto lk = pyspecter_native_lock(s);
        if (il_dst == -1) {
            L->ahead.clear();
            return LLAMA_PYSPECTER_OK;
        }
        auto * D = pyspecter_layer_of(model, il_dst);
        const int32_t E = s->n_expert;
        if (!D || !W || !b || !table || n_embd <= 0 || n_used <= 0 || n_used > E || n_bins <= 0 ||
                (n_bins > 1 && !edges)) {
            return LLAMA_PYSPECTER_ERR_ARG;
        }
        int32_t h = 0; // MoE layers from L to D in forward order
        for (auto * N = L->next; N; N = N->next) {
            ++h;
            if (N == D) {
                break;
            }
        }
        if (h == 0 || D->il <= L->il) {
            return LLAMA_PYSPECTER_ERR_ARG; // not a later MoE layer
        }
        pyspecter_ahead_map m;
        m.dst = D;
        m.h = h;
        m.n_embd = n_embd;
        m.n_used = n_used;
        m.gating = gating;
        m.n_bins = n_bins;
        m.W.assign(W, W + (size_t) n_embd * E);
        m.b.assign(b, b + E);
        if (sel_bias) {
            m.sel_bias.assign(sel_bias, sel_bias + E);
        }
        m.table.assign(table, table + (size_t) n_bins * E);
        if (n_bins > 1) {
            m.edges.assign(edges, edges + n_bins - 1);
        }
        auto it = std::find_if(L->ahead.begin(), L->ahead.end(), [&](const pyspecter_ahead_map & o) { return o.dst == D; });
        if (it != L->ahead.end()) {
            *it = std::move(m);
        } else {
            L->ahead.push_back(std::move(m));
        }
        pyspecter_set_native_plan(s, plan_ahead);
        return LLAMA_PYSPECTER_OK;
    } catch (const std::bad_alloc &) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    }
}

int32_t llama_pyspecter_ahead_probs(llama_model * model, int32_t il_src, int32_t il_dst, const float * x,
                                    int32_t n_embd, float * out, int32_t n_expert) {
    auto * s = pyspecter_slots_of(model);
    auto * L = pyspecter_layer_of(model, il_src);
    auto * D = pyspecter_layer_of(model, il_dst);
    if (!s || !L || !D || !x || !out || n_expert != s->n_expert) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    try {
        auto lk = pyspecter_native_lock(s);
        for (const auto & m : L->ahead) {
            if (m.dst == D && m.n_embd == n_embd) {
                std::vector<float> y((size_t) n_expert);
                pyspecter_ahead_probs(m, x, y.data(), out);
                return LLAMA_PYSPECTER_OK;
            }
        }
        return LLAMA_PYSPECTER_ERR_ARG;
    } catch (const std::bad_alloc &) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    }
}

int32_t llama_pyspecter_set_planner(llama_model * model, bool enabled, float min_prob, float max_stall) {
    auto * R = residency_of(model);
    if (!R || !(min_prob >= 0.0f && min_prob <= 1.0f) || !(max_stall >= 0.0f)) {
        return R ? LLAMA_PYSPECTER_ERR_ARG : LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    std::lock_guard<std::mutex> lk(R->mu);
    R->planner = enabled;
    R->min_prob = min_prob;
    R->max_stall = max_stall;
    return LLAMA_PYSPECTER_OK;
}
