// Disk tier: expert pages of the model's file mapping leave the process, so experts live only in slots and on disk.
//
// mmap loading pre-faults the whole GGUF (MAP_POPULATE), which would put every expert in RAM and make the disk tier
// a lie. Touching a released page again (host execution of a miss) faults it back in from the file.

#include "pyspecter-impl.h"

#include <cstring>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#define PYSPECTER_HAVE_MADVISE 1
#endif

size_t llama_pyspecter_release_host_experts(llama_model * model) {
    auto * s = pyspecter_slots_of(model);
    return s ? pyspecter_release_experts(s) : 0;
}

size_t pyspecter_release_layer_experts(const llama_pyspecter_layer * L) {
    size_t released = 0;
#ifdef PYSPECTER_HAVE_MADVISE
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    for (auto * h : L->host) {
        // only buffers over a file mapping ("CPU_Mapped"): dropping anonymous memory would lose its contents
        if (!h || !h->buffer ||
                strcmp(ggml_backend_buft_name(ggml_backend_buffer_get_type(h->buffer)), "CPU_Mapped") != 0) {
            continue;
        }
        const uintptr_t a = ((uintptr_t) h->data + page - 1) / page * page;
        const uintptr_t b = ((uintptr_t) h->data + ggml_nbytes(h)) / page * page;
        if (b > a && madvise((void *) a, b - a, MADV_DONTNEED) == 0) {
            released += b - a;
        }
    }
#else
    (void) L;
#endif
    return released;
}

size_t pyspecter_release_experts(llama_pyspecter_slots * s) {
    size_t released = 0;
    for (auto & L : s->layers) {
        if (L) {
            released += pyspecter_release_layer_experts(L.get());
        }
    }
    return released;
}
