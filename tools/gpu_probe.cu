// tools/gpu_probe.cu: what a slot layer's host visit and its alternatives cost on this GPU, measured with the CUDA
// runtime alone (no ggml), in a few seconds. Issue 42's candidate designs need these numbers, not assumptions:
//
//   sync_us             an empty kernel, then cudaStreamSynchronize: the floor of any host wait
//   visit_us            a host visit as a split slot layer makes it: the device writes the pack, the host reads it
//                       back (D2H, synchronised), then sends the host path's rows down (H2D): what stays when the
//                       scheduler's bookkeeping and the CPU's compute are taken out
//   upload_expert_us    one expert's bytes from pinned host memory to the device, synchronised
//   h2d_pinned_gbps     many expert-sized uploads back to back from pinned memory: the link's upload rate
//   h2d_pageable_gbps   the same from ordinary (pageable) memory: what an upload costs without a pinned copy
//   zero_copy_expert_us a kernel reading one expert's bytes straight from mapped pinned host memory (over the link,
//                       no copy): candidate 1's miss path, against upload_expert_us and a host visit
//   zero_copy_gbps      that read over many experts' bytes
//   device_expert_us    the same kernel over one expert in device memory: a resident expert's read
//   device_read_gbps    that over many experts' bytes
//   wait_spin_us        one expert uploaded on a stream of its own, then an event of ggml's kind (no flags) recorded
//   wait_spin_cpu_us    and synchronised, as pyspecter's readers wait for a batch to land: the wall time, and the
//                       waiting thread's CPU time (spinning: about the same; CUDA's default scheduling spins where
//                       the host has more cores than the process has contexts)
//   wait_block_us       the same with a cudaEventBlockingSync event: what a blocking wait would cost in latency, and
//   wait_block_cpu_us   the core it would give back to llama.cpp's CPU threads (host layers, --miss cpu)
//
//   nvcc -O2 -arch=sm_90 tools/gpu_probe.cu -o gpu_probe && ./gpu_probe [--expert-bytes N] [--pack-bytes N]
//                                                                      [--rows-bytes N] [--device I]
//
// Prints one JSON object (medians over repeats). Exit 2 with one line on bad arguments or when no CUDA device is
// usable. The defaults are Qwen3-30B-A3B's: a Q4_0 expert (gate, up and down, 2048 x 768 each, 18 bytes per 32
// weights), the pack of one decode token (2048 floats and 4 (slot, expert) pairs) and the host path's rows (4 x 2048
// floats).

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

static double thread_cpu_us() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static double now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Median wall time in us of body(i) over n repeats, after `warm` untimed ones; body ends synchronised.
template <typename F> static double timed(int n, int warm, F body) {
    std::vector<double> t;
    for (int i = 0; i < warm + n; ++i) {
        const double t0 = now_us();
        body(i);
        if (i >= warm) {
            t.push_back(now_us() - t0);
        }
    }
    return median(t);
}

// Any CUDA error after the device was found is a failure of the probe itself: say where, exit 1.
#define CHECK(call)                                                                                               \
    do {                                                                                                          \
        cudaError_t err_ = (call);                                                                                \
        if (err_ != cudaSuccess) {                                                                                \
            fprintf(stderr, "gpu_probe: %s: %s (line %d)\n", #call, cudaGetErrorString(err_), __LINE__);          \
            exit(1);                                                                                              \
        }                                                                                                         \
    } while (0)

__global__ void empty_kernel() {}

// Reads n float4 (coalesced, grid-strided) and writes one sum per block, so the loads cannot be dropped.
__global__ void read_kernel(const float4 * src, size_t n, float * out) {
    float acc = 0.0f;
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x) {
        const float4 v = src[i];
        acc += v.x + v.y + v.z + v.w;
    }
    __shared__ float part[256];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int) threadIdx.x < s) {
            part[threadIdx.x] += part[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[blockIdx.x] = part[0];
    }
}

// Stands in for the device's last op before a host split: writes the pack the host reads back.
__global__ void write_kernel(float * dst, size_t n) {
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x) {
        dst[i] = (float) i;
    }
}

static bool parse_size(const char * s, size_t * out) {
    char * end = nullptr;
    const unsigned long long v = strtoull(s, &end, 10);
    if (!s[0] || *end || v == 0) {
        return false;
    }
    *out = (size_t) v;
    return true;
}

int main(int argc, char ** argv) {
    size_t expert_bytes = 3ull * 2048 * 768 / 32 * 18; // one Q4_0 expert of Qwen3-30B-A3B: 2,654,208 bytes
    size_t pack_bytes = (2048 + 2 * 4) * sizeof(float);
    size_t rows_bytes = 4ull * 2048 * sizeof(float);
    int device = 0;
    for (int i = 1; i < argc; ++i) {
        const bool has_value = i + 1 < argc;
        size_t v = 0;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: gpu_probe [--expert-bytes N] [--pack-bytes N] [--rows-bytes N] [--device I]\n"
                   "one JSON object: host wait and host visit floors, upload rates (pinned, pageable), zero-copy\n"
                   "reads of pinned host memory against device memory (header of tools/gpu_probe.cu)\n");
            return 0;
        } else if (has_value && !strcmp(argv[i], "--device")) {
            device = atoi(argv[++i]);
        } else if (has_value && parse_size(argv[i + 1], &v) &&
                   (!strcmp(argv[i], "--expert-bytes") || !strcmp(argv[i], "--pack-bytes") ||
                    !strcmp(argv[i], "--rows-bytes"))) {
            (!strcmp(argv[i], "--expert-bytes") ? expert_bytes : !strcmp(argv[i], "--pack-bytes") ? pack_bytes
                                                                                                   : rows_bytes) = v;
            ++i;
        } else {
            fprintf(stderr, "gpu_probe: bad argument %s (--help)\n", argv[i]);
            return 2;
        }
    }
    int n_dev = 0;
    const cudaError_t err = cudaGetDeviceCount(&n_dev);
    if (err != cudaSuccess || device < 0 || device >= n_dev) {
        fprintf(stderr, "gpu_probe: no CUDA device %d (%s)\n", device,
                err != cudaSuccess ? cudaGetErrorString(err) : "out of range");
        return 2;
    }
    CHECK(cudaSetDevice(device));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, device));
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

    // many experts' bytes for the rates (at least 256 MiB), rounded to whole float4s
    expert_bytes = (expert_bytes + 15) / 16 * 16;
    const int n_rate = (int) std::max<size_t>(16, (256ull << 20) / expert_bytes);
    const size_t big = expert_bytes * n_rate;
    const int blocks = prop.multiProcessorCount * 4, threads = 256;

    float *d_big = nullptr, *d_out = nullptr, *d_pack = nullptr, *d_rows = nullptr;
    CHECK(cudaMalloc(&d_big, big));
    CHECK(cudaMalloc(&d_out, blocks * sizeof(float)));
    CHECK(cudaMalloc(&d_pack, pack_bytes));
    CHECK(cudaMalloc(&d_rows, rows_bytes));
    CHECK(cudaMemset(d_big, 0, big));
    float *h_pinned = nullptr, *h_pack = nullptr, *h_rows = nullptr, *h_mapped = nullptr, *d_mapped = nullptr;
    CHECK(cudaHostAlloc(&h_pinned, big, cudaHostAllocDefault));
    CHECK(cudaHostAlloc(&h_pack, pack_bytes, cudaHostAllocDefault));
    CHECK(cudaHostAlloc(&h_rows, rows_bytes, cudaHostAllocDefault));
    CHECK(cudaHostAlloc(&h_mapped, big, cudaHostAllocMapped));
    CHECK(cudaHostGetDevicePointer(&d_mapped, h_mapped, 0));
    std::vector<char> pageable(big, 1);
    memset(h_pinned, 1, big);
    memset(h_mapped, 1, big);
    memset(h_rows, 0, rows_bytes);

    // the floor of a host wait
    const double sync_us = timed(200, 10, [&](int) {
        empty_kernel<<<1, 1, 0, st>>>();
        CHECK(cudaStreamSynchronize(st));
    });

    // a host visit: the pack written on the device, read back, the host's rows sent down before the next kernel
    const double visit_us = timed(200, 10, [&](int) {
        write_kernel<<<1, threads, 0, st>>>(d_pack, pack_bytes / sizeof(float));
        CHECK(cudaMemcpyAsync(h_pack, d_pack, pack_bytes, cudaMemcpyDeviceToHost, st));
        CHECK(cudaStreamSynchronize(st));
        h_rows[0] = h_pack[0]; // the host read what came back
        CHECK(cudaMemcpyAsync(d_rows, h_rows, rows_bytes, cudaMemcpyHostToDevice, st));
        empty_kernel<<<1, 1, 0, st>>>();
        CHECK(cudaStreamSynchronize(st));
    });

    // one expert uploaded, synchronised (each repeat another expert's bytes)
    const double upload_expert_us = timed(50, 10, [&](int i) {
        const size_t off = (size_t) (i % n_rate) * expert_bytes;
        CHECK(cudaMemcpyAsync((char *) d_big + off, (const char *) h_pinned + off, expert_bytes,
                              cudaMemcpyHostToDevice, st));
        CHECK(cudaStreamSynchronize(st));
    });

    // upload rates: every expert back to back, from pinned and from pageable memory (bytes per ns = GB/s)
    auto rate = [&](const void * src) {
        return big / (1e3 * timed(5, 0, [&](int) {
            for (int e = 0; e < n_rate; ++e) {
                CHECK(cudaMemcpyAsync((char *) d_big + e * expert_bytes, (const char *) src + e * expert_bytes,
                                      expert_bytes, cudaMemcpyHostToDevice, st));
            }
            CHECK(cudaStreamSynchronize(st));
        }));
    };
    const double h2d_pinned_gbps = rate(h_pinned);
    const double h2d_pageable_gbps = rate(pageable.data());

    // reads by a kernel: one expert from mapped pinned host memory, then many; the same from device memory. Each
    // repeat of a one-expert read takes the next expert of the buffer, so none is served from the GPU's L2 (tens
    // of MB: a few experts would fit), as a miss's expert would not be
    auto read = [&](const float * src, size_t bytes, int n) {
        const double us = timed(n, 3, [&](int k) {
            const size_t off = bytes < big ? (size_t) (k % n_rate) * expert_bytes : 0;
            read_kernel<<<blocks, threads, 0, st>>>((const float4 *) ((const char *) src + off), bytes / 16, d_out);
            CHECK(cudaStreamSynchronize(st));
        });
        CHECK(cudaGetLastError());
        return us;
    };
    const double zero_copy_expert_us = read(d_mapped, expert_bytes, 50);
    const double zero_copy_gbps = big / (read(d_mapped, big, 5) * 1e3);
    const double device_expert_us = read(d_big, expert_bytes, 50);
    const double device_read_gbps = big / (read(d_big, big, 5) * 1e3);

    // a landing waited for, as a reader waits: wall and the waiting thread's CPU time, per event kind
    cudaStream_t up;
    CHECK(cudaStreamCreateWithFlags(&up, cudaStreamNonBlocking));
    auto wait = [&](unsigned flags, double * cpu_us) {
        cudaEvent_t ev;
        CHECK(cudaEventCreateWithFlags(&ev, flags));
        std::vector<double> cpu;
        const double us = timed(50, 5, [&](int i) {
            const size_t off = (size_t) (i % n_rate) * expert_bytes;
            CHECK(cudaMemcpyAsync((char *) d_big + off, (const char *) h_pinned + off, expert_bytes,
                                  cudaMemcpyHostToDevice, up));
            CHECK(cudaEventRecord(ev, up));
            const double c0 = thread_cpu_us();
            CHECK(cudaEventSynchronize(ev));
            cpu.push_back(thread_cpu_us() - c0);
        });
        cpu.erase(cpu.begin(), cpu.begin() + 5); // the warm-up repeats, as timed() leaves them out
        *cpu_us = median(cpu);
        CHECK(cudaEventDestroy(ev));
        return us;
    };
    double wait_spin_cpu_us = 0, wait_block_cpu_us = 0;
    const double wait_spin_us = wait(cudaEventDisableTiming, &wait_spin_cpu_us);
    const double wait_block_us = wait(cudaEventDisableTiming | cudaEventBlockingSync, &wait_block_cpu_us);
    CHECK(cudaStreamDestroy(up));

    printf("{\"device\": \"%s\", \"cc\": \"%d.%d\", \"sms\": %d, \"expert_bytes\": %zu, \"pack_bytes\": %zu, "
           "\"rows_bytes\": %zu, \"sync_us\": %.2f, \"visit_us\": %.2f, \"upload_expert_us\": %.2f, "
           "\"h2d_pinned_gbps\": %.2f, \"h2d_pageable_gbps\": %.2f, \"zero_copy_expert_us\": %.2f, "
           "\"zero_copy_gbps\": %.2f, \"device_expert_us\": %.2f, \"device_read_gbps\": %.2f, "
           "\"wait_spin_us\": %.2f, \"wait_spin_cpu_us\": %.2f, \"wait_block_us\": %.2f, "
           "\"wait_block_cpu_us\": %.2f}\n",
           prop.name, prop.major, prop.minor, prop.multiProcessorCount, expert_bytes, pack_bytes, rows_bytes,
           sync_us, visit_us, upload_expert_us, h2d_pinned_gbps, h2d_pageable_gbps, zero_copy_expert_us,
           zero_copy_gbps, device_expert_us, device_read_gbps, wait_spin_us, wait_spin_cpu_us, wait_block_us,
           wait_block_cpu_us);

    cudaFreeHost(h_pinned);
    cudaFreeHost(h_pack);
    cudaFreeHost(h_rows);
    cudaFreeHost(h_mapped);
    cudaFree(d_big);
    cudaFree(d_out);
    cudaFree(d_pack);
    cudaFree(d_rows);
    cudaStreamDestroy(st);
    return 0;
}
