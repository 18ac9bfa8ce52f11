// The graph side: the routing op that splits each MoE layer's rows between slots and the host copy, the wait op of
// the late path, and the matmuls built on them.

#include "pyspecter-impl.h"

#include <algorithm>
#include <cstring>
#include <vector>

// A split route (pyspecter-graph.h) has one plane: the host path's ids. Per-matmul routes have two or three.
static bool is_split(const ggml_tensor * route) {
    return route && route->op == GGML_OP_CUSTOM && route->ne[2] == 1;
}

void llama_pyspecter_set_route_cb(llama_model * model, llama_pyspecter_route_cb cb, void * user_data) {
    if (auto * s = pyspecter_slots_of(model)) {
        s->route_cb = cb;
        s->route_ud = user_data;
    }
}

void llama_pyspecter_set_input_cb(llama_model * model, llama_pyspecter_input_cb cb, void * user_data) {
    if (auto * s = pyspecter_slots_of(model)) {
        s->input_cb = cb;
        s->input_ud = user_data;
    }
}

void llama_pyspecter_set_route_weights(llama_model * model, bool enabled) {
    if (auto * s = pyspecter_slots_of(model)) {
        s->route_weights = enabled;
    }
}

void llama_pyspecter_set_wait_cb(llama_model * model, llama_pyspecter_wait_cb cb, void * user_data) {
    if (auto * s = pyspecter_slots_of(model)) {
        s->wait_cb = cb;
        s->wait_ud = user_data;
    }
}

int32_t llama_pyspecter_set_late(llama_model * model, int32_t il, int32_t expert, int32_t slot) {
    auto * s = pyspecter_slots_of(model);
    auto * L = pyspecter_layer_of(model, il);
    if (!L || !s->wait_cb || expert < 0 || expert >= (int32_t) L->late.size() || slot < 0 ||
            slot >= (int32_t) L->owner.size()) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    pyspecter_late_set(L, expert, slot);
    return LLAMA_PYSPECTER_OK;
}

// The router input x (src[2] of the op, when it was built with one) to the input hook, then native residency's
// decision for ids [n_tokens][n_used]. Returns native residency's lock, held (not owning: not enabled), so the
// caller can apply the remap under the same snapshot.
static std::unique_lock<std::mutex> decide(llama_pyspecter_layer * L, const ggml_tensor * x, const ggml_tensor * raw,
                                           const int32_t * ids, int32_t n_tokens, int32_t n_used, bool with_late,
                                           bool served) {
    auto * s = L->parent;
    if (x && s->input_cb) {
        const int64_t c0 = pyspecter_now_ns();
        s->input_cb(s->input_ud, L->il, n_tokens, (int32_t) x->ne[0], (const float *) x->data);
        s->counters.hook_ns += pyspecter_now_ns() - c0;
    }
    std::unique_lock<std::mutex> native = pyspecter_native_lock(s);
    if (native.owns_lock()) {
        const float * x_last = x && x->type == GGML_TYPE_F32 && n_tokens > 0 ? // a batch's next token is its last's
                (const float *) x->data + (size_t) (n_tokens - 1) * x->ne[0] : nullptr;
        const float * raw_last = x_last && raw && raw->type == GGML_TYPE_F32 ? (const float *) raw->data : nullptr;
        pyspecter_native_route(L, ids, n_tokens, n_used, with_late, served, x_last, x ? (int32_t) x->ne[0] : 0,
                               raw_last);
    }
    return native;
}

// The experts one routing call of layer L selected (ids [n_tokens][n_used], -1: none), counted for the control plane
// (llama_pyspecter_take_uses). On the host side of the layer, which has the ids already: no copy, no wait.
static void count_uses(llama_pyspecter_layer * L, const int32_t * ids, int32_t n_tokens, int32_t n_used) {
    const size_t E = L->remap.size();
    if (L->uses.size() != E + 1) {
        L->uses.assign(E + 1, 0);
    }
    for (int32_t i = 0; i < n_tokens * n_used; ++i) {
        if (ids[i] >= 0 && (size_t) ids[i] < E) {
            L->uses[ids[i]]++;
        }
    }
    L->uses[E] += (uint32_t) n_tokens;
}

int32_t llama_pyspecter_take_uses(llama_model * model, int32_t min_tokens, uint32_t * out, int32_t n) {
    auto * s = pyspecter_slots_of(model);
    if (!s) {
        return model ? LLAMA_PYSPECTER_ERR_NO_SLOTS : LLAMA_PYSPECTER_ERR_ARG;
    }
    const size_t E = (size_t) s->n_expert;
    if (!out || n < 0 || (size_t) n < s->layers.size() * E) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    int64_t routed = 0; // the first slot layer's: every slot layer routes every token
    for (const auto & L : s->layers) {
        if (L) {
            routed = L->uses.size() == E + 1 ? L->uses[E] : 0;
            break;
        }
    }
    if (routed <= 0 || routed < min_tokens) {
        return 0;
    }
    for (size_t il = 0; il < s->layers.size(); ++il) {
        auto * L = s->layers[il].get();
        const bool counted = L && L->uses.size() == E + 1;
        for (size_t e = 0; e < E; ++e) {
            out[il * E + e] = counted ? L->uses[e] : 0;
        }
        if (counted) {
            std::fill(L->uses.begin(), L->uses.end(), 0u);
        }
    }
    return (int32_t) std::min<int64_t>(routed, INT32_MAX);
}

// Router weights [1, n_used, n_tokens] (any strides) as [n_tokens][n_used] floats, for the routing hook.
static void pack_weights(const ggml_tensor * w, int32_t n_tokens, int32_t n_used, float * out) {
    for (int32_t t = 0; t < n_tokens; ++t) {
        for (int32_t j = 0; j < n_used; ++j) {
            out[t * n_used + j] = *(const float *) ((const char *) w->data + t * w->nb[2] + j * w->nb[1]);
        }
    }
}

static void route_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    // the CPU backend calls a custom op on every thread whatever n_tasks says; the hook must run once
    if (ith != 0) {
        return;
    }
    auto * L = (llama_pyspecter_layer *) userdata;
    auto * s = L->parent;
    // a device layer's ids come from the device: the scheduler synchronised it before this CPU split
    pyspecter_drained_scope drained;
    const ggml_tensor * ids = dst->src[0]; // [n_used, n_tokens], may be a strided view (top-k of argsort)
    const ggml_tensor * w   = dst->src[1]; // [1, n_used, n_tokens], or null (route weights off)
    const int32_t n_used   = (int32_t) ids->ne[0];
    const int32_t n_tokens = (int32_t) ids->ne[1];
    pyspecter_op_timer timer(s->counters, n_tokens == 1 ? PYSPECTER_OP_ROUTE_DECODE : PYSPECTER_OP_ROUTE);

    // planes of dst: contiguous [n_tokens][n_used] each
    int32_t * slot_ids = (int32_t *) dst->data;
    int32_t * host_ids = slot_ids + (size_t) n_used * n_tokens;

    for (int32_t t = 0; t < n_tokens; ++t) {
        for (int32_t j = 0; j < n_used; ++j) {
            host_ids[t * n_used + j] = *(const int32_t *) ((const char *) ids->data + t * ids->nb[1] + j * ids->nb[0]);
        }
    }
    const bool with_late = dst->ne[2] > 2;
    int32_t * late_ids = with_late ? host_ids + (size_t) n_used * n_tokens : nullptr;
    if (with_late) {
        pyspecter_late_reset(L);
    }
    // the lock also covers the remap below: the tables the matmuls read are one snapshot
    auto native = decide(L, dst->src[2], dst->src[4], host_ids, n_tokens, n_used, with_late, /*served=*/false);
    pyspecter_draft_observe(L, host_ids, w, n_tokens, n_used); // a draft's step, or the window it handed over
    count_uses(L, host_ids, n_tokens, n_used);
    if (s->route_cb) {
        // with native residency the hook only observes (traces, predictors): the decision is made
        // router weights, packed the same way (slot_ids is scratch until the remap below)
        static_assert(sizeof(float) == sizeof(int32_t), "");
        float * wts = w ? (float *) slot_ids : nullptr;
        if (w) {
            pack_weights(w, n_tokens, n_used, wts);
        }
        const int64_t c0 = pyspecter_now_ns();
        s->route_cb(s->route_ud, L->il, n_tokens, n_used, host_ids, wts);
        s->counters.hook_ns += pyspecter_now_ns() - c0;
    }
    int64_t hit = 0;
    bool missed = false; // some row's expert not resident (late rows included): the layer's CPU counts as a miss's
    for (int32_t i = 0; i < n_used * n_tokens; ++i) {
        const int32_t e = host_ids[i];
        const bool known = e >= 0 && e < (int32_t) L->remap.size();
        // distinct per row of a token, as a device needs
        const int32_t zero = pyspecter_miss_id(L, i % n_used, known ? e : -1);
        const int32_t slot = known ? L->remap[e] : -1;
        const int32_t late = with_late && slot < 0 && e >= 0 && e < (int32_t) L->late.size() ? L->late[e] : -1;
        missed = missed || slot < 0;
        if (slot >= 0) {
            slot_ids[i] = slot;
            host_ids[i] = -1;
            ++hit;
        } else if (late >= 0) {
            slot_ids[i] = zero;
            host_ids[i] = -1;
            ++hit; // computed from a slot, only later
        } else {
            slot_ids[i] = zero;
        }
        if (with_late) {
            late_ids[i] = late >= 0 ? late : zero;
        }
        // a device kernel reads an id outside its slots out of bounds: on a device every id is a slot, a zero slot,
        // or ~expert where its kernel takes negative ids
        GGML_ASSERT(L->miss_slot < 0 || (pyspecter_valid_slot_id(L, slot_ids[i]) &&
                                         (!with_late || pyspecter_valid_slot_id(L, late_ids[i]))));
    }
    s->counters.hit_rows  += hit;
    s->counters.miss_rows += (int64_t) n_used * n_tokens - hit;
    s->counters.route_calls += 1;
    // native residency may have read its misses in already (miss mode wait): its decision says whether it missed
    timer.missed = missed || (native.owns_lock() && L->route_missed);
}

// The host side of a layer whose slot path has run from the table already (a split route's op, or a speculated
// layer after its ubatch): native residency decides for the next ubatches (what lands reaches the device at the
// next fence, an eviction at once only where the layer may still run), a draft observes, the routing hook hears
// it. ids: the logical ids [n_tokens][n_used]. Returns whether native residency decided.
static bool after_slot_path(llama_pyspecter_layer * L, const ggml_tensor * x, const ggml_tensor * raw,
                            const ggml_tensor * w, const int32_t * ids, int32_t n_tokens, int32_t n_used) {
    auto * s = L->parent;
    const bool native = decide(L, x, raw, ids, n_tokens, n_used, false, true).owns_lock(); // released at once
    pyspecter_draft_observe(L, ids, w, n_tokens, n_used); // a draft's step, or the window it handed over
    count_uses(L, ids, n_tokens, n_used);
    if (s->route_cb) {
        thread_local std::vector<float> wts;
        if (w) {
            wts.resize((size_t) n_tokens * n_used);
            pack_weights(w, n_tokens, n_used, wts.data());
        }
        const int64_t c0 = pyspecter_now_ns();
        s->route_cb(s->route_ud, L->il, n_tokens, n_used, ids, w ? wts.data() : nullptr);
        s->counters.hook_ns += pyspecter_now_ns() - c0;
    }
    return native;
}

void pyspecter_route_settled(llama_pyspecter_layer * L, const int32_t * pairs, int32_t n_tokens, int32_t n_used) {
    auto * s = L->parent;
    const int32_t n = n_tokens * n_used;
    thread_local std::vector<int32_t> ids;
    ids.assign(pairs + n, pairs + 2 * n); // the experts, after the slots
    after_slot_path(L, nullptr, nullptr, nullptr, ids.data(), n_tokens, n_used);
    int64_t hit = 0; // a row that missed was read from the host copy (a mapped layer; any other was redone)
    for (int32_t i = 0; i < n; ++i) {
        hit += !pyspecter_is_zero_slot(L, pairs[i]);
    }
    s->counters.hit_rows += hit;
    s->counters.miss_rows += n - hit;
    s->counters.mapped_rows += n - hit;
    s->counters.route_calls += 1;
}

// (slot, expert) of row i = t * n_used + j of a split route's pack [n_embd + 2 n_used, n_tokens] (k = 0, 1): token
// t's row of the pack ends with its n_used pairs, as floats (exact: ids are far below 2^24).
static int32_t pack_pair(const ggml_tensor * pack, int32_t n_used, int32_t i, int k) {
    const int64_t t = i / n_used, col = pack->ne[0] - 2 * (int64_t) n_used + 2 * (i % n_used) + k;
    return (int32_t) *(const float *) ((const char *) pack->data + t * pack->nb[1] + col * pack->nb[0]);
}

// The host path's input [n_embd, 1, n_tokens], unpacked from the pack that the route op reads too: one read back
// from the device serves both (as two tensors they would be two, each a host wait).
static void unpack_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(userdata);
    const ggml_tensor * pack = dst->src[0];
    const size_t row = (size_t) dst->ne[0] * sizeof(float);
    for (int64_t t = ith; t < dst->ne[2]; t += nth) {
        memcpy((char *) dst->data + t * dst->nb[2], (const char *) pack->data + t * pack->nb[1], row);
    }
}

// The route op of a split route: on the CPU, after the device ran the layer's slot path from its table. src[0] is
// the pack, whose rows end with what the device looked up, (slot, expert) per (token, expert) row; the host
// computes exactly the rows it sent to the zero slot, so the two paths share one snapshot of residency whatever the
// table held.
static void route_split_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    auto * L = (llama_pyspecter_layer *) userdata;
    auto * s = L->parent;
    pyspecter_drained_scope drained;
    pyspecter_mark_passed(L); // this CPU split began after the device finished the split before it: the slot path
    const ggml_tensor * pack = dst->src[0]; // [n_embd + 2 n_used, n_tokens]
    const ggml_tensor * w    = dst->src[1]; // [1, n_used, n_tokens], or null (route weights off)
    const int32_t n_used   = (int32_t) dst->ne[0];
    const int32_t n_tokens = (int32_t) dst->ne[1];
    const int32_t n        = n_used * n_tokens;
    pyspecter_op_timer timer(s->counters, n_tokens == 1 ? PYSPECTER_OP_ROUTE_DECODE : PYSPECTER_OP_ROUTE);

    int32_t * host_ids = (int32_t *) dst->data;
    for (int32_t i = 0; i < n; ++i) {
        host_ids[i] = pack_pair(pack, n_used, i, 1);
    }
    const bool native = after_slot_path(L, dst->src[2], dst->src[4], w, host_ids, n_tokens, n_used);
    int64_t hit = 0;
    for (int32_t i = 0; i < n; ++i) {
        if (!pyspecter_is_zero_slot(L, pack_pair(pack, n_used, i, 0))) {
            host_ids[i] = -1;
            ++hit;
        }
    }
    s->counters.hit_rows  += hit;
    s->counters.miss_rows += n - hit;
    s->counters.route_calls += 1;
    timer.missed = hit < n || (native && L->route_missed);
}

// Runs after the resident experts' matmul (its src[1], for ordering only): waits for the layer's late uploads
// through the wait hook, then hands the late plane to the third matmul.
static void wait_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    auto * L = (llama_pyspecter_layer *) userdata;
    auto * s = L->parent;
    const ggml_tensor * route = dst->src[0];
    const size_t n = (size_t) route->ne[0] * route->ne[1];
    const int32_t * late_ids = (const int32_t *) route->data + 2 * n;
    bool any = false;
    for (size_t i = 0; i < n && !any; ++i) {
        any = late_ids[i] >= 0;
    }
    if (any && pyspecter_native_enabled(s)) {
        if (!L->late_settled.load(std::memory_order_acquire)) { // the first of the layer's wait ops waits for all
            pyspecter_native_wait(L);
        }
    } else if (any && s->wait_cb) {
        const int64_t c0 = pyspecter_now_ns();
        s->wait_cb(s->wait_ud, L->il);
        s->counters.hook_ns += pyspecter_now_ns() - c0;
    }
    memcpy(dst->data, late_ids, n * sizeof(int32_t));
}

// The graph this thread may build next (speculate.cpp's begin_ubatch sets it, its redo clears it): the
// scheduler's speculation state, which the build records its form and speculated layers in, and whether to
// speculate. Null while nothing began (graph reserves, other threads): the split form, nothing recorded.
static thread_local pyspecter_spec * t_building = nullptr;
static thread_local bool t_speculate = false;

void pyspecter_build_for(pyspecter_spec * st, bool speculate) {
    t_building = st;
    t_speculate = st && speculate;
}

pyspecter_spec * pyspecter_build_state() {
    return t_building;
}

bool llama_pyspecter_speculating() {
    return t_speculate;
}

// Whether slot layer L of the graph being built is built speculated, given whether it could be (eligible); the
// graph's first slot layer records the form the graph is built in.
static bool speculate_layer(llama_pyspecter_layer * L, bool eligible) {
    pyspecter_spec * st = t_building;
    if (!st || st->owner != L->parent) { // not a build begin_ubatch began (left over by an aborted ubatch)
        return false;
    }
    if (st->listed != st->ubatch) {
        st->listed = st->ubatch;
        st->built = t_speculate;
        st->layers.clear();
    }
    if (!t_speculate || !eligible) {
        return false;
    }
    st->layers.push_back(L);
    return true;
}

// The ids of a speculated layer's matmuls over the host copy (mapped.cpp), from the slot path's: ~id, the expert
// where the slot path missed (its id is ~expert there: pyspecter_miss_id) and negative where it hit, a zero row.
// Three small ops on the device (there is no integer arithmetic in ggml's CUDA ops), exact: ids are far below 2^24.
static ggml_tensor * mapped_ids(ggml_context * ctx, ggml_tensor * slot_ids, int il) {
    ggml_tensor * f = ggml_scale_bias(ctx, ggml_cast(ctx, slot_ids, GGML_TYPE_F32), -1.0f, -1.0f);
    ggml_tensor * ids = ggml_cast(ctx, f, GGML_TYPE_I32);
    ggml_format_name(ids, "ffn_moe_mapped_ids-%d", il);
    return ids;
}

ggml_tensor * llama_pyspecter_build_route(ggml_context * ctx, const llama_pyspecter_slots * slots, int il,
                                          ggml_tensor * selected_experts, ggml_tensor * weights,
                                          ggml_tensor * ffn_inp, bool allow_split) {
    llama_pyspecter_layer * L = slots ? slots->layer(il) : nullptr;
    if (!L) {
        return nullptr;
    }
    // the input is read as contiguous f32 rows; any other form is simply not offered to the hook
    const bool with_input = (slots->input_cb || pyspecter_native_wants_input(slots)) && ffn_inp &&
            ffn_inp->type == GGML_TYPE_F32 && ggml_is_contiguous(ffn_inp);
    // the reuse scores' map · x for the ubatch's last token (the op's x_last), as a matmul of the graph
    ggml_tensor * raw = nullptr;
    if (with_input && L->reuse_t && L->reuse_t->ne[0] == ffn_inp->ne[0]) {
        const int64_t D = ffn_inp->ne[0], n_tokens = ggml_nelements(ffn_inp) / D;
        ggml_tensor * x_last = ggml_view_2d(ctx, ffn_inp, D, 1, D * ggml_element_size(ffn_inp),
                                            (size_t) ((n_tokens - 1) * D) * ggml_element_size(ffn_inp));
        raw = ggml_mul_mat(ctx, L->reuse_t, x_last);
        ggml_format_name(raw, "ffn_moe_reuse-%d", il);
    }
    const bool split = allow_split && L->table >= 0 && slots->cpu_anchor && !slots->wait_cb &&
            !pyspecter_native_late(slots) && ffn_inp && ffn_inp->type == GGML_TYPE_F32 && ggml_is_contiguous(ffn_inp);
    // speculated (speculate.cpp): the split form less its host path, where nothing on the host reads the layer
    // mid-ubatch; prompt-sized ubatches only where the misses are read from the host copy (nothing to redo)
    const int64_t n_tok = selected_experts->ne[1];
    const bool speculate = speculate_layer(L, split && !with_input && !slots->route_weights &&
                                               selected_experts->ne[0] == slots->n_used && // the log's layout
                                               (n_tok <= PYSPECTER_SPEC_MAX_TOKENS ||
                                                (pyspecter_is_mapped(L) && n_tok <= PYSPECTER_LOG_MAX_TOKENS)));
    if (split) {
        // (slot, expert) of every (token, expert) row, looked up on the device: the slot path's ids (where row j's
        // expert is not resident, what a miss reads: pyspecter_miss_id, never a slot twice in a token), and packed
        // behind the layer's input for the host to read back in one copy; ordered misses, Python's or C's, keep
        // the per-matmul route: their late path needs it
        const auto & tab = slots->tables[L->table];
        const int64_t D = ffn_inp->ne[0], n_used = selected_experts->ne[0];
        const int64_t E = slots->n_expert, n = n_used * n_tok;
        GGML_ASSERT(n_used <= slots->n_used && "more rows per token than table planes");
        // the layer's row as planes [2, n_expert, n_used]: row j of a token looks up its expert in plane j, which
        // get_rows does in one op with the ids transposed ([n_tokens, n_used]: ids[t, j] reads plane j)
        const size_t ts = ggml_element_size(tab.t);
        ggml_tensor * planes = ggml_view_3d(ctx, tab.t, 2, E, n_used, 2 * ts, 2 * E * ts,
                                            (size_t) L->table_row * tab.t->nb[1]);
        ggml_tensor * pairs = ggml_get_rows(ctx, planes, ggml_transpose(ctx, selected_experts)); // [2, n_tok, n_used]
        ggml_format_name(pairs, "ffn_moe_slot_pairs-%d", il);
        // laid out [n_used, n_tokens, 2]: the slots, then the experts, each in the router's order, so the slot path's
        // ids are the first plane as it is. Speculated, they go to the layer's row of the device's log, which the host
        // reads once after the ubatch, and the slot path reads its ids from what was logged (so the copy runs first)
        ggml_tensor * by_row = ggml_permute(ctx, pairs, 2, 1, 0, 3);
        ggml_tensor * flat = speculate
                ? ggml_cpy(ctx, by_row, ggml_view_3d(ctx, tab.spec_log, n_used, n_tok, 2, n_used * ts, n * ts,
                                                     pyspecter_log_offset(L, n_tok) * ts))
                : ggml_cont(ctx, by_row);
        ggml_format_name(flat, speculate ? "ffn_moe_spec_log-%d" : "ffn_moe_slot_flat-%d", il);
        ggml_tensor * slot_ids = ggml_view_2d(ctx, flat, n_used, n_tok, n_used * ts, 0);
        ggml_format_name(slot_ids, "ffn_moe_slot_ids-%d", il);
        slots->split_built = true;
        if (speculate) {
            ggml_tensor * from_host = pyspecter_is_mapped(L) ? mapped_ids(ctx, slot_ids, il) : nullptr;
            std::lock_guard<std::mutex> lk(slots->graph_mu);
            slots->split_routes[slot_ids] = { slot_ids, ffn_inp, nullptr, true, from_host };
            return slot_ids; // the route: build_mm_id and on_path know it by its entry
        }
        // [n_embd + 2 n_used, n_tokens]: each token's input, then its (slot, expert) pairs as floats. Stock's host
        // layer reads back its input and its expert ids; this reads back one tensor
        ggml_tensor * pack = ggml_concat(ctx, ggml_reshape_2d(ctx, ffn_inp, D, n_tok),
                                         ggml_reshape_2d(ctx, ggml_cast(ctx, ggml_permute(ctx, pairs, 0, 2, 1, 3),
                                                                        GGML_TYPE_F32), 2 * n_used, n_tok),
                                         0);
        ggml_format_name(pack, "ffn_moe_host_pack-%d", il);
        ggml_tensor * unpack_args[2] = { pack, slots->cpu_anchor }; // the anchor keeps the op on the CPU
        ggml_tensor * x_host = ggml_custom_4d(ctx, GGML_TYPE_F32, D, 1, n_tok, 1, unpack_args, 2, unpack_op,
                                              GGML_N_TASKS_MAX, nullptr);
        ggml_format_name(x_host, "ffn_moe_host_inp-%d", il);
        ggml_tensor * args[5] = { pack, slots->route_weights ? weights : nullptr, with_input ? x_host : nullptr,
                                  slots->cpu_anchor, raw };
        ggml_tensor * route = ggml_custom_4d(ctx, GGML_TYPE_I32, n_used, n_tok, 1, 1, args, raw ? 5 : 4,
                                             route_split_op, 1, (void *) L);
        {
            std::lock_guard<std::mutex> lk(slots->graph_mu);
            slots->split_routes[route] = { slot_ids, ffn_inp, x_host, false };
        }
        return route;
    }
    // fixed places: 1 the router weights (or null), 2 the input (or null), 3 the CPU anchor of device layers (or
    // null), 4 the reuse map · x
    ggml_tensor * args[5] = { selected_experts, slots->route_weights ? weights : nullptr,
                              with_input ? ffn_inp : nullptr, slots->cpu_anchor, raw };
    const int n_args = raw ? 5 : slots->cpu_anchor ? 4 : with_input ? 3 : 2;
    // one task: the op is tiny (route_op itself makes sure only thread 0 works)
    return ggml_custom_4d(ctx, GGML_TYPE_I32, selected_experts->ne[0], selected_experts->ne[1],
                          slots->wait_cb || pyspecter_native_late(slots) ? 3 : 2, 1, args, n_args, route_op, 1,
                          (void *) L);
}

// The parts build_route made for a split or speculated route (found: its entry; otherwise none).
static bool parts_of(const llama_pyspecter_slots * slots, const ggml_tensor * route,
                     llama_pyspecter_slots::split_parts * out) {
    std::lock_guard<std::mutex> lk(slots->graph_mu);
    auto it = slots->split_routes.find(route); // set by build_route of this very graph
    if (it == slots->split_routes.end()) {
        return false;
    }
    *out = it->second;
    return true;
}

// A speculated route is the slot path's ids (never a custom op, as split and per-matmul routes are: an entry left by
// an earlier graph at the same address cannot pass for one)
static bool is_speculated(const llama_pyspecter_slots * slots, const ggml_tensor * route) {
    llama_pyspecter_slots::split_parts parts;
    return route && route->op != GGML_OP_CUSTOM && parts_of(slots, route, &parts) && parts.speculated;
}

// A speculated route whose misses the device reads from the host copy (mapped.cpp): its ids there, else null.
static ggml_tensor * mapped_ids_of(const llama_pyspecter_slots * slots, const ggml_tensor * route) {
    llama_pyspecter_slots::split_parts parts;
    return slots && route && route->op != GGML_OP_CUSTOM && parts_of(slots, route, &parts) && parts.speculated
            ? parts.mapped_ids : nullptr;
}

int llama_pyspecter_n_paths(const ggml_tensor * route) {
    // a mapped route is known by the graph being built (build_route just made it): its slots are the build's
    const pyspecter_spec * st = pyspecter_build_state();
    return is_split(route) || (st && mapped_ids_of(st->owner, route)) ? 2 : 1;
}

ggml_tensor * llama_pyspecter_on_path(const llama_pyspecter_slots * slots, ggml_tensor * t, const ggml_tensor * route,
                                      int path) {
    if (!t || !slots) {
        return t;
    }
    // both paths of a mapped route are on the device; a split route's host path reads the host's own tensors
    const bool on_device = path == 0 ? is_split(route) || is_speculated(slots, route)
                                     : path == 1 && mapped_ids_of(slots, route) != nullptr;
    if (!on_device) {
        return t;
    }
    auto it = slots->on_device.find(t);
    return it == slots->on_device.end() ? t : it->second;
}

// An expert matmul whose ids may be negative, each a zero row (GGML_MUL_MAT_ID_NEGATIVE_ZERO, patches 0001 and
// 0008): the host path's, and a slot path's where its layer has no zero slots. A device kernel that honours the
// mark is told so; one with zero slots never sees a negative id and its op stays stock's.
static ggml_tensor * mm_id(ggml_context * ctx, ggml_tensor * w, ggml_tensor * cur, ggml_tensor * ids, bool negative) {
    ggml_tensor * t = ggml_mul_mat_id(ctx, w, cur, ids);
    t->op_params[GGML_MUL_MAT_ID_NEGATIVE_ZERO] = negative ? 1 : 0;
    return t;
}

ggml_tensor * llama_pyspecter_build_mm_id(ggml_context * ctx, const llama_pyspecter_slots * slots,
                                          ggml_tensor * w, ggml_tensor * cur, ggml_tensor * ids,
                                          ggml_tensor * route, int path) {
    GGML_UNUSED(ids);
    if (!slots || !route) {
        return nullptr;
    }
    auto it = slots->slot_of_host.find(w);
    if (it == slots->slot_of_host.end()) {
        return nullptr;
    }
    llama_pyspecter_layer * L = it->second.layer;
    ggml_tensor * slot_w = L->slot[it->second.kind];
    const bool neg = L->n_zero == 0; // the slot path's misses are negative ids
    llama_pyspecter_slots::split_parts parts;
    if (route->op != GGML_OP_CUSTOM && parts_of(slots, route, &parts) && parts.speculated) {
        if (path == 0) {
            return mm_id(ctx, slot_w, cur, route, neg); // the slot path: the route is its ids
        }
        // a mapped route's path 1: the misses, read by the device from the host copy (ids negative where the slot
        // path hit); each row is exact on one path and zero on the other, and the down projections are added
        ggml_tensor * from_host = L->mapped[it->second.kind];
        GGML_ASSERT(parts.mapped_ids && from_host && "path 1 of a speculated route that is not mapped");
        return mm_id(ctx, from_host, cur, parts.mapped_ids, true);
    }
    if (is_split(route)) {
        parts_of(slots, route, &parts);
        if (path == 0) {
            // never null: without it the caller would build the host matmul on both paths
            GGML_ASSERT(parts.slot_ids != nullptr && "a split route without its slot ids");
            return mm_id(ctx, slot_w, cur, parts.slot_ids, neg);
        }
        // the layer's input, as the host unpacked it (another input, e.g. weighted before the FFN, is read back alone)
        ggml_tensor * host_ids = ggml_view_2d(ctx, route, route->ne[0], route->ne[1], route->nb[1], 0);
        return mm_id(ctx, w, cur == parts.ffn_inp ? parts.x_host : cur, host_ids, true);
    }

    ggml_tensor * slot_ids = ggml_view_2d(ctx, route, route->ne[0], route->ne[1], route->nb[1], 0);
    ggml_tensor * host_ids = ggml_view_2d(ctx, route, route->ne[0], route->ne[1], route->nb[1], route->nb[2]);
    ggml_tensor * a = mm_id(ctx, slot_w, cur, slot_ids, neg);
    ggml_tensor * b = mm_id(ctx, w, cur, host_ids, true);
    // every row is exact in one term and exactly zero in the other, so the sum is the stock result bit for bit
    ggml_tensor * res = ggml_add(ctx, a, b);
    if (route->ne[2] > 2) {
        // late rows: from their slots, once uploaded; the wait depends on `res` so resident rows go first
        ggml_tensor * args[3] = { route, res, slots->cpu_anchor }; // the anchor keeps the op on the CPU
        ggml_tensor * late_ids = ggml_custom_4d(ctx, GGML_TYPE_I32, route->ne[0], route->ne[1], 1, 1, args,
                                                slots->cpu_anchor ? 3 : 2, wait_op, 1, (void *) L);
        res = ggml_add(ctx, res, mm_id(ctx, slot_w, cur, late_ids, neg));
    }
    return res;
}
