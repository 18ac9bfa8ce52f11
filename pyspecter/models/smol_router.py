"""smol-moe's routers: a numpy reference forward pass of the dense SmolLM2 (checked against llama.cpp) gives the
model's own FFN inputs on real text; balanced spherical k-means in a whitened space fits one router per layer."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from pyspecter.errors import SpecterError

KMEANS_ITERS = 20
WHITEN_DIMS = 384  # principal components whitened before clustering (of n_embd = 576)
TARGET_TOP1_PROB = 0.5  # median top-1 softmax probability the router scale is chosen for


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


# --- a numpy reference forward pass ------------------------------------------------------------------------------

def _dequant(t) -> np.ndarray:
    # Reader tensors are numpy-ordered (outermost first); quantized ones are raw bytes per row.
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(t.data, dtype=np.float32).reshape(tuple(int(x) for x in reversed(t.shape.tolist())))
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32, copy=False)


@dataclass
class _Layer:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


class DenseReference:
    """The dense llama-arch forward pass in numpy float32, from the GGUF's dequantized weights.

    Why not llama.cpp's eval callback: this is self-contained and debuggable, and it hands us every layer's FFN
    input (the ``ffn_norm`` output the router sees) directly. It is validated against llama.cpp's logits.
    """

    def __init__(self, path: str | os.PathLike, on_layer: Callable[[int, int], None] | None = None) -> None:
        """``on_layer(i, n)``: called as layer i of n is dequantized (progress)."""
        r = gguf.GGUFReader(path)
        arch = _field(r, "general.architecture")
        if arch != "llama":
            raise SpecterError(f"{path}: reference forward pass supports arch llama, not {arch}")
        self.n_layer = int(_field(r, "llama.block_count"))
        self.n_embd = int(_field(r, "llama.embedding_length"))
        self.n_head = int(_field(r, "llama.attention.head_count"))
        self.n_head_kv = int(_field(r, "llama.attention.head_count_kv"))
        self.head_dim = self.n_embd // self.n_head
        self.eps = float(_field(r, "llama.attention.layer_norm_rms_epsilon"))
        self.rope_base = float(_field(r, "llama.rope.freq_base") or 10000.0)
        t = {x.name: x for x in r.tensors}
        self.tok_embd = _dequant(t["token_embd.weight"])
        # SmolLM2 ties its output projection to the embeddings (llama.cpp does the same when output is absent)
        self.output = _dequant(t["output.weight"]) if "output.weight" in t else self.tok_embd
        self.output_norm = _dequant(t["output_norm.weight"])
        self.layers = []
        for il in range(self.n_layer):
            p = f"blk.{il}."
            self.layers.append(_Layer(*(_dequant(t[p + n + ".weight"]) for n in (
                "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                "ffn_down"))))
            if on_layer is not None:
                on_layer(il + 1, self.n_layer)

    def _rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        # llama uses LLAMA_ROPE_TYPE_NORM: rotate adjacent pairs (2i, 2i+1). The HF->GGUF converter permutes
        # the q/k rows so that this matches HF's rotate-half on the original weights.
        d = self.head_dim
        theta = pos[:, None].astype(np.float64) * self.rope_base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        cos, sin = np.cos(theta).astype(np.float32)[:, None, :], np.sin(theta).astype(np.float32)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def forward(self, seqs: list[list[int]], *, logits: bool = True, ffn_inputs: list[np.ndarray] | None = None,
                kv_out: list[tuple[np.ndarray, np.ndarray]] | None = None,
                on_layer: Callable[[int, int], None] | None = None) -> np.ndarray | None:
        """Run independent sequences, each from position 0, as one batch (all rows concatenated, so every matmul
        is one large call). Appends each layer's FFN input ([sum T, n_embd]) to ffn_inputs and its roped K and V
        ([sum T, n_head_kv, head_dim]) to kv_out if given; returns the logits ([sum T, n_vocab]) if asked.
        ``on_layer(i, n)``: called as layer i of n is done (progress)."""
        hd, nh, nkv = self.head_dim, self.n_head, self.n_head_kv
        lens = [len(s) for s in seqs]
        bounds = np.cumsum([0, *lens])
        pos = np.concatenate([np.arange(n) for n in lens])
        masks = {n: np.triu(np.full((n, n), -np.inf, dtype=np.float32), k=1) for n in set(lens)}
        scale = np.float32(1.0 / math.sqrt(hd))
        h = self.tok_embd[np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])]
        N = len(h)
        for il, L in enumerate(self.layers):
            x = self._rms(h, L.attn_norm)
            q = self._rope((x @ L.wq.T).reshape(N, nh, hd), pos)
            k = self._rope((x @ L.wk.T).reshape(N, nkv, hd), pos)
            v = (x @ L.wv.T).reshape(N, nkv, hd)
            if kv_out is not None:
                kv_out.append((k, v))
            # GQA: query head j reads kv head j // (nh / nkv), as ggml's broadcasting mul_mat does
            k = np.repeat(k, nh // nkv, axis=1)
            v = np.repeat(v, nh // nkv, axis=1)
            a = np.empty((N, nh, hd), dtype=np.float32)
            for i, n in enumerate(lens):
                sl = slice(bounds[i], bounds[i + 1])
                sc = np.einsum("qhd,khd->hqk", q[sl], k[sl]) * scale + masks[n]
                sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
                sc /= sc.sum(axis=-1, keepdims=True)
                a[sl] = np.einsum("hqk,khd->qhd", sc, v[sl])
            h = h + a.reshape(N, nh * hd) @ L.wo.T
            h = h + self._ffn(L, h, ffn_inputs)
            if on_layer is not None:
                on_layer(il + 1, len(self.layers))
        if not logits:
            return None
        return self._rms(h, self.output_norm) @ self.output.T

    def _ffn(self, L: _Layer, h: np.ndarray, ffn_inputs: list[np.ndarray] | None) -> np.ndarray:
        x = self._rms(h, L.ffn_norm)
        if ffn_inputs is not None:
            ffn_inputs.append(x)
        g = x @ L.gate.T
        return ((g / (1.0 + np.exp(-g))) * (x @ L.up.T)) @ L.down.T

    def generate(self, prompts: list[list[int]], n: int, eog: set[int],
                 on_prefill: Callable[[int, int], None] | None = None,
                 on_step: Callable[[int, int], None] | None = None) -> list[list[int]]:
        """Greedy continuations (up to n tokens each, stopping after an end-of-generation token) of all prompts at
        once: one batched prefill, then one batched step per token over a padded KV cache. Progress: the
        prefill's layer i of n (``on_prefill(i, n)``), then step i of n (``on_step(i, n)``)."""
        hd, nh, nkv = self.head_dim, self.n_head, self.n_head_kv
        B = len(prompts)
        lens = np.array([len(p) for p in prompts])
        T = int(lens.max()) + n
        # Prefill every prompt but its last token; the step loop starts from that token, so the prefill never
        # computes vocab-sized logits for all prompt rows.
        cache_k = np.zeros((self.n_layer, B, T, nkv, hd), dtype=np.float32)
        cache_v = np.zeros_like(cache_k)
        ctx = [b for b in range(B) if lens[b] > 1]
        if ctx:
            kv: list[tuple[np.ndarray, np.ndarray]] = []
            self.forward([prompts[b][:-1] for b in ctx], logits=False, kv_out=kv, on_layer=on_prefill)
            starts = np.cumsum([0, *(lens[b] - 1 for b in ctx)])
            for il, (k, v) in enumerate(kv):
                for i, b in enumerate(ctx):
                    cache_k[il, b, : lens[b] - 1] = k[starts[i]: starts[i + 1]]
                    cache_v[il, b, : lens[b] - 1] = v[starts[i]: starts[i + 1]]
            del kv
        pos = lens - 1
        tok = np.array([p[-1] for p in prompts])
        out: list[list[int]] = [[] for _ in range(B)]
        done = np.zeros(B, dtype=bool)
        scale = np.float32(1.0 / math.sqrt(hd))
        rows = np.arange(B)
        causal = np.arange(T)[None, None, None, :]
        for step in range(n):
            h = self.tok_embd[tok]
            for il, L in enumerate(self.layers):
                x = self._rms(h, L.attn_norm)
                q = self._rope((x @ L.wq.T).reshape(B, nh, hd), pos)
                cache_k[il, rows, pos] = self._rope((x @ L.wk.T).reshape(B, nkv, hd), pos)
                cache_v[il, rows, pos] = (x @ L.wv.T).reshape(B, nkv, hd)
                sc = np.einsum("bkgd,btkd->bkgt", q.reshape(B, nkv, nh // nkv, hd), cache_k[il]) * scale
                sc = np.where(causal <= pos[:, None, None, None], sc, -np.inf)
                sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
                sc /= sc.sum(axis=-1, keepdims=True)
                a = np.einsum("bkgt,btkd->bkgd", sc, cache_v[il]).reshape(B, nh * hd)
                h = h + a @ L.wo.T
                h = h + self._ffn(L, h, None)
            tok = np.argmax(self._rms(h, self.output_norm) @ self.output.T, axis=1)
            for b in np.flatnonzero(~done):
                out[b].append(int(tok[b]))
                done[b] = int(tok[b]) in eog
            if on_step is not None:
                on_step(step + 1, n)
            if done.all():
                break
            pos = pos + 1
        return out


# --- calibration: real text and the hidden states it produces -----------------------------------------------

def _ffn_inputs(ref: DenseReference, seqs: list[list[int]],
                on_layer: Callable[[int, int], None] | None = None) -> np.ndarray:
    """[n_layer, N, n_embd]: every layer's FFN input (ffn_norm output) at every calibration position, except that
    a prefix shared by several sequences (the chat template's system prompt) counts once: identical contexts give
    identical states, and dozens of copies would pull the k-means towards them."""
    seen: set[tuple[int, ...]] = set()
    keep = []
    for seq in seqs:
        prefixes = [tuple(seq[: i + 1]) for i in range(len(seq))]
        keep.append(np.array([p not in seen for p in prefixes]))
        seen.update(prefixes)
    states: list[np.ndarray] = []
    ref.forward(seqs, logits=False, ffn_inputs=states, on_layer=on_layer)
    rows = np.concatenate(keep)
    return np.stack([x[rows] for x in states])


# --- the router -------------------------------------------------------------------------------------------------

def _balanced_argmax(S: np.ndarray, iters: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """argmax_k(S[i, k] - price[k]) with per-column prices found so every column wins about N/K rows: a cheap
    dual (auction-style) capacity constraint. Returns the assignment and the prices."""
    N, K = S.shape
    price = np.zeros(K)
    step = 0.5 * float(S.std())
    for t in range(iters):
        a = np.argmax(S - price, axis=1)
        over = np.bincount(a, minlength=K) / (N / K) - 1.0  # > 0: column wins too many rows
        price += step * over / (1.0 + 0.1 * t)  # decaying steps settle instead of oscillating
    return np.argmax(S - price, axis=1), price


def _balanced_kmeans(Z: np.ndarray, K: int, rng: np.random.Generator, iters: int) -> np.ndarray:
    """Spherical k-means on unit rows Z with a balancing price in the assignment step. Returns unit centroids."""
    N = len(Z)
    # k-means++ on cosine distance: spread-out starting centroids, deterministic given rng
    idx = [int(rng.integers(N))]
    dist = 1.0 - Z @ Z[idx[0]]
    for _ in range(K - 1):
        p = np.maximum(dist, 0.0) ** 2
        i = int(rng.choice(N, p=p / p.sum())) if p.sum() > 0 else int(rng.integers(N))
        idx.append(i)
        dist = np.minimum(dist, 1.0 - Z @ Z[i])
    C = Z[idx].copy()
    for _ in range(iters):
        a, _ = _balanced_argmax(Z @ C.T)
        for k in range(K):
            members = Z[a == k]
            if len(members):
                c = members.sum(axis=0)
                C[k] = c / max(np.linalg.norm(c), 1e-12)
    return C


def _softmax_top1(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e.max(axis=1) / e.sum(axis=1)


def _topk_counts(logits: np.ndarray, k: int) -> np.ndarray:
    sel = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    return np.bincount(sel.ravel(), minlength=logits.shape[1])


def fit_router(X: np.ndarray, n_expert: int, top_k: int, seed: int) -> tuple[np.ndarray, dict]:
    """Router weights ([n_expert, n_embd] float32) for one layer, from its FFN inputs X ([N, n_embd]).

    Clustering happens in a whitened space: centre, standardise each dimension, and whiten the top WHITEN_DIMS
    principal components. Raw hidden states have a few very high-variance directions (outlier dimensions, text
    type); clustered raw, those decide every cluster, and plain prose then lands on a handful of experts (measured:
    some experts never selected on the held-out text in 7 of 30 layers). Whitened, the clusters follow finer
    token-level structure: every expert is used on held-out prose, ~14.5 of 16 effective experts, and the top-1
    expert repeats for consecutive tokens about twice as often as chance (real MoEs show similar locality).

    A linear router can carry that map (logit_e = c_e . S (x - mu)), except for the constant -c_e . S mu: llama's
    router has no bias. The inputs' mean direction u is nearly constant in x . u, so a multiple of u in each row
    stands in for the bias; it is then tuned so the experts' top-k loads are equal on the calibration tokens. A
    final scale makes the softmax reasonably confident (median top-1 probability TARGET_TOP1_PROB), not one-hot.
    """
    X = X.astype(np.float64)
    N, d = X.shape
    mu = X.mean(axis=0)
    u = mu / np.linalg.norm(mu)
    m = X @ u  # ~constant per token (coefficient of variation ~0.1): the stand-in for a bias input
    Xc = X - mu
    sd = Xc.std(axis=0)
    sd = np.maximum(sd, 1e-6 * sd.max())
    lam, V = np.linalg.eigh(np.cov((Xc / sd).T))
    r = min(WHITEN_DIMS, d)
    lam, V = lam[::-1][:r], V[:, ::-1][:, :r]
    S = (V / np.sqrt(np.maximum(lam, 1e-12 * lam[0]))) / sd[:, None]  # [d, r]: x -> whitened features
    F = Xc @ S
    Z = F / np.maximum(np.linalg.norm(F, axis=1, keepdims=True), 1e-12)
    C = _balanced_kmeans(Z, n_expert, np.random.default_rng(seed), KMEANS_ITERS)
    W = C @ S.T  # [K, d]

    # Bias as b_e * (x . u), started at the centring term and tuned so every expert gets N*top_k/K selections.
    A = X @ W.T
    b = -(W @ mu) / m.mean()
    target = N * top_k / n_expert
    step = 0.5 * float(A.std()) / abs(float(m.mean()))
    for t in range(200):
        over = _topk_counts(A + np.outer(m, b), top_k) / target - 1.0
        b -= step * over / (1.0 + 0.05 * t)  # decaying steps settle instead of oscillating
    W = W + np.outer(b, u)
    logits = X @ W.T

    # Scale: bisection on log s; the top-1 probability grows monotonically with s for every token.
    lo, hi = -12.0, 12.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.median(_softmax_top1(logits * math.exp(mid))) < TARGET_TOP1_PROB:
            lo = mid
        else:
            hi = mid
    s = math.exp((lo + hi) / 2)
    W *= s
    logits *= s
    counts = _topk_counts(logits, top_k)
    top1 = np.argmax(logits, axis=1)
    stats = {
        "topk_load_min": float(counts.min() / target), "topk_load_max": float(counts.max() / target),
        "median_top1_prob": float(np.median(_softmax_top1(logits))),
        "bias_input_cv": float(m.std() / abs(m.mean())),  # how constant x . u is, i.e. how well the bias works
        "top1_repeat": float(np.mean(top1[1:] == top1[:-1])),  # across sequence joins too; a rough locality
    }
    return W.astype(np.float32), stats


# --- writing the MoE GGUF ---------------------------------------------------------------------------------------

