// Process-wide switches of the backends' behaviour: batch-invariant CPU matmuls (patch 0004). How a fatal ggml
// error ends a command-line program is logs.cpp's, beside the lines it prints first.

#include "pyspecter-impl.h"

#include "ggml-cpu.h"

void llama_pyspecter_set_batch_invariant(bool enabled) {
    ggml_cpu_set_llamafile(!enabled);
}
