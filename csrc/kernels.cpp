// Process-wide switches of the backends' behaviour: batch-invariant CPU matmuls (patch 0004) and how a fatal ggml
// error ends a command-line program.

#include "pyspecter-impl.h"

#include "ggml-cpu.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>

void llama_pyspecter_set_batch_invariant(bool enabled) {
    ggml_cpu_set_llamafile(!enabled);
}

static int32_t g_abort_exit_code = 2;

// Called by ggml_abort on whatever thread failed (the RPC client's dispatcher thread when a server goes away). Only
// async-signal-safe calls: the process may be in any state.
static void exit_on_abort(const char * message) {
    static const char prefix[] = "pyspecter: fatal: ";
    size_t n = 0;
    while (message && message[n] && message[n] != '\n') {
        ++n;
    }
    ssize_t ignored = write(STDERR_FILENO, prefix, sizeof(prefix) - 1);
    if (n) {
        ignored = write(STDERR_FILENO, message, n);
    }
    ignored = write(STDERR_FILENO, "\n", 1);
    (void) ignored;
    _exit(g_abort_exit_code);
}

void llama_pyspecter_exit_on_abort(int32_t code) {
    g_abort_exit_code = code;
    ggml_set_abort_callback(exit_on_abort);
}
