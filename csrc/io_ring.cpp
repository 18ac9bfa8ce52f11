// io_uring through its raw system calls (liburing is not a build dependency): one ring that keeps a reader's
// chunk reads in flight together on one thread, where pread needs a thread per read in flight. Opening it may be
// refused (an old kernel, io_uring disabled by sysctl, a seccomp sandbox): the caller then reads on pread threads.
//
// The ring also holds a poll on an eventfd, so a thread blocked for completions wakes when new reads are queued
// (wake), without a completion to wait for.

#include "pyspecter-impl.h"

#include "llama-impl.h"

#if defined(__linux__) && __has_include(<linux/io_uring.h>)
#define PYSPECTER_HAVE_IO_URING 1
#include <linux/io_uring.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#endif

#ifdef PYSPECTER_HAVE_IO_URING

namespace {

constexpr uint64_t WAKE = ~(uint64_t) 0; // user_data of the eventfd's poll

int ring_setup(unsigned entries, io_uring_params * p) {
    return (int) syscall(__NR_io_uring_setup, entries, p);
}

int ring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return (int) syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0);
}

} // namespace

struct pyspecter_ring {
    int fd = -1, efd = -1;
    void * sq_ptr = MAP_FAILED, * cq_ptr = MAP_FAILED;
    size_t sq_len = 0, cq_len = 0;
    io_uring_sqe * sqes = (io_uring_sqe *) MAP_FAILED;
    size_t sqes_len = 0;
    unsigned * sq_head = nullptr, * sq_tail = nullptr, * sq_mask = nullptr, * sq_array = nullptr;
    unsigned * cq_head = nullptr, * cq_tail = nullptr, * cq_mask = nullptr;
    io_uring_cqe * cqes = nullptr;
    unsigned sq_entries = 0;
    unsigned to_submit = 0;    // queued since the last enter
    bool poll_armed = false;
    uint64_t efd_count = 0;    // the poll's read target
    std::vector<iovec> iov;    // one per submission queue entry: a readv's vector lives until it completes

    ~pyspecter_ring() {
        if (sqes != MAP_FAILED) {
            munmap(sqes, sqes_len);
        }
        if (cq_ptr != MAP_FAILED && cq_ptr != sq_ptr) {
            munmap(cq_ptr, cq_len);
        }
        if (sq_ptr != MAP_FAILED) {
            munmap(sq_ptr, sq_len);
        }
        if (fd >= 0) {
            close(fd);
        }
        if (efd >= 0) {
            close(efd);
        }
    }

    io_uring_sqe * next_sqe() {
        const unsigned head = __atomic_load_n(sq_head, __ATOMIC_ACQUIRE);
        const unsigned tail = *sq_tail;
        if (tail - head >= sq_entries) {
            return nullptr;
        }
        const unsigned idx = tail & *sq_mask;
        io_uring_sqe * sqe = &sqes[idx];
        std::memset(sqe, 0, sizeof(*sqe));
        sq_array[idx] = idx;
        return sqe;
    }

    void commit() {
        __atomic_store_n(sq_tail, *sq_tail + 1, __ATOMIC_RELEASE);
        ++to_submit;
    }

    bool arm_poll() {
        io_uring_sqe * sqe = next_sqe();
        if (!sqe) {
            return false;
        }
        sqe->opcode = IORING_OP_POLL_ADD;
        sqe->fd = efd;
        sqe->poll_events = POLLIN;
        sqe->user_data = WAKE;
        commit();
        poll_armed = true;
        return true;
    }

    // enter: submit the queued entries and wait for min_complete completions
    int enter(unsigned min_complete) {
        for (;;) {
            const int rc = ring_enter(fd, to_submit, min_complete, min_complete ? IORING_ENTER_GETEVENTS : 0);
            if (rc >= 0) {
                to_submit -= std::min(to_submit, (unsigned) rc);
                if (to_submit == 0 || min_complete == 0) {
                    return 0;
                }
                continue; // part submitted: the rest next
            }
            if (errno == EINTR) {
                continue;
            }
            return -errno;
        }
    }

    // the completions seen so far; the eventfd's is drained and its poll armed again
    void reap(std::vector<pyspecter_ring_cqe> & out) {
        unsigned head = *cq_head;
        const unsigned tail = __atomic_load_n(cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail; ++head) {
            const io_uring_cqe & c = cqes[head & *cq_mask];
            if (c.user_data == WAKE) {
                poll_armed = false;
                uint64_t n = 0;
                while (read(efd, &n, sizeof(n)) == (ssize_t) sizeof(n)) {
                }
            } else {
                out.push_back({ c.user_data, c.res });
            }
        }
        __atomic_store_n(cq_head, head, __ATOMIC_RELEASE);
    }
};

pyspecter_ring * pyspecter_ring_open(uint32_t depth) {
    std::unique_ptr<pyspecter_ring> R(new (std::nothrow) pyspecter_ring());
    if (!R) {
        return nullptr;
    }
    io_uring_params p;
    std::memset(&p, 0, sizeof(p));
    R->fd = ring_setup(depth + 1, &p); // + the eventfd's poll
    if (R->fd < 0) {
        LLAMA_LOG_INFO("pyspecter: io_uring refused (%s): disk reads on pread threads\n", std::strerror(errno));
        return nullptr;
    }
    R->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    R->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) {
        R->sq_len = R->cq_len = std::max(R->sq_len, R->cq_len);
    }
    R->sq_ptr = mmap(nullptr, R->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, R->fd, IORING_OFF_SQ_RING);
    if (R->sq_ptr == MAP_FAILED) {
        return nullptr;
    }
    R->cq_ptr = single ? R->sq_ptr
                       : mmap(nullptr, R->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, R->fd,
                              IORING_OFF_CQ_RING);
    if (R->cq_ptr == MAP_FAILED) {
        return nullptr;
    }
    R->sqes_len = p.sq_entries * sizeof(io_uring_sqe);
    R->sqes = (io_uring_sqe *) mmap(nullptr, R->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, R->fd,
                                    IORING_OFF_SQES);
    if (R->sqes == MAP_FAILED) {
        return nullptr;
    }
    char * sq = (char *) R->sq_ptr, * cq = (char *) R->cq_ptr;
    R->sq_head  = (unsigned *) (sq + p.sq_off.head);
    R->sq_tail  = (unsigned *) (sq + p.sq_off.tail);
    R->sq_mask  = (unsigned *) (sq + p.sq_off.ring_mask);
    R->sq_array = (unsigned *) (sq + p.sq_off.array);
    R->cq_head  = (unsigned *) (cq + p.cq_off.head);
    R->cq_tail  = (unsigned *) (cq + p.cq_off.tail);
    R->cq_mask  = (unsigned *) (cq + p.cq_off.ring_mask);
    R->cqes     = (io_uring_cqe *) (cq + p.cq_off.cqes);
    R->sq_entries = p.sq_entries;
    R->iov.resize(p.sq_entries);
    R->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (R->efd < 0) {
        return nullptr;
    }
    // a sandbox may allow setup yet refuse io_uring_enter, or the kernel may lack poll: try both once here
    std::vector<pyspecter_ring_cqe> got;
    if (!R->arm_poll() || R->enter(0) != 0) {
        LLAMA_LOG_INFO("pyspecter: io_uring cannot submit: disk reads on pread threads\n");
        return nullptr;
    }
    pyspecter_ring_wake(R.get());
    if (R->enter(1) != 0) {
        LLAMA_LOG_INFO("pyspecter: io_uring cannot wait: disk reads on pread threads\n");
        return nullptr;
    }
    R->reap(got);
    if (R->poll_armed || !got.empty()) {
        return nullptr; // the wake did not come back as the poll's completion
    }
    return R.release();
}

void pyspecter_ring_close(pyspecter_ring * ring) noexcept {
    delete ring;
}

bool pyspecter_ring_read(pyspecter_ring * ring, int fd, void * buf, uint32_t len, int64_t off, uint64_t user_data) {
    io_uring_sqe * sqe = ring->next_sqe();
    if (!sqe) {
        return false;
    }
    const unsigned idx = *ring->sq_tail & *ring->sq_mask;
    ring->iov[idx] = { buf, len };
    sqe->opcode = IORING_OP_READV; // not IORING_OP_READ: readv is there since io_uring itself (5.1)
    sqe->fd = fd;
    sqe->addr = (uint64_t) (uintptr_t) &ring->iov[idx];
    sqe->len = 1;
    sqe->off = (uint64_t) off;
    sqe->user_data = user_data;
    ring->commit();
    return true;
}

int32_t pyspecter_ring_wait(pyspecter_ring * ring, std::vector<pyspecter_ring_cqe> & out) {
    out.clear();
    if (!ring->poll_armed && !ring->arm_poll()) {
        return -EBUSY;
    }
    const int rc = ring->enter(1);
    if (rc != 0) {
        return rc;
    }
    ring->reap(out);
    return 0;
}

void pyspecter_ring_wake(pyspecter_ring * ring) noexcept {
    const uint64_t one = 1;
    const ssize_t n = write(ring->efd, &one, sizeof(one));
    GGML_UNUSED(n); // full (EAGAIN): a wake is pending already
}

#else

struct pyspecter_ring {};

pyspecter_ring * pyspecter_ring_open(uint32_t) {
    return nullptr;
}

void pyspecter_ring_close(pyspecter_ring * ring) noexcept {
    delete ring;
}

bool pyspecter_ring_read(pyspecter_ring *, int, void *, uint32_t, int64_t, uint64_t) {
    return false;
}

int32_t pyspecter_ring_wait(pyspecter_ring *, std::vector<pyspecter_ring_cqe> &) {
    return -1;
}

void pyspecter_ring_wake(pyspecter_ring *) noexcept {}

#endif
