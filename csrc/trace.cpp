// The routing trace native residency records (params.record): flat [il, n, e_1 .. e_n] per routing call, appended
// by the routing op (residency.cpp) and taken whole calls at a time by the control plane between decodes.

#include "residency-impl.h"

#include <algorithm>

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
