// Native residency: inside a MoE layer the routing op looks up residency, picks victims, starts reads and hands
// misses to the host path without leaving C. The control plane configures it, schedules prefetches and writes
// eviction scores between decodes, and reads counters.
//
// Exactness does not depend on anything here: a slot is mapped only once its read has landed whole, so every
// (token, expert) row is computed either from a complete slot or from the host copy, exactly.
//
// Threads: the routing op (llama.cpp's compute thread) and the API calls hold `mu` while they touch the slot
// tables; reader threads never touch the tables, only the queue (`qmu`) and their read's atomics. Lock order:
// mu, then qmu.

#include "pyspecter-impl.h"

#include "llama-impl.h"

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>

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

static void release_after_batch(pyspecter_residency * R);

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
    std::atomic<int64_t> queued_bytes{0}; // bytes of the tasks queued and not yet taken by a reader
    size_t max_chunks = 0;                // the chunks of one expert's read at most (push reserves them)

    // under mu: a routing call's reads, pushed and not yet queued (flush); batching: inside a routing call
    std::vector<std::shared_ptr<pyspecter_read>> batch;
    bool batching = false;
    // under mu: a routing call's scratch, kept so the op allocates nothing per call
    std::vector<int32_t> needed, missing;
    std::vector<uint8_t> taken, keep;
    std::vector<std::pair<int32_t, int32_t>> loads; // (expert, slot)
    std::vector<pyspecter_read *> landing, reads, freeing;

    // the planner (planner.cpp): on/off, its least probability, and the layer-time its deadlines are counted in
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

    // qmu held: account the time since the last change of `running` or `stalled`
    void mark_locked() {
        const int64_t now = pyspecter_now_ns();
        const int64_t dt = now - t_mark;
        if (running > 0) {
            s->counters.read_busy_ns += dt;
        }
        if (stalled > 0) {
            s->counters.stall_reads_ns += (int64_t) running * dt;
        }
        t_mark = now;
    }

    void start(int32_t n) {
        t_mark = pyspecter_now_ns();
        if (p.fd >= 0 && p.io == LLAMA_PYSPECTER_IO_AUTO) {
            ring = pyspecter_ring_open((uint32_t) n);
        }
        if (ring) {
            // the ring keeps n chunk reads in flight; a thread of its own gives the advice, which blocks
            readers.emplace_back([this, n] { run_ring(n); });
            readers.emplace_back([this] { run(/*files=*/false); });
            return;
        }
        for (int32_t i = 0; i < n; ++i) {
            readers.emplace_back([this] { run(/*files=*/true); });
        }
    }

    void stop() noexcept {
        {
            auto lk = qlock();
            if (stopping) {
                return;
            }
            stopping = true;
            for (auto & r : queue) { // cancelled, never copied: whoever waits sees a failed read
                r->failed = true;
                r->tasks_left -= (int32_t) (r->chunks.size() - r->next);
                r->next = r->chunks.size();
                if (r->tasks_left == 0) {
                    set_done_locked(*r);
                }
            }
            queue.clear();
            queued_files = 0;
            queued_bytes = 0;
        }
        cv_work.notify_all();
        cv_done.notify_all();
        if (ring) {
            pyspecter_ring_wake(ring);
        }
        for (auto & t : readers) {
            if (t.joinable()) {
                try {
                    t.join();
                } catch (...) {
                }
            }
        }
        pyspecter_ring_close(ring); // its thread has drained the reads in flight
        ring = nullptr;
    }

    static int64_t chunk_bytes(const pyspecter_read & r, const pyspecter_chunk & c) {
        if (c.kind <= -2) {
            return 0;
        }
        if (c.kind >= 0) {
            return c.hi - c.lo;
        }
        int64_t n = 0;
        for (auto * h : r.L->host) {
            n += h ? (int64_t) h->nb[2] : 0;
        }
        return n;
    }

    // qmu held: r has finished (landed, failed or cancelled); true when the op waiting for reads is to be woken
    // (it waits for all of its reads, so only the last of them wakes it)
    bool set_done_locked(pyspecter_read & r) {
        r.done = true;
        if (!r.awaited) {
            return false;
        }
        r.awaited = false;
        return --awaiting == 0;
    }

    static bool is_file_read(const pyspecter_read & r) { return r.chunks.front().kind >= 0; }

    // qmu held: queue[i] has no chunk left to hand out
    void unqueue(size_t i) {
        queued_files -= is_file_read(*queue[i]);
        queue[i] = std::move(queue.back()); // take() orders by before(), not by place
        queue.pop_back();
    }

    static bool before(const pyspecter_read & a, const pyspecter_read & b) {
        if (a.cls != b.cls) {
            return a.cls < b.cls;
        }
        if (a.deadline != b.deadline) {
            return a.deadline < b.deadline;
        }
        if (a.priority != b.priority) {
            return a.priority > b.priority;
        }
        return a.seq < b.seq;
    }

    // the reads a reader takes: a ring's thread the file reads, the thread beside it the rest (advice)
    bool takes(const pyspecter_read & r, bool files) const {
        return ring ? is_file_read(r) == files : true;
    }

    bool has_work(bool files) const {
        return ring ? (files ? queued_files : (int32_t) queue.size() - queued_files) > 0 : !queue.empty();
    }

    // qmu held, has_work(files): the next chunk of the first read by class, deadline, priority and order
    pyspecter_task take(bool files) {
        size_t best = queue.size();
        s->counters.queue_scans += (int64_t) queue.size();
        for (size_t i = 0; i < queue.size(); ++i) {
            if (takes(*queue[i], files) && (best == queue.size() || before(*queue[i], *queue[best]))) {
                best = i;
            }
        }
        pyspecter_read & r = *queue[best];
        const pyspecter_chunk & c = r.chunks[r.next++];
        pyspecter_task t{ queue[best], c.kind, c.lo, c.hi };
        queued_bytes -= chunk_bytes(r, c);
        if (r.next == r.chunks.size()) {
            unqueue(best);
        }
        t.r->started = true;
        if (t.kind >= -1) { // advice and release are no reads: they count neither as in flight nor as link time
            mark_locked();
            ++running;
        }
        return t;
    }

    // qmu held: a chunk taken has finished (rc) after nbytes; true: wake the op waiting for reads
    bool finish_locked(const pyspecter_task & t, int32_t rc, size_t nbytes) {
        if (t.kind >= -1) {
            mark_locked();
            --running;
            s->counters.read_bytes += (int64_t) nbytes;
        }
        if (t.kind >= 0) {
            s->counters.read_ops++;
        }
        if (rc != LLAMA_PYSPECTER_OK) {
            t.r->failed = true;
        }
        return --t.r->tasks_left == 0 && set_done_locked(*t.r);
    }

    void finish(pyspecter_task & t, int32_t rc, size_t nbytes) {
        bool wake = false;
        {
            auto lk = qlock();
            wake = finish_locked(t, rc, nbytes);
        }
        t.r.reset();
        if (wake) {
            cv_done.notify_all();
        }
    }

    int64_t file_offset(const pyspecter_task & t) const {
        return t.r->L->file_off[t.kind] + (int64_t) (t.r->L->host[t.kind]->nb[2] * t.r->expert);
    }

    void run(bool files) {
        void * buf = nullptr;
        if (p.fd >= 0 && files && posix_memalign(&buf, PYSPECTER_IO_ALIGN, read_buf) != 0) {
            buf = nullptr; // every file read of this thread then fails: its experts stay on the host path
        }
        pyspecter_task t;
        int32_t rc = LLAMA_PYSPECTER_OK;
        size_t nbytes = 0;
        for (;;) {
            // the chunk just read is finished and the next taken under one acquisition of the lock
            bool wake_reader = false, stop_now = false;
            {
                auto lk = qlock();
                if (t.r && finish_locked(t, rc, nbytes)) {
                    // now (this thread may block for work below), and with the lock let go: a waiter woken while
                    // it is held blocks again on the lock, a second sleep and wake-up inside the routing op
                    lk.unlock();
                    cv_done.notify_all();
                    s->counters.queue_locks++;
                    lk.lock();
                }
                ++idle;
                cv_work.wait(lk, [&] { return stopping || has_work(files); });
                --idle;
                stop_now = stopping;
                if (!stop_now) {
                    t = take(files); // (the finished read's reference goes here)
                    // push woke one reader for the whole read: each reader that takes a chunk hands the rest on
                    // to one more, so the routing op wakes one thread however many chunks a read has
                    wake_reader = !ring && idle > 0 && has_work(files);
                }
            }
            if (stop_now) {
                break;
            }
            if (wake_reader) {
                s->counters.reader_wakes++;
                cv_work.notify_one();
            }
            rc = LLAMA_PYSPECTER_OK;
            nbytes = 0;
            llama_pyspecter_layer * L = t.r->L;
            if (t.kind == -3) {
                release_after_batch(this);
            } else if (t.kind == -2) {
#ifdef POSIX_FADV_WILLNEED
                for (int k = 0; k < LLAMA_PYSPECTER_N_KINDS; ++k) {
                    if (L->host[k] && L->file_off[k] >= 0) {
                        const size_t n = L->host[k]->nb[2];
                        posix_fadvise(p.fd, L->file_off[k] + (int64_t) (n * t.r->expert), (off_t) n, POSIX_FADV_WILLNEED);
                    }
                }
#endif
            } else if (t.kind == -1) {
                rc = pyspecter_run_copy(s->counters, [&] { return pyspecter_load_one(L, t.r->expert, t.r->slot); });
                for (auto * h : L->host) {
                    nbytes += h ? h->nb[2] : 0;
                }
            } else {
                const int64_t off = file_offset(t);
                rc = !buf ? (int32_t) LLAMA_PYSPECTER_ERR_NO_MEMORY : pyspecter_run_copy(s->counters, [&] {
                    return pyspecter_read_range(L, t.kind, t.r->slot, p.fd, off, t.lo, t.hi, buf, read_buf,
                                                p.drop_cache);
                });
                nbytes = (size_t) (t.hi - t.lo);
            }
        }
        free(buf);
    }

    // The ring's thread: up to depth chunk reads in flight, each landed (copied into its slot) here as it
    // completes. On stop it takes nothing new and drains what is in flight (the kernel writes into its buffers).
    void run_ring(int32_t depth) {
        struct op {
            pyspecter_task t;
            void * buf = nullptr;
            int64_t start = 0, len = 0, got = 0;
            bool busy = false;
        };
        std::vector<op> ops((size_t) depth);
        for (auto & o : ops) {
            if (posix_memalign(&o.buf, PYSPECTER_IO_ALIGN, read_buf) != 0) {
                o.buf = nullptr; // a read given to it fails: its expert stays on the host path
            }
        }
        std::vector<pyspecter_ring_cqe> done;
        std::vector<size_t> refused; // taken without a buffer: failed outside the lock
        int32_t n_busy = 0;
        bool warned = false;
        auto submit = [&](size_t i) {
            op & o = ops[i];
            return pyspecter_ring_read(ring, p.fd, (char *) o.buf + o.got, (uint32_t) (o.len - o.got),
                                       o.start + o.got, (uint64_t) i);
        };
        for (;;) {
            {
                auto lk = qlock();
                if (n_busy == 0) {
                    cv_work.wait(lk, [&] { return stopping || has_work(true); });
                    if (stopping) {
                        break;
                    }
                }
                for (size_t i = 0; i < ops.size() && !stopping && has_work(true); ++i) {
                    op & o = ops[i];
                    if (o.busy) {
                        continue;
                    }
                    o.t = take(true);
                    o.busy = true;
                    ++n_busy;
                    int64_t end = 0;
                    pyspecter_file_span(file_offset(o.t), o.t.lo, o.t.hi, &o.start, &end);
                    o.len = end - o.start;
                    o.got = 0;
                    if (!o.buf || !submit(i)) {
                        refused.push_back(i);
                    }
                }
                ring_waiting = refused.empty();
            }
            for (size_t i : refused) {
                finish(ops[i].t, LLAMA_PYSPECTER_ERR_NO_MEMORY, 0);
                ops[i].busy = false;
                --n_busy;
            }
            if (!refused.empty() || n_busy == 0) {
                refused.clear();
                continue;
            }
            const int32_t rc = pyspecter_ring_wait(ring, done);
            {
                auto lk = qlock();
                ring_waiting = false;
            }
            if (rc != 0) {
                // the probe at open passed, so this is the kernel short of resources for now: try again
                if (!warned) {
                    LLAMA_LOG_WARN("pyspecter: io_uring_enter failed (%s), retrying\n", std::strerror(-rc));
                    warned = true;
                }
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
                continue;
            }
            for (const auto & c : done) {
                op & o = ops[(size_t) c.user_data];
                if (c.res == -EINTR || c.res == -EAGAIN) {
                    if (submit((size_t) c.user_data)) {
                        continue;
                    }
                } else if (c.res > 0) {
                    o.got += c.res;
                    if (o.got < o.len && submit((size_t) c.user_data)) {
                        continue; // short: read the rest (the end of the file answers 0)
                    }
                }
                // an error or the end of the file: land_range judges whether what came covers the chunk
                llama_pyspecter_layer * L = o.t.r->L;
                const int64_t off = file_offset(o.t);
                const int32_t rc_land = pyspecter_run_copy(s->counters, [&] {
                    return pyspecter_land_range(L, o.t.kind, o.t.r->slot, off, o.t.lo, o.t.hi, o.buf,
                                                (size_t) o.got);
                });
#ifdef POSIX_FADV_DONTNEED
                if (p.drop_cache) {
                    posix_fadvise(p.fd, o.start, o.len, POSIX_FADV_DONTNEED);
                }
#endif
                finish(o.t, rc_land, (size_t) (o.t.hi - o.t.lo));
                o.busy = false;
                --n_busy;
            }
        }
        for (auto & o : ops) {
            free(o.buf);
        }
    }

    // mu held (the caller's pending table); queues the tasks of r, or, inside a routing call (batching), keeps it
    // for flush: a layer's reads then cost the routing op one acquisition of the queue's lock and one wake-up
    // advise: r is readahead advice for its expert (CLS_ADVISE); release: r (CLS_ADVISE, no layer) gives a
    // prompt's expert pages back
    void push(const std::shared_ptr<pyspecter_read> & r, bool advise = false, bool release = false) {
        // the chunks are r's own until it is queued: readers never see it before; its bytes count as queued at
        // once, so what the call decides after this (the planner's deadline model) sees them as before
        llama_pyspecter_layer * L = r->L;
        if (release) {
            r->chunks.push_back({ -3 });
        } else if (advise) {
            r->chunks.push_back({ -2 });
        } else if (p.fd >= 0) {
            r->chunks.reserve(max_chunks);
            for (int k = 0; k < LLAMA_PYSPECTER_N_KINDS; ++k) {
                if (L->host[k]) {
                    push_chunks(*r, k);
                }
            }
        } else {
            r->chunks.push_back({ -1 });
        }
        if (r->chunks.empty()) { // nothing to read: landed as it is
            r->done = true;
            return;
        }
        r->tasks_left = (int32_t) r->chunks.size();
        for (const auto & c : r->chunks) {
            queued_bytes += chunk_bytes(*r, c);
        }
        batch.push_back(r);
        if (!batching) {
            flush();
        }
    }

    // mu held: queues the reads push kept, in the order they were pushed, and wakes the readers once
    void flush() {
        if (batch.empty()) {
            return;
        }
        bool wake_reader = false, wake_ring = false;
        {
            auto lk = qlock();
            for (auto & r : batch) {
                r->seq = seq++;
                if (r->done) { // taken back before it was queued (cancel_locked: its bytes are off already)
                    continue;
                }
                if (stopping) {
                    for (const auto & c : r->chunks) {
                        queued_bytes -= chunk_bytes(*r, c);
                    }
                    r->next = r->chunks.size();
                    r->tasks_left = 0;
                    r->failed = true;
                    r->done = true;
                    continue;
                }
                queue.push_back(r);
                queued_files += is_file_read(*r);
                s->counters.queue_entries++;
            }
            batch.clear();
            if (stopping) {
                return;
            }
            wake_reader = idle > 0;
            wake_ring = ring && ring_waiting;
        }
        if (ring) {
            // two waiters that take different reads: wake both (notify_one might pick the wrong one); the ring's
            // thread blocked for completions hears it through the ring
            cv_work.notify_all();
            s->counters.reader_wakes++;
            if (wake_ring) {
                s->counters.reader_wakes++;
                pyspecter_ring_wake(ring);
            }
            return;
        }
        // one idle reader, which hands the reads' other chunks on (run): waking one per chunk from here would
        // have the idle ones compete with the compute threads for the cores, inside the routing op's time
        if (wake_reader) {
            s->counters.reader_wakes++;
            cv_work.notify_one();
        }
    }

    // the chunks of kind k of r's expert. Its tensor's aligned file span is cut into equal aligned pieces of at
    // most `chunk` bytes, so one expert spreads over several readers
    void push_chunks(pyspecter_read & r, int32_t k) const {
        const llama_pyspecter_layer * L = r.L;
        const int64_t n = (int64_t) L->host[k]->nb[2];
        const int64_t off = L->file_off[k] + n * r.expert;
        int64_t start = 0, end = 0;
        pyspecter_file_span(off, 0, n, &start, &end);
        const int64_t pieces = (end - start + chunk - 1) / chunk;
        const int64_t per = ((end - start) / pieces + PYSPECTER_IO_ALIGN - 1) / PYSPECTER_IO_ALIGN * PYSPECTER_IO_ALIGN;
        for (int64_t cs = start; cs < end; cs += per) {
            const int64_t lo = std::max(cs, off) - off, hi = std::min(cs + per, off + n) - off;
            if (hi > lo) {
                r.chunks.push_back({ k, lo, hi });
            }
        }
    }

    // A queued read taken back whole (true: none of it started, the slot was never touched), or moved ahead of
    // everything else as a demand read (false).
    bool take_back(pyspecter_read * r) {
        auto lk = qlock();
        if (cancel_locked(r)) {
            return true;
        }
        r->cls = CLS_DEMAND;
        return false;
    }

    // A queued read taken back whole when none of it has started (true); one started is left to land.
    bool cancel(pyspecter_read * r) {
        auto lk = qlock();
        return cancel_locked(r);
    }

    // A stale read taken back: whole when none of it has started (true: its slot is free now); otherwise its
    // queued chunks go, those on the wire finish into its slot unused, and it ends failed and dropped (false).
    bool drop(pyspecter_read * r) {
        auto lk = qlock();
        if (cancel_locked(r)) {
            return true;
        }
        if (!r->done) {
            r->tasks_left -= unqueue_read(r);
            r->dropped = true;
            r->failed = true;
            if (r->tasks_left == 0) {
                set_done_locked(*r); // (not awaited: whoever drops holds mu, as every waiter does)
            }
        }
        return false;
    }

    // qmu held: r's chunks not yet handed out leave the queue; how many
    int32_t unqueue_read(pyspecter_read * r) {
        const int32_t n = (int32_t) (r->chunks.size() - r->next);
        for (size_t i = 0; n > 0 && i < queue.size(); ++i) {
            s->counters.queue_scans++;
            if (queue[i].get() == r) {
                for (size_t c = r->next; c < r->chunks.size(); ++c) {
                    queued_bytes -= chunk_bytes(*r, r->chunks[c]);
                }
                unqueue(i);
                break;
            }
        }
        r->next = r->chunks.size();
        return n;
    }

    bool cancel_locked(pyspecter_read * r) {
        if (r->started || r->done) {
            return false;
        }
        unqueue_read(r);
        r->tasks_left = 0;
        r->failed = true;
        set_done_locked(*r); // (not awaited: whoever cancels holds mu, as every waiter does)
        return true;
    }

    // Blocks until every read of rs has finished (landed or failed); stall: the compute thread waits (counted),
    // not the control plane between decodes.
    void wait_all(const std::vector<pyspecter_read *> & rs, bool stall = true) {
        flush(); // (mu held, as push's): what this call pushed is queued before anything waits
        const int64_t t0 = pyspecter_now_ns(), cpu0 = pyspecter_op_cpu_ns();
        auto lk = qlock();
        mark_locked();
        stalled += stall;
        for (pyspecter_read * r : rs) {
            if (!r->done && !r->awaited) {
                r->awaited = true;
                ++awaiting;
            }
        }
        int64_t looks = 0;
        cv_done.wait(lk, [&] {
            s->counters.waiter_wakes += looks++ > 0;
            return std::all_of(rs.begin(), rs.end(), [](const pyspecter_read * r) { return r->done.load(); });
        });
        mark_locked();
        stalled -= stall;
        if (stall) {
            s->counters.wait_ns += pyspecter_now_ns() - t0;
            if (cpu0 >= 0) { // the same ops' CPU as route_cpu_ns, scaled the same way
                const int64_t cpu = pyspecter_thread_cpu_ns() - cpu0;
                s->counters.wait_cpu_ns += cpu * PYSPECTER_CPU_SAMPLE;
                pyspecter_op_exclude(cpu);
            }
        }
    }
};

//
// the slot table (mu held)
//

// Through pyspecter_remap_set, like every residency change: on a device layer an eviction reaches the device's
// table at once when the layer's slot path may still run in the ubatch in flight.
static void map_slot(pyspecter_residency * R, llama_pyspecter_layer * L, int32_t expert, int32_t slot) {
    pyspecter_remap_set(L, expert, slot);
    L->last_use[slot] = L->loaded[slot] = R->clock;
}

static void evict_slot(llama_pyspecter_layer * L, int32_t slot) {
    const int32_t prev = L->owner[slot];
    if (prev >= 0) {
        pyspecter_remap_set(L, prev, -1);
    }
}

// Maps every read of L that has landed; a failed one leaves its slot free and its expert a miss.
static void reap(pyspecter_residency * R, llama_pyspecter_layer * L) {
    for (int32_t slot = 0; slot < (int32_t) L->pending.size(); ++slot) {
        auto & r = L->pending[slot];
        if (r && r->done) {
            if (!r->failed) {
                map_slot(R, L, r->expert, slot);
            } else if (!r->dropped) {
                L->parent->counters.upload_failures++;
            }
            r.reset();
        }
    }
}

static pyspecter_read * inflight(const llama_pyspecter_layer * L, int32_t expert) {
    for (const auto & r : L->pending) {
        if (r && r->expert == expert && !r->dropped) { // a dropped one never lands: read the expert anew
            return r.get();
        }
    }
    return nullptr;
}

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

static void recency_observe(llama_pyspecter_layer * L, const std::vector<int32_t> & needed) {
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
// recently used, or (scores) the lowest score, LRU among equals; what does not fit stays out.
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

// The held slots' ghost, GhostLRU's bookkeeping (policies.py, the tests' reference): this call's misses are the
// needed experts it does not hold; then each needed one, in order, becomes the most recent, and the least recent
// go until the ghost holds no more than its capacity.
static int32_t held_ghost_observe(llama_pyspecter_layer * L, const std::vector<int32_t> & needed) {
    auto & g = L->ghost_held;
    int32_t misses = 0, n_in = 0;
    for (int32_t e : needed) {
        misses += g[e] < 0;
    }
    for (int32_t e : needed) {
        g[e] = ++L->ghost_stamp;
    }
    for (int64_t v : g) {
        n_in += v >= 0;
    }
    for (; n_in > L->ghost_cap; --n_in) {
        int32_t oldest = -1;
        for (int32_t v = 0; v < (int32_t) g.size(); ++v) {
            if (g[v] >= 0 && (oldest < 0 || g[v] < g[oldest])) {
                oldest = v;
            }
        }
        g[oldest] = -1;
    }
    return misses;
}

static void duel_observe(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<int32_t> & needed,
                         bool count) {
    R->duel_clock++;
    const int64_t clock = (int64_t) R->duel_clock;
    const int32_t a = ghost_step(L->ghost_lru, needed, L->mark, L->n_usable, clock, nullptr);
    const int32_t b = ghost_step(L->ghost_score, needed, L->mark, L->n_usable, clock, L);
    if (!count) {
        return;
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
}

// A slot to reuse: a free one, else by policy among slots neither being filled, nor taken, nor holding an expert
// marked in `keep` (needed now). Experts predicted for the window in flight are spared unless `need`: an expert
// needed now outranks a prediction. -1: none.
static int32_t victim(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<uint8_t> & keep,
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

static std::shared_ptr<pyspecter_read> start_read(pyspecter_residency * R, llama_pyspecter_layer * L, int32_t expert,
                                                  int32_t slot, int32_t cls, float priority = 0.0f,
                                                  int64_t deadline = 0) {
    auto r = std::make_shared<pyspecter_read>();
    r->L = L;
    r->expert = expert;
    r->slot = slot;
    r->cls = cls;
    r->priority = priority;
    r->deadline = deadline;
    L->pending[slot] = r;
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
        if (L->remap[e] >= 0 || inflight(L, e)) {
            continue;
        }
        const int32_t slot = victim(R, L, keep, nullptr, false);
        if (slot < 0) {
            break;
        }
        evict_slot(L, slot);
        // in the background: only the prefill lookahead reads ahead so (schedule's reads are prefetches)
        start_read(R, L, e, slot, cls, priority, deadline)->lookahead = cls == CLS_BACKGROUND;
        ++issued;
    }
    L->parent->counters.prefetches += issued;
    return issued;
}

// After a prompt (file tier): its host-path pages leave the process and the page cache.
static void release_after_batch(pyspecter_residency * R) {
    pyspecter_release_experts(R->s);
#ifdef POSIX_FADV_DONTNEED
    for (auto * L : R->order) {
        for (int k = 0; k < LLAMA_PYSPECTER_N_KINDS; ++k) {
            if (L->host[k] && L->file_off[k] >= 0) {
                posix_fadvise(R->p.fd, L->file_off[k], (off_t) (L->host[k]->nb[2] * L->remap.size()),
                              POSIX_FADV_DONTNEED);
            }
        }
    }
#endif
}

// A prompt's ubatch routes its many tokens to most experts of every layer, so the next layer will want about as
// many as this one: start reading its most used ones now, while this layer computes, and have the kernel read
// ahead what does not fit for the host path's page faults.
static void prefill_lookahead(pyspecter_residency * R, llama_pyspecter_layer * L, int32_t n_needed) {
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
            if (N->remap[e] < 0 && !inflight(N, e)) {
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
static void drop_stale_lookahead(pyspecter_residency * R, llama_pyspecter_layer * L) {
    for (auto & r : L->pending) {
        if (r && r->lookahead && !r->dropped && !L->mark[r->expert] && R->drop(r.get())) {
            r.reset(); // its slot was evicted when the read was scheduled: free again
            L->parent->counters.uploads--;
        }
    }
}

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
    reap(R, L);
    return victim(R, L, needed, &taken, true);
}

static void miss_wait(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<int32_t> & missing) {
    auto & c = L->parent->counters;
    // queued prefetches of these experts are taken back and read now; started ones become demand reads
    std::vector<pyspecter_read *> & landing = R->landing;
    landing.clear();
    for (int32_t e : missing) {
        pyspecter_read * r = inflight(L, e);
        if (!r) {
            continue;
        }
        if (R->take_back(r)) {
            L->pending[r->slot].reset(); // its slot was evicted when the read was scheduled: free again
            c.uploads--;
            c.taken_back++;
        } else {
            landing.push_back(r);
        }
    }
    if (!landing.empty()) {
        R->wait_all(landing);
        c.waited += (int64_t) landing.size();
        reap(R, L);
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
        evict_slot(L, slot);
        taken[slot] = 1;
        loads.emplace_back(e, slot);
    }
    if (loads.empty()) {
        return;
    }
    if (R->p.fd < 0) {
        // from RAM: a copy on this thread costs less than the hand-off to a reader it would wait for anyway
        const int64_t t0 = pyspecter_now_ns(), cpu0 = pyspecter_op_cpu_ns();
        for (auto [e, slot] : loads) {
            c.uploads++;
            const int32_t rc = pyspecter_run_copy(c, [&] { return pyspecter_load_one(L, e, slot); });
            if (rc == LLAMA_PYSPECTER_OK) {
                map_slot(R, L, e, slot);
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
        reads.push_back(start_read(R, L, e, slot, CLS_DEMAND).get());
    }
    R->wait_all(reads);
    reap(R, L);
}

// Ordered: every miss becomes a late expert (its read started or promoted here), computed from its slot after
// the layer's resident experts and host path; the wait op blocks for the reads (pyspecter_native_wait).
static void miss_ordered(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<int32_t> & missing) {
    auto & c = L->parent->counters;
    std::vector<uint8_t> & taken = R->taken;
    taken.assign(L->owner.size(), 0);
    for (int32_t e : missing) {
        int32_t slot;
        if (pyspecter_read * r = inflight(L, e)) {
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
            evict_slot(L, slot);
            start_read(R, L, e, slot, CLS_DEMAND);
        }
        taken[slot] = 1;
        L->late[e] = slot;
        c.late++;
    }
}

static void miss_cpu(pyspecter_residency * R, llama_pyspecter_layer * L, const std::vector<int32_t> & missing) {
    auto & c = L->parent->counters;
    // a read already on the wire is due soon: wait for it; one still queued would stall longer than the host path
    std::vector<pyspecter_read *> & due = R->landing;
    due.clear();
    {
        auto lk = R->qlock();
        for (int32_t e : missing) {
            pyspecter_read * r = inflight(L, e);
            if (r && r->started) {
                due.push_back(r);
            }
        }
    }
    if (!due.empty()) {
        R->wait_all(due);
        c.waited += (int64_t) due.size();
        reap(R, L);
    }
    for (int32_t e : missing) {
        if (L->remap[e] >= 0 || inflight(L, e)) {
            continue;
        }
        const int32_t slot = victim(R, L, L->mark, nullptr, true);
        if (slot < 0) {
            break;
        }
        evict_slot(L, slot);
        start_read(R, L, e, slot, CLS_BACKGROUND);
    }
}

bool pyspecter_native_enabled(const llama_pyspecter_slots * s) {
    return s && s->res;
}

std::unique_lock<std::mutex> pyspecter_native_lock(llama_pyspecter_slots * s) {
    return s && s->res ? std::unique_lock<std::mutex>(s->res->mu) : std::unique_lock<std::mutex>();
}

void pyspecter_native_route(llama_pyspecter_layer * L, const int32_t * ids, int32_t n_tokens, int32_t n_used,
                            bool with_late, const float * x, int32_t n_embd, const float * raw) {
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
    L->x_cur = x && n_embd == L->reuse_embd ? x : nullptr;
    L->raw_cur = L->x_cur ? raw : nullptr;
    std::fill(L->score_fresh.begin(), L->score_fresh.end(), 0);
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
    L->prev_call = L->last_call;
    L->last_call = R->clock;
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
    const int32_t E = (int32_t) L->remap.size();
    std::fill(L->mark.begin(), L->mark.end(), 0);
    std::vector<int32_t> & needed = R->needed;
    needed.clear();
    for (int32_t i = 0; i < n_tokens * n_used; ++i) {
        const int32_t e = ids[i];
        if (e >= 0 && e < E && !L->mark[e]) {
            L->mark[e] = 1;
            needed.push_back(e);
        }
    }
    std::sort(needed.begin(), needed.end()); // misses are served in expert order: one answer for one routing
    if (R->p.record) {
        R->trace.push_back(L->il);
        R->trace.push_back((int32_t) needed.size());
        R->trace.insert(R->trace.end(), needed.begin(), needed.end());
    }
    for (int32_t e : needed) {
        L->freq[e]++;
    }
    if (!L->ghost_held.empty()) {
        const int32_t g = held_ghost_observe(L, needed);
        L->ghost_held_misses += g;
        c.ghost_misses += g;
    }
    reap(R, L);
    drop_stale_lookahead(R, L);
    std::vector<int32_t> & missing = R->missing;
    missing.clear();
    for (int32_t e : needed) {
        const int32_t slot = L->remap[e];
        if (slot >= 0) {
            L->last_use[slot] = R->clock;
        } else {
            missing.push_back(e);
        }
    }
    c.needed += (int64_t) needed.size();
    c.resident_at_need += (int64_t) (needed.size() - missing.size());
    L->route_missed = !missing.empty();
    const bool moves = R->p.miss != LLAMA_PYSPECTER_MISS_HOST; // host: every miss computed from home, in place
    if (n_tokens > 1 && R->p.lookahead && moves && R->p.miss != LLAMA_PYSPECTER_MISS_CPU) {
        prefill_lookahead(R, L, (int32_t) needed.size());
    }
    if (!missing.empty() && moves) {
        if (R->p.miss == LLAMA_PYSPECTER_MISS_ORDERED && with_late) {
            miss_ordered(R, L, missing);
        } else if (R->p.miss != LLAMA_PYSPECTER_MISS_CPU) {
            miss_wait(R, L, missing);
        } else if (n_tokens == 1) {
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
    L->x_cur = nullptr;
    L->raw_cur = nullptr;
    // Decoding: the next layers of this token. Not while the link is the bottleneck: when waits for reads take
    // more than max_stall of a layer-time the link has no idle time for prefetches to fill, and every wrong one
    // takes it from the misses the compute thread waits for (on smol-moe's disk tier at 50% prefetching raised
    // the stall; tokens there are 70-78% stalled on reads).
    const bool link_bound = R->t_layer_ns > 0.0 && R->stall_ns > R->max_stall * R->t_layer_ns;
    if (n_tokens == 1 && R->planner && moves && !L->ahead.empty() && !link_bound) {
        pyspecter_plan_ahead(L, x, n_embd);
    }
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

// The deadline model: the readers' throughput, measured (bytes read over the time at least one read was in
// flight), moves `rate * h * t_layer` bytes in the h layer-times before D needs its experts; what is queued
// already (demand and background reads, earlier prefetches) goes first. So one more expert of D is in time when
// queued + its bytes fit in that. Before anything is measured every prediction is in time: the first reads
// measure the link.
bool pyspecter_native_in_time(llama_pyspecter_layer * D, int32_t h) {
    pyspecter_residency * R = D->parent->res.get();
    const auto & c = D->parent->counters;
    const int64_t busy = c.read_busy_ns.load(), bytes = c.read_bytes.load();
    if (busy <= 0 || bytes <= 0 || R->t_layer_ns <= 0.0) {
        return true;
    }
    int64_t nbytes = 0;
    for (auto * t : D->host) {
        nbytes += t ? (int64_t) t->nb[2] : 0;
    }
    const double rate = (double) bytes / (double) busy; // bytes per ns
    return (double) (R->queued_bytes.load() + nbytes) <= rate * h * R->t_layer_ns;
}

bool pyspecter_native_prefetch(llama_pyspecter_layer * D, int32_t e, float p, int32_t h, const float * probs) {
    pyspecter_residency * R = D->parent->res.get();
    if (D->remap[e] >= 0 || inflight(D, e)) {
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
    evict_slot(D, best);
    start_read(R, D, e, best, CLS_PREFETCH, p, (int64_t) R->clock + h);
    D->parent->counters.prefetches++;
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

void llama_pyspecter_slots::residency_deleter::operator()(pyspecter_residency * r) const noexcept {
    delete r;
}

bool pyspecter_native_io_uring(const llama_pyspecter_slots * s) {
    return s && s->res && s->res->ring;
}

bool pyspecter_native_late(const llama_pyspecter_slots * s) {
    if (!s || !s->res || s->res->p.miss != LLAMA_PYSPECTER_MISS_ORDERED) {
        return false;
    }
    return true;
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
    reap(R, L);
    // A late expert whose read failed is not resident, yet the graph computes its rows from its slot: read it
    // again, here; if that fails too, this ubatch's output is wrong, which the control plane reports as an error.
    bool settled = true;
    for (auto [e, slot] : late) {
        if (L->remap[e] == slot) {
            continue;
        }
        int32_t rc = LLAMA_PYSPECTER_OK;
        if (R->p.fd < 0) {
            rc = pyspecter_run_copy(c, [&] { return pyspecter_load_one(L, e, slot); });
        } else {
            void * buf = nullptr;
            if (posix_memalign(&buf, 4096, R->buf_size) != 0) {
                rc = LLAMA_PYSPECTER_ERR_NO_MEMORY;
            }
            for (int k = 0; k < LLAMA_PYSPECTER_N_KINDS && rc == LLAMA_PYSPECTER_OK; ++k) {
                if (L->host[k]) {
                    const int64_t off = L->file_off[k] + (int64_t) (L->host[k]->nb[2] * e);
                    rc = pyspecter_run_copy(c, [&] {
                        return pyspecter_read_one(L, k, slot, R->p.fd, off, buf, R->buf_size, R->p.drop_cache);
                    });
                }
            }
            free(buf);
        }
        if (rc == LLAMA_PYSPECTER_OK) {
            map_slot(R, L, e, slot);
        } else {
            c.late_lost++;
            settled = false; // the next kind's wait op tries again
        }
    }
    L->late_settled.store(settled, std::memory_order_release);
}

void pyspecter_native_stop(llama_pyspecter_slots * s) noexcept {
    if (s && s->res) {
        s->res->stop();
    }
}

//
// API
//

static pyspecter_residency * residency_of(llama_model * model) {
    auto * s = pyspecter_slots_of(model);
    return s ? s->res.get() : nullptr;
}

int32_t llama_pyspecter_residency_init(llama_model * model, const llama_pyspecter_residency_params * params) {
    auto * s = pyspecter_slots_of(model);
    if (!s || !params) {
        return s ? LLAMA_PYSPECTER_ERR_ARG : LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    if (s->res) {
        return LLAMA_PYSPECTER_ERR_ENABLED;
    }
    if (params->policy < LLAMA_PYSPECTER_POLICY_LRU || params->policy > LLAMA_PYSPECTER_POLICY_SCORE ||
            params->miss < LLAMA_PYSPECTER_MISS_CPU || params->miss > LLAMA_PYSPECTER_MISS_HOST ||
            params->io < LLAMA_PYSPECTER_IO_AUTO || params->io > LLAMA_PYSPECTER_IO_THREADS) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    return pyspecter_guarded(__func__, [&]() -> int32_t {
        std::unique_ptr<pyspecter_residency, llama_pyspecter_slots::residency_deleter> R(new pyspecter_residency());
        R->s = s;
        R->p = *params;
        size_t biggest = 0;
        for (auto & L : s->layers) {
            if (!L) {
                continue;
            }
            const size_t n_slots = L->owner.size(), E = L->remap.size();
            L->last_use.assign(n_slots, 0);
            L->loaded.assign(n_slots, 0);
            L->pending.assign(n_slots, nullptr);
            L->freq.assign(E, 0);
            L->score.assign(E, 0.0f);
            L->prot.assign(E, 0);
            L->mark.assign(E, 0);
            L->n_usable = (int32_t) n_slots;
            L->host_touched = true; // loading may have faulted its pages in (mmap pre-faults): a prompt frees them
            for (int32_t slot = 0; slot < (int32_t) n_slots; ++slot) {
                if (L->owner[slot] >= 0) { // set_slot before: keep it (a warm start)
                    L->loaded[slot] = 0;
                }
            }
            if (!R->order.empty()) {
                R->order.back()->next = L.get();
            }
            R->order.push_back(L.get());
            for (auto * h : L->host) {
                biggest = std::max(biggest, h ? (size_t) h->nb[2] : (size_t) 0);
            }
        }
        R->buf_size = (biggest + 2 * 4096 + 4095) / 4096 * 4096;
        const int64_t chunk = params->read_chunk > 0 ? params->read_chunk : 256 * 1024;
        R->chunk = (chunk + PYSPECTER_IO_ALIGN - 1) / PYSPECTER_IO_ALIGN * PYSPECTER_IO_ALIGN;
        R->read_buf = std::min(R->buf_size, (size_t) R->chunk);
        R->max_chunks = LLAMA_PYSPECTER_N_KINDS * ((R->buf_size + (size_t) R->chunk - 1) / (size_t) R->chunk);
        R->start(std::max(1, params->n_readers));
        s->res = std::move(R);
        return LLAMA_PYSPECTER_OK;
    });
}

bool llama_pyspecter_residency_enabled(const llama_model * model) {
    return pyspecter_native_enabled(pyspecter_slots_of(model));
}

int32_t llama_pyspecter_set_file_offset(llama_model * model, int32_t il, int32_t kind, int64_t offset) {
    auto * R = residency_of(model);
    auto * L = pyspecter_layer_of(model, il);
    if (!R || !L || kind < 0 || kind >= LLAMA_PYSPECTER_N_KINDS || !L->host[kind] || offset < 0) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    std::lock_guard<std::mutex> lk(R->mu);
    L->file_off[kind] = offset;
    return LLAMA_PYSPECTER_OK;
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
            evict_slot(L, slot);
        }
    }
    L->n_usable = n;
    return LLAMA_PYSPECTER_OK;
}

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
        L->n_held = n_held;
        L->ghost_cap = L->n_usable + n_held;
        L->ghost_held.assign(n_held ? L->remap.size() : 0, -1);
        L->ghost_stamp = L->ghost_held_misses = 0;
        return LLAMA_PYSPECTER_OK;
    } catch (const std::bad_alloc &) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    }
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
        L->n_held = L->ghost_cap = 0;
        L->ghost_held.clear();
        std::fill(L->prot.begin(), L->prot.end(), 0);
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
        L->score_fresh.assign(E, 0);
        L->reuse_b.assign(rb, rb + E);
        L->blend.assign(blend ? blend : rb, blend ? blend + 6 : rb); // empty without a blend
        L->reuse_embd = n_embd;
        L->ring.assign(16 * E, 0);
        L->last_call_used.assign(E, -1);
        L->calls = 0;
        L->ghost_lru.assign(E, -1);
        L->ghost_score.assign(E, -1);
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
        reap(R, L);
        return upload_ahead(R, L, { expert }, CLS_PREFETCH, priority, (int64_t) R->clock + deadline);
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
            reap(R, L);
        }
        return LLAMA_PYSPECTER_OK;
    } catch (const std::bad_alloc &) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    }
}

size_t llama_pyspecter_trace_take(llama_model * model, int32_t * out, size_t cap) {
    auto * R = residency_of(model);
    if (!R) {
        return 0;
    }
    std::lock_guard<std::mutex> lk(R->mu);
    if (!out || cap == 0) {
        return R->trace.size();
    }
    size_t n = 0; // whole calls only
    while (n + 1 < R->trace.size() && n + 2 + (size_t) R->trace[n + 1] <= cap) {
        n += 2 + (size_t) R->trace[n + 1];
    }
    std::copy(R->trace.begin(), R->trace.begin() + (ptrdiff_t) n, out);
    R->trace.erase(R->trace.begin(), R->trace.begin() + (ptrdiff_t) n);
    return n;
}

int32_t llama_pyspecter_set_record(llama_model * model, bool enabled) {
    auto * R = residency_of(model);
    if (!R) {
        return LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    std::lock_guard<std::mutex> lk(R->mu);
    R->p.record = enabled;
    if (!enabled) {
        std::vector<int32_t>().swap(R->trace);
    }
    return LLAMA_PYSPECTER_OK;
}
