// Misses the device reads from the host copy (candidate 1 of docs/DEVICES.md): a speculated slot layer (speculate.cpp)
// adds, to each expert matmul over its slots, one over a device view of the layer's host experts, whose ids are the
// expert where the slot path read nothing (a negative id, ~expert: the layer has no zero slots) and negative
// elsewhere. Each row is then exact in one term and zero in the other, so a token that misses needs no redo and no
// CPU split: the layer never waits for the host, whatever it hits. Residency still learns the routing after the
// token, from the log.
//
// The view: on CUDA, where the model's host experts are in the pinned type a slot session loads them into
// (pinned.cpp: CUDA_Host memory, from cudaMallocHost: under unified addressing its device pointer is its host
// pointer; laid out with CUDA's row padding), a buffer of the device's own type over that memory, so the scheduler
// runs the matmul on the device and its kernel reads the bytes over the link. No copy and no device memory.
// Elsewhere (the RPC device, tests) a device copy of every expert can stand in: it checks the composition, the
// splits and the bookkeeping, not the read rate, and it costs device memory.

#include "pyspecter-impl.h"

#include "ggml-backend-impl.h"
#include "llama-impl.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>

namespace {

// The view owns nothing: the model's host buffer does, and outlives the slots. Reads and writes are host memcpy.
void view_free(ggml_backend_buffer_t) {}

void * view_base(ggml_backend_buffer_t buf) {
    return buf->context;
}

void view_set(ggml_backend_buffer_t, ggml_tensor * t, const void * data, size_t offset, size_t size) {
    memcpy((char *) t->data + offset, data, size);
}

void view_get(ggml_backend_buffer_t, const ggml_tensor * t, void * data, size_t offset, size_t size) {
    memcpy(data, (const char *) t->data + offset, size);
}

void view_clear(ggml_backend_buffer_t, uint8_t) {
    GGML_ABORT("pyspecter: a view of the model's host experts is never cleared");
}

const ggml_backend_buffer_i VIEW_IFACE = {
    /* .free_buffer   = */ view_free,
    /* .get_base      = */ view_base,
    /* .init_tensor   = */ nullptr,
    /* .memset_tensor = */ nullptr,
    /* .set_tensor    = */ view_set,
    /* .get_tensor    = */ view_get,
    /* .set_tensor_2d = */ nullptr,
    /* .get_tensor_2d = */ nullptr,
    /* .cpy_tensor    = */ nullptr,
    /* .clear         = */ view_clear,
    /* .reset         = */ nullptr,
};

// Whether dev's kernels can read host tensor h where it is: pinned memory laid out as dev's own buffers, on CUDA.
bool device_reads_in_place(ggml_backend_dev_t dev, const ggml_tensor * h) {
    const std::string reg = ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev));
    ggml_backend_buffer_type_t pinned = llama_pyspecter_pinned_buffer_type(dev);
    return reg == "CUDA" && pinned && h->buffer && ggml_backend_buffer_get_type(h->buffer) == pinned &&
           ggml_backend_buffer_get_base(h->buffer) != nullptr;
}

} // namespace

int32_t llama_pyspecter_map_host_experts(llama_model * model, int32_t allow_copy, size_t * copy_bytes) {
    auto * s = pyspecter_slots_of(model);
    if (copy_bytes) {
        *copy_bytes = 0;
    }
    if (!s) {
        return LLAMA_PYSPECTER_ERR_NO_SLOTS;
    }
    for (auto & L : s->layers) {
        if (L && pyspecter_is_mapped(L.get())) {
            return LLAMA_PYSPECTER_ERR_ENABLED; // graphs built since may read the views
        }
    }
    const int32_t rc = pyspecter_guarded(__func__, [&]() -> int32_t {
        std::unordered_map<ggml_backend_buffer_t, ggml_backend_buffer_t> views; // host buffer -> its view
        int32_t n_layers = 0;
        size_t copied = 0;
        for (auto & Lp : s->layers) {
            llama_pyspecter_layer * L = Lp.get();
            if (!L || L->table < 0) {
                continue; // host-side slots compute their misses in place already
            }
            if (L->n_zero > 0) {
                LLAMA_LOG_ERROR("%s: layer %d's device takes no negative ids (zero slots): nothing to map\n",
                        __func__, L->il);
                return LLAMA_PYSPECTER_ERR_ARG;
            }
            ggml_init_params ip = { ggml_tensor_overhead() * LLAMA_PYSPECTER_N_KINDS, nullptr, true };
            ggml_context * ctx = ggml_init(ip);
            if (!ctx) {
                return LLAMA_PYSPECTER_ERR_NO_MEMORY;
            }
            s->ctxs.push_back(ctx);
            std::vector<std::pair<ggml_tensor *, ggml_tensor *>> copies;
            for (int k = 0; k < LLAMA_PYSPECTER_N_KINDS; ++k) {
                ggml_tensor * h = L->host[k];
                if (!h) {
                    continue;
                }
                ggml_tensor * t = ggml_dup_tensor(ctx, h);
                ggml_format_name(t, "%s.mapped", h->name);
                L->mapped[k] = t;
                if (device_reads_in_place(L->dev, h)) {
                    ggml_backend_buffer_t & v = views[h->buffer];
                    if (!v) {
                        v = ggml_backend_buffer_init(ggml_backend_dev_buffer_type(L->dev), VIEW_IFACE,
                                                     ggml_backend_buffer_get_base(h->buffer),
                                                     ggml_backend_buffer_get_size(h->buffer));
                        ggml_backend_buffer_set_usage(v, GGML_BACKEND_BUFFER_USAGE_WEIGHTS); // run where it lives
                        s->mapped_bufs.push_back(v);
                    }
                    // placed by hand at the host tensor's bytes, whose padding the pinned type laid out as the
                    // device's own
                    t->buffer = v;
                    t->data = h->data;
                } else if (allow_copy) {
                    copies.emplace_back(h, t);
                } else {
                    LLAMA_LOG_ERROR("%s: %s: %s cannot read it in %s (pinned host memory, CUDA only)\n", __func__,
                            h->name, ggml_backend_dev_name(L->dev),
                            h->buffer ? ggml_backend_buffer_name(h->buffer) : "no buffer");
                    return LLAMA_PYSPECTER_ERR_ARG;
                }
            }
            if (!copies.empty()) {
                ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(
                        ctx, ggml_backend_dev_buffer_type(L->dev)); // only the copies: the views have their data
                if (!buf) {
                    LLAMA_LOG_ERROR("%s: cannot copy layer %d's experts to %s\n", __func__, L->il,
                            ggml_backend_dev_name(L->dev));
                    return LLAMA_PYSPECTER_ERR_NO_MEMORY;
                }
                ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
                s->mapped_bufs.push_back(buf);
                for (auto & [h, t] : copies) {
                    ggml_backend_tensor_set(t, h->data, 0, ggml_nbytes(h));
                    copied += ggml_nbytes(h);
                }
            }
            ++n_layers;
        }
        if (copied > 0) {
            LLAMA_LOG_WARN("%s: the device cannot read host memory: a copy of the experts stands in, %.1f MiB of "
                    "device memory beyond the slots\n", __func__, copied / 1048576.0);
        }
        if (copy_bytes) {
            *copy_bytes = copied;
        }
        return n_layers;
    });
    s->mapped_all = rc > 0;
    if (rc < 0) { // nothing half mapped: the layers' graphs stay as they were (what was allocated goes with the model)
        for (auto & L : s->layers) {
            if (L) {
                std::fill(std::begin(L->mapped), std::end(L->mapped), nullptr);
            }
        }
    }
    return rc;
}
