// The emulated link of the `emulated:GBPS` tier: uploads take as long as they would over a link of that speed.

#include "pyspecter-impl.h"

#include <algorithm>

void llama_pyspecter_link::throttle(int64_t t0_ns, size_t nbytes) {
    const double g = gbps.load();
    if (g <= 0) {
        return;
    }
    // a virtual clock: each copy occupies the link for n / gbps from when it is free, so sleep overshoot on one
    // copy is paid back by the next instead of adding up
    int64_t due;
    {
        std::lock_guard<std::mutex> lk(mu);
        free_ns = std::max(free_ns, t0_ns) + (int64_t) ((double) nbytes / g); // bytes / (GB/s) = ns
        due = free_ns;
    }
    // sleep most of the way (wake-ups run late on a busy machine), then yield-spin to the exact time
    if (due - pyspecter_now_ns() > 300000) {
        std::this_thread::sleep_until(std::chrono::steady_clock::time_point(std::chrono::nanoseconds(due - 200000)));
    }
    while (pyspecter_now_ns() < due) {
        std::this_thread::yield();
    }
}

void llama_pyspecter_set_link_gbps(llama_model * model, double gbps) {
    if (auto * s = pyspecter_slots_of(model)) {
        s->link.gbps = gbps;
    }
}

void llama_pyspecter_link::begin() {
    std::lock_guard<std::mutex> lk(mu);
    if (active++ == 0) {
        active_ns = pyspecter_now_ns();
    }
}

int64_t llama_pyspecter_link::end() {
    std::lock_guard<std::mutex> lk(mu);
    return --active == 0 ? pyspecter_now_ns() - active_ns : 0;
}
