// llama.cpp's and ggml's log lines: kept off stderr, but the ones a failure needs are remembered (see the header).
//
// Why natively: a fatal error (GGML_ABORT, GGML_ASSERT, CUDA_CHECK) logs its reason as error lines and then aborts
// inside C, often on a thread Python does not run on. The lines must be kept where the abort callback can print
// them without Python; and a Python log callback would cost a GIL round trip for each of the hundreds of lines a
// model load prints.
//
// The memory is fixed arrays (no allocation while logging or aborting) behind one mutex; the abort callback does
// not wait long for it, in case the aborting thread or a dead one holds it.

#include "llama-pyspecter.h"
#include "pyspecter-log.h"

#include "ggml.h"
#include "llama-impl.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#if defined(__GLIBC__)
#include <execinfo.h>
#endif
#include <unistd.h>

namespace {

constexpr size_t LINE_BYTES = 1024; // a longer line is cut: its head says what failed

struct log_memory {
    std::mutex mu;
    char   lines[LLAMA_PYSPECTER_LOG_LINES][LINE_BYTES] = {}; // a ring of error and warning lines, NUL-terminated
    int32_t next  = 0;                                         // the slot the next line goes to
    int32_t count = 0;                                         // lines held (up to LLAMA_PYSPECTER_LOG_LINES)
    bool   keeping = false; // the latest message was kept, so its GGML_LOG_LEVEL_CONT continuations are too
    char   splits[LINE_BYTES] = {}; // the latest line reporting a graph's split counts
};

// Never destroyed: llama.cpp and ggml may still log (and abort) while static destructors run at exit.
log_memory & memory() {
    static log_memory * m = new log_memory;
    return *m;
}

void copy_cut(char * dst, const char * src, size_t cap) {
    const size_t n = strnlen(src, cap - 1);
    memcpy(dst, src, n);
    dst[n] = '\0';
}

// ggml-cuda's graph lines (GGML_LOG_DEBUG in ggml_backend_cuda_graph_compute, on the thread computing the graph)
thread_local int64_t t_graph_warmups = 0;
thread_local int64_t t_graph_resets  = 0;

void on_log(enum ggml_log_level level, const char * text, void * /*user_data*/) {
    if (text == nullptr) {
        return;
    }
    if (level == GGML_LOG_LEVEL_DEBUG) { // before the lock: a graph's lines come once a compute, from its thread
        if (strstr(text, "CUDA graph warmup complete") != nullptr) {
            t_graph_warmups++;
        } else if (strstr(text, "CUDA graph warmup reset") != nullptr) {
            t_graph_resets++;
        }
    }
    log_memory & m = memory();
    std::lock_guard<std::mutex> lock(m.mu);
    if (strstr(text, "splits = ") != nullptr) {
        copy_cut(m.splits, text, LINE_BYTES);
    }
    if (level == GGML_LOG_LEVEL_CONT) {
        if (m.keeping && m.count > 0) { // the rest of the latest kept line
            char * last = m.lines[(m.next + LLAMA_PYSPECTER_LOG_LINES - 1) % LLAMA_PYSPECTER_LOG_LINES];
            const size_t used = strnlen(last, LINE_BYTES - 1);
            copy_cut(last + used, text, LINE_BYTES - used);
        }
        return;
    }
    m.keeping = level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN;
    if (!m.keeping) {
        return;
    }
    copy_cut(m.lines[m.next], text, LINE_BYTES);
    m.next = (m.next + 1) % LLAMA_PYSPECTER_LOG_LINES;
    if (m.count < LLAMA_PYSPECTER_LOG_LINES) {
        m.count++;
    }
}

// The remembered lines, oldest first, each ending in a newline, into buf (cut to size); the bytes they need.
// The caller holds the lock, or gave up waiting for it (see on_abort).
int32_t recent(const log_memory & m, char * buf, int32_t size) {
    int32_t need = 0;
    for (int32_t i = 0; i < m.count; i++) {
        const char * line = m.lines[(m.next - m.count + i + LLAMA_PYSPECTER_LOG_LINES) % LLAMA_PYSPECTER_LOG_LINES];
        const size_t n = strnlen(line, LINE_BYTES);
        const bool newline = n > 0 && line[n - 1] == '\n';
        for (size_t j = 0; j < n + (newline ? 0 : 1); j++, need++) {
            if (buf != nullptr && need < size - 1) {
                buf[need] = j < n ? line[j] : '\n';
            }
        }
    }
    if (buf != nullptr && size > 0) {
        buf[need < size - 1 ? need : size - 1] = '\0';
    }
    return need;
}

// 0: ggml's abort() follows the callback; else the exit code of a command-line program (exit_on_abort)
std::atomic<int32_t> g_exit_code{0};

void on_abort(const char * message) {
    log_memory & m = memory();
    // another thread holds the lock only to copy a line; the aborting thread itself may hold it (an abort inside
    // a log call), so wait a little, then print without it rather than hang a dying process
    bool locked = false;
    for (int i = 0; i < 50 && !(locked = m.mu.try_lock()); i++) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    static char text[LLAMA_PYSPECTER_LOG_LINES * (LINE_BYTES + 1) + 1];
    const int32_t n = recent(m, text, (int32_t) sizeof(text));
    if (locked) {
        m.mu.unlock();
    }
    fflush(stdout);
    if (n > 0) {
        fputs("llama.cpp's last errors and warnings before it aborted:\n", stderr);
        fputs(text, stderr);
    }
    if (const int32_t code = g_exit_code.load()) {
        // a command-line program: the reason's first line as its one error line, then the exit code, no core
        size_t len = 0;
        while (message != nullptr && message[len] != '\0' && message[len] != '\n') {
            ++len;
        }
        fprintf(stderr, "pyspecter: fatal: %.*s\n", (int) len, message != nullptr ? message : "ggml aborted");
        fflush(stderr);
        _exit(code);
    }
    fprintf(stderr, "%s\n", message != nullptr ? message : "ggml aborted");
#if defined(__GLIBC__)
    // ggml prints a backtrace only when no abort callback is set: keep one (glibc's, no debugger needed)
    void * frames[64];
    const int n_frames = backtrace(frames, 64);
    backtrace_symbols_fd(frames, n_frames, STDERR_FILENO);
#endif
    fflush(stderr);
    // returning lets ggml_abort call abort(), as without a callback
}

} // namespace

void pyspecter_log_exception(const char * where, const char * what) noexcept {
    try {
        LLAMA_LOG_ERROR("pyspecter: %s: %s\n", where, what);
    } catch (...) {
        // logging is best effort; the status code carries the failure
    }
}

void pyspecter_cuda_graph_counts(int64_t * warmups, int64_t * resets, bool reset) noexcept {
    if (warmups) {
        *warmups = t_graph_warmups;
    }
    if (resets) {
        *resets = t_graph_resets;
    }
    if (reset) {
        t_graph_warmups = t_graph_resets = 0;
    }
}

void llama_pyspecter_logs_quiet(void) {
    memory(); // made before any callback can run
    llama_log_set(on_log, nullptr);
    ggml_set_abort_callback(on_abort);
}

void llama_pyspecter_exit_on_abort(int32_t code) {
    memory(); // made before any callback can run
    g_exit_code.store(code);
    ggml_set_abort_callback(on_abort);
}

int32_t llama_pyspecter_logs_recent(char * buf, int32_t size) {
    log_memory & m = memory();
    std::lock_guard<std::mutex> lock(m.mu);
    return recent(m, buf, size);
}

int32_t llama_pyspecter_logs_splits_line(char * buf, int32_t size) {
    log_memory & m = memory();
    std::lock_guard<std::mutex> lock(m.mu);
    const int32_t need = (int32_t) strnlen(m.splits, LINE_BYTES);
    if (buf != nullptr && size > 0) {
        copy_cut(buf, m.splits, (size_t) size < LINE_BYTES ? (size_t) size : LINE_BYTES);
    }
    return need;
}
