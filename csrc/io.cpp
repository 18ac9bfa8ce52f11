// Native residency's reads (residency-impl.h): the read queue, its reader threads (pread threads, or one
// io_uring thread beside one for advice), and the readers' throughput as the planner's deadline model sees it.
// Readers never touch the slot tables, only the queue (qmu) and their read's atomics.

#include "residency-impl.h"

#include "llama-impl.h"

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>

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

// qmu held: account the time since the last change of `running` or `stalled`
void pyspecter_residency::mark_locked() {
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

void pyspecter_residency::start(int32_t n) {
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

void pyspecter_residency::stop() noexcept {
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

int64_t pyspecter_residency::chunk_bytes(const pyspecter_read & r, const pyspecter_chunk & c) {
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
bool pyspecter_residency::set_done_locked(pyspecter_read & r) {
    r.done = true;
    if (!r.awaited) {
        return false;
    }
    r.awaited = false;
    return --awaiting == 0;
}

bool pyspecter_residency::is_file_read(const pyspecter_read & r) { return r.chunks.front().kind >= 0; }

// qmu held: queue[i] has no chunk left to hand out
void pyspecter_residency::unqueue(size_t i) {
    queued_files -= is_file_read(*queue[i]);
    queue[i] = std::move(queue.back()); // take() orders by before(), not by place
    queue.pop_back();
}

bool pyspecter_residency::before(const pyspecter_read & a, const pyspecter_read & b) {
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
bool pyspecter_residency::takes(const pyspecter_read & r, bool files) const {
    return ring ? is_file_read(r) == files : true;
}

bool pyspecter_residency::has_work(bool files) const {
    return ring ? (files ? queued_files : (int32_t) queue.size() - queued_files) > 0 : !queue.empty();
}

// qmu held, has_work(files): the next chunk of the first read by class, deadline, priority and order
pyspecter_task pyspecter_residency::take(bool files) {
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
bool pyspecter_residency::finish_locked(const pyspecter_task & t, int32_t rc, size_t nbytes) {
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

void pyspecter_residency::finish(pyspecter_task & t, int32_t rc, size_t nbytes) {
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

int64_t pyspecter_residency::file_offset(const pyspecter_task & t) const {
    return t.r->L->file_off[t.kind] + (int64_t) (t.r->L->host[t.kind]->nb[2] * t.r->expert);
}

void pyspecter_residency::run(bool files) {
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
            rc = pyspecter_run_copy(s->counters, [&] {
                return faults.apply(L, -1, t.r->slot, 0, 0, [&] { return pyspecter_load_one(L, t.r->expert, t.r->slot); });
            });
            for (auto * h : L->host) {
                nbytes += h ? h->nb[2] : 0;
            }
        } else {
            const int64_t off = file_offset(t);
            rc = !buf ? (int32_t) LLAMA_PYSPECTER_ERR_NO_MEMORY : pyspecter_run_copy(s->counters, [&] {
                return faults.apply(L, t.kind, t.r->slot, t.lo, t.hi, [&] {
                    return pyspecter_read_range(L, t.kind, t.r->slot, p.fd, off, t.lo, t.hi, buf, read_buf,
                                                p.drop_cache);
                });
            });
            nbytes = (size_t) (t.hi - t.lo);
        }
    }
    free(buf);
}

// The ring's thread: up to depth chunk reads in flight, each landed (copied into its slot) here as it
// completes. On stop it takes nothing new and drains what is in flight (the kernel writes into its buffers).
void pyspecter_residency::run_ring(int32_t depth) {
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
                return faults.apply(L, o.t.kind, o.t.r->slot, o.t.lo, o.t.hi, [&] {
                    return pyspecter_land_range(L, o.t.kind, o.t.r->slot, off, o.t.lo, o.t.hi, o.buf,
                                                (size_t) o.got);
                });
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
void pyspecter_residency::push(const std::shared_ptr<pyspecter_read> & r, bool advise, bool release) {
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
void pyspecter_residency::flush() {
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
void pyspecter_residency::push_chunks(pyspecter_read & r, int32_t k) const {
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
bool pyspecter_residency::take_back(pyspecter_read * r) {
    auto lk = qlock();
    if (cancel_locked(r)) {
        return true;
    }
    r->cls = CLS_DEMAND;
    return false;
}

// A queued read taken back whole when none of it has started (true); one started is left to land.
bool pyspecter_residency::cancel(pyspecter_read * r) {
    auto lk = qlock();
    return cancel_locked(r);
}

// A stale read taken back: whole when none of it has started (true: its slot is free now); otherwise its
// queued chunks go, those on the wire finish into its slot unused, and it ends failed and dropped (false).
bool pyspecter_residency::drop(pyspecter_read * r) {
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
int32_t pyspecter_residency::unqueue_read(pyspecter_read * r) {
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

bool pyspecter_residency::cancel_locked(pyspecter_read * r) {
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
void pyspecter_residency::wait_all(const std::vector<pyspecter_read *> & rs, bool stall) {
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

bool pyspecter_native_io_uring(const llama_pyspecter_slots * s) {
    return s && s->res && s->res->ring;
}

//
// the planner's side (planner.cpp calls these from the routing op, R->mu held)
//

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

//
// API
//

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

// fault injection (tests)


int32_t llama_pyspecter_set_read_faults(llama_model * model, const llama_pyspecter_read_faults * f) {
    auto * R = residency_of(model);
    if (!R || !f) {
        return R ? LLAMA_PYSPECTER_ERR_ARG : LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    if (f->fail_every < 0 || f->slow_us < 0 || f->land_us < 0) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    auto & F = R->faults;
    F.fail_every = f->fail_every;
    F.torn = f->torn;
    F.slow_us = f->slow_us;
    F.land_us = f->land_us;
    F.on = f->fail_every > 0 || f->slow_us > 0 || f->land_us > 0;
    return LLAMA_PYSPECTER_OK;
}

int64_t llama_pyspecter_read_faults_injected(const llama_model * model) {
    auto * s = pyspecter_slots_of(model);
    auto * R = s ? s->res.get() : nullptr;
    return R ? R->faults.injected.load() : (int64_t) LLAMA_PYSPECTER_ERR_NO_SLOTS;
}
