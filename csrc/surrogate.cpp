// Surrogates (LLAMA_PYSPECTER_MISS_SURROGATE: approximate, opt-in; the control plane's surrogate.py chooses what
// each expert keeps and hands the kept bytes over once): their store, and their expansion into a layer's reserved
// slots, which the miss mode (residency.cpp) maps a one-token ubatch's misses to. The kept bytes are the target's own quantized rows and blocks, so an expansion is a copy with the
// dropped neurons' bytes zero (an all-zero block is 0.0 in every ggml weight type), not a re-quantization.

#include "residency-impl.h"

#include <algorithm>
#include <cstring>

// bytes of one kept quantization block of a down row (the down projection's rows hold the neurons as columns)
static size_t down_block(const ggml_tensor * t, int32_t group) {
    return t->nb[1] / (size_t) (t->ne[0] / group);
}

// kept bytes per expert of kind k: gate/up the kept neurons' rows, down each row's kept blocks
static size_t kept_per_expert(const ggml_tensor * t, int32_t k, const pyspecter_surrogates & S) {
    if (k == LLAMA_PYSPECTER_KIND_DOWN) {
        return (size_t) t->ne[1] * (size_t) S.n_keep * down_block(t, S.group);
    }
    return (size_t) S.n_keep * (size_t) S.group * t->nb[1];
}

// kind k of expert e's surrogate into S.scratch: the kept neurons' bytes where the expert has them, zero elsewhere
static void expand(pyspecter_surrogates & S, const llama_pyspecter_layer * L, int32_t k, int32_t e) {
    const ggml_tensor * t = L->host[k];
    const size_t row = t->nb[1];
    S.scratch.assign(t->nb[2], 0);
    uint8_t * dst = S.scratch.data();
    const int32_t * gr = S.groups.data() + (size_t) e * (size_t) S.n_keep;
    const uint8_t * src = S.kept[k].data() + (size_t) e * kept_per_expert(t, k, S);
    if (k == LLAMA_PYSPECTER_KIND_DOWN) { // [rows][n_keep][block]
        const size_t block = down_block(t, S.group);
        for (int64_t r = 0; r < t->ne[1]; ++r) {
            for (int32_t j = 0; j < S.n_keep; ++j, src += block) {
                std::memcpy(dst + (size_t) r * row + (size_t) gr[j] * block, src, block);
            }
        }
        return;
    }
    for (int32_t j = 0; j < S.n_keep; ++j) { // [n_keep * group rows][row]
        for (int32_t i = 0; i < S.group; ++i, src += row) {
            std::memcpy(dst + ((size_t) gr[j] * (size_t) S.group + (size_t) i) * row, src, row);
        }
    }
}

bool pyspecter_map_surrogate(pyspecter_residency * R, llama_pyspecter_layer * L, int32_t e) {
    pyspecter_surrogates * P = L->il < (int32_t) R->sur.size() ? R->sur[L->il].get() : nullptr;
    if (!P) {
        return false; // no surrogates for this layer: the host path computes e exactly
    }
    pyspecter_surrogates & S = *P;
    int32_t r = -1;
    for (int32_t i = 0; i < S.n_reserved; ++i) {
        if (L->owner[S.first + i] >= 0) {
            continue; // mapped for this ubatch already
        }
        if (S.in[i] == e) {
            r = i;
            break;
        }
        r = r < 0 ? i : r;
    }
    if (r < 0) {
        return false;
    }
    if (S.in[r] != e) {
        S.in[r] = -1; // until every kind is written
        for (int32_t k = 0; k < LLAMA_PYSPECTER_N_KINDS; ++k) {
            if (!L->host[k]) {
                continue;
            }
            if (S.kept[k].empty()) {
                return false; // the control plane has not handed this kind over
            }
            expand(S, L, k, e);
            const int32_t rc = pyspecter_run_copy(L->parent->counters, [&] {
                return pyspecter_write_one(L, k, S.first + r, S.scratch.data(), S.scratch.size());
            });
            if (rc != LLAMA_PYSPECTER_OK) {
                return false;
            }
        }
        S.in[r] = e;
    }
    pyspecter_remap_set(L, e, S.first + r);
    S.mapped.push_back(e);
    R->surrogate_uses++;
    return true;
}

void pyspecter_unmap_surrogates(pyspecter_residency * R, llama_pyspecter_layer * L) {
    pyspecter_surrogates & S = *R->sur[L->il];
    for (int32_t e : S.mapped) {
        const int32_t slot = L->remap[e];
        if (slot >= S.first && slot < S.first + S.n_reserved) { // not resident in full since
            pyspecter_remap_set(L, e, -1);
        }
    }
    S.mapped.clear();
}

//
// API
//

int32_t llama_pyspecter_set_surrogates(llama_model * model, int32_t il, int32_t first, int32_t n_reserved,
                                       int32_t group, const int32_t * groups, int32_t n_keep) {
    auto * R = residency_of(model);
    auto * L = pyspecter_layer_of(model, il);
    if (!R || !L || !groups || n_reserved <= 0 || first < L->n_usable + L->n_held ||
            first + n_reserved > (int32_t) L->owner.size() || group <= 0 || n_keep <= 0 ||
            !L->host[LLAMA_PYSPECTER_KIND_DOWN] || L->host[LLAMA_PYSPECTER_KIND_GATE_UP]) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    const int64_t n_ff = L->host[LLAMA_PYSPECTER_KIND_DOWN]->ne[0];
    const size_t E = L->remap.size();
    if (n_ff % group != 0 || n_keep > n_ff / group ||
            std::any_of(groups, groups + E * (size_t) n_keep, [&](int32_t g) { return g < 0 || g >= n_ff / group; })) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    return pyspecter_guarded(__func__, [&]() -> int32_t {
        auto S = std::make_unique<pyspecter_surrogates>();
        S->first = first;
        S->n_reserved = n_reserved;
        S->group = group;
        S->n_keep = n_keep;
        S->groups.assign(groups, groups + E * (size_t) n_keep);
        S->in.assign((size_t) n_reserved, -1);
        std::lock_guard<std::mutex> lk(R->mu);
        if (R->sur.empty()) {
            R->sur.resize(R->s->layers.size());
        }
        R->sur[il] = std::move(S);
        return LLAMA_PYSPECTER_OK;
    });
}

int32_t llama_pyspecter_set_surrogate_bytes(llama_model * model, int32_t il, int32_t kind, const void * data,
                                            size_t nbytes) {
    auto * R = residency_of(model);
    auto * L = pyspecter_layer_of(model, il);
    if (!R || !L || !data || kind < 0 || kind >= LLAMA_PYSPECTER_KIND_GATE_UP || !L->host[kind]) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    std::lock_guard<std::mutex> lk(R->mu);
    pyspecter_surrogates * S = il < (int32_t) R->sur.size() ? R->sur[il].get() : nullptr;
    if (!S || nbytes != L->remap.size() * kept_per_expert(L->host[kind], kind, *S)) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    return pyspecter_guarded(__func__, [&]() -> int32_t {
        S->kept[kind].assign((const uint8_t *) data, (const uint8_t *) data + nbytes);
        return LLAMA_PYSPECTER_OK;
    });
}

int64_t llama_pyspecter_surrogate_uses(const llama_model * model) {
    auto * s = pyspecter_slots_of(model);
    return s && s->res ? s->res->surrogate_uses.load() : (int64_t) LLAMA_PYSPECTER_ERR_NO_SLOTS;
}
