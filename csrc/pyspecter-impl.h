// Internal side of llama-pyspecter.h: the slot state a model owns (llama_model::pyspecter_slots) and the helpers
// the csrc/ files share. llama.cpp itself sees only pyspecter-graph.h.
#pragma once

#include "llama-pyspecter.h"
#include "pyspecter-graph.h"
#include "pyspecter-log.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

struct llama_model;
struct llama_pyspecter_layer;
struct llama_pyspecter_slots;
struct pyspecter_read;
struct pyspecter_residency;
struct pyspecter_draft;

// One learned layer-ahead map (planner.cpp, llama_pyspecter_set_ahead_map): from a layer's router input to the
// routing of layer dst, h MoE layers later, and the calibration that turns its ranking into probabilities.
struct pyspecter_ahead_map {
    llama_pyspecter_layer * dst = nullptr;
    int32_t h = 0;
    int32_t n_embd = 0, n_used = 0, gating = 0, n_bins = 0;
    std::vector<float> W, b, sel_bias, table, edges; // [n_embd][E], [E], [E] or empty, [n_bins][E], [n_bins - 1]
};

// One device's upload stream, through ggml's generic backend API: a backend instance of its own for the device
// (ggml_backend_dev_init; on CUDA that is a stream of its own), copies issued with set_tensor_async (from the
// model's pinned host copy where the device has a host buffer type), and one event per batch (an expert's kinds,
// or a layer's misses), synchronized before the batch counts as landed. A slot is mapped (remap_set) only after
// its upload has landed, and the device sees a new mapping only at the next fence, so no table ever points at a
// slot being written. Several batches are in flight at once, each awaiting its own event from `events` (threads
// that issue while another's batch is on the wire keep the link busy through the first's landing); the stream
// orders them. Devices that report no async copies or no events copy synchronously (ggml_backend_tensor_set), as
// does every device with SPECTER_SYNC_UPLOADS=1.
constexpr int32_t PYSPECTER_UPLOADS_IN_FLIGHT = 4; // batches a stream holds issued and not yet landed

struct pyspecter_upload_stream {
    ggml_backend_dev_t   dev     = nullptr;
    ggml_backend_t       backend = nullptr;
    ggml_backend_event_t after_compute = nullptr; // recorded on the compute stream, waited on by this one
    std::mutex           mu; // one issuer at a time (copies, event records); the upload thread, readers, callers
    std::vector<ggml_backend_event_t> events; // PYSPECTER_UPLOADS_IN_FLIGHT of them, freed with the stream
    // guarded by mu: the events no batch in flight holds (a batch takes one to record after its copies)
    std::vector<ggml_backend_event_t> free_events;
    std::condition_variable event_freed;

    pyspecter_upload_stream() = default;
    pyspecter_upload_stream(const pyspecter_upload_stream &) = delete;
    pyspecter_upload_stream & operator=(const pyspecter_upload_stream &) = delete;
    ~pyspecter_upload_stream();
};

// One MoE layer's record. Each section below has one owner file (the "// owner:" line, which
// tests/unit/test_structure.py reads): only that file assigns its fields; every other file changes them through the
// owner's functions (declared beside the owner's other functions in this header or residency-impl.h). Reads stay
// direct: the routing op, the victim scan and the readers read these fields on the hot path, and a getter per read
// would buy nothing but a call.
struct llama_pyspecter_layer {
    // owner: slots.cpp. The slot table: where the layer's experts are, its device and table row
    // (pyspecter_table_init, pyspecter_remap_set; the late path's pyspecter_late_*; pyspecter_mark_passed).
    int32_t il = -1;
    ggml_tensor * host[LLAMA_PYSPECTER_N_KINDS] = {}; // the model's own expert tensors (the host copy)
    ggml_tensor * slot[LLAMA_PYSPECTER_N_KINDS] = {}; // [.., .., n_slots + n_zero] on the layer's device
    std::vector<int32_t> remap; // expert -> slot, -1 when not resident
    std::vector<int32_t> late;  // expert -> slot it is still being uploaded into (this ubatch), -1 otherwise
    // every late expert of this ubatch is in its slot: the wait ops of the layer's other matmuls (one per kind)
    // have nothing to wait for (set by the first, cleared by the routing op)
    std::atomic<bool> late_settled{false};
    std::vector<int32_t> owner; // slot -> expert, -1 when free
    // slot -> device work already queued may still read its bytes: its expert is mapped, or was unmapped before the
    // layer's slot path passed in the ubatch in flight. An upload into the slot waits for that work first; one into
    // a slot freed after the layer passed (a speculated ubatch's settling, a split route's op, between decodes) need
    // not, and so does not wait for the next ubatch, queued meanwhile, which never reads it (pyspecter_remap_set)
    std::unique_ptr<std::atomic<bool>[]> read_queued;
    // Where non-resident rows point in the slot matmul. miss_slot: -1 on the CPU, else n_slots (a device layer). A
    // miss is a negative id (pyspecter_miss_id), a zero row, where the layer's kernel takes one (the CPU, CUDA, RPC:
    // llama_pyspecter_zero_slots); elsewhere a kernel takes neither a negative id nor an id twice in one token
    // (its MUL_MAT_ID groups a token's rows by expert and leaves a repeated one unwritten), so the layer holds
    // n_zero all-zero slots after the real ones and the miss in row j of a token reads zero slot j.
    int32_t miss_slot = -1;
    int32_t n_zero = 0;
    llama_pyspecter_slots * parent = nullptr;
    pyspecter_upload_stream * stream = nullptr; // its device's upload stream (null: synchronous copies)
    ggml_backend_dev_t dev = nullptr;           // the device its slots are on
    // Device layers: the slot matmul reads its ids from a table on the device (get_rows over the router's ids), so
    // it never waits for the host. table_row is this layer's row of tables[table]; the row holds remap as of the
    // latest fence (the zero slot where not resident), except evictions, which reach it at once (see remap_set).
    int32_t table = -1;
    int32_t table_row = -1;
    std::atomic<bool> passed{false}; // this ubatch's slot path of the layer has run (its route op has started)

    // owner: residency.cpp. Native residency's slot bookkeeping, guarded by its mutex; empty until residency_init
    // (residency_layer_init, residency_append, residency_call_begin, residency_needed, residency_hits,
    // residency_map, residency_pend, residency_land).
    std::vector<uint64_t> last_use, loaded;                // slot -> clock of its last hit / of its mapping
    std::vector<std::shared_ptr<pyspecter_read>> pending;  // slot -> the read filling it (null: none)
    std::vector<uint64_t> freq;                            // expert -> times selected
    std::vector<uint8_t> mark;                             // expert -> scratch of one routing call
    int32_t n_usable = 0;                                  // slots [0, n_usable) are handed out
    uint64_t prev_call = 0, last_call = 0;                 // clock of the layer's previous and latest calls
    bool route_missed = false;  // native residency's latest call of the layer found a needed expert not resident
    bool host_touched = false; // disk tier: its host pages may have been faulted in since they were last released
    llama_pyspecter_layer * next = nullptr;                // the next MoE layer in forward order

    // owner: policy.cpp. Eviction: the scores, the predictions spared, the reuse map, the recency features and the
    // simulated caches (policy_layer_init, policy_call_begin/end, policy_take_scores, policy_set_held,
    // policy_release_held, policy_map_init, policy_protect, and the observe functions of residency-impl.h).
    std::vector<float> score;                              // expert -> eviction score (SCORE policy; higher: keep)
    std::vector<uint8_t> prot;                             // expert -> predicted for the window in flight
    // a draft's memory (set_held): slots [n_usable, n_usable + n_held) held back until release_held, and plain LRU
    // over both simulated in bookkeeping (expert -> stamp of its last use, -1: out; empty: no ghost)
    int32_t n_held = 0, ghost_cap = 0;
    std::vector<int64_t> ghost_held;
    int64_t ghost_stamp = 0, ghost_held_misses = 0;
    // reuse map (SCORE policy from the router input) and what it blends with: the layer's own past calls
    std::vector<float> reuse_R, reuse_b, blend;  // [n_expert][n_embd] (an expert a row), [n_expert], [6] or empty
    int32_t reuse_embd = 0;
    // reuse_R again as a graph weight, [n_embd, n_expert] in a CPU buffer: graphs built while it exists compute
    // map · x for the routing op as a matmul of the layer's graph (both compute threads), not inside the one-task op
    ggml_tensor * reuse_t = nullptr;
    const float * x_cur = nullptr;                 // this call's router input row (valid during the call)
    const float * raw_cur = nullptr;               // this call's map · x from the graph (valid during the call), or null
    std::vector<uint8_t> score_fresh;              // expert -> score holds this call's reuse score
    std::vector<uint8_t> ring;                     // [16][n_expert]: experts each of the last 16 calls used
    std::vector<int64_t> last_call_used;           // expert -> call index of its last use (-1: never)
    int64_t calls = 0;
    std::vector<int64_t> ghost_lru, ghost_score;   // duel: expert -> last use in each simulated cache (-1: out)

    // owner: io.cpp. Where expert 0 of each kind is in the file (found at the layer's first file read).
    int64_t file_off[LLAMA_PYSPECTER_N_KINDS] = { -1, -1, -1, -1 };

    // owner: planner.cpp.
    std::vector<pyspecter_ahead_map> ahead;        // the planner's maps from this layer's router input

    // owner: route.cpp. expert -> times this layer's routing selected it since the control plane last took the
    // counts, and [n_expert] the tokens routed (llama_pyspecter_take_uses, between decodes: a static hot set
    // re-chosen from the session's own text, hotset.py); counted where the host already sees the ids
    std::vector<uint32_t> uses;

    // owner: mapped.cpp. The host copy as the device reads it, where a speculated ubatch's misses are read there
    // (null: not mapped)
    ggml_tensor * mapped[LLAMA_PYSPECTER_N_KINDS] = {};
};

// policy.cpp: e is spared by eviction (on) unless a need wants its slot, or no longer (off): a draft's predictions
// for the window in flight (draft.cpp)
void policy_protect(llama_pyspecter_layer * L, int32_t e, bool on);
// policy.cpp: C's one LRU, a cache simulated in bookkeeping (res: expert -> stamp of its last use, -1 out) taking one
// routing call (needed, distinct, each marked in mark) at stamp clock: its misses; the call's experts are never
// victims, and what does not fit stays out (the draft's ghost in draft.cpp; the held ghost and the duel's)
int32_t lru_sim_call(std::vector<int64_t> & res, const std::vector<int32_t> & needed, const std::vector<uint8_t> & mark,
                     int32_t capacity, int64_t clock);


// One remap table per device: [2 * n_expert * n_used, n_layer] I32 in a weights buffer of that device, and its host
// image. A layer's row holds a plane per row j of a token: (slot, expert) per expert, and where the expert is not
// resident what a miss reads (pyspecter_miss_id): ~expert, or zero slot j where the kernel takes no negative id, so
// that a token's misses read distinct zero slots. The slot path looks up plane j's row of the expert (one get_rows
// over the row seen as [2, n_expert, n_used]).
struct llama_pyspecter_table {
    ggml_tensor * t = nullptr;
    // what a speculated ubatch's slot paths looked up, as the device wrote them: for each layer in turn,
    // 2 * n_used * n_tokens values, the ubatch's rows' slots, then their experts (rows in the router's order,
    // token-major; pyspecter_log_offset), room for PYSPECTER_LOG_MAX_TOKENS tokens. Packed by the ubatch's own size,
    // so speculate.cpp reads back what was written, in one copy: a decode token's log is 2 * n_used values a layer
    ggml_tensor * spec_log = nullptr;
    ggml_backend_buffer_t log_host = nullptr; // pinned memory the log is read into (set_speculate), or none
    std::vector<int32_t> image; // what the device holds
    bool dirty = false;         // remap changed since the image was last pushed
};

// Bumped from the compute thread (route op), the upload thread and callers' threads at once, hence atomics.
struct llama_pyspecter_counters {
    std::atomic<int64_t> route_calls{0}, hit_rows{0}, miss_rows{0}, route_ns{0}, hook_ns{0};
    std::atomic<int64_t> upload_bytes{0}, upload_ns{0}, upload_failures{0};
    std::atomic<int64_t> needed{0}, resident_at_need{0}, uploads{0}, prefetches{0}, waited{0}, overflow{0};
    std::atomic<int64_t> wait_ns{0}, stall_reads_ns{0}, read_bytes{0}, read_busy_ns{0}, lookahead{0}, late{0};
    std::atomic<int64_t> late_lost{0}, route_cpu_ns{0}, copy_cpu_ns{0}, wait_cpu_ns{0};
    std::atomic<int64_t> ahead_maps{0}, ahead_prefetches{0}, ahead_late{0}, ahead_refused{0}; // the planner
    std::atomic<int64_t> ghost_misses{0}; // the held slots' ghost LRU (set_held)
    std::atomic<int64_t> layer_cpu_hist[2][LLAMA_PYSPECTER_HIST_BINS] = {}; // llama_pyspecter_get_layer_cpu_hist
    std::atomic<int64_t> read_ops{0}, taken_back{0}; // chunk reads finished; prefetches a demand took back
    std::atomic<int64_t> queue_entries{0}, queue_scans{0}, queue_locks{0}, reader_wakes{0}, waiter_wakes{0};
    // device tables (llama_pyspecter_device_stats)
    std::atomic<int64_t> fences{0}, table_pushes{0}, table_bytes{0}, eviction_writes{0};
    std::atomic<int64_t> async_batches{0}; // upload batches sent on an upload stream and awaited by their event
    std::atomic<int64_t> inflight_peak{0}; // most batches one upload stream held in flight at once
    std::atomic<int64_t> landing_wait_ns{0}, landing_wait_cpu_ns{0}; // upload threads in their events' waits
    std::atomic<int64_t> compute_orders{0}; // upload batches ordered after the device's queued compute
    std::atomic<int64_t> spec_ubatches{0}, spec_redos{0}; // speculated ubatches; of which a row missed (speculate.cpp)
    std::atomic<int64_t> mapped_rows{0}; // rows a speculated layer's device read from the host copy (mapped.cpp)
};

// An emulated link (uploads.cpp charges every copy to it): a virtual clock of when the link is next free.
struct llama_pyspecter_link {
    std::atomic<double> gbps{0.0}; // 0: not emulated
    std::mutex mu;
    int64_t free_ns = 0;

    void throttle(int64_t t0_ns, size_t nbytes); // returns once nbytes started at t0 would be through

    // The time some upload batch was in flight (counters.upload_ns), overlapping batches counted once: a batch
    // begins at its first copy and ends once landed (throttle included). end() returns the time to add.
    void    begin();
    int64_t end();

private:
    int32_t active = 0;     // mu held
    int64_t active_ns = 0;  // since when some batch has been in flight
};

// The upload thread: a FIFO of copies. Tickets are issued in order and finish in order, so "finished up to t" is
// one number; the few that fail are remembered by ticket.
struct llama_pyspecter_uploads {
    using job = std::function<int32_t()>; // runs one copy and returns its status; may throw (run catches)

    llama_pyspecter_counters * counters = nullptr;

    ~llama_pyspecter_uploads() { stop(); }

    void    start();              // may throw (std::system_error): callers are inside a try
    void    stop() noexcept;      // refuse new work, cancel what is queued, let the copy in flight finish, join
    int64_t enqueue(job fn) noexcept;
    int32_t status(int64_t ticket);
    int32_t wait(int64_t ticket);

private:
    std::mutex mu;
    std::condition_variable cv_work, cv_done;
    std::deque<std::pair<int64_t, job>> queue;
    std::vector<int64_t> failed;      // ascending: tickets finish in order
    int64_t failed_from = INT64_MAX;  // every ticket from here on failed (cancelled, or a failure we could not note)
    int64_t next_ticket = 1;
    int64_t done_ticket = 0;
    bool accepting = false;           // a worker runs and stop() has not been called
    bool stopping  = false;
    std::thread worker;

    void    run();
    void    note_failure(int64_t ticket) noexcept;
    int32_t status_locked(int64_t ticket) const;
};

// Tokens per ubatch a graph may speculate hits on: decode tokens and a draft's verification window. Larger ones
// (a prompt) rarely hit everywhere, and a miss computes the ubatch again.
constexpr int32_t PYSPECTER_SPEC_MAX_TOKENS = 8;
// Tokens per ubatch a speculated graph may log: where every device slot layer reads its misses from the host copy
// (mapped.cpp) nothing is computed again, so prompt-sized ubatches up to llama.cpp's default n_ubatch speculate too.
constexpr int32_t PYSPECTER_LOG_MAX_TOKENS = 512;

// One scheduler's speculation (owner: speculate.cpp, but for the build's record, `built`, `listed` and `layers`,
// which route.cpp's graph builder writes). Touched only by the thread decoding on that scheduler.
struct pyspecter_spec {
    const llama_pyspecter_slots * owner = nullptr;
    bool built = false;        // the form its graph was last built in (speculated or with host paths)
    bool redo = false;         // the next build is the redo of a speculated ubatch that missed: host paths
    bool last_hit = false;     // the last ubatch hit in every row of every slot layer
    int32_t skip = 0;          // ubatches to run with host paths before speculating again
    int32_t backoff = 0;       // skip after the next speculation that misses (doubles each time, 0 after a hit)
    int32_t n_tokens = 0;      // of the ubatch in flight
    int64_t ubatch = 0;        // begin_ubatch calls
    int64_t listed = -1;       // the ubatch whose build listed `layers`
    int64_t miss_rows0 = 0;    // counters.miss_rows when the ubatch began
    std::vector<llama_pyspecter_layer *> layers; // the speculated layers of its current graph
};

struct llama_pyspecter_slots {
    int32_t n_slots  = 0;
    int32_t n_expert = 0;
    int32_t n_used   = 0; // experts a token uses (the model's top-k): rows per token, table planes per device layer
    bool poison = false;  // SPECTER_POISON_SLOTS=1: device slots start as NaN, not zeros (tests: reads before writes)
    int64_t upload_fault_us = 0; // SPECTER_UPLOAD_FAULT_US=N: a batch copies NaN; its real bytes land N us after
    std::vector<std::unique_ptr<llama_pyspecter_layer>> layers; // by layer index; null for dense layers
    struct slot_ref {
        llama_pyspecter_layer * layer;
        int kind;
    };
    std::unordered_map<const ggml_tensor *, slot_ref> slot_of_host; // a model expert tensor -> where its slots are
    // small per-expert tensors of device layers (biases, scales) kept in host memory beside the experts -> their
    // copy on the layer's device, which the slot path reads so that it stays on the device
    std::unordered_map<const ggml_tensor *, ggml_tensor *> on_device;
    std::vector<llama_pyspecter_table> tables;
    std::vector<std::unique_ptr<pyspecter_upload_stream>> streams; // one per device with async copies and events
    // The backends of the context computing on the slots (its scheduler's, from the fence), by device: an upload
    // into a device slot is ordered after the work they have queued, which may still read the slot's old expert
    // (a kernel launched before the eviction reached the table). Guarded by compute_mu; cleared when it goes.
    std::mutex compute_mu;
    const void * compute_sched = nullptr;
    std::vector<std::pair<ggml_backend_dev_t, ggml_backend_t>> compute;
    std::mutex table_mu;              // remap changes, table images and fences
    mutable std::atomic<bool> split_built{false}; // a graph with split routes was built: evictions reach the tables
    // split route -> what its layer's matmuls read: the slot path's ids, and the host path's input as the route
    // built it on the device (ffn_inp) and as the host unpacks it (graph building: set by build_route, then read by
    // build_mm_id for the same graph; contexts may build graphs on several threads)
    struct split_parts {
        ggml_tensor * slot_ids = nullptr;
        const ggml_tensor * ffn_inp = nullptr;
        ggml_tensor * x_host = nullptr;
        bool speculated = false; // the slot path alone (speculate.cpp): the route is slot_ids itself
        ggml_tensor * mapped_ids = nullptr; // speculated with misses read from the host copy: their ids, -1 on hits
    };
    mutable std::mutex graph_mu;
    mutable std::unordered_map<const ggml_tensor *, split_parts> split_routes;
    // the routing op reads the router weights: only for a reader that asked (a routing hook that wants them, a
    // draft's confidence); on a device each layer's weights are otherwise one more read back to the host
    bool route_weights = false;
    // Speculating that a ubatch hits in every row (speculate.cpp, its owner): on, and each scheduler's state
    std::atomic<bool> speculate{false};
    // every device slot layer reads its misses from the host copy (mapped.cpp): a speculated ubatch never redoes,
    // so decode speculates whatever the last ubatch hit. Set before a context, by llama_pyspecter_map_host_experts
    bool mapped_all = false;
    std::mutex spec_mu;
    std::unordered_map<const void *, pyspecter_spec> spec;
    std::vector<ggml_context *> ctxs;
    std::vector<ggml_backend_buffer_t> bufs;
    // mapped.cpp's: views of the host copy (host memory) and the copies standing in for them, apart from bufs,
    // which llama_pyspecter_slots_nbytes counts as slot memory
    std::vector<ggml_backend_buffer_t> mapped_bufs;
    // With slots on a device: a one-element tensor in a host weights buffer, a source of every route and wait op.
    // The scheduler runs an op where its weights live, so this keeps our CPU custom ops on the CPU; a device that
    // claims to support every op (RPC) would otherwise be sent a host function pointer to run.
    ggml_tensor * cpu_anchor = nullptr;

    llama_pyspecter_route_cb route_cb = nullptr;
    void * route_ud = nullptr;
    llama_pyspecter_wait_cb wait_cb = nullptr; // set: graphs get the late path (a third plane in the route)
    void * wait_ud = nullptr;
    llama_pyspecter_input_cb input_cb = nullptr; // set: the route op also reads the layer's router input
    void * input_ud = nullptr;

    llama_pyspecter_counters counters;
    llama_pyspecter_link link;
    // Native residency, once enabled (its readers write into bufs). Its type is private to residency-impl.h, so
    // whoever makes one hands over how to free it (stopping its readers) with it: these slots, below residency,
    // free it without calling into residency.
    using residency_free = void (*)(pyspecter_residency *) noexcept;
    std::unique_ptr<pyspecter_residency, residency_free> res{ nullptr, nullptr };
    // a draft's recorder, or the target's draft window (draft.cpp, whose type is private to it: freed the same way)
    using draft_free = void (*)(pyspecter_draft *) noexcept;
    std::unique_ptr<pyspecter_draft, draft_free> draft{ nullptr, nullptr };
    // Last member: its thread copies into bufs and reads the model's host copy, so it must be stopped first
    // (the destructor does that explicitly before freeing anything).
    llama_pyspecter_uploads uploads;

    llama_pyspecter_slots() { uploads.counters = &counters; }
    ~llama_pyspecter_slots();

    llama_pyspecter_slots(const llama_pyspecter_slots &) = delete;
    llama_pyspecter_slots & operator=(const llama_pyspecter_slots &) = delete;

    llama_pyspecter_layer * layer(int il) const { // non-const: the route op marks late experts in it
        return il >= 0 && il < (int) layers.size() ? layers[il].get() : nullptr;
    }
};

// shared by the csrc/ files

// Every change of a layer's residency (remap/owner) goes through here: expert -> slot, slot -1 evicts. On a device
// layer an eviction reaches the device's table before this returns when the layer's slot path may still run in
// the ubatch in flight (a slot it maps may be overwritten right after); a new mapping waits for the next fence.
// Returns LLAMA_PYSPECTER_OK or ERR_ARG.
int32_t pyspecter_remap_set(llama_pyspecter_layer * L, int32_t expert, int32_t slot);

// The id a non-resident expert e in row j of a token has in the slot matmul: where the layer's kernel takes negative
// ids, ~e (-1 - e: any negative id is a zero row), else zero slot j. The complement keeps the expert in the one
// value a row looks up, so the ids of the matmul over the host copy (mapped.cpp) are ~id of the slot path's: the
// expert where it missed, negative where it hit, and the two can never disagree about a row, even while an
// eviction rewrites the table under a running graph.
inline int32_t pyspecter_miss_id(const llama_pyspecter_layer * L, int32_t j, int32_t e) {
    return L->n_zero > 0 ? L->miss_slot + j % L->n_zero : e >= 0 ? ~e : -1;
}

// An id of the slot matmul that computes nothing: a zero slot or a negative id.
inline bool pyspecter_is_zero_slot(const llama_pyspecter_layer * L, int32_t slot) {
    return slot < 0 || (L->n_zero > 0 && slot >= L->miss_slot);
}

// Where layer L's rows of a speculated ubatch of n_tokens start in its table's log (in values).
inline size_t pyspecter_log_offset(const llama_pyspecter_layer * L, int64_t n_tokens) {
    return (size_t) L->table_row * 2 * L->parent->n_used * n_tokens;
}

// Whether a device layer's misses are read from the host copy by the device (mapped.cpp) when it is speculated.
inline bool pyspecter_is_mapped(const llama_pyspecter_layer * L) {
    return L->mapped[0] || L->mapped[1] || L->mapped[2];
}

// An id a device layer's slot matmul may be given: a slot, a zero slot, or ~expert where misses are negative ids.
inline bool pyspecter_valid_slot_id(const llama_pyspecter_layer * L, int32_t id) {
    const int32_t n_slots = L->parent->n_slots;
    return L->n_zero == 0 ? id >= -L->parent->n_expert && id < n_slots : id >= 0 && id < n_slots + L->n_zero;
}

llama_pyspecter_slots * pyspecter_slots_of(const llama_model * model);
llama_pyspecter_layer * pyspecter_layer_of(const llama_model * model, int32_t il);

// The slot table's writes from other files (slots.cpp owns the record's first section).
// A table with no expert resident: il, parent, remap and late for n_expert experts, owner for n_slots slots.
void pyspecter_table_init(llama_pyspecter_layer * L, int32_t il, llama_pyspecter_slots * s, int32_t n_expert,
                          int32_t n_slots);
void pyspecter_late_set(llama_pyspecter_layer * L, int32_t expert, int32_t slot); // expert lands in slot this ubatch
void pyspecter_late_reset(llama_pyspecter_layer * L);   // the routing op: no expert late yet, nothing settled
void pyspecter_late_settle(llama_pyspecter_layer * L, bool settled); // the wait op: every late expert is in (or not)
void pyspecter_mark_passed(llama_pyspecter_layer * L);  // the layer's route op has started in this ubatch
// Held by a route op while it runs on the compute thread: a CPU split whose device input the scheduler copied after
// synchronising the device, so no work queued there before it still runs, and a table written now is the one the
// layers' later slot paths read. A slot freed meanwhile needs no upload ordered after device work (read_queued).
struct pyspecter_drained_scope {
    pyspecter_drained_scope();
    ~pyspecter_drained_scope();
};
// a context is going away (speculate.cpp's llama_pyspecter_context_gone): uploads stop ordering after its backends
void pyspecter_compute_gone(llama_pyspecter_slots * s, const void * sched);
// The scheduler's backend on a device (null: it has none there).
ggml_backend_t pyspecter_sched_backend(ggml_backend_sched * sched, ggml_backend_dev_t dev);

// Speculation. speculate.cpp decides per ubatch and hands route.cpp's graph builder the scheduler's state for the
// graph this thread may build next (null: none, the split form), which the builder records the graph's form and
// speculated layers in.
void pyspecter_build_for(pyspecter_spec * st, bool speculate);
pyspecter_spec * pyspecter_build_state();
// A speculated layer whose rows all hit, once its ubatch has run (route.cpp): what its route op would have done
// on the host (native residency's decision, a draft's observation, the routing hook) from the (slot, expert) pairs
// its slot path looked up: the n_tokens * n_used rows' slots, then their experts.
void pyspecter_route_settled(llama_pyspecter_layer * L, const int32_t * pairs, int32_t n_tokens, int32_t n_used);


// Runs f (returning a status) so that no exception leaves a C entry point: out of memory and anything else thrown
// become statuses, what an exception says is logged under `where`.
template <typename F>
int32_t pyspecter_guarded(const char * where, F && f) noexcept {
    try {
        return f();
    } catch (const std::bad_alloc &) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    } catch (const std::exception & e) {
        pyspecter_log_exception(where, e.what());
        return LLAMA_PYSPECTER_ERR_INTERNAL;
    } catch (...) {
        return LLAMA_PYSPECTER_ERR_INTERNAL;
    }
}

// Runs one accepted copy: a failure is counted and reported as a status, and no exception gets out.
template <typename F>
int32_t pyspecter_run_copy(llama_pyspecter_counters & counters, F && copy) noexcept {
    const int32_t rc = pyspecter_guarded("upload", copy);
    if (rc != LLAMA_PYSPECTER_OK) {
        counters.upload_failures++;
    }
    return rc;
}

// The upload stream of device dev, made on first use (null: the device copies synchronously): slots.cpp's, which
// owns the streams; slot allocation calls it.
pyspecter_upload_stream * pyspecter_upload_stream_for(llama_pyspecter_slots * s, ggml_backend_dev_t dev);

// Copies into one layer's slots that land together (uploads.cpp). On the layer's upload stream each copy is issued
// asynchronously and land() records one event after them and waits for it: only then have they landed (the caller
// maps the slots after that, and the sources may be reused). Without a stream each copy is synchronous. The emulated
// link is charged for the batch's bytes either way. The stream is locked per copy, not per batch, so other
// threads' batches go out between this one's copies and while it is awaited: that is how several are in flight.
class pyspecter_upload_batch {
public:
    explicit pyspecter_upload_batch(llama_pyspecter_layer * L);
    ~pyspecter_upload_batch(); // left without land() (an exception): waits for what was issued, whose sources live on
    pyspecter_upload_batch(const pyspecter_upload_batch &) = delete;
    pyspecter_upload_batch & operator=(const pyspecter_upload_batch &) = delete;

    // n bytes into slot, at byte `at` of the slot's expert (a chunk of it)
    void copy(ggml_tensor * slot_t, int32_t slot, const void * src, size_t n, size_t at = 0);
    // n bytes of slot, at byte `at` of its expert, made 0xFF (NaN): fault injection's garbage
    void poison(ggml_tensor * slot_t, int32_t slot, size_t n, size_t at = 0);
    // n bytes of scratch alive until the batch has landed: a copy's source (a host copy read back from a device,
    // fault injection's NaN)
    void * keep(size_t n);
    void land();

private:
    // once, before the batch first writes a slot that queued device work may read (read_queued); st->mu held if st
    void                 order_after_compute(int32_t slot);
    ggml_backend_event_t record();    // an event after the copies issued so far; release() gives it back
    void                 release(ggml_backend_event_t ev);

    llama_pyspecter_layer *           L;
    pyspecter_upload_stream *         st;
    int64_t                           t0;
    size_t                            bytes  = 0;
    bool                              issued = false; // async copies not yet awaited
    bool                              ordered = false; // after the device's queued compute
    bool                              timing  = false; // a copy issued: the link's busy clock counts this batch
    std::vector<std::vector<uint8_t>> kept;
    struct late_copy {
        ggml_tensor * t;
        size_t        off;
        const void *  src;
        size_t        n;
    };
    std::vector<late_copy> late; // fault injection (upload_fault_us): the real bytes, written when the batch lands
};

// Copies one expert (all kinds) from the model's host copy into a slot; one kind of one expert from a file (fd at
// offset, through the page-aligned buf of buf_size bytes) into a slot. Both run on any thread; the caller counts
// failures (pyspecter_run_copy). load_into issues an expert's copies in a batch the caller lands.
int32_t pyspecter_load_one(llama_pyspecter_layer * L, int32_t expert, int32_t slot);
int32_t pyspecter_load_into(pyspecter_upload_batch & b, llama_pyspecter_layer * L, int32_t expert, int32_t slot);
// one kind of one expert's bytes (nbytes, the slot's whole expert) into a slot
int32_t pyspecter_write_one(llama_pyspecter_layer * L, int32_t kind, int32_t slot, const void * src, size_t nbytes);
int32_t pyspecter_read_one(llama_pyspecter_layer * L, int32_t kind, int32_t slot, int fd, int64_t offset,
                           void * buf, size_t buf_size, bool drop_cache);

// Several experts of one layer, (expert, slot) each, from its host copy into their slots as one batch: one event
// awaited for all. through(slot, load) runs one expert's load and returns its status (a caller's fault injection
// may refuse it); landed[i] says whether load i landed.
using pyspecter_load_fn = std::function<int32_t()>;
void pyspecter_load_batch(llama_pyspecter_layer * L, const std::vector<std::pair<int32_t, int32_t>> & loads,
                          std::vector<uint8_t> & landed,
                          const std::function<int32_t(int32_t slot, const pyspecter_load_fn & load)> & through);

// O_DIRECT wants file offset, length and memory aligned to this (a page; every block size we meet divides it)
constexpr int64_t PYSPECTER_IO_ALIGN = 4096;

// Bytes [lo, hi) of one expert's tensor that starts at `offset` in the file: the aligned file range that holds them
inline void pyspecter_file_span(int64_t offset, int64_t lo, int64_t hi, int64_t * start, int64_t * end) {
    *start = (offset + lo) / PYSPECTER_IO_ALIGN * PYSPECTER_IO_ALIGN;
    *end   = (offset + hi + PYSPECTER_IO_ALIGN - 1) / PYSPECTER_IO_ALIGN * PYSPECTER_IO_ALIGN;
}

// A chunk: bytes [lo, hi) of one kind of one expert (at `offset` in the file), read into the same bytes of its
// slot. read_range reads the chunk's aligned span into buf and lands it; land_range copies a span already read
// (got bytes of it, from its aligned start) into the slot: ERR_IO where got falls short of the chunk.
int32_t pyspecter_read_range(llama_pyspecter_layer * L, int32_t kind, int32_t slot, int fd, int64_t offset,
                             int64_t lo, int64_t hi, void * buf, size_t buf_size, bool drop_cache);
int32_t pyspecter_land_range(llama_pyspecter_layer * L, int32_t kind, int32_t slot, int64_t offset, int64_t lo,
                             int64_t hi, const void * buf, size_t got);

// Fills bytes [lo, hi) of one kind of a slot (kind -1: every kind whole) with 0xFF, NaN in every float and block
// scale type: what a read still landing, or one torn, leaves there (uploads.cpp)
int32_t pyspecter_poison_range(llama_pyspecter_layer * L, int32_t kind, int32_t slot, int64_t lo, int64_t hi);

// io_uring without liburing (io_ring.cpp): one ring of depth reads, opened where the kernel and its sandbox allow
// it (null otherwise: the caller falls back to pread threads). Submission and completion run on one thread; only
// wake() may be called from others.
struct pyspecter_ring;
struct pyspecter_ring_cqe {
    uint64_t user_data;
    int32_t  res; // bytes read, or -errno
};
pyspecter_ring * pyspecter_ring_open(uint32_t depth);
void pyspecter_ring_close(pyspecter_ring * ring) noexcept;
// queue a read of len bytes at off into buf (submitted by the next wait); false: the submission queue is full
bool pyspecter_ring_read(pyspecter_ring * ring, int fd, void * buf, uint32_t len, int64_t off, uint64_t user_data);
// submit what is queued, then block until at least one read completes or wake() is called; returns the
// completions (wakes are not among them), or fails (-errno) with nothing submitted
int32_t pyspecter_ring_wait(pyspecter_ring * ring, std::vector<pyspecter_ring_cqe> & out);
void pyspecter_ring_wake(pyspecter_ring * ring) noexcept;

// madvise(DONTNEED) of the host copy's expert pages that live in a file mapping; the bytes released
size_t pyspecter_release_experts(llama_pyspecter_slots * s);
size_t pyspecter_release_layer_experts(const llama_pyspecter_layer * L); // ... of one layer

// Native residency (residency.cpp): the routing op's decision for layer L, given the ubatch's selected experts
// ids [n_tokens][n_used]; changes L's remap, which the op then applies. Stops the readers (slots destructor).
bool pyspecter_native_enabled(const llama_pyspecter_slots * s);
std::unique_lock<std::mutex> pyspecter_native_lock(llama_pyspecter_slots * s); // not owning: not enabled
// with_late: this graph has the late path (ordered misses may be marked late in L->late); served: the ubatch's rows
// have looked up the table already (a split route's op, a speculated layer's settling), so no read landing now
// serves them; raw: the graph's map · x for x (reuse_t), or null
void pyspecter_native_route(llama_pyspecter_layer * L, const int32_t * ids, int32_t n_tokens, int32_t n_used,
                            bool with_late, bool served, const float * x, int32_t n_embd, const float * raw);
bool pyspecter_native_wants_input(const llama_pyspecter_slots * s); // some layer has a reuse or ahead map

// The native planner (planner.cpp). ahead_probs: map m's probabilities for router input x into probs[E], with
// y[E] as scratch. The planner sits above residency: its plan (from the routing op of L, R->mu held, one-token
// ubatches: L's maps' predictions queued as prefetches, through pyspecter_native_prefetch) is registered with its
// first map, and residency calls it through that pointer, never by name.
void pyspecter_ahead_probs(const pyspecter_ahead_map & m, const float * x, float * y, float * probs);
using pyspecter_plan_fn = void (*)(llama_pyspecter_layer * L, const float * x, int32_t n_embd);
void pyspecter_set_native_plan(llama_pyspecter_slots * s, pyspecter_plan_fn plan); // R->mu held
// residency.cpp's side of the planner (R->mu held). room: some slot of D could take a prefetch and some expert of
// D is neither resident nor on its way. in_time: the readers can land one more expert of D within h layer-times.
// prefetch: read e into D if a slot holds nothing at least as likely to be needed (probs: D's predicted
// probabilities), as CLS_PREFETCH with priority p and deadline h; true if queued.
bool pyspecter_native_room(const llama_pyspecter_layer * D);
bool pyspecter_native_in_time(llama_pyspecter_layer * D, int32_t h);
bool pyspecter_native_prefetch(llama_pyspecter_layer * D, int32_t e, float p, int32_t h, const float * probs);
// A queued prefetch of e into L taken back whole (none of it read yet; R->mu held): its slot is free again. False
// where there is none, or it has started.
bool pyspecter_native_take_back_prefetch(llama_pyspecter_layer * D, int32_t e);
float pyspecter_native_min_prob(const llama_pyspecter_slots * s); // < 0: the planner is off
bool pyspecter_native_late(const llama_pyspecter_slots * s); // ordered misses: graphs get the late path
bool pyspecter_native_io_uring(const llama_pyspecter_slots * s); // file reads go through io_uring
void pyspecter_native_wait(llama_pyspecter_layer * L);       // the wait op: L's late reads have landed on return

// A draft's handover (draft.cpp): the routing op's selected experts ids [n_tokens][n_used] and router weights w
// ([1, n_used, n_tokens], or null), before any remap: recorded on a draft while it drafts a step, scored against
// the window in flight on a target. Costs a pointer test where no handover or recording was ever set up.
void pyspecter_draft_observe(llama_pyspecter_layer * L, const int32_t * ids, const ggml_tensor * w, int32_t n_tokens,
                             int32_t n_used);

// the model layer's expert tensors by kind (null where the layer has none)
void pyspecter_host_experts(const llama_model * model, int32_t il, ggml_tensor * out[LLAMA_PYSPECTER_N_KINDS]);

// CPU "extra" buffers (weight repacking) are not host-readable, and the repacked mul_mat_id kernels abort on the
// negative ids the host path uses for resident rows.
bool pyspecter_is_repacked(const ggml_tensor * t);

// This thread's CPU time (0 where the platform has no per-thread clock): set beside wall time, it tells the op's
// own work from the time the scheduler gave its core to someone else.
int64_t pyspecter_thread_cpu_ns();
// this thread's CPU time where the op running on it is one whose CPU time is sampled (pyspecter_op_timer), else -1:
// a part of the op timed with it (a copy) is then counted on the same ops, scaled the same way
int64_t pyspecter_op_cpu_ns();

// Times one routing or wait op: its wall time always (steady_clock, a vDSO read), its thread CPU time on one op in
// PYSPECTER_CPU_SAMPLE of each thread, scaled up: the thread CPU clock is a system call (0.7 us measured here), and
// read twice per op it was a fifth of a cheap op's own time. A sampled op still pays the clock (and the kernel
// entry's cache and TLB cost), so on ops of a few us the CPU figure reads above the wall time: read the wall one.
// A layer's wait ops are sampled with its routing op, so that the layer's CPU time is whole (layer_cpu_hist).
constexpr int PYSPECTER_CPU_SAMPLE = 8;
enum pyspecter_op_kind { PYSPECTER_OP_ROUTE, PYSPECTER_OP_ROUTE_DECODE, PYSPECTER_OP_WAIT };
struct pyspecter_op_timer {
    llama_pyspecter_counters & c;
    const pyspecter_op_kind kind;
    const int64_t wall0, cpu0; // cpu0 < 0: this op's CPU time is not sampled
    bool missed = false;       // a routing op: some needed expert was not resident (set before the op returns)
    pyspecter_op_timer(llama_pyspecter_counters & c, pyspecter_op_kind kind);
    ~pyspecter_op_timer();
};
// CPU time (this thread's clock, unscaled) of a read wait or a copy inside the op now running, left out of its
// layer's histogram entry as wait_cpu_ns and copy_cpu_ns are left out of the means
void pyspecter_op_exclude(int64_t cpu_ns);

inline int64_t pyspecter_now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Counted into this thread's llama_pyspecter_sync_counts (stats.cpp): the host's bookkeeping after a speculated
// ubatch (speculate.cpp), time between ubatches in which the device has nothing queued.
void pyspecter_count_settle(int64_t ns);
