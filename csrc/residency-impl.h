// Native residency's private state (residency.cpp, native_route.cpp, io.cpp, policy.cpp, and replay.cpp's private
// slot table; nothing else includes this): the reads and their queue, and pyspecter_residency, the state a model's
// native residency owns.
//
// Threads: the routing op (llama.cpp's compute thread) and the API calls hold `mu` while they touch the slot
// tables; reader threads never touch the tables, only the queue (`qmu`) and their read's atomics. Lock order:
// mu, then qmu.
#pragma once

#include "pyspecter-impl.h"

// What a reader does for a read: one chunk of one kind from the file, every kind from the host copy, or advice.
struct pyspecter_chunk {
    int32_t kind;           // a kind to read from the file; -1: every kind from the host copy; -2: advise (readahead);
                            // -3: give a prompt's expert pages back (release_after_batch)
    int64_t lo = 0, hi = 0; // a file read: bytes [lo, hi) of the expert's tensor of that kind
};

// One expert being read into one slot: one queue entry, whose chunks (each kind's, from the file; one for all
// kinds from the host copy) readers take in order, side by side.
struct pyspecter_read {
    llama_pyspecter_layer * L = nullptr;
    int32_t expert = -1, slot = -1;
    int32_t cls = 0;          // 0: a miss the routing op waits for; 1: a miss read in the background; 2: prefetch
    int64_t deadline = 0;     // prefetches: lower first (the routing call it is due at: the clock + h)
    float priority = 0.0f;    // prefetches of one deadline: higher first
    uint64_t seq = 0;         // FIFO among equals
    int32_t tasks_left = 0;   // under qmu: chunks not yet finished
    bool started = false;     // under qmu: some chunk of it has been taken by a reader
    bool awaited = false;     // under qmu: the op waiting for reads (wait_all) waits for it
    std::vector<pyspecter_chunk> chunks; // under qmu, set by push
    size_t next = 0;          // under qmu: chunks[next..] are still queued
    bool lookahead = false;   // under mu: the prefill lookahead's guess for its layer's next call
    bool dropped = false;     // under mu and qmu: a stale guess whose queued chunks were taken back; it lands unused
    std::atomic<bool> failed{false};
    std::atomic<bool> done{false};
};

// A chunk a reader has taken, and its read.
struct pyspecter_task {
    std::shared_ptr<pyspecter_read> r;
    int32_t kind = 0;
    int64_t lo = 0, hi = 0;
};

enum { CLS_DEMAND = 0, CLS_BACKGROUND = 1, CLS_PREFETCH = 2, CLS_ADVISE = 3 };

// Injected read faults (llama_pyspecter_set_read_faults): set between decodes, read by every reader
struct pyspecter_faults {
    std::atomic<int32_t> fail_every{0}, slow_us{0}, land_us{0};
    std::atomic<bool> torn{false}, on{false};
    std::atomic<int64_t> reads{0}, injected{0};

    // One read (kind >= 0: bytes [lo, hi) of that kind; -1: every kind) through the faults: read()'s status, or
    // the injected failure
    template <typename F>
    int32_t apply(llama_pyspecter_layer * L, int32_t kind, int32_t slot, int64_t lo, int64_t hi, F && read) {
        if (!on.load(std::memory_order_relaxed)) {
            return read();
        }
        if (const int32_t us = slow_us.load()) {
            std::this_thread::sleep_for(std::chrono::microseconds(us));
        }
        const int32_t every = fail_every.load();
        if (every > 0 && ++reads % every == 0) {
            injected++;
            if (torn) {
                pyspecter_poison_range(L, kind, slot, lo, hi);
            }
            return LLAMA_PYSPECTER_ERR_IO;
        }
        if (const int32_t us = land_us.load()) {
            pyspecter_poison_range(L, kind, slot, lo, hi);
            std::this_thread::sleep_for(std::chrono::microseconds(us));
        }
        return read();
    }
};

// One layer's surrogates (surrogate.cpp; MISS_SURROGATE, set_surrogates): every expert's kept bytes, and the
// reserved slots they are expanded into
struct pyspecter_surrogates {
    int32_t first = 0, n_reserved = 0, group = 0, n_keep = 0;
    std::vector<int32_t> groups;                        // [n_expert][n_keep] kept neuron groups
    std::vector<uint8_t> kept[LLAMA_PYSPECTER_N_KINDS]; // per kind, as set_surrogate_bytes takes them
    std::vector<int32_t> in;                            // reserved slot - first -> expert expanded there, -1
    std::vector<int32_t> mapped;                        // experts routed to a reserved slot for this ubatch
    std::vector<uint8_t> scratch;                       // one expanded kind
};

struct pyspecter_residency {
    llama_pyspecter_slots * s = nullptr;
    llama_pyspecter_residency_params p = {};
    std::vector<llama_pyspecter_layer *> order; // MoE layers in forward order

    std::mutex mu; // the slot tables, the clock, the trace
    uint64_t clock = 0;
    int32_t prev_tokens = 0;
    std::vector<int32_t> trace;

    // the duel between LRU and the reuse scores (set_duel)
    bool duel = false, use_scores = true, trust_scores = true;
    float decay = 0.998f, margin = 0.03f;
    double recent[2] = { 0.0, 0.0 }; // decayed misses: LRU, scores
    uint64_t duel_clock = 0;
    int64_t switches = 0;

    std::mutex qmu;
    std::condition_variable cv_work, cv_done;
    std::vector<std::shared_ptr<pyspecter_read>> queue; // reads with chunks not yet taken, in no order
    int32_t queued_files = 0; // ... of which file reads (the ring's thread takes those, the thread beside it the rest)
    int32_t idle = 0;         // pread threads blocked for work
    int32_t awaiting = 0;     // awaited reads not yet done: wait_all is woken when the last one is
    std::vector<std::thread> readers;
    bool stopping = false;
    uint64_t seq = 0;
    int32_t running = 0;  // reads on the wire (chunks, for file reads)
    int32_t stalled = 0;  // the routing op is waiting
    int64_t t_mark = 0;
    size_t buf_size = 0;  // a whole kind of the biggest expert, aligned: the late path's read again
    int64_t chunk = 0;    // a file read's aligned span at most
    size_t read_buf = 0;  // a reader's buffer: one chunk's span
    pyspecter_ring * ring = nullptr; // file reads go through io_uring (one thread); null: pread threads
    bool ring_waiting = false;       // under qmu: the ring's thread is blocked for completions (wake it)
    pyspecter_faults faults;              // injected (tests); off by default
    std::vector<std::unique_ptr<pyspecter_surrogates>> sur; // by layer index (MISS_SURROGATE); null: none
    std::atomic<int64_t> surrogate_uses{0};
    std::atomic<int64_t> queued_bytes{0}; // bytes of the tasks queued and not yet taken by a reader
    size_t max_chunks = 0;                // the chunks of one expert's read at most (push reserves them)

    // under mu: a routing call's reads, pushed and not yet queued (flush); batching: inside a routing call
    std::vector<std::shared_ptr<pyspecter_read>> batch;
    bool batching = false;
    // under mu: a routing call's scratch, kept so the op allocates nothing per call
    std::vector<int32_t> needed, missing;
    std::vector<uint8_t> taken, keep, landed; // landed: which of `loads` did (miss_wait)
    std::vector<std::pair<int32_t, int32_t>> loads; // (expert, slot)
    std::vector<pyspecter_read *> landing, reads, freeing;

    // the planner (planner.cpp): its plan (registered with its first map), on/off, its least probability, and the
    // layer-time its deadlines are counted in
    pyspecter_plan_fn plan = nullptr;
    bool planner = false;
    float min_prob = 0.5f;
    float max_stall = 0.5f;
    double t_layer_ns = 0.0;  // EMA of the time between consecutive one-token routing calls
    double stall_ns = 0.0;    // EMA of the routing and wait ops' waits for reads over those gaps
    int64_t last_route_ns = 0, last_wait_ns = 0;

    ~pyspecter_residency() { stop(); }

    // the queue's lock, counted (stats.queue_locks)
    std::unique_lock<std::mutex> qlock() {
        s->counters.queue_locks++;
        return std::unique_lock<std::mutex>(qmu);
    }

    // the read queue and its readers (io.cpp)
    void mark_locked();
    void start(int32_t n);
    void stop() noexcept;
    static int64_t chunk_bytes(const pyspecter_read & r, const pyspecter_chunk & c);
    bool set_done_locked(pyspecter_read & r);
    static bool is_file_read(const pyspecter_read & r);
    void unqueue(size_t i);
    static bool before(const pyspecter_read & a, const pyspecter_read & b);
    bool takes(const pyspecter_read & r, bool files) const;
    bool has_work(bool files) const;
    pyspecter_task take(bool files);
    bool finish_locked(const pyspecter_task & t, int32_t rc, size_t nbytes);
    void finish(pyspecter_task & t, int32_t rc, size_t nbytes);
    int64_t file_offset(const pyspecter_task & t) const;
    void run(bool files);
    void run_ring(int32_t depth);
    void push(const std::shared_ptr<pyspecter_read> & r, bool advise = false, bool release = false);
    void flush();
    void push_chunks(pyspecter_read & r, int32_t k) const;
    bool take_back(pyspecter_read * r);
    bool cancel(pyspecter_read * r);
    bool drop(pyspecter_read * r);
    int32_t unqueue_read(pyspecter_read * r);
    bool cancel_locked(pyspecter_read * r);
    void wait_all(const std::vector<pyspecter_read *> & rs, bool stall = true);
};

inline pyspecter_residency * residency_of(llama_model * model) {
    auto * s = pyspecter_slots_of(model);
    return s ? s->res.get() : nullptr;
}

// The record's residency section (residency.cpp, mu held), written from other files (replay.cpp's private table)
// through these: a layer's bookkeeping with n_usable slots handed out; the next layer in forward order; a routing
// call's stamps, its distinct needed experts (ascending, marked, counted), its hits (refreshed) and misses; a slot
// mapped; a read pending in a slot (not queued: the caller pushes it, or lands it with residency_land).
void residency_layer_init(llama_pyspecter_layer * L, int32_t n_usable);
void residency_append(pyspecter_residency * R, llama_pyspecter_layer * L);
void residency_call_begin(pyspecter_residency * R, llama_pyspecter_layer * L);
void residency_needed(llama_pyspecter_layer * L, const int32_t * ids, int32_t n, std::vector<int32_t> & needed);
void residency_hits(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<int32_t> & needed,
                    std::vector<int32_t> & missing);
void residency_map(pyspecter_residency * R, llama_pyspecter_layer * L, int32_t expert, int32_t slot);
std::shared_ptr<pyspecter_read> residency_pend(llama_pyspecter_layer * L, int32_t expert, int32_t slot);
void residency_land(pyspecter_residency * R, llama_pyspecter_layer * L, int32_t slot);
// For native_route.cpp (the routing op's side, mu held): a slot's expert unmapped; every landed read of L mapped
// (a failed one leaves its slot free); L's read of an expert in flight (none: nullptr); a read into a slot started
// and queued; a queued read taken back; the prompt's lookahead into the next layer and its stale guesses dropped;
// the disk tier's expert pages given back.
void residency_evict(llama_pyspecter_layer * L, int32_t slot);
void residency_reap(pyspecter_residency * R, llama_pyspecter_layer * L);
pyspecter_read * residency_inflight(const llama_pyspecter_layer * L, int32_t expert);
std::shared_ptr<pyspecter_read> residency_start_read(pyspecter_residency * R, llama_pyspecter_layer * L,
                                                     int32_t expert, int32_t slot, int32_t cls,
                                                     float priority = 0.0f, int64_t deadline = 0);
bool residency_take_back(pyspecter_residency * R, llama_pyspecter_layer * L, pyspecter_read * r);
void residency_prefill_lookahead(pyspecter_residency * R, llama_pyspecter_layer * L, int32_t n_needed);
void residency_drop_stale_lookahead(pyspecter_residency * R, llama_pyspecter_layer * L);
void residency_host_pages(pyspecter_residency * R, llama_pyspecter_layer * L, int32_t n_tokens);

// The record's policy section (policy.cpp, mu held), written from other files through these: scores and
// predictions at residency_init; a routing call's router input (x, or none unless n_embd is the reuse map's; raw:
// map · x from the graph) and its end; a replayed call's scores standing for the reuse map's (null: none); the
// held slots and their ghost (set_held), and their release; set_reuse_map's fresh flags and the duel's two
// simulated caches, empty.
void policy_layer_init(llama_pyspecter_layer * L);
void policy_call_begin(llama_pyspecter_layer * L, const float * x, int32_t n_embd, const float * raw);
void policy_call_end(llama_pyspecter_layer * L);
void policy_take_scores(llama_pyspecter_layer * L, const float * scores);
void policy_set_held(llama_pyspecter_layer * L, int32_t n_held);
void policy_release_held(llama_pyspecter_layer * L);
void policy_map_init(llama_pyspecter_layer * L);

// eviction (policy.cpp, mu held): a slot to reuse, and what each routing call teaches the policies
int32_t victim(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<uint8_t> & keep,
               const std::vector<uint8_t> * taken, bool need);
void recency_observe(llama_pyspecter_layer * L, const std::vector<int32_t> & needed);
int32_t held_ghost_observe(llama_pyspecter_layer * L, const std::vector<int32_t> & needed); // its misses, counted
// (the misses of the duel's two simulated caches on this call: LRU, scores)
std::pair<int32_t, int32_t> duel_observe(pyspecter_residency * R, llama_pyspecter_layer * L,
                                         const std::vector<int32_t> & needed, bool count);

// surrogate.cpp (mu held): e routed to a reserved slot of L for this ubatch, its surrogate expanded there unless
// the slot holds it already (false: no surrogates for L, every reserved slot serves another miss, or a write
// failed; the host path then computes e exactly); the previous ubatch's surrogate routing ends (at L's routing call)
bool pyspecter_map_surrogate(pyspecter_residency * R, llama_pyspecter_layer * L, int32_t e);
void pyspecter_unmap_surrogates(pyspecter_residency * R, llama_pyspecter_layer * L);
