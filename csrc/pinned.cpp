// The buffer type a slot session's routed experts stay in on the host beside a device with a pinned host buffer type
// (CUDA_Host): the memory is that type's (cudaMallocHost), the layout the device's own buffers'.
//
// Why not the host type itself: llama.cpp's loader replaces an override to a device's host buffer type with the
// CPU's whenever the file is mmap'd ("avoid using a host buffer when using mmap", llama-model-loader.cpp), so the
// experts stayed in the file's pageable mapping. Uploads from there are staged by the driver and block the thread
// that issues them (the first GPU run's ~5 GB/s on a ~50 GB/s link), and --miss mapped found nothing the device can
// read in place. This type is not the host type, so the loader keeps it: it copies the experts from the mapping
// into it at load, and the rest of the model stays mapped, as stock's does.
//
// Why the device's layout: CUDA pads each quantized tensor past its last row (MATRIX_ROW_PADDING, zeroed), and MMQ
// reads whole 256-value steps of a row, past the end of a shorter one; the device reads these tensors in place
// (mapped.cpp), so they carry the same padding, zeroed here at init as CUDA zeroes its own.
//
// SPECTER_PINNED_PROXY=1 (tests): a device without a host buffer type (the RPC device) gets one over the CPU's, so the
// suite loads, places and computes the experts through this type on every machine; =refuse: one whose memory is
// refused, as cudaMallocHost refuses what it cannot pin.

#include "pyspecter-impl.h"

#include "ggml-backend-impl.h"
#include "llama-impl.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

struct pinned_type {
    ggml_backend_buffer_type buft;     // what the loader and the allocator see; context: this
    ggml_backend_buffer_type_t host;   // where the memory comes from
    ggml_backend_buffer_type_t device; // whose allocation sizes lay it out
    std::string name;
};

pinned_type * of(ggml_backend_buffer_type_t buft) {
    return (pinned_type *) buft->context;
}

const char * pinned_name(ggml_backend_buffer_type_t buft) {
    return of(buft)->name.c_str();
}

size_t pinned_alignment(ggml_backend_buffer_type_t buft) {
    return std::max(ggml_backend_buft_get_alignment(of(buft)->host), ggml_backend_buft_get_alignment(of(buft)->device));
}

size_t pinned_max_size(ggml_backend_buffer_type_t buft) {
    return ggml_backend_buft_get_max_size(of(buft)->host);
}

size_t pinned_alloc_size(ggml_backend_buffer_type_t buft, const ggml_tensor * t) {
    return std::max(ggml_backend_buft_get_alloc_size(of(buft)->host, t),
                    ggml_backend_buft_get_alloc_size(of(buft)->device, t));
}

bool pinned_is_host(ggml_backend_buffer_type_t) {
    return true;
}

ggml_status pinned_init_tensor(ggml_backend_buffer_t buf, ggml_tensor * t) {
    if (t->view_src == nullptr) {
        const size_t n = ggml_nbytes(t), size = ggml_backend_buffer_get_alloc_size(buf, t);
        if (size > n) {
            memset((char *) t->data + n, 0, size - n);
        }
    }
    return GGML_STATUS_SUCCESS;
}

// The loader fills the buffer tensor by tensor from the file's mapping (ggml_backend_tensor_set): one expert tensor
// of a 30B model is ~100 MB, and one thread copying from a mapping (its page faults included) makes the copy most
// of a load; so a large copy is cut across threads.
void pinned_set_tensor(ggml_backend_buffer_t, ggml_tensor * t, const void * data, size_t offset, size_t size) {
    constexpr size_t PIECE = 16u << 20;
    char * dst = (char *) t->data + offset;
    const size_t n_threads = std::min<size_t>({ size / PIECE, std::max(1u, std::thread::hardware_concurrency()), 8 });
    if (n_threads < 2) {
        memcpy(dst, data, size);
        return;
    }
    const size_t part = (size + n_threads - 1) / n_threads;
    std::vector<std::thread> threads;
    for (size_t i = 1; i < n_threads; ++i) {
        const size_t at = i * part, n = std::min(part, size - at);
        try {
            threads.emplace_back([=] { memcpy(dst + at, (const char *) data + at, n); });
        } catch (...) { // no thread to be had: this one copies it
            memcpy(dst + at, (const char *) data + at, n);
        }
    }
    memcpy(dst, data, part);
    for (auto & th : threads) {
        th.join();
    }
}

ggml_backend_buffer_t pinned_alloc(ggml_backend_buffer_type_t buft, size_t size) {
    pinned_type * p = of(buft);
    const char * proxy = std::getenv("SPECTER_PINNED_PROXY");
    const bool refuse = proxy && std::strcmp(proxy, "refuse") == 0;
    ggml_backend_buffer_t b = refuse ? nullptr : ggml_backend_buft_alloc_buffer(p->host, size);
    if (!b || ggml_backend_buffer_get_type(b) != p->host || b->iface.init_tensor != nullptr) {
        // CUDA_Host falls back to pageable memory where cudaMallocHost fails: that is not this type's memory, and the
        // load fails instead (the Python side then loads the experts as stock does, saying so)
        LLAMA_LOG_ERROR("%s: could not allocate %.2f GiB of %s memory for the host experts\n", __func__,
                size / 1073741824.0, ggml_backend_buft_name(p->host));
        if (b) {
            ggml_backend_buffer_free(b);
        }
        return nullptr;
    }
    b->buft = buft; // the allocator lays tensors out by the buffer's type
    b->iface.init_tensor = pinned_init_tensor;
    b->iface.set_tensor = pinned_set_tensor; // the host type's is a memcpy too
    return b;
}

std::mutex types_mu;
std::unordered_map<ggml_backend_dev_t, std::unique_ptr<pinned_type>> types; // per device, for the process

} // namespace

ggml_backend_buffer_type_t llama_pyspecter_pinned_buffer_type(ggml_backend_dev_t dev) {
    if (!dev || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
        return nullptr;
    }
    ggml_backend_buffer_type_t host = ggml_backend_dev_host_buffer_type(dev);
    if (!host) {
        const char * proxy = std::getenv("SPECTER_PINNED_PROXY");
        if (!proxy || (std::strcmp(proxy, "1") != 0 && std::strcmp(proxy, "refuse") != 0)) {
            return nullptr;
        }
        host = ggml_backend_cpu_buffer_type();
    }
    std::lock_guard<std::mutex> lk(types_mu);
    auto & p = types[dev];
    if (!p) {
        p = std::make_unique<pinned_type>();
        p->host = host;
        p->device = ggml_backend_dev_buffer_type(dev);
        p->name = std::string(ggml_backend_buft_name(host)) + "_experts";
        p->buft.iface = {
            /* .get_name       = */ pinned_name,
            /* .alloc_buffer   = */ pinned_alloc,
            /* .get_alignment  = */ pinned_alignment,
            /* .get_max_size   = */ pinned_max_size,
            /* .get_alloc_size = */ pinned_alloc_size,
            /* .is_host        = */ pinned_is_host,
        };
        p->buft.device = dev;
        p->buft.context = p.get();
    }
    return &p->buft;
}

const char * llama_pyspecter_host_experts_buffer(const llama_model * model, int32_t il) {
    const llama_pyspecter_layer * L = pyspecter_layer_of(model, il);
    if (!L) {
        return nullptr;
    }
    for (const ggml_tensor * h : L->host) {
        if (h && h->buffer) {
            return ggml_backend_buffer_name(h->buffer);
        }
    }
    return nullptr;
}
