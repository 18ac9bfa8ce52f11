// Timing the routing and wait ops (pyspecter_op_timer, pyspecter-impl.h): their wall time, their thread CPU time
// on sampled ops, and the decode layers' CPU histogram. Counted into the model's counters, which stats.cpp reports.

#include "pyspecter-impl.h"

#include <algorithm>
#include <ctime>

int64_t pyspecter_thread_cpu_ns() {
#if defined(CLOCK_THREAD_CPUTIME_ID)
    timespec ts;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) {
        return (int64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
    }
#endif
    return 0;
}

static thread_local bool op_sampled = false; // the op running on this thread has its CPU time sampled
static thread_local int64_t op_excluded = 0;  // ... and the CPU of its read waits and copies so far (unscaled)

// The layer call this thread last sampled for layer_cpu_hist: a decode routing op, counted when it ends, and moved
// to a later bin as each wait op of the layer after it ends. Only the running op's own counters are written (c is
// compared, never followed, before that): a routing op always starts a new one on the thread its wait ops run on.
struct layer_sample {
    llama_pyspecter_counters * c = nullptr; // null: the latest routing op was not sampled
    int32_t row = 0, bin = -1;              // where it is counted (bin -1: not yet)
    int64_t cpu_ns = 0;

    void add(int64_t ns) {
        cpu_ns += ns;
        const int32_t b = (int32_t) std::clamp<int64_t>(cpu_ns / LLAMA_PYSPECTER_HIST_NS, 0,
                                                        LLAMA_PYSPECTER_HIST_BINS - 1);
        if (b != bin) {
            if (bin >= 0) {
                c->layer_cpu_hist[row][bin]--;
            }
            c->layer_cpu_hist[row][b]++;
            bin = b;
        }
    }
};
static thread_local layer_sample layer;
static thread_local bool route_sampled = false; // the latest routing op on this thread was sampled: so are its wait ops

static int64_t sampled_cpu_ns(llama_pyspecter_counters & c, pyspecter_op_kind kind) {
    if (kind == PYSPECTER_OP_WAIT) { // with its layer's routing op (a prompt's too: route_cpu_ns holds both)
        op_sampled = route_sampled;
    } else {
        layer = {};
        // at random, not every 8th: a fixed stride over a model's layers times the same layers every token
        thread_local uint32_t x = 2463534242u;
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        op_sampled = route_sampled = x % PYSPECTER_CPU_SAMPLE == 0;
        if (op_sampled && kind == PYSPECTER_OP_ROUTE_DECODE) {
            layer.c = &c;
        }
    }
    op_excluded = 0;
    return op_sampled ? pyspecter_thread_cpu_ns() : -1;
}

int64_t pyspecter_op_cpu_ns() {
    return op_sampled ? pyspecter_thread_cpu_ns() : -1;
}

void pyspecter_op_exclude(int64_t cpu_ns) {
    op_excluded += cpu_ns;
}

pyspecter_op_timer::pyspecter_op_timer(llama_pyspecter_counters & c, pyspecter_op_kind kind) :
    c(c), kind(kind), wall0(pyspecter_now_ns()), cpu0(sampled_cpu_ns(c, kind)) {}

pyspecter_op_timer::~pyspecter_op_timer() {
    op_sampled = false;
    if (cpu0 >= 0) {
        const int64_t cpu = pyspecter_thread_cpu_ns() - cpu0;
        c.route_cpu_ns += cpu * PYSPECTER_CPU_SAMPLE;
        if (layer.c == &c) {
            if (kind != PYSPECTER_OP_WAIT) {
                layer.row = missed ? 1 : 0;
            }
            layer.add(cpu - op_excluded);
        }
    }
    c.route_ns += pyspecter_now_ns() - wall0;
}
