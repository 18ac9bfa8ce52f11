// The seam: all that llama.cpp's own code (patched llama-graph.cpp, llama-context.cpp) calls. Kept to forward
// declarations so the patch needs none of our internals.
#pragma once

struct ggml_context;
struct ggml_tensor;
struct ggml_backend_sched;
struct llama_pyspecter_slots;

// The routing op of MoE layer il, built in build_moe_ffn after the router and before the expert matmuls; null
// when slots are off or the layer has none (the graph is then stock). A CPU custom op over (selected_experts,
// weights). ffn_inp is the layer's router input [n_embd, 1, n_tokens]; it becomes a source of the op only when an
// input hook is set (learned predictors read it).
//
// Two forms. Split (a device layer, allow_split, no wait hook): the slot path reads its ids from the device's remap
// table (get_rows over selected_experts: (slot, expert) per row, zero slot j where row j's expert is not resident) and never waits
// for the host; the op reads those pairs back, packed behind the FFN input as one tensor (the router weights too
// if a reader asked), and returns I32 [n_used, n_tokens, 1], the logical ids for the host path (-1 where the slot
// path computes the row). The layer then costs one CPU split (this op and every host matmul) between two device
// ones, with one read back where stock --cpu-moe's host layer takes two (its ids and its input). Per matmul (CPU slots, LoRA, or a wait hook): I32 [n_used, n_tokens, 2 or 3],
// plane 0 = slot ids, plane 1 = logical ids for the host matmul, with a wait hook plane 2 = slot ids of late experts.
// allow_split: false when the paths cannot be built apart (LoRA adapters would add their rows to both).
ggml_tensor * llama_pyspecter_build_route(ggml_context * ctx, const llama_pyspecter_slots * slots, int il,
                                          ggml_tensor * selected_experts, ggml_tensor * weights,
                                          ggml_tensor * ffn_inp, bool allow_split);

// How many times build_moe_ffn builds its expert FFN for this route: 2 for a split route (path 0 the slots on the
// device, path 1 the host copy; the two down projections are added) and for a speculated route whose misses the
// device reads from the host copy (path 1 that copy, on the device: csrc/mapped.cpp), else 1 (route may be null).
int llama_pyspecter_n_paths(const ggml_tensor * route);

// The expert matmul of w on one path of the route (split), or slot path + host path (+ late path) summed (per
// matmul, path 0), each row computed by exactly one of them. Null when w has no slots: the caller builds the
// stock matmul. ids: the logical ids (selected_experts).
ggml_tensor * llama_pyspecter_build_mm_id(ggml_context * ctx, const llama_pyspecter_slots * slots,
                                          ggml_tensor * w, ggml_tensor * cur, ggml_tensor * ids,
                                          ggml_tensor * route, int path);

// A per-expert tensor of the layer (bias, scale) as path `path` of a split route reads it: on path 0 (both paths of a
// mapped route), and after the paths are joined, its copy on the device; otherwise t itself (also for null t or
// route).
ggml_tensor * llama_pyspecter_on_path(const llama_pyspecter_slots * slots, ggml_tensor * t,
                                      const ggml_tensor * route, int path);

// Before each ubatch's graph runs (llama_context::graph_compute): the device tables take what landed since the
// previous one, in one copy per device; and the scheduler's backends become the ones uploads order themselves
// after (an upload into a slot waits for the device work queued before it, which may still read the slot's old
// expert). Null slots: nothing.
void llama_pyspecter_fence(llama_pyspecter_slots * slots, ggml_backend_sched * sched);

// A context is going away (llama_context's destructor, after it synchronised): uploads stop ordering themselves
// after its backends, and its scheduler's speculation state goes (speculate.cpp).
void llama_pyspecter_context_gone(llama_pyspecter_slots * slots, ggml_backend_sched * sched);

// Speculating that a ubatch hits (csrc/speculate.cpp). A slot layer whose rows all hit still visits the host in
// its split form; a speculated graph has no host path at all (misses read zero slots) and logs on the device what
// each slot path looked up. Before each ubatch's graph is taken (llama_context::process_ubatch, after its memory
// context is applied): decides the form this thread's next graph is built in, and is true when the scheduler's last
// graph was built in the other form (it must be built again: the arenas below differ too, but exactness does not
// rest on that).
bool llama_pyspecter_begin_ubatch(llama_pyspecter_slots * slots, ggml_backend_sched * sched, int n_tokens);

// Whether the graph this thread builds next is speculated (begin_ubatch decided; false outside a ubatch).
// llama_context keeps it in graph arenas of its own (get_gf_res_prev), so that each form's tensors keep their
// addresses from one build to the next: ggml-cuda keys a captured CUDA graph by its first node's address, and two
// forms in one arena would restart each other's warm-up (two runs without a graph) at every change of form.
bool llama_pyspecter_speculating();

// After the ubatch's graph has computed: true when it was speculated and a row missed. The caller then runs the
// same ubatch again (its KV cells are rewritten) without taking its memory context again; this time the graph is
// built with host paths. Otherwise the layers' host-side routing (residency, hooks) has run.
bool llama_pyspecter_redo(llama_pyspecter_slots * slots, ggml_backend_sched * sched);
