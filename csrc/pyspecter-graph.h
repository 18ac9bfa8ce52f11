// The seam: all that llama.cpp's own code (patched llama-graph.cpp) calls. Kept to forward declarations so the
// patch needs none of our internals.
#pragma once

struct ggml_context;
struct ggml_tensor;
struct llama_pyspecter_slots;

// The routing op of MoE layer il, built in build_moe_ffn after the router and before the expert matmuls; null
// when slots are off or the layer has none (the graph is then stock). A CPU custom op over (selected_experts,
// weights) returning I32 [n_used, n_tokens, 2 or 3]: plane 0 = slot ids for the slot matmul, plane 1 = logical ids
// for the host matmul (-1 where the other path computes the row); with a wait hook, plane 2 = slot ids of late
// experts. ffn_inp is the layer's router input [n_embd, 1, n_tokens]; it becomes a source of the op only when an
// input hook is set (learned predictors read it).
ggml_tensor * llama_pyspecter_build_route(ggml_context * ctx, const llama_pyspecter_slots * slots, int il,
                                          ggml_tensor * selected_experts, ggml_tensor * weights,
                                          ggml_tensor * ffn_inp);

// The expert matmul of w through the route: slot path + host path (+ late path), each row computed by exactly one
// of them. Null when w has no slots: the caller builds the stock matmul.
ggml_tensor * llama_pyspecter_build_mm_id(ggml_context * ctx, const llama_pyspecter_slots * slots,
                                          ggml_tensor * w, ggml_tensor * cur, ggml_tensor * route);
