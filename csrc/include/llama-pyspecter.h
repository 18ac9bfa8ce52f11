// pyspecter's C API: our own code (csrc/), compiled into libllama by the top-level CMakeLists.txt. Not upstream.
//
// Expert slots: a budgeted number of each MoE layer's experts live in "slots" on the layer's device (VRAM, or RAM
// on a CPU-only build). The expert matmuls of that layer read the slots through a per-layer remap table
// (expert -> slot); experts that are not resident are computed exactly from the host copy (the model's own expert
// tensors) and the two results are added, so the output never depends on what is resident. A routing hook is
// called once per MoE layer per ubatch, before the expert matmuls, with the selected experts: the control plane
// may upload misses there (and wait for them), or leave them to the host.
//
// When llama_pyspecter_slots_init() is never called, nothing here runs and the library is stock.
//
// Errors: functions returning int32_t/int64_t answer a non-negative value on success and a negative
// llama_pyspecter_status on failure. No C++ exception ever crosses this API: callers are C and ctypes.
#pragma once

#include "llama.h"

// The API version compiled into this library. The Python side refuses any other (a stock or stale build) with a
// clear message instead of a missing-symbol crash or a silent ABI mismatch; bump it with every change below.
#define LLAMA_PYSPECTER_VERSION 32

#ifdef __cplusplus
extern "C" {
#endif

LLAMA_API int32_t llama_pyspecter_version(void); // LLAMA_PYSPECTER_VERSION of the library

enum llama_pyspecter_status {
    LLAMA_PYSPECTER_OK                 =   0,
    LLAMA_PYSPECTER_ERR_ARG            =  -1, // null pointer, or layer/expert/slot/kind/nbytes out of range
    LLAMA_PYSPECTER_ERR_ENABLED        =  -2, // slots_init twice: graphs built so far would not see a change
    LLAMA_PYSPECTER_ERR_DENSE          =  -3, // the model has no experts
    LLAMA_PYSPECTER_ERR_NO_MEMORY      =  -4, // a slot buffer, context or host staging copy could not be allocated
    LLAMA_PYSPECTER_ERR_LAYOUT         =  -5, // an expert tensor does not hold n_expert experts
    LLAMA_PYSPECTER_ERR_REPACKED       =  -6, // expert tensors in a repacked CPU buffer: load with use_extra_bufts = false
    LLAMA_PYSPECTER_ERR_NO_SLOTS       =  -7, // slots are not enabled on this model
    LLAMA_PYSPECTER_ERR_STOPPED        =  -8, // the model is being freed: its upload thread takes no more work
    LLAMA_PYSPECTER_ERR_UPLOAD_FAILED  =  -9, // the copy of this ticket failed, or was cancelled when the model was freed
    LLAMA_PYSPECTER_ERR_UNKNOWN_TICKET = -10, // a ticket that was never issued (<= 0, or not yet)
    LLAMA_PYSPECTER_ERR_INTERNAL       = -11, // an unexpected C++ exception, caught at the API boundary
    LLAMA_PYSPECTER_ERR_IO             = -12, // read_slot: the file read failed or came back short
};

// Which matmul weight of an expert (a layer has gate+up+down, or merged gate_up+down).
enum llama_pyspecter_kind {
    LLAMA_PYSPECTER_KIND_GATE    = 0,
    LLAMA_PYSPECTER_KIND_UP      = 1,
    LLAMA_PYSPECTER_KIND_DOWN    = 2,
    LLAMA_PYSPECTER_KIND_GATE_UP = 3,
    LLAMA_PYSPECTER_N_KINDS      = 4,
};

// Called once per MoE layer per ubatch from the compute thread, before that layer's expert matmuls.
// ids: [n_tokens][n_used] selected (logical) experts; weights: [n_tokens][n_used] router weights.
// The callback may change layer il's residency (llama_pyspecter_write_slot / load_expert + set_slot) before
// returning; whatever is still not resident when it returns is computed on the host.
typedef void (*llama_pyspecter_route_cb)(void * user_data, int32_t il, int32_t n_tokens, int32_t n_used,
                                         const int32_t * ids, const float * weights);

// Allocate n_slots expert slots in every MoE layer, on the layer's device, with the layer's expert tensor types
// (plus llama_pyspecter_zero_slots of them, all-zero, where misses point on a device whose kernel takes no negative
// id: row j of a token reads zero slot j, since such a kernel also takes no expert id twice in a token; elsewhere a
// miss is a negative id, a zero row). Call after loading the model and before creating a context on it. All
// experts start non-resident. CPU slots are not touched here, so a slot takes memory only once an expert is written
// into it. Returns 0, or a negative status.
LLAMA_API int32_t llama_pyspecter_slots_init(struct llama_model * model, int32_t n_slots);

// The all-zero slots a slot layer on dev holds besides its slots: 0 where dev's mul_mat_id takes a negative id as
// a zero row in an op marked GGML_MUL_MAT_ID_NEGATIVE_ZERO (the CPU, patch 0001; CUDA, patch 0008; RPC, whose
// server computes with the CPU's kernels), else n_used; n_used everywhere but the CPU under SPECTER_ZERO_SLOTS=1.
// They are device memory: a budget counts them (pyspecter's budget.zero_slots asks here).
LLAMA_API int32_t llama_pyspecter_zero_slots(ggml_backend_dev_t dev, int32_t n_used);

// A layer plan: what each MoE layer is. Only slot layers get slots and a routing op; host and full layers keep
// stock llama.cpp's graph, with their experts wherever the model load put them (host layers: in host memory, as
// with --cpu-moe; full layers: on the device, as stock's device layers, with no host round trip at all).
enum llama_pyspecter_layer_kind {
    LLAMA_PYSPECTER_LAYER_SLOTS = 0,
    LLAMA_PYSPECTER_LAYER_HOST  = 1,
    LLAMA_PYSPECTER_LAYER_FULL  = 2,
};
// slots_init with a plan: kinds[il] for layers il < n_kinds (SLOTS beyond), n_kinds = 0 is slots_init.
LLAMA_API int32_t llama_pyspecter_slots_init_layers(struct llama_model * model, int32_t n_slots,
                                                    const int32_t * kinds, int32_t n_kinds);
// SLOTS (the layer has slots), HOST (its experts are in host memory), FULL (on the device), -1 not a MoE layer
LLAMA_API int32_t llama_pyspecter_layer_kind(const struct llama_model * model, int32_t il);
LLAMA_API int32_t llama_pyspecter_n_slots   (const struct llama_model * model); // 0: slots not enabled
LLAMA_API bool    llama_pyspecter_is_moe_layer(const struct llama_model * model, int32_t il);
// bytes of one expert in one kind of weight of layer il; 0 if the layer has no such tensor
LLAMA_API size_t  llama_pyspecter_expert_nbytes(const struct llama_model * model, int32_t il, int32_t kind);
LLAMA_API size_t  llama_pyspecter_slots_nbytes (const struct llama_model * model); // total slot memory

// Residency. set_slot(il, e, s) makes expert e resident in slot s (the slot must already hold e's bytes);
// s = -1 evicts e. A slot holds at most one expert: the previous owner of s becomes non-resident.
// Change residency only from the routing hook or between decodes.
//
// On a device the slot matmul reads a remap table on the device, so residency reaches it in two ways: a new
// mapping at the next fence (before each ubatch's graph runs: one copy per device), an eviction at once when the
// layer may still run in the ubatch in flight, so that its slot can be overwritten as soon as set_slot returns.
// The host computes exactly the rows the device sent to a zero slot or a negative id, whatever the table held.
LLAMA_API int32_t llama_pyspecter_slot_of  (const struct llama_model * model, int32_t il, int32_t expert);
LLAMA_API int32_t llama_pyspecter_expert_in(const struct llama_model * model, int32_t il, int32_t slot);
LLAMA_API int32_t llama_pyspecter_set_slot (struct llama_model * model, int32_t il, int32_t expert, int32_t slot);
// What each slot layer's routing selected since the last take, for a hot set re-chosen between decodes: once the
// first slot layer has routed at least min_tokens tokens (and at least one), fills out[il * n_expert + e] with the
// times layer il selected expert e (0 for layers without slots), restarts the counts and returns the tokens routed;
// otherwise returns 0 and leaves out alone. n >= n_layer * n_expert, else LLAMA_PYSPECTER_ERR_ARG. Between decodes.
LLAMA_API int32_t llama_pyspecter_take_uses(struct llama_model * model, int32_t min_tokens, uint32_t * out, int32_t n);

// Uploads. write_slot copies one kind's bytes of one expert (nbytes == expert_nbytes) from src into slot;
// load_expert copies all kinds of expert e from the model's host copy. Both return 0 or a negative status.
//
// The _async forms queue the copy on the model's upload thread and return a ticket: > 0, issued in order and
// finished in order, or a negative status when the copy was refused (never queued; it never counts as done).
// src must stay valid until the ticket has finished. Every issued ticket ends either landed or failed:
//   upload_status: 1 landed, 0 still queued or copying, LLAMA_PYSPECTER_ERR_UPLOAD_FAILED (the copy failed, or
//                  was cancelled because the model is being freed), LLAMA_PYSPECTER_ERR_UNKNOWN_TICKET.
//   upload_wait:   blocks until the ticket has finished, then returns its status (1 or negative, never 0); an
//                  unknown ticket returns at once.
//   upload_done:   upload_status == 1. Ticket 0, the point before the first ticket, counts as done, so "has the
//                  upload before t landed" is upload_done(t - 1) for every t.
LLAMA_API int32_t llama_pyspecter_write_slot (struct llama_model * model, int32_t il, int32_t kind, int32_t slot,
                                              const void * src, size_t nbytes);
LLAMA_API int32_t llama_pyspecter_load_expert(struct llama_model * model, int32_t il, int32_t expert, int32_t slot);
LLAMA_API int64_t llama_pyspecter_write_slot_async (struct llama_model * model, int32_t il, int32_t kind,
                                                    int32_t slot, const void * src, size_t nbytes);
LLAMA_API int64_t llama_pyspecter_load_expert_async(struct llama_model * model, int32_t il, int32_t expert,
                                                    int32_t slot);
// Read one kind's bytes of one expert from a file and copy them into slot, in one call: the disk tier's reader
// threads call it from Python with the GIL released, so a read costs them one foreign call rather than a Python
// read, a buffer view and a second call for the copy. fd: the GGUF, opened by the caller (O_DIRECT or not);
// offset: where the expert's bytes start in it (nbytes == expert_nbytes); buf: the calling thread's own
// page-aligned buffer of buf_size >= nbytes + 2 * 4096 bytes, as O_DIRECT wants (aligned offset, size and memory:
// the read covers the 4096-aligned range around the bytes). drop_cache: give the range's pages back to the
// kernel afterwards (buffered reads). 0, LLAMA_PYSPECTER_ERR_IO (the read failed or was short: the slot was
// not written), or another negative status.
LLAMA_API int32_t llama_pyspecter_read_slot(struct llama_model * model, int32_t il, int32_t kind, int32_t slot,
                                            int32_t fd, int64_t offset, void * buf, size_t buf_size,
                                            bool drop_cache);

// Copy a slot's bytes of one kind out (nbytes == expert_nbytes), from wherever the slot lives: what a read
// landed there, for checks. 0 or a negative status.
LLAMA_API int32_t llama_pyspecter_slot_get(const struct llama_model * model, int32_t il, int32_t kind, int32_t slot,
                                           void * out, size_t nbytes);

LLAMA_API int32_t llama_pyspecter_upload_status(struct llama_model * model, int64_t ticket);
LLAMA_API int32_t llama_pyspecter_upload_wait  (struct llama_model * model, int64_t ticket);
LLAMA_API bool    llama_pyspecter_upload_done  (struct llama_model * model, int64_t ticket);

// Emulate a slower link: every upload takes at least nbytes / (gbps * 1e9) seconds. 0 = as fast as possible.
LLAMA_API void    llama_pyspecter_set_link_gbps(struct llama_model * model, double gbps);

LLAMA_API void    llama_pyspecter_set_route_cb(struct llama_model * model, llama_pyspecter_route_cb cb, void * user_data);
// Whether the routing op reads the router weights (off by default): the routing hook then gets them, and a draft's
// routing op weighs its predictions by them (off: the hook's weights are null, every prediction weighs 1). On a
// device each layer's weights are one more read back to the host per ubatch, a host wait a slot layer whose
// experts all hit would otherwise not take. Set it before creating a context.
LLAMA_API void    llama_pyspecter_set_route_weights(struct llama_model * model, bool enabled);
// Speculate that ubatches hit (off by default): a ubatch of up to 8 tokens whose previous ubatch hit in every row
// of every device slot layer runs with no host path, so none of its layers waits for the host; a row that missed
// (read a zero slot) has the ubatch computed again with host paths, so the output stays exact. After a miss the
// next speculation waits 1, 2, 4 ... 64 ubatches. Only for device slot layers in miss mode cpu, and not while a
// reader needs a layer's input or router weights mid-ubatch (input hooks, learned predictors, route weights):
// those graphs keep their host paths. SPECTER_SPECULATE=0 in the environment keeps it off (benchmarks' A/B), and so
// does a model with recurrent layers (llama_model_is_recurrent, _is_hybrid): a redo computes the ubatch again on the
// memory the first pass left, which attention's KV cells allow (rewritten in place) and a recurrent state does not
// (it would advance twice). Returns whether speculation is on (false also without slots).
LLAMA_API bool    llama_pyspecter_set_speculate(struct llama_model * model, bool enabled);
// Misses the device reads from the host copy (docs/DEVICES.md, candidate 1): each device slot layer gets a device
// view of its host experts, and a speculated ubatch adds to each slot matmul one over that view for the rows whose
// expert is not resident (their slot id is ~expert), so it never redoes: with speculation on, decode and prompt
// ubatches (up to 512 tokens) run with no CPU split and no host wait inside them whatever they hit, and residency
// hears the routing after each. The view is the host memory itself where the device's kernels read it in place
// (CUDA, experts in its pinned host buffer type: no copy, no device memory); elsewhere, with allow_copy, a device
// copy of every expert stands in (the RPC device in tests: it costs the experts' bytes of device memory, returned in
// *copy_bytes; Python allows it on RPC only). Needs a device that takes negative ids (no zero slots:
// llama_pyspecter_zero_slots). Call after slots_init and before creating a context. Returns the layers mapped (0:
// none on a device), or LLAMA_PYSPECTER_ERR_NO_SLOTS, ERR_ENABLED (mapped already), ERR_ARG (a layer with zero
// slots, or host experts the device cannot read and allow_copy 0; nothing is mapped then), ERR_NO_MEMORY.
LLAMA_API int32_t llama_pyspecter_map_host_experts(struct llama_model * model, int32_t allow_copy, size_t * copy_bytes);
// Where a slot session keeps the routed experts on the host beside device dev (the placement's override for them):
// dev's pinned host buffer type (CUDA_Host) laid out with dev's own allocation sizes, so that uploads copy from pinned
// memory and the device reads the experts in place (map_host_experts). llama.cpp's loader turns an override to the
// host type itself into the CPU's whenever the file is mmap'd, so the experts stayed pageable (csrc/pinned.cpp). NULL
// where dev has no host buffer type (the CPU, RPC; SPECTER_PINNED_PROXY=1 gives RPC one over CPU memory, for tests).
// A buffer the host type cannot pin is refused (the model load then fails), not made pageable.
LLAMA_API ggml_backend_buffer_type_t llama_pyspecter_pinned_buffer_type(ggml_backend_dev_t dev);
// The name of the buffer type that holds slot layer il's host experts (what its uploads and mapped misses read), or
// NULL (no slots, not a slot layer).
LLAMA_API const char * llama_pyspecter_host_experts_buffer(const struct llama_model * model, int32_t il);

// Called once per MoE layer per ubatch from the compute thread, just before the routing hook, with the layer's
// router input x: [n_tokens][n_embd] contiguous f32 rows, valid only during the call (learned routing predictors
// read it to predict later layers). Set it before creating a context: graphs built earlier do not pass x.
typedef void (*llama_pyspecter_input_cb)(void * user_data, int32_t il, int32_t n_tokens, int32_t n_embd,
                                         const float * x);
LLAMA_API void    llama_pyspecter_set_input_cb(struct llama_model * model, llama_pyspecter_input_cb cb, void * user_data);

// Late experts (cache-aware ordering). With a wait hook set before the context is created, each expert matmul
// also gets a "late" path: an expert the routing hook marks late with set_late(il, e, slot) (its upload into slot
// started but not finished) is left out of the slot and host paths, and computed from that slot after the
// resident experts' matmul and the host path have run and the wait hook(il) has returned (it must make sure the
// upload has landed). Marks last for the ubatch in progress.
typedef void (*llama_pyspecter_wait_cb)(void * user_data, int32_t il);
LLAMA_API void    llama_pyspecter_set_wait_cb(struct llama_model * model, llama_pyspecter_wait_cb cb, void * user_data);
LLAMA_API int32_t llama_pyspecter_set_late   (struct llama_model * model, int32_t il, int32_t expert, int32_t slot);

// Disk tier: drop the host copy's expert pages from this process's memory (madvise MADV_DONTNEED on the
// page-aligned inside of every expert tensor that lives in a file mapping; mmap loading pre-faults the whole file).
// The tensors stay valid: a later read faults the bytes back in from the file. Returns the bytes released.
LLAMA_API size_t  llama_pyspecter_release_host_experts(struct llama_model * model);

// Batch-invariant CPU matmuls: off (the default) the CPU backend uses llamafile's sgemm where it can, as stock does,
// and a matmul's bits may depend on how many tokens share the batch; on, every mul_mat takes ggml's own kernel,
// whose rows are the same bits at any batch size (so a K+1-token verification pass equals K+1 one-token decodes).
// Process-wide; change it only between decodes.
LLAMA_API void    llama_pyspecter_set_batch_invariant(bool enabled);

// For command-line programs: when ggml aborts (an assertion, a CUDA error, or a lost RPC connection, which ggml
// treats as fatal), print llama.cpp's last remembered error and warning lines (llama_pyspecter_logs_quiet's), then
// one line "pyspecter: fatal: <first line of the message>" to stderr, and exit with `code` instead of dumping a
// backtrace and dumping core. A library user who wants the default behaviour never calls this.
LLAMA_API void    llama_pyspecter_exit_on_abort(int32_t code);

// Native residency: the routing op itself decides, reads and evicts, with no call into the control plane inside a
// layer. Once enabled (after slots_init, before creating a context) this library owns the slot table: which expert
// each slot holds, the reads in flight, eviction, and what a miss does. The control plane configures it, schedules
// prefetches and writes eviction scores between decodes, and reads counters; a route hook, if set, is then only an
// observer called after the decision (traces, predictors), and set_slot must not be used.
enum llama_pyspecter_policy {
    LLAMA_PYSPECTER_POLICY_LRU        = 0, // least recently used
    LLAMA_PYSPECTER_POLICY_LFU        = 1, // least often selected, recency breaking ties
    LLAMA_PYSPECTER_POLICY_PREV_TOKEN = 2, // keep what the layer's previous call used, the rest first in first out
    LLAMA_PYSPECTER_POLICY_SCORE      = 3, // lowest score (set_scores) first, recency breaking ties
};
enum llama_pyspecter_miss {
    LLAMA_PYSPECTER_MISS_CPU  = 0, // compute misses on the host now, read them into slots in the background
    LLAMA_PYSPECTER_MISS_WAIT = 1, // read misses into slots now (side by side), wait, compute them from the slots
    LLAMA_PYSPECTER_MISS_ORDERED = 2, // wait, refined: misses are late experts, computed from their slots after the
                                      // layer's resident experts, while their reads land (the late path below)
    LLAMA_PYSPECTER_MISS_HOST = 3, // compute misses on the host from their home copy and never move an expert (no
                                   // read, prefetch, lookahead or planner): for slots in host memory whose experts'
                                   // home copy is host RAM too, where a copy into a slot is pure cost (a memcpy on
                                   // the compute threads' cores for rows the host computes as fast from home)
    LLAMA_PYSPECTER_MISS_SURROGATE = 4, // APPROXIMATE, opt-in (set_surrogates): a one-token ubatch's miss not
                                        // landing soon is computed from its surrogate, mapped into a reserved slot
                                        // for that ubatch, while the full expert is read in the background;
                                        // multi-token ubatches wait (MISS_WAIT)
};
struct llama_pyspecter_residency_params {
    int32_t policy;     // llama_pyspecter_policy
    int32_t miss;       // llama_pyspecter_miss
    int32_t n_readers;  // reads in flight at most (reader threads, or the ring's depth); <= 0: 1
    int32_t fd;         // >= 0: read experts from this file (the GGUF; O_DIRECT or not), offsets by set_file_offset;
                        // < 0: copy them from the model's host copy (RAM, through the emulated link if set)
    bool    drop_cache; // fd is buffered: give each read's pages back to the kernel afterwards
    bool    lookahead;  // multi-token ubatch: read the next layer's most used experts while this layer computes
    bool    record;     // keep the routing trace for trace_take
    int32_t read_chunk; // fd >= 0: bytes per file read at most (rounded up to 4096); one expert's kind is split
                        // into equal 4096-aligned chunks read side by side, so a layer's few misses keep the disk's
                        // queue several deep; <= 0: 256 KiB
    int32_t io;         // llama_pyspecter_io: how file reads are issued
};
enum llama_pyspecter_io {
    LLAMA_PYSPECTER_IO_AUTO    = 0, // io_uring (n_readers reads in flight on one ring) where the kernel and its
                                    // sandbox allow it, else pread on n_readers threads; stats.io_uring says which
    LLAMA_PYSPECTER_IO_THREADS = 1, // pread on n_readers threads
};
LLAMA_API int32_t llama_pyspecter_residency_init(struct llama_model * model,
                                                 const struct llama_pyspecter_residency_params * params);
LLAMA_API bool    llama_pyspecter_residency_enabled(const struct llama_model * model);
// where expert 0 of layer il's `kind` tensor starts in the file (expert e at offset + e * expert_nbytes)
LLAMA_API int32_t llama_pyspecter_set_file_offset(struct llama_model * model, int32_t il, int32_t kind, int64_t offset);
// slots [0, n) of layer il are handed out (the rest are held back, e.g. a draft's memory); n <= n_slots
LLAMA_API int32_t llama_pyspecter_set_usable(struct llama_model * model, int32_t il, int32_t n);
// A draft's memory: layer il holds back n_held slots after its usable ones (set_usable first) until release_held,
// and simulates plain LRU over both (n_usable + n_held experts) in bookkeeping on its routing calls: the misses it
// has are counted in ghost_misses (stats), what dropping the draft would leave. n_held = 0: none, no ghost.
LLAMA_API int32_t llama_pyspecter_set_held(struct llama_model * model, int32_t il, int32_t n_held);
// The draft is dropped (between decodes): every layer hands out its held slots from here on and its ghost ends;
// protections end and the prefetches still queued unread (the dropped draft's predictions) are taken back.
// Returns the slots released over all layers, or a negative status.
LLAMA_API int32_t llama_pyspecter_release_held(struct llama_model * model);
// The eviction policy from the next routing call on (between decodes; llama_pyspecter_policy): a draft session
// evicts LRU while the draft's predictions fill the slots, and by the reuse maps once it is dropped
LLAMA_API int32_t llama_pyspecter_set_policy(struct llama_model * model, int32_t policy);
// Layer il's held slots now (a negative status on error), and its ghost's misses since set_held into
// *ghost_misses (may be null)
LLAMA_API int32_t llama_pyspecter_held(const struct llama_model * model, int32_t il, int64_t * ghost_misses);
// SCORE policy: layer il's eviction scores, one per expert (higher: keep); copied
LLAMA_API int32_t llama_pyspecter_set_scores(struct llama_model * model, int32_t il, const float * scores, int32_t n);
// SCORE policy from a reuse map, computed in the routing op from the layer's router input x (its last row) when an
// eviction first needs them: s = x R + rb (R: [n_embd][n_expert] row-major f32, rb: [n_expert]); with blend (6
// floats) the score is blend . (s, used by the previous call, share of the last 4 calls, of the last 16,
// 1 / (1 + calls since last use), 1), the features counted natively over the layer's calls. Copied. Set before
// creating a context (the graph then hands the op the router input).
LLAMA_API int32_t llama_pyspecter_set_reuse_map(struct llama_model * model, int32_t il, const float * R,
                                                const float * rb, int32_t n_embd, const float * blend);
// Set dueling between LRU and the reuse scores: every layer with a map is also simulated in bookkeeping under both,
// and the real cache evicts by whichever missed less lately (one-token calls, counts decayed by `decay` per call,
// a `margin` before the trusted side gives way). start_learned: trust the scores first.
LLAMA_API int32_t llama_pyspecter_set_duel(struct llama_model * model, bool enabled, bool start_learned, float decay,
                                           float margin);
// 1 while the duel evicts by the scores, 0 by LRU, with the switches so far in *switches (may be null)
LLAMA_API int32_t llama_pyspecter_duel_state(struct llama_model * model, int64_t * switches);

// experts of layer il predicted for the window in flight: eviction spares them unless a needed expert wants the
// slot. n = 0 clears layer il; il = -1 clears every layer.
LLAMA_API int32_t llama_pyspecter_set_protected(struct llama_model * model, int32_t il, const int32_t * experts,
                                                int32_t n);
// A prefetch: read expert into a slot of layer il ahead of need, behind every demand read; lower deadline first,
// then higher priority. deadline: in routing calls from now (a layer h MoE layers ahead of the one computing, or at
// position h of the next pass, is due in h). 1 queued, 0 nothing to do (resident, in flight, no slot to give, or
// miss mode host, which moves nothing), negative: error. The native planner (set_ahead_map) queues its predictions the same way.
LLAMA_API int32_t llama_pyspecter_schedule(struct llama_model * model, int32_t il, int32_t expert, float priority,
                                           int32_t deadline);

// The native planner: learned layer-ahead maps, applied in the routing op of layer il_src to its router input's
// last row x (one-token ubatches only: decoding) to predict layer il_dst's routing of the same token, h MoE layers
// later. Selection scores y = x W + b (W: [n_embd][n_expert] row-major f32, b: [n_expert]); with sel_bias
// (non-null, [n_expert]) y becomes gating(y) + sel_bias, as llama.cpp ranks experts (gating: the model's
// LLAMA_EXPERT_GATING_FUNC_TYPE; softmax unless sigmoid or sqrt-softplus). The expert ranked r gets probability
// table[bin][r] (table: [n_bins][n_expert]), bin = how many of edges[0 .. n_bins - 2] (ascending) the gap
// y(rank n_used - 1) - y(rank n_used) reaches: learned.LearnedPredictor.predict's calibration. Experts of il_dst
// at probability >= min_prob (set_planner) that are not resident are prefetched (priority: the probability,
// deadline: h) while the readers' measured throughput can land them within h layer-times. Copied; set before
// creating a context (the graph then hands the op the router input). il_dst = -1 drops il_src's maps.
LLAMA_API int32_t llama_pyspecter_set_ahead_map(struct llama_model * model, int32_t il_src, int32_t il_dst,
                                                const float * W, const float * b, int32_t n_embd, int32_t n_used,
                                                int32_t gating, const float * sel_bias, const float * table,
                                                const float * edges, int32_t n_bins);
// planner on/off (its maps are kept either way), the least probability it prefetches at, and the link-bound rule:
// it stands aside while the waits for reads take more than max_stall of a layer-time (EMAs over one-token calls;
// >= 1: never)
LLAMA_API int32_t llama_pyspecter_set_planner(struct llama_model * model, bool enabled, float min_prob,
                                              float max_stall);
// The probabilities il_src's map for il_dst gives router input x ([n_embd]) into out[n_expert]: what the routing op
// computes (tests compare it with the Python predictor). 0, or a negative status (no such map).
LLAMA_API int32_t llama_pyspecter_ahead_probs(struct llama_model * model, int32_t il_src, int32_t il_dst,
                                              const float * x, int32_t n_embd, float * out, int32_t n_expert);
// A replay: a routing trace run through native residency's own eviction code (victim, the policies' ranks, the
// duel, the held slots' ghost) on a private slot table of its own, with no model: what study/ judges policies
// by. Reads land at once: a miss is read into its slot within its call, a prompt's read-ahead (lookahead) by its
// layer's next call, so the replay reads what the routing op reads wherever that does not depend on timing
// (misses waited for, RAM tier). Layers are replayed in the order of their index.
struct llama_pyspecter_replay;
struct llama_pyspecter_replay_params {
    int32_t n_layer;                // layers [0, n_layer)
    int32_t n_expert;
    const int32_t * slots;          // [n_layer]: usable slots of each layer; 0: not replayed (a dense layer)
    const int64_t * expert_bytes;   // [n_layer]: bytes of one expert of each layer (stats.bytes), or null
    int32_t policy;                 // llama_pyspecter_policy
    bool    lookahead;              // a multi-token call reads the next layer's most used experts ahead
    int32_t held;                   // > 0: set_held's slots and ghost LRU over slots + held in every layer
    bool    duel, start_learned;    // set_duel's; a call's scores (replay_call) are its layer's reuse scores
    float   decay, margin;
};
struct llama_pyspecter_replay_stats {
    int64_t calls;                  // counted routing calls (replay_call's `counted`); the rest count only below
    int64_t needed;                 // distinct experts they needed
    int64_t hits;                   // ... resident when needed
    int64_t misses;                 // ... not resident
    int64_t reads;                  // ... read into a slot (a miss that finds none is computed on the host)
    int64_t evictions;              // ... of which evicted another expert
    int64_t bytes;                  // reads times the layer's expert_bytes
    int64_t lookahead;              // experts read ahead by multi-token calls (every call)
    int64_t held_ghost_misses;      // the held slots' ghost LRU's misses (every call, as stats.ghost_misses)
    int64_t ghost_lru_misses;       // the duel's simulated caches' misses, counted calls: LRU ...
    int64_t ghost_score_misses;     // ... and the scores
    int32_t use_scores;             // 1 while the duel evicts by the scores
    int64_t switches;               // the duel's switches
};
// null on a bad argument or out of memory; free with replay_free
LLAMA_API struct llama_pyspecter_replay * llama_pyspecter_replay_init(const struct llama_pyspecter_replay_params * p);
LLAMA_API void    llama_pyspecter_replay_free(struct llama_pyspecter_replay * r);
// One routing call of layer il: ids [n_tokens][n_used] (negative: none); scores: [n_expert], the call's eviction
// scores (the SCORE policy and the duel read them; null: none this call, as with no router input); counted: a
// decode call (a prompt's batch moves the table and the simulated caches but counts only its lookahead)
LLAMA_API int32_t llama_pyspecter_replay_call(struct llama_pyspecter_replay * r, int32_t il, const int32_t * ids,
                                              int32_t n_tokens, int32_t n_used, const float * scores, bool counted);
// layer il's counts, or (il = -1) every layer's summed
LLAMA_API int32_t llama_pyspecter_replay_get_stats(const struct llama_pyspecter_replay * r, int32_t il,
                                                   struct llama_pyspecter_replay_stats * out);
// Surrogates (MISS_SURROGATE): layer il's reserved slots [first, first + n_reserved) (after its usable and held
// ones) hold expanded surrogates, and each expert's surrogate keeps n_keep groups of `group` neurons (groups:
// [n_expert][n_keep] group indices, ascending). Then, per kind (gate, up, down; no merged gate_up), the kept bytes:
// gate/up [n_expert][n_keep * group rows][row bytes] (the rows of the kept neurons, in order), down
// [n_expert][rows][n_keep][block bytes] (each row's quantization blocks of the kept groups). An expanded surrogate
// is the expert with every other neuron's bytes zero. Copied; set after residency_init, before creating a context.
LLAMA_API int32_t llama_pyspecter_set_surrogates(struct llama_model * model, int32_t il, int32_t first,
                                                 int32_t n_reserved, int32_t group, const int32_t * groups,
                                                 int32_t n_keep);
LLAMA_API int32_t llama_pyspecter_set_surrogate_bytes(struct llama_model * model, int32_t il, int32_t kind,
                                                      const void * data, size_t nbytes);
// misses served by surrogates since residency_init (a negative status without residency)
LLAMA_API int64_t llama_pyspecter_surrogate_uses(const struct llama_model * model);
// Fault injection (tests): every read native residency makes (a chunk of a file read, a copy from the host copy,
// a late expert's read again) goes through these from the next read on. Set between decodes; all zero: none.
struct llama_pyspecter_read_faults {
    int32_t fail_every; // every fail_every-th read fails (ERR_IO) and its expert stays a miss; 0: none fail
    bool    torn;       // a failing read first fills its bytes of the slot with 0xFF (NaN), as a torn read would
    int32_t slow_us;    // every read first waits this long: a slow disk
    int32_t land_us;    // every read fills its bytes of the slot with 0xFF, waits this long, then lands: a slot
                        // read before its read landed turns the logits NaN
};
LLAMA_API int32_t llama_pyspecter_set_read_faults(struct llama_model * model,
                                                  const struct llama_pyspecter_read_faults * faults);
// reads failed by injection since residency_init, or a negative status
LLAMA_API int64_t llama_pyspecter_read_faults_injected(const struct llama_model * model);
// A draft's routing in the target's planner, handed over once per draft step (draft.cpp). Between decodes,
// draft_handover(target, draft, min_conf, per_pass, n_tokens) closes the target's previous window and arms the
// draft (its slots enabled, so that its MoE layers have the routing op) for its next n_tokens tokens: as its routing
// op routes them, each selected expert at router weight >= min_conf (the confidence) is protected for the window
// and, where not resident, prefetched into the target as the native planner prefetches (behind every demand read;
// a slot is taken only from an expert less likely to be needed than the draft's measured precision so far), due at
// the verification call that needs it (the most confident first among equals):
// token i of the window, verified per_pass tokens a pass, reaches the MoE layer at forward position p at routing call
// (i / per_pass) * n_moe_layers + p + 1 from now. A window's prefetches still queued when it closes are taken back.
// draft = null only closes the window (a step without the draft). Target: native residency on. 0, or a negative
// status. draft_unlink: the draft's routing goes nowhere from here on (before its target goes, or the draft is done).
LLAMA_API int32_t llama_pyspecter_draft_handover(struct llama_model * target, struct llama_model * draft,
                                                 float min_conf, int32_t per_pass, int32_t n_tokens);
LLAMA_API int32_t llama_pyspecter_draft_unlink(struct llama_model * draft);
// Counters of the handovers made to a target, over closed windows where it says so.
struct llama_pyspecter_draft_stats {
    int64_t handovers;  // draft steps handed over
    int64_t picks;      // (token, layer, expert) rows the draft routed in them at min_conf or more
    int64_t predicted;  // distinct (layer, expert) of a window at min_conf or more
    int64_t resident;   // ... resident already at the handover
    int64_t prefetches; // ... queued as prefetches
    int64_t refused;    // ... refused: no slot held an expert predicted less likely
    int64_t scored;     // prefetches of closed windows
    int64_t used;       // ... that the target needed at their layer within their window (precision: used / scored)
    int64_t stale;      // ... unused and still queued when their window closed: taken back
    int64_t needed;     // the target's needs in windows (distinct experts per routing call)
    int64_t hits;       // ... resident at need (coverage: hits / needed)
    int64_t recalled;   // ... that the draft predicted (recall: recalled / needed)
    int64_t lru_hits;   // ... that plain LRU over the layer's usable slots would have had resident (a ghost)
};
LLAMA_API int32_t llama_pyspecter_get_draft_stats(struct llama_model * target, struct llama_pyspecter_draft_stats * out);
// wait for every read in flight and map what landed (between decodes)
LLAMA_API int32_t llama_pyspecter_drain(struct llama_model * model);
// The routing trace (record): flat int32 [il, n, e_1 .. e_n] per routing call, the distinct experts ascending.
// Copies and removes up to cap ints of whole calls; returns how many (0 with cap 0: the ints waiting).
LLAMA_API size_t  llama_pyspecter_trace_take(struct llama_model * model, int32_t * out, size_t cap);
// Recording on or off from the next routing call on (between decodes): off also forgets the calls not yet taken.
// A draft session records only while its prefetches are scored against their verification pass.
LLAMA_API int32_t llama_pyspecter_set_record(struct llama_model * model, bool enabled);
// The device tables' counters since the last stats_reset (all zero without device slots).
struct llama_pyspecter_device_stats {
    int64_t fences;          // ubatches started (graph computes) with device tables
    int64_t table_pushes;    // fences that copied a table to its device (something changed)
    int64_t table_bytes;     // bytes those copies sent
    int64_t eviction_writes; // evictions written to a table at once (the layer could still run this ubatch)
    int64_t upload_streams;  // devices whose uploads run on their own backend stream, ordered by events (not reset)
    int64_t async_batches;   // upload batches (an expert's kinds) sent on such a stream and awaited by their event
    int64_t compute_orders;  // upload batches ordered after the device work queued before them (device layers)
    int64_t spec_ubatches;   // ubatches computed speculated: no host path, every row from a slot
    int64_t spec_redos;      // ... of which a row missed: computed again with host paths
    int64_t inflight_peak;   // most upload batches one stream held issued and not yet landed at once
    int64_t mapped_rows;     // rows a speculated mapped layer's device read from the host copy (its misses)
    // the upload threads waiting for their batches' events to land them: the time, and those threads' CPU time in
    // it. Near the wall time the wait spins a core (CUDA's default events do), one the CPU's compute threads lose
    int64_t landing_wait_ns;
    int64_t landing_wait_cpu_ns;
};
LLAMA_API void    llama_pyspecter_get_device_stats(const struct llama_model * model,
                                                   struct llama_pyspecter_device_stats * out);
// Host<->device synchronisations actually taken, counted as the scheduler runs (not as it plans: that is llama.cpp's
// split count), on the thread that reads them (the decoding thread; the upload thread's waits are its own).
struct llama_pyspecter_sync_counts {
    int64_t syncs;           // backend synchronizes of a counted non-CPU device: the host waited for its queue
    int64_t event_syncs;     // event synchronizes on such a device: the host waited for an event
    int64_t device_computes; // graph computes (a split each) on a counted non-CPU device
    int64_t host_computes;   // ... on a counted CPU device
    int64_t switches;        // consecutive graph computes on different kinds (host, device): a split boundary taken
    // where a token's time went, by the same wrappers (times, for benchmarks: two clock reads per call)
    int64_t sync_ns;           // in the syncs and event_syncs above: the host waiting for the device
    int64_t host_compute_ns;   // in host graph computes: the CPU splits (synchronous: their whole compute)
    int64_t device_compute_ns; // in device graph computes: launching a split (asynchronous on CUDA; a round trip on RPC)
    int64_t settle_ns;         // after a speculated ubatch, the host's bookkeeping from its log (residency hearing
                               // each layer's routing): between ubatches, where the device waits for the next
    // ggml-cuda's CUDA graphs, from its debug log lines on this thread (counted once llama_pyspecter_logs_quiet
    // routed the logs; 0 on other backends): a split's graph captured ("warmup complete"), and a captured graph
    // dropped because its nodes changed ("warmup reset": the split then runs without a graph, launching each kernel)
    int64_t cuda_graph_warmups;
    int64_t cuda_graph_resets;
};
// Count dev's synchronisations from now on (its backends made after this call; idempotent; dev a ggml device,
// the CPU's too: its graph computes are the host splits). 0, or LLAMA_PYSPECTER_ERR_ARG.
LLAMA_API int32_t llama_pyspecter_count_syncs(ggml_backend_dev_t dev);
LLAMA_API void    llama_pyspecter_get_sync_counts(struct llama_pyspecter_sync_counts * out);
LLAMA_API void    llama_pyspecter_sync_counts_reset(void);
// Layer il's row of its device's remap table, read back from the device: a plane per row j of a token (n_used
// of them), (slot, expert) per expert in each, 2 * n_expert * n_used int32 into out (n at least that). The slot
// matmul's ids are get_rows over it, so every slot in it must be a slot or, for an expert e not resident, ~e
// (-1 - e) where the device takes negative ids, else the layer's zero slot j (n_slots + j), so that a token's rows
// never share one. Returns 2 * n_expert * n_used, LLAMA_PYSPECTER_ERR_NO_SLOTS, or LLAMA_PYSPECTER_ERR_ARG (no
// such device layer, or n too small).
LLAMA_API int32_t llama_pyspecter_read_table(const struct llama_model * model, int32_t il, int32_t * out, int32_t n);

// Counters since the last reset (all zero when slots are not enabled).
struct llama_pyspecter_stats {
    int64_t route_calls;     // routing op runs (one per MoE layer per ubatch)
    int64_t hit_rows;        // (token, expert) rows computed from slots
    int64_t miss_rows;       // rows computed from the host copy
    int64_t route_ns;        // time in the routing op (and the wait op of late experts), hooks and waits included
    int64_t hook_ns;         // time in the routing and wait hooks
    int64_t upload_bytes;    // bytes copied into slots
    int64_t upload_ns;       // time some copy was in flight, overlapping ones counted once (throttle included)
    int64_t upload_failures; // accepted uploads whose copy failed
    // native residency
    int64_t needed;           // distinct experts asked for, summed over routing calls
    int64_t resident_at_need; // ... of which resident when asked (before this call's reads)
    int64_t uploads;          // experts read into slots (demand, background and prefetch)
    int64_t prefetches;       // ... of which scheduled ahead of need (schedule, prefill lookahead)
    int64_t waited;           // misses that waited for a read already in flight
    int64_t overflow;         // misses left to the host because every slot was needed at once
    int64_t wait_ns;          // time the routing and wait ops waited for reads (the stall)
    int64_t stall_reads_ns;   // integral of reads in flight over the stall (/ wait_ns: mean reads outstanding)
    int64_t read_bytes;       // bytes read by the reader threads
    int64_t read_busy_ns;     // wall time with at least one read in flight (read_bytes / this: the link's speed)
    int64_t lookahead;        // reads the prefill lookahead started (in prefetches too)
    int64_t late;             // misses computed late (ordered)
    int64_t late_lost;        // late experts whose read failed twice: that ubatch's output is wrong (an error)
    // the compute thread's own CPU time in the routing and wait ops, and the part of it that copied experts into
    // slots (RAM-tier misses are copied on that thread); route_ns minus route_cpu_ns is time it was not running.
    // route_cpu_ns is sampled (one op in 8 per thread, scaled by 8: the thread CPU clock is a system call)
    int64_t route_cpu_ns;
    int64_t copy_cpu_ns;
    // the native planner
    int64_t ahead_maps;       // layer-ahead maps applied in routing ops
    int64_t ahead_prefetches; // prefetches they queued (in prefetches too)
    int64_t ahead_late;       // predictions >= min_prob left out: the link could not land them by their deadline
    int64_t ahead_refused;    // ... left out: no slot whose expert is less likely to be needed
    int64_t ghost_misses;     // misses of the held slots' ghost LRU (set_held), summed over layers
    // file reads
    int64_t read_ops;         // chunk reads the readers finished (read_chunk bytes at most each)
    int64_t taken_back;       // queued prefetches a demand took back whole (none of their chunks started) and
                              // read again as demand reads; one started is promoted instead (counted in waited)
    int64_t io_uring;         // not a counter: 1 while file reads go through io_uring, 0 on pread threads
    // the read queue's own work (deterministic for one run's decisions; what the routing op's CPU time goes to)
    int64_t queue_entries;    // entries queued (a read of an expert is one, whatever its chunks)
    int64_t queue_scans;      // queue entries examined by the readers' and the routing op's searches
    int64_t queue_locks;      // acquisitions of the queue's lock, by every thread
    int64_t reader_wakes;     // notifications sent to idle readers (and to the ring's thread)
    int64_t waiter_wakes;     // times a routing or wait op waiting for reads woke up to look again
    // the part of route_cpu_ns spent inside read waits (sampled on the same ops): the kernel's work to put the
    // thread to sleep and wake it again. route_ns - wait_ns and route_cpu_ns - wait_cpu_ns - copy_cpu_ns are the
    // ops' wall and CPU time with read waits excluded; the gap between them is time the thread was runnable but
    // off its core (measured: mostly run-queue delay while readers and the spinning sibling compute thread hold both)
    int64_t wait_cpu_ns;
};
LLAMA_API void    llama_pyspecter_get_stats  (const struct llama_model * model, struct llama_pyspecter_stats * out);
LLAMA_API void    llama_pyspecter_stats_reset(struct llama_model * model);

// The CPU time of one MoE layer's routing in decoding, as a distribution: each sampled routing op of a one-token
// ubatch (one in 8, as route_cpu_ns) together with its layer's wait ops, read waits and copies left out, counted in
// bins of LLAMA_PYSPECTER_HIST_NS ns (the last bin: that much or more). Row 0: layers whose every needed expert was
// resident when routed; row 1: layers with a miss. A mean over layers adds whatever the kernel charges the thread
// while it runs (interrupts, where the kernel has no IRQ time accounting); a median is the op's own work.
#define LLAMA_PYSPECTER_HIST_BINS 257
#define LLAMA_PYSPECTER_HIST_NS   250
// Copies the two rows (2 * LLAMA_PYSPECTER_HIST_BINS counts since the last stats_reset) into out; returns that
// count, or LLAMA_PYSPECTER_ERR_ARG when n is smaller (all zero when slots are not enabled).
LLAMA_API int32_t llama_pyspecter_get_layer_cpu_hist(const struct llama_model * model, int64_t * out, int32_t n);

// Logs (csrc/logs.cpp). llama.cpp and ggml log through one callback; this one keeps their lines off stderr while
// remembering what a failure needs: the last LLAMA_PYSPECTER_LOG_LINES error and warning lines (with their
// continuations) and the latest line reporting a graph's split counts. It also sets ggml's abort callback: a fatal
// GGML_ABORT, GGML_ASSERT or CUDA error prints the remembered lines to stderr before its own message (a CUDA error
// logs its error string, the function, the failing statement and the op as error lines just before it aborts),
// then a backtrace, and the process aborts as before. Non-fatal errors stay quiet. Call it once the library is
// loaded, before loading models; calling it again changes nothing.
#define LLAMA_PYSPECTER_LOG_LINES 16
LLAMA_API void    llama_pyspecter_logs_quiet(void);
// Copies the remembered lines, oldest first, each ending in a newline, NUL-terminated and cut to size bytes, into
// buf (null: only measure); returns the bytes they need without the NUL.
LLAMA_API int32_t llama_pyspecter_logs_recent(char * buf, int32_t size);
// The same for the latest line containing "splits = " (llama_context's graph line when a context is created):
// 0 when there was none since logs_quiet.
LLAMA_API int32_t llama_pyspecter_logs_splits_line(char * buf, int32_t size);

#ifdef __cplusplus
}
#endif
