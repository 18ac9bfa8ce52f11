// Copies into slots, synchronous or on the model's upload thread, and the tickets that track the latter.

#include "pyspecter-impl.h"

#include "llama-impl.h"

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <system_error>
#include <thread>

//
// the upload thread
//

void llama_pyspecter_uploads::start() {
    worker = std::thread([this] { run(); });
    std::lock_guard<std::mutex> lk(mu);
    accepting = true;
}

void llama_pyspecter_uploads::stop() noexcept {
    {
        std::lock_guard<std::mutex> lk(mu);
        if (stopping) {
            return;
        }
        stopping  = true;
        accepting = false;
        // what is still queued is cancelled rather than copied: the model is going away, nobody will use it
        if (!queue.empty()) {
            failed_from = std::min(failed_from, queue.front().first);
        }
        queue.clear();
    }
    cv_work.notify_all();
    if (worker.joinable()) {
        try {
            worker.join();
        } catch (const std::system_error &) {
            // join only throws for a thread that is not joinable or is this one; neither happens here
        }
    }
    {
        std::lock_guard<std::mutex> lk(mu);
        done_ticket = next_ticket - 1;
    }
    cv_done.notify_all();
}

void llama_pyspecter_uploads::run() {
    for (;;) {
        std::pair<int64_t, job> j;
        {
            std::unique_lock<std::mutex> lk(mu);
            cv_work.wait(lk, [&] { return stopping || !queue.empty(); });
            if (queue.empty()) {
                return;
            }
            j = std::move(queue.front());
            queue.pop_front();
        }
        const int32_t rc = pyspecter_run_copy(*counters, j.second);
        {
            std::lock_guard<std::mutex> lk(mu);
            if (rc != LLAMA_PYSPECTER_OK) {
                note_failure(j.first);
            }
            done_ticket = j.first;
        }
        cv_done.notify_all();
    }
}

void llama_pyspecter_uploads::note_failure(int64_t ticket) noexcept {
    try {
        failed.push_back(ticket);
    } catch (...) {
        failed_from = std::min(failed_from, ticket); // never report a failed copy as landed
    }
}

int64_t llama_pyspecter_uploads::enqueue(job fn) noexcept {
    int64_t t;
    try {
        std::lock_guard<std::mutex> lk(mu);
        if (!accepting) {
            return LLAMA_PYSPECTER_ERR_STOPPED;
        }
        t = next_ticket;
        queue.emplace_back(t, std::move(fn));
        ++next_ticket; // only once queued: a refused copy leaves no ticket behind that could never finish
    } catch (...) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    }
    cv_work.notify_one();
    return t;
}

int32_t llama_pyspecter_uploads::status_locked(int64_t ticket) const {
    if (ticket <= 0 || ticket >= next_ticket) {
        return LLAMA_PYSPECTER_ERR_UNKNOWN_TICKET;
    }
    if (ticket > done_ticket) {
        return 0;
    }
    if (ticket >= failed_from || std::binary_search(failed.begin(), failed.end(), ticket)) {
        return LLAMA_PYSPECTER_ERR_UPLOAD_FAILED;
    }
    return 1;
}

int32_t llama_pyspecter_uploads::status(int64_t ticket) {
    std::lock_guard<std::mutex> lk(mu);
    return status_locked(ticket);
}

int32_t llama_pyspecter_uploads::wait(int64_t ticket) {
    std::unique_lock<std::mutex> lk(mu);
    int32_t st;
    cv_done.wait(lk, [&] { return (st = status_locked(ticket)) != 0; });
    return st;
}

//
// copies
//

pyspecter_upload_batch::pyspecter_upload_batch(llama_pyspecter_layer * L)
    : L(L), st(L->stream), t0(pyspecter_now_ns()) {}

pyspecter_upload_batch::~pyspecter_upload_batch() {
    try {
        if (issued) {
            ggml_backend_event_t ev = record();
            ggml_backend_event_synchronize(ev);
            release(ev);
        }
    } catch (...) {
        // a mutex that cannot be locked: nothing left to wait with
    }
    if (timing) {
        try {
            L->parent->counters.upload_ns += L->parent->link.end();
        } catch (...) {
        }
    }
}

void pyspecter_upload_batch::copy(ggml_tensor * slot_t, int32_t slot, const void * src, size_t n, size_t at) {
    const size_t off = (size_t) slot * slot_t->nb[2] + at;
    if (L->parent->upload_fault_us) {
        // fault injection (tests): a copy's bytes are undefined until its batch has landed, whatever order the
        // device runs its commands in (RPC runs them in order, CUDA's streams do not). So what is issued is NaN,
        // and land() writes the real bytes, later, once the batch's event has passed: a kernel that reads the slot
        // before the batch landed (mapped too early) turns the logits NaN
        void * nan = keep(n);
        std::memset(nan, 0xFF, n);
        late.push_back({ slot_t, off, src, n });
        src = nan;
    }
    if (!timing) {
        timing = true;
        L->parent->link.begin();
    }
    if (st) {
        std::lock_guard<std::mutex> lk(st->mu);
        order_after_compute(slot);
        ggml_backend_tensor_set_async(st->backend, slot_t, src, off, n);
        issued = true;
    } else {
        order_after_compute(slot);
        ggml_backend_tensor_set(slot_t, src, off, n);
    }
    bytes += n;
}

void pyspecter_upload_batch::poison(ggml_tensor * slot_t, int32_t slot, size_t n, size_t at) {
    std::unique_lock<std::mutex> lk;
    if (st) {
        lk = std::unique_lock<std::mutex>(st->mu);
    }
    order_after_compute(slot);
    ggml_backend_tensor_memset(slot_t, 0xFF, (size_t) slot * slot_t->nb[2] + at, n);
}

void * pyspecter_upload_batch::keep(size_t n) {
    kept.emplace_back(n);
    return kept.back().data();
}

// The emulated link's time counts as the batch's flight: its event is held until the throttle lets it land.
void pyspecter_upload_batch::land() {
    auto * s = L->parent;
    ggml_backend_event_t ev = issued ? record() : nullptr;
    if (ev) {
        const int64_t w0 = pyspecter_now_ns(), c0 = pyspecter_thread_cpu_ns();
        ggml_backend_event_synchronize(ev);
        s->counters.landing_wait_cpu_ns += pyspecter_thread_cpu_ns() - c0;
        s->counters.landing_wait_ns += pyspecter_now_ns() - w0;
        s->counters.async_batches++;
    }
    if (!late.empty()) { // fault injection: the real bytes, a while after the batch's NaN landed
        std::this_thread::sleep_for(std::chrono::microseconds(s->upload_fault_us));
        for (const auto & c : late) {
            ggml_backend_tensor_set(c.t, c.src, c.off, c.n);
        }
        late.clear();
    }
    s->link.throttle(t0, bytes);
    if (ev) {
        release(ev);
    }
    s->counters.upload_bytes += (int64_t) bytes;
    if (timing) {
        s->counters.upload_ns += s->link.end();
        timing = false;
    }
    bytes = 0;
    kept.clear();
}

// One of the stream's events, recorded after this batch's copies (taking one waits while every event is held by a
// batch in flight). The caller synchronizes it outside the stream's lock, so other threads issue meanwhile, and
// gives it back (release) once the batch has landed.
ggml_backend_event_t pyspecter_upload_batch::record() {
    std::unique_lock<std::mutex> lk(st->mu);
    st->event_freed.wait(lk, [&] { return !st->free_events.empty(); });
    ggml_backend_event_t ev = st->free_events.back();
    st->free_events.pop_back();
    ggml_backend_event_record(ev, st->backend);
    issued = false;
    auto & peak = L->parent->counters.inflight_peak;
    const int64_t n = (int64_t) (st->events.size() - st->free_events.size());
    for (int64_t cur = peak.load(); n > cur && !peak.compare_exchange_weak(cur, n);) {
    }
    return ev;
}

void pyspecter_upload_batch::release(ggml_backend_event_t ev) {
    {
        std::lock_guard<std::mutex> lk(st->mu);
        st->free_events.push_back(ev);
    }
    st->event_freed.notify_one();
}

// A device slot may still be read for the expert it held by kernels queued before the eviction reached the table
// (the layer's split already launched): the batch's first copy into such a slot waits for the device work queued
// so far. On the upload stream that is an event the stream waits on (the host goes on); a synchronous copy, on
// another stream of the device's, waits on the host. A slot freed after the layer's slot path passed needs no wait
// (read_queued): waiting would hold the copy behind the next ubatch, which the device may have queued by now, and
// an upload decided after one token would land only after the next. CPU slots are read by the compute thread
// itself: nothing to wait for.
void pyspecter_upload_batch::order_after_compute(int32_t slot) {
    if (ordered || L->miss_slot < 0 || !L->read_queued[slot].load(std::memory_order_acquire)) {
        return;
    }
    ordered = true;
    auto * s = L->parent;
    std::lock_guard<std::mutex> lk_compute(s->compute_mu);
    for (const auto & [dev, backend] : s->compute) {
        if (dev != L->dev) {
            continue;
        }
        if (st) {
            ggml_backend_event_record(st->after_compute, backend);
            ggml_backend_event_wait(st->backend, st->after_compute);
        } else {
            ggml_backend_synchronize(backend);
        }
        s->counters.compute_orders++;
    }
}

int32_t pyspecter_poison_range(llama_pyspecter_layer * L, int32_t kind, int32_t slot, int64_t lo, int64_t hi) {
    return pyspecter_guarded(__func__, [&]() -> int32_t {
        pyspecter_upload_batch b(L);
        for (int k = 0; k < LLAMA_PYSPECTER_N_KINDS; ++k) {
            if (L->slot[k] && (kind < 0 || k == kind)) {
                const size_t n = L->slot[k]->nb[2];
                const size_t at = kind < 0 ? 0 : (size_t) lo, len = kind < 0 ? n : (size_t) (hi - lo);
                b.poison(L->slot[k], slot, std::min(len, n - at), at);
            }
        }
        return LLAMA_PYSPECTER_OK;
    });
}

int32_t pyspecter_write_one(llama_pyspecter_layer * L, int32_t kind, int32_t slot, const void * src, size_t nbytes) {
    pyspecter_upload_batch b(L);
    b.copy(L->slot[kind], slot, src, nbytes);
    b.land();
    return LLAMA_PYSPECTER_OK;
}

int32_t pyspecter_load_into(pyspecter_upload_batch & b, llama_pyspecter_layer * L, int32_t expert, int32_t slot) {
    for (int k = 0; k < LLAMA_PYSPECTER_N_KINDS; ++k) {
        ggml_tensor * h = L->host[k];
        if (!h) {
            continue;
        }
        const size_t n = h->nb[2];
        if (h->buffer && ggml_backend_buffer_is_host(h->buffer)) {
            b.copy(L->slot[k], slot, (const char *) h->data + (size_t) expert * n, n);
        } else if (pyspecter_is_repacked(h)) {
            return LLAMA_PYSPECTER_ERR_REPACKED; // can't be read back (get_tensor is null); refused at init already
        } else {
            void * back = b.keep(n); // device-resident host copy: read it back
            ggml_backend_tensor_get(h, back, (size_t) expert * n, n);
            b.copy(L->slot[k], slot, back, n);
        }
    }
    return LLAMA_PYSPECTER_OK;
}

void pyspecter_load_batch(llama_pyspecter_layer * L, const std::vector<std::pair<int32_t, int32_t>> & loads,
                          std::vector<uint8_t> & landed,
                          const std::function<int32_t(int32_t slot, const pyspecter_load_fn & load)> & through) {
    auto & c = L->parent->counters;
    landed.assign(loads.size(), 0);
    const int32_t rc = pyspecter_run_copy(c, [&] {
        pyspecter_upload_batch b(L);
        for (size_t i = 0; i < loads.size(); ++i) {
            const auto [e, slot] = loads[i];
            landed[i] = pyspecter_run_copy(c, [&] {
                return through(slot, [&] { return pyspecter_load_into(b, L, e, slot); });
            }) == LLAMA_PYSPECTER_OK;
        }
        b.land();
        return LLAMA_PYSPECTER_OK;
    });
    if (rc != LLAMA_PYSPECTER_OK) {
        landed.assign(loads.size(), 0); // the batch itself failed: nothing counts as landed
    }
}

int32_t pyspecter_load_one(llama_pyspecter_layer * L, int32_t expert, int32_t slot) {
    pyspecter_upload_batch b(L);
    const int32_t rc = pyspecter_load_into(b, L, expert, slot);
    b.land(); // what was issued lands before an error is reported
    return rc;
}

static int32_t layer_for_upload(const llama_model * model, int32_t il, llama_pyspecter_layer ** out) {
    if (!model) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    if (!pyspecter_slots_of(model)) {
        return LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    *out = pyspecter_layer_of(model, il);
    return *out ? LLAMA_PYSPECTER_OK : LLAMA_PYSPECTER_ERR_ARG;
}

static int32_t check_write(const llama_model * model, int32_t il, int32_t kind, int32_t slot, const void * src,
                           size_t nbytes, llama_pyspecter_layer ** out) {
    const int32_t rc = layer_for_upload(model, il, out);
    if (rc != LLAMA_PYSPECTER_OK) {
        return rc;
    }
    const llama_pyspecter_layer * L = *out;
    if (kind < 0 || kind >= LLAMA_PYSPECTER_N_KINDS || !L->slot[kind] || slot < 0 || slot >= L->parent->n_slots ||
            !src || nbytes != L->slot[kind]->nb[2]) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    return LLAMA_PYSPECTER_OK;
}

static int32_t check_load(const llama_model * model, int32_t il, int32_t expert, int32_t slot,
                          llama_pyspecter_layer ** out) {
    const int32_t rc = layer_for_upload(model, il, out);
    if (rc != LLAMA_PYSPECTER_OK) {
        return rc;
    }
    const llama_pyspecter_layer * L = *out;
    if (expert < 0 || expert >= L->parent->n_expert || slot < 0 || slot >= L->parent->n_slots) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    return LLAMA_PYSPECTER_OK;
}

//
// API
//

int32_t llama_pyspecter_write_slot(llama_model * model, int32_t il, int32_t kind, int32_t slot,
                                   const void * src, size_t nbytes) {
    llama_pyspecter_layer * L = nullptr;
    const int32_t rc = check_write(model, il, kind, slot, src, nbytes, &L);
    if (rc != LLAMA_PYSPECTER_OK) {
        return rc;
    }
    return pyspecter_run_copy(L->parent->counters, [=] { return pyspecter_write_one(L, kind, slot, src, nbytes); });
}

int32_t llama_pyspecter_load_expert(llama_model * model, int32_t il, int32_t expert, int32_t slot) {
    llama_pyspecter_layer * L = nullptr;
    const int32_t rc = check_load(model, il, expert, slot, &L);
    if (rc != LLAMA_PYSPECTER_OK) {
        return rc;
    }
    return pyspecter_run_copy(L->parent->counters, [=] { return pyspecter_load_one(L, expert, slot); });
}

int32_t pyspecter_land_range(llama_pyspecter_layer * L, int32_t kind, int32_t slot, int64_t offset, int64_t lo,
                             int64_t hi, const void * buf, size_t got) {
    int64_t start = 0, end = 0;
    pyspecter_file_span(offset, lo, hi, &start, &end);
    if (got < (size_t) (offset + hi - start)) {
        return LLAMA_PYSPECTER_ERR_IO; // short: an error, or the end of the file came first
    }
    pyspecter_upload_batch b(L);
    b.copy(L->slot[kind], slot, (const char *) buf + (offset + lo - start), (size_t) (hi - lo), (size_t) lo);
    b.land();
    return LLAMA_PYSPECTER_OK;
}

int32_t pyspecter_read_range(llama_pyspecter_layer * L, int32_t kind, int32_t slot, int fd, int64_t offset,
                             int64_t lo, int64_t hi, void * buf, size_t buf_size, bool drop_cache) {
#if defined(__unix__) || defined(__APPLE__)
    int64_t start = 0, end = 0;
    pyspecter_file_span(offset, lo, hi, &start, &end);
    if (fd < 0 || offset < 0 || lo < 0 || hi <= lo || hi > (int64_t) L->slot[kind]->nb[2] ||
            (uintptr_t) buf % PYSPECTER_IO_ALIGN != 0 || (size_t) (end - start) > buf_size) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    size_t got = 0;
    while (got < (size_t) (end - start)) {
        const ssize_t r = pread(fd, (char *) buf + got, (size_t) (end - start) - got, start + (int64_t) got);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            break; // an error, or the end of the file (the aligned range of the last tensor may pass it)
        }
        got += (size_t) r;
    }
#ifdef POSIX_FADV_DONTNEED
    if (drop_cache) {
        posix_fadvise(fd, start, end - start, POSIX_FADV_DONTNEED);
    }
#endif
    return pyspecter_land_range(L, kind, slot, offset, lo, hi, buf, got);
#else
    GGML_UNUSED(L); GGML_UNUSED(kind); GGML_UNUSED(slot); GGML_UNUSED(fd); GGML_UNUSED(offset); GGML_UNUSED(lo);
    GGML_UNUSED(hi); GGML_UNUSED(buf); GGML_UNUSED(buf_size); GGML_UNUSED(drop_cache);
    return LLAMA_PYSPECTER_ERR_IO; // no pread here: every disk read fails, its expert stays on the host path
#endif
}

int32_t pyspecter_read_one(llama_pyspecter_layer * L, int32_t kind, int32_t slot, int fd, int64_t offset,
                           void * buf, size_t buf_size, bool drop_cache) {
    return pyspecter_read_range(L, kind, slot, fd, offset, 0, (int64_t) L->slot[kind]->nb[2], buf, buf_size,
                                drop_cache);
}

int32_t llama_pyspecter_slot_get(const llama_model * model, int32_t il, int32_t kind, int32_t slot, void * out,
                                 size_t nbytes) {
    const llama_pyspecter_layer * L = nullptr;
    if (!model || !pyspecter_slots_of(model)) {
        return model ? LLAMA_PYSPECTER_ERR_NO_SLOTS : LLAMA_PYSPECTER_ERR_ARG;
    }
    L = pyspecter_layer_of(model, il);
    if (!L || kind < 0 || kind >= LLAMA_PYSPECTER_N_KINDS || !L->slot[kind] || slot < 0 ||
            slot >= L->parent->n_slots || !out || nbytes != L->slot[kind]->nb[2]) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    ggml_backend_tensor_get(L->slot[kind], out, (size_t) slot * nbytes, nbytes);
    return LLAMA_PYSPECTER_OK;
}

int32_t llama_pyspecter_read_slot(llama_model * model, int32_t il, int32_t kind, int32_t slot, int32_t fd,
                                  int64_t offset, void * buf, size_t buf_size, bool drop_cache) {
    llama_pyspecter_layer * L = nullptr;
    const int32_t rc = layer_for_upload(model, il, &L);
    if (rc != LLAMA_PYSPECTER_OK) {
        return rc;
    }
    if (kind < 0 || kind >= LLAMA_PYSPECTER_N_KINDS || !L->slot[kind] || slot < 0 || slot >= L->parent->n_slots ||
            !buf) {
        return LLAMA_PYSPECTER_ERR_ARG;
    }
    return pyspecter_run_copy(L->parent->counters,
                              [=] { return pyspecter_read_one(L, kind, slot, fd, offset, buf, buf_size, drop_cache); });
}

// The queued copy holds the layer, not the model: the model's lookup of its slots is gone while they are freed.
int64_t llama_pyspecter_write_slot_async(llama_model * model, int32_t il, int32_t kind, int32_t slot,
                                         const void * src, size_t nbytes) {
    llama_pyspecter_layer * L = nullptr;
    const int32_t rc = check_write(model, il, kind, slot, src, nbytes, &L);
    if (rc != LLAMA_PYSPECTER_OK) {
        return rc;
    }
    try {
        return L->parent->uploads.enqueue([=] { return pyspecter_write_one(L, kind, slot, src, nbytes); });
    } catch (...) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY; // building the job
    }
}

int64_t llama_pyspecter_load_expert_async(llama_model * model, int32_t il, int32_t expert, int32_t slot) {
    llama_pyspecter_layer * L = nullptr;
    const int32_t rc = check_load(model, il, expert, slot, &L);
    if (rc != LLAMA_PYSPECTER_OK) {
        return rc;
    }
    try {
        return L->parent->uploads.enqueue([=] { return pyspecter_load_one(L, expert, slot); });
    } catch (...) {
        return LLAMA_PYSPECTER_ERR_NO_MEMORY;
    }
}

int32_t llama_pyspecter_upload_status(llama_model * model, int64_t ticket) {
    auto * s = pyspecter_slots_of(model);
    if (!s) {
        return model ? LLAMA_PYSPECTER_ERR_NO_SLOTS : LLAMA_PYSPECTER_ERR_ARG;
    }
    try {
        return s->uploads.status(ticket);
    } catch (...) {
        return LLAMA_PYSPECTER_ERR_INTERNAL; // a mutex that cannot be locked
    }
}

int32_t llama_pyspecter_upload_wait(llama_model * model, int64_t ticket) {
    auto * s = pyspecter_slots_of(model);
    if (!s) {
        return model ? LLAMA_PYSPECTER_ERR_NO_SLOTS : LLAMA_PYSPECTER_ERR_ARG;
    }
    try {
        return s->uploads.wait(ticket);
    } catch (...) {
        return LLAMA_PYSPECTER_ERR_INTERNAL;
    }
}

bool llama_pyspecter_upload_done(llama_model * model, int64_t ticket) {
    return ticket == 0 || llama_pyspecter_upload_status(model, ticket) == 1;
}
