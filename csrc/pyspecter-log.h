// What csrc/ logs itself (logs.cpp keeps llama.cpp's and ggml's lines): apart from pyspecter-impl.h, so that
// logs.cpp, which everything's pyspecter_guarded calls, includes nothing that calls back into the rest of csrc.
#pragma once

// An exception caught at a C entry point (pyspecter_guarded): logged as an error line under `where`.
void pyspecter_log_exception(const char * where, const char * what) noexcept;
