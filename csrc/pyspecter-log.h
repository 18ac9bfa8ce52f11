// What csrc/ logs itself (logs.cpp keeps llama.cpp's and ggml's lines): apart from pyspecter-impl.h, so that
// logs.cpp, which everything's pyspecter_guarded calls, includes nothing that calls back into the rest of csrc.
#pragma once

#include <cstdint>

// An exception caught at a C entry point (pyspecter_guarded): logged as an error line under `where`.
void pyspecter_log_exception(const char * where, const char * what) noexcept;

// ggml-cuda's CUDA graphs, as its debug log lines tell them on this thread since the last reset (stats.cpp reports
// them with the synchronisations): "CUDA graph warmup complete" (a split's graph captured, again after a reset) and
// "CUDA graph warmup reset" (a captured graph's nodes changed: the split runs without a graph until they are the
// same twice). reset: zero them after reading. None on other backends.
void pyspecter_cuda_graph_counts(int64_t * warmups, int64_t * resets, bool reset) noexcept;
