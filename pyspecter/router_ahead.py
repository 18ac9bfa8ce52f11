"""Layer-ahead maps that need no fitting: the next MoE layer's own router, applied to this layer's router input.

The residual stream changes little from one layer to the next, so layer j+h's router on layer j's normalised FFN
input x_j predicts layer j+h's routing of the same token. The router input is RMSNorm(residual) * ffn_norm, so the
ratio of the two layers' ffn_norm weights is folded into the map: W = diag(norm_{j+h} / norm_j) @ G_{j+h}^T
(G: ffn_gate_inp, [n_expert, n_embd]), plus the target router's bias. Nothing is learned; only the calibration
table (the chance that the expert at predicted rank r is truly selected) comes from measurement, and it is one
table for every model (``RANK_PROB``): a model with no fitted predictor has no text of its own to measure it on.

The result is a ``LearnedPredictor`` (horizons of 1 MoE layer, one confidence bin), so the native planner applies
it exactly as it applies fitted maps (csrc/planner.cpp). It has no reuse maps: eviction stays the session's policy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout, _field_value
from pyspecter.learned import GATING_SOFTMAX, LearnedPredictor, selection_scores, top_ids

# Share of rows on which the expert at predicted rank r (of the next layer's router on this layer's input) was in
# that layer's true top-k, by u = (r + 0.5) / k at u = 0.125, 0.375, ..., 1.875: teacher-forced on the held-out
# text's first 512 tokens (study/router_ahead_eval.py), the mean of big-qwen3moe's first 6 layers (128 experts,
# top-8: 0.948 ... 0.113), bench-qwen3moe (32, top-4: 0.945 ... 0.102) and smol-moe (16, top-2, real weights: 0.899
# ... 0.109), which agree within 0.05 past the first rank. Ranks past 2k share what is left of the k selections.
RANK_U = np.arange(0.125, 2.0, 0.25)
RANK_PROB = np.array([0.931, 0.821, 0.647, 0.483, 0.325, 0.215, 0.151, 0.108], np.float32)


@dataclass
class Routers:
    """Each MoE layer's router as llama.cpp applies it: logits = x @ weight.T (+ bias), ranked by gating and
    sel_bias (learned.selection_scores), top n_used; norm: the layer's ffn_norm weight (None: the arch has none).
    The one record of them: the planner's maps, the predictor fit and the trace recorder all read it."""

    weight: list[np.ndarray]  # [n_expert, n_embd] float32
    bias: list[np.ndarray | None]
    sel_bias: list[np.ndarray | None]
    gating: int
    n_used: int
    names: list[str] = field(default_factory=list)
    norm: list[np.ndarray | None] = field(default_factory=list)

    def logits(self, j: int, x: np.ndarray) -> np.ndarray:
        """Router logits of MoE layer j for router inputs x [..., n_embd]."""
        out = np.asarray(x, np.float32) @ self.weight[j].T
        return out + self.bias[j] if self.bias[j] is not None else out

    def select(self, j: int, logits: np.ndarray) -> np.ndarray:
        """The top n_used experts layer j's router picks from its logits, best first."""
        return top_ids(selection_scores(logits, self.gating, self.sel_bias[j]), self.n_used)


def read_routers(path: str | os.PathLike, layout: ModelLayout) -> Routers:
    """The routers and ffn_norm weights of every MoE layer, from the GGUF (dequantized where needed)."""
    import gguf

    path = Path(path)
    reader = gguf.GGUFReader(path, "r")
    tensors = {t.name: t for t in reader.tensors}

    def dense(name: str) -> np.ndarray | None:
        t = tensors.get(name)
        if t is None:
            return None
        data = np.asarray(t.data)
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = gguf.quants.dequantize(data, t.tensor_type)
        return np.asarray(data, np.float32)

    weights, biases, sel, names, norms = [], [], [], [], []
    for L in layout.layers:
        name = f"blk.{L.index}.ffn_gate_inp.weight"
        w = dense(name)
        if w is None:
            raise SpecterError(f"{path}: no router tensor {name}")
        weights.append(w.reshape(layout.n_expert, -1))
        b = dense(f"blk.{L.index}.ffn_gate_inp.bias")
        biases.append(None if b is None else b.reshape(-1))
        s = dense(f"blk.{L.index}.exp_probs_b.bias")
        sel.append(None if s is None else s.reshape(-1))
        n = dense(f"blk.{L.index}.ffn_norm.weight")
        norms.append(None if n is None else n.reshape(-1))
        names.append(name)
    gating = int(_field_value(reader, f"{layout.arch}.expert_gating_func") or GATING_SOFTMAX)
    return Routers(weights, biases, sel, gating, layout.n_expert_used, names, norms)


def norm_ratio(src: np.ndarray | None, dst: np.ndarray | None) -> np.ndarray | None:
    """dst / src per channel, where both exist and src is not ~0 (a channel the source's norm zeroes carries
    nothing of the residual to scale back up: left at 1)."""
    if src is None or dst is None:
        return None
    ok = np.abs(src) > 1e-6
    return np.where(ok, dst / np.where(ok, src, 1.0), 1.0).astype(np.float32)


def maps(routers: Routers, j: int, h: int, fold_norm: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(W [n_embd, E], b [E]) from MoE layer position j's router input to layer j+h's router logits."""
    G = routers.weight[j + h]
    W = np.ascontiguousarray(G.T, np.float32)
    r = norm_ratio(routers.norm[j], routers.norm[j + h]) if fold_norm else None
    if r is not None:
        W = W * r[:, None]
    b = routers.bias[j + h]
    return W, (np.zeros(G.shape[0], np.float32) if b is None else b.astype(np.float32))


def rank_table(n_expert: int, n_used: int) -> np.ndarray:
    """[n_expert] chance by predicted rank: RANK_PROB at the rank's u = (r + 0.5) / k up to 2k ranks; the rest
    share what those leave of the k experts selected (a table summing to k, as the truth does)."""
    r = np.arange(n_expert)
    u = (r + 0.5) / n_used
    head = u < RANK_U[-1] + 0.125
    table = np.zeros(n_expert, np.float32)
    table[head] = np.interp(u[head], RANK_U, RANK_PROB)
    n_tail = int((~head).sum())
    if n_tail:
        table[~head] = min(max(n_used - float(table[head].sum()), 0.0) / n_tail, float(RANK_PROB[-1]))
    return table


def router_ahead(model_path: str | os.PathLike, layout: ModelLayout, *, fold_norm: bool = True) -> LearnedPredictor:
    """The router-ahead predictor of a model (one MoE layer ahead), as the native planner takes maps."""
    routers = read_routers(model_path, layout)
    n, E, k = len(layout.layers), layout.n_expert, layout.n_expert_used
    A: list[np.ndarray | None] = [None] * n
    b: list[np.ndarray | None] = [None] * n
    for j in range(n - 1):
        A[j], b[j] = maps(routers, j, 1, fold_norm)
    rank_prob = np.broadcast_to(rank_table(E, k), (n, 1, 1, E)).copy()
    meta = {"n_expert": E, "n_expert_used": k, "horizons": 1, "gating": routers.gating, "kind": "router-ahead"}
    return LearnedPredictor(meta=meta, layers=[L.index for L in layout.layers], A=A, b=b, rank_prob=rank_prob,
                            gap_edges=np.zeros((n, 1, 0), np.float32), sel_bias=list(routers.sel_bias))


def is_router_ahead(predictor: LearnedPredictor) -> bool:
    """Whether a predictor is router-ahead maps (no reuse maps, nothing fitted) rather than a fitted one."""
    return predictor.meta.get("kind") == "router-ahead"
