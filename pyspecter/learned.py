"""Learned routing predictors: from one MoE layer's router input, which experts the next few MoE layers will pick.

A predictor holds, for each MoE layer j and horizon h = 1..H, a linear map from layer j's router (FFN) input x_j
to layer j+h's router logits, fitted offline on calibration text (``pyspecter fit-predictor``, code in
models/predictor_fit.py). All horizons of one source layer share one matrix, so a prediction is one matmul per
layer: ``x @ A_j + b_j`` gives the logits of layers j+1..j+H side by side. Horizons count MoE layers, as the
routing hook sees them, not transformer blocks. A reduced-rank predictor (``fit-predictor --rank r``) stores each
source's matrix as two factors [n_embd, r] and [r, H * n_expert]: two smaller matmuls, fewer bytes.

Reuse maps (for eviction): per MoE layer j, a linear map from x_j to how likely each expert of layer j is to be
used again by the next ``reuse_horizon`` tokens (ridge on multi-hot targets, fitted on the same recorded text).
The layer-ahead maps see only the current token; which resident expert to give up depends on the tokens to
come, and the hidden state already carries much of what the next token will be. ``blend`` [L, 6] then weighs
that score with what the layer's own past says of each expert (``Recency``: the recency and frequency LRU and
LFU go by), fitted on rows the maps were not: where x says little of the future (random-weight models), the
past carries the score, and where it says much, the two together evict best. ``miss_curves`` [L, E + 1]: the
misses per token an LRU cache of s slots had at each layer on the fit text (the budget's slot allocation reads
them).

What a caller gets (the runtime API; the routing op applies the same maps natively, csrc/planner.cpp and
csrc/residency.cpp, and these are the reference the tests compare it with):

    p = LearnedPredictor.for_model(model_path)     # the sidecar fitted for this exact file, or None
    p = LearnedPredictor.load("P.npz")             # an explicit file (or a model path: its sidecar, or an error)
    probs = p.predict(il, x)    # {layer index il+h: float32 [n_expert] (or [n_tokens, n_expert])} for h = 1..H
    p.topk(il, x)               # {layer index: int64 [n_used]} the predicted expert sets
    p.reuse(il, x, recency)     # float32 [n_expert]: scores of use at layer il within the next tokens (or None);
                                # recency: the layer's Recency, blended in where the file has a blend
    p.nbytes                    # fast memory the predictor occupies (count it in the budget)

``predict``'s numbers are calibrated probabilities that an expert is in the layer's true top-k: the experts are
ranked by predicted selection score, and rank r maps to the share of calibration rows on which the expert at
predicted rank r was truly selected at that layer and horizon (measured on rows the maps were not fitted on),
separately for four confidence bins of the prediction's gap between ranks k-1 and k (a clear winner is right far
more often than a near-tie). A softmax of the predicted logits would be the router's weight, which is not the
chance of being needed.

Routers: selection is the arch's gating function of the logits plus the selection bias where the model has one
(``exp_probs_b``, DeepSeek-V3 style); without a bias every gating function llama.cpp has (softmax, sigmoid,
softmax over the selected, sqrt-softplus) ranks experts like the logits. Expert groups are not modelled.

The sidecar is keyed by the model file's content (``model_key``: its size, its first MiB, which holds the GGUF
header, and 16 spread samples of 64 KiB), so a rebuilt model with the same name and size does not pick up a stale
predictor; the key is stored inside the file and checked on load too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pyspecter.errors import SpecterError
from pyspecter.paths import atomic_path, cache_dir

FORMAT = "pyspecter-learned-predictor/2"
_HEAD_BYTES = 1 << 20
_SAMPLES, _SAMPLE_BYTES = 16, 1 << 16

# LLAMA_EXPERT_GATING_FUNC_TYPE_*: what turns router logits into the probabilities selection ranks
GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT, GATING_SQRT_SOFTPLUS = 1, 2, 3, 4


def model_key(path: str | os.PathLike) -> str:
    """A short hash of a model file's content: its size, its first MiB (the GGUF header and tensor table) and 16
    samples of 64 KiB spread over the rest. Reads ~2 MiB whatever the file's size; size and mtime alone would
    call a rebuilt file of the same size the same model."""
    p = Path(path)
    try:
        size = p.stat().st_size
        h = hashlib.sha256(str(size).encode() + b"\0")
        with open(p, "rb") as f:
            h.update(f.read(_HEAD_BYTES))
            if size > _HEAD_BYTES:
                for off in np.linspace(_HEAD_BYTES, max(size - _SAMPLE_BYTES, _HEAD_BYTES), _SAMPLES).astype(np.int64):
                    f.seek(int(off))
                    h.update(f.read(_SAMPLE_BYTES))
    except OSError as e:
        raise SpecterError(f"{p}: cannot read ({e.strerror})") from None
    return h.hexdigest()[:16]


class Recency:
    """What one layer's past routing calls say of each expert, the features the reuse blend weighs: used by the
    previous call; share of the last 4 calls and of the last 16 that used it; 1 / (1 + calls since its last
    use), 0 if never used. ``observe`` only notes a call; the features are built when a blend needs them. The
    same class makes the features offline (``features_of``) and for the Python reference of C's blend, so fit and
    use agree."""

    N_FEATURES = 4
    _WINDOW = 16
    _SHORT = 4

    def __init__(self, n_expert: int) -> None:
        self.n_expert = n_expert
        self.ring = np.zeros((self._WINDOW, n_expert), np.float32)  # row t % 16: the experts call t used
        self.last = np.full(n_expert, -np.inf)  # call index of each expert's last use
        self.calls = 0

    def features(self) -> np.ndarray:
        """[n_expert, 4] before the next call."""
        t, W = self.calls, self._WINDOW
        out = np.empty((self.n_expert, self.N_FEATURES), np.float32)
        out[:, 0] = self.ring[(t - 1) % W]  # all zero before the first call
        out[:, 1] = self.ring[np.arange(t - self._SHORT, t) % W].sum(0) / self._SHORT  # rows not yet used are 0
        out[:, 2] = self.ring.sum(0) / W
        out[:, 3] = 1.0 / (1.0 + t - self.last)
        return out

    def observe(self, needed) -> None:
        """One routing call used ``needed`` (expert ids)."""
        ids = list(needed)
        row = self.ring[self.calls % self._WINDOW]
        row[:] = 0.0
        row[ids] = 1.0
        self.last[ids] = self.calls
        self.calls += 1

    @classmethod
    def features_of(cls, ids: np.ndarray, n_expert: int) -> np.ndarray:
        """Features [n, n_expert, 4] of one layer's routing ids [n, k] (-1: none), each row's before its call."""
        rec = cls(n_expert)
        out = np.empty((len(ids), n_expert, cls.N_FEATURES), np.float32)
        for t, row in enumerate(ids):
            out[t] = rec.features()
            rec.observe([int(e) for e in row if e >= 0])
        return out


def blend_scores(w: np.ndarray, scores: np.ndarray, recency: np.ndarray) -> np.ndarray:
    """w [6] over (the reuse map's score, the 4 recency features, 1): scores [..., E], recency [..., E, 4]."""
    return w[0] * scores + recency @ w[1:5] + w[5]


def predictors_dir() -> Path:
    return cache_dir() / "predictors"


def sidecar_path(model_path: str | os.PathLike, key: str | None = None) -> Path:
    """Where the predictor fitted for this model file lives (in the cache, named by the file's content key)."""
    p = Path(model_path)
    return predictors_dir() / f"{p.stem}-{key or model_key(p)}.npz"


def selection_scores(logits: np.ndarray, gating: int, sel_bias: np.ndarray | None) -> np.ndarray:
    """What llama.cpp's build_moe_ffn ranks experts by, from router logits [..., E]."""
    if sel_bias is None:
        return logits  # every gating function is monotone in the logits
    return gate_probs(logits, gating) + sel_bias


def gate_probs(logits: np.ndarray, gating: int) -> np.ndarray:
    """The arch's gating function of router logits [..., E] (softmax-over-selected ranks like softmax)."""
    if gating == GATING_SIGMOID:
        return 1.0 / (1.0 + np.exp(-logits))
    if gating == GATING_SQRT_SOFTPLUS:
        return np.sqrt(np.logaddexp(0.0, logits))
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def gap_bins(gap: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Confidence bin of each prediction: how many bin edges its gap (selection score of rank k-1 minus that of
    rank k, where k is top-k) reaches. edges [..., B - 1] ascending, broadcast against gap [...]."""
    return (gap[..., None] >= edges).sum(-1)


def top_ids(scores: np.ndarray, k: int) -> np.ndarray:
    """The k highest-scoring ids along the last axis, best first (ties: lower id first)."""
    return np.argsort(-scores, axis=-1, kind="stable")[..., :k]


@dataclass
class LearnedPredictor:
    """Maps from each MoE layer's router input to later layers' router logits (module docstring).

    ``A[j]``: float32 [n_embd, n_t * n_expert], ``b[j]``: [n_t * n_expert], for source position j and its n_t
    horizons (fewer near the last layer; none for the last). ``rank_prob``: float32 [n_layers, H, B, n_expert],
    [j, h-1, b, r] = chance that the expert ranked r for layer j at horizon h is truly selected when the
    prediction's confidence (its gap between ranks k-1 and k) falls in bin b of ``gap_edges`` [n_layers, H, B-1]."""

    meta: dict
    layers: list[int]  # llama.cpp layer index of each MoE layer, by position
    A: list[np.ndarray | None]
    b: list[np.ndarray | None]
    rank_prob: np.ndarray
    gap_edges: np.ndarray
    sel_bias: list[np.ndarray | None] = field(default_factory=list)
    # reduced rank (fit-predictor --rank r): A[j] is [n_embd, r] and A2[j] [r, n_t * n_expert]
    A2: list[np.ndarray | None] = field(default_factory=list)
    # reuse maps (eviction): R[j] [n_embd, E], rb[j] [E]; empty for a file that has none (``reuse`` then returns None)
    R: list[np.ndarray | None] = field(default_factory=list)
    rb: list[np.ndarray | None] = field(default_factory=list)
    miss_curves: np.ndarray | None = None  # [L, E + 1] LRU misses per token with s slots, on the fit text
    blend: np.ndarray | None = None  # [L, 6] reuse score and recency weights (``blend_scores``); None: scores alone

    def __post_init__(self) -> None:
        self.n_expert = int(self.meta["n_expert"])
        self.n_used = int(self.meta["n_expert_used"])
        self.horizons = int(self.meta["horizons"])
        self.gating = int(self.meta.get("gating", GATING_SOFTMAX))
        self.pos = {il: j for j, il in enumerate(self.layers)}
        n = len(self.layers)
        self.sel_bias = self.sel_bias or [None] * n
        self.A2 = self.A2 or [None] * n
        self.R = self.R or [None] * n
        self.rb = self.rb or [None] * n
        self.reuse_horizon = int(self.meta.get("reuse_horizon", 0))
        # per source j: the tables and bin edges of its targets j+1..j+n_t side by side ([n_t, B, E], [n_t, B-1])
        self._tables = [np.stack([self.rank_prob[j + h, h - 1] for h in range(1, self.n_targets(j) + 1)])
                        if self.b[j] is not None else None for j in range(n)]
        self._edges = [np.stack([self.gap_edges[j + h, h - 1] for h in range(1, self.n_targets(j) + 1)])
                       if self.b[j] is not None else None for j in range(n)]
        self._hs = np.arange(self.horizons)
        self._biased = [any(self.sel_bias[j + h] is not None for h in range(1, self.n_targets(j) + 1))
                        for j in range(n)]

    # --- facts ---------------------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes the predictor holds in memory (maps, biases, calibration tables): count them in the budget."""
        arrays = [*self.A, *self.A2, *self.b, *self.sel_bias, *self.R, *self.rb, self.rank_prob, self.gap_edges,
                  self.blend]
        return int(sum(a.nbytes for a in arrays if a is not None))

    @property
    def has_reuse(self) -> bool:
        return any(r is not None for r in self.R)

    def reuse_only(self) -> LearnedPredictor:
        """This predictor without its layer-ahead maps and their calibration: what eviction alone reads (the
        reuse maps, their blend, the miss curves), for a session whose planner does not prefetch. The maps left
        out are most of the bytes (on smol-moe 4.1 of 5.2 MB), so the budget counts only what is held."""
        n = len(self.layers)
        empty = np.zeros((0,), np.float32)
        return dataclasses.replace(self, A=[None] * n, b=[None] * n, A2=[None] * n, sel_bias=[None] * n,
                                   rank_prob=empty, gap_edges=empty)

    def n_targets(self, j: int) -> int:
        """Horizons available from MoE layer position j."""
        return 0 if self.b[j] is None else self.b[j].shape[0] // self.n_expert

    # --- prediction ----------------------------------------------------------------------------------------

    def _raw(self, j: int, x: np.ndarray) -> np.ndarray:
        """Predicted logits [..., n_t, E]: one matmul, or two for a reduced-rank predictor."""
        y = np.asarray(x, np.float32) @ self.A[j]
        if self.A2[j] is not None:
            y = y @ self.A2[j]
        y += self.b[j]
        return y.reshape(*np.shape(x)[:-1], -1, self.n_expert)

    def _scores(self, j: int, x: np.ndarray) -> np.ndarray | None:
        """Selection scores of every horizon at once: [..., n_t, E] (one matmul, no per-horizon Python)."""
        A = self.A[j]
        if A is None:
            return None
        y = self._raw(j, x)
        if self._biased[j]:
            for h in range(1, y.shape[-2] + 1):
                y[..., h - 1, :] = selection_scores(y[..., h - 1, :], self.gating, self.sel_bias[j + h])
        return y

    def logits(self, il: int, x: np.ndarray) -> dict[int, np.ndarray]:
        """Predicted router logits of layers il+1..il+H (by llama.cpp layer index) from layer il's router input
        x [n_embd] or [n_tokens, n_embd]. Empty for the last MoE layer; KeyError for a layer that is not MoE."""
        j = self.pos[il]
        if self.A[j] is None:
            return {}
        y = self._raw(j, x)
        return {self.layers[j + h]: y[..., h - 1, :] for h in range(1, y.shape[-2] + 1)}

    def predict(self, il: int, x: np.ndarray) -> dict[int, np.ndarray]:
        """For each later layer il+h (h = 1..H): float32 [n_expert] (or [n_tokens, n_expert]), the calibrated
        probability that each expert is in that layer's top-k for this token."""
        j = self.pos[il]
        y = self._scores(j, x)
        if y is None:
            return {}
        one = y.ndim == 2
        y = y[None] if one else y  # [n, n_t, E]; plain fancy indexing below (take/put_along_axis cost ~5 us each)
        k, n_t = self.n_used, y.shape[1]
        t, hs = np.arange(len(y))[:, None], self._hs[None, :n_t]
        order = np.argsort(-y, axis=-1)  # exact ties between predicted scores do not happen; stable costs 2x
        gap = y[t, hs, order[..., k - 1]] - y[t, hs, order[..., k]]  # [n, n_t]
        probs = np.empty(y.shape, np.float32)
        probs[t[..., None], hs[..., None], order] = self._tables[j][hs, gap_bins(gap, self._edges[j])]
        probs = probs[0] if one else probs
        return {self.layers[j + h]: probs[..., h - 1, :] for h in range(1, n_t + 1)}

    def topk(self, il: int, x: np.ndarray, k: int | None = None) -> dict[int, np.ndarray]:
        """For each later layer: the k (default: the model's top-k) experts predicted, best first."""
        j = self.pos[il]
        y = self._scores(j, x)
        if y is None:
            return {}
        ids = top_ids(y, k or self.n_used)
        return {self.layers[j + h]: ids[..., h - 1, :] for h in range(1, y.shape[-2] + 1)}

    def reuse(self, il: int, x: np.ndarray, recency: Recency | None = None) -> np.ndarray | None:
        """Scores [n_expert] of each expert of layer il being used again within the next ``reuse_horizon``
        tokens, from layer il's router input x [n_embd] (or [n_tokens, n_embd]: the last row, whose next token
        is the one to come) and, where the file has a blend, the layer's past calls (``recency``).
        Higher: keep. None when the predictor has no reuse map for the layer."""
        x = np.asarray(x, np.float32)
        feats = recency.features() if recency is not None and self.blend is not None else None
        return self.reuse_rows(self.pos[il], x if x.ndim == 1 else x[-1], feats)

    def reuse_rows(self, j: int, x: np.ndarray, recency: np.ndarray | None = None) -> np.ndarray | None:
        """``reuse`` by MoE layer position j, for one row or many: x [..., n_embd], recency [..., n_expert, 4]."""
        R = self.R[j]
        if R is None:
            return None
        s = np.asarray(x, np.float32) @ R + self.rb[j]
        if self.blend is None or recency is None:
            return s
        return blend_scores(self.blend[j], s, recency)

    # --- files ---------------------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        arrays = {"rank_prob": self.rank_prob, "gap_edges": self.gap_edges}
        for j in range(len(self.layers)):
            if self.A[j] is not None:
                arrays[f"A{j}"], arrays[f"b{j}"] = self.A[j], self.b[j]
            if self.A2[j] is not None:
                arrays[f"A2_{j}"] = self.A2[j]
            if self.sel_bias[j] is not None:
                arrays[f"sel_bias{j}"] = self.sel_bias[j]
            if self.R[j] is not None:
                arrays[f"R{j}"], arrays[f"rb{j}"] = self.R[j], self.rb[j]
        if self.miss_curves is not None:
            arrays["miss_curves"] = self.miss_curves
        if self.blend is not None:
            arrays["blend"] = self.blend
        meta = {**self.meta, "format": FORMAT, "layers": self.layers}
        meta.pop("path", None)  # where it was read from, not part of the file
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path, suffix=".npz") as tmp:
            np.savez(tmp, meta=np.array(json.dumps(meta)), **arrays)
        return path

    @classmethod
    def load(cls, path_or_model: str | os.PathLike) -> LearnedPredictor:
        """A predictor file (.npz), or a model file whose sidecar must exist."""
        p = Path(path_or_model)
        if p.suffix != ".npz":
            found = cls.for_model(p)
            if found is None:
                raise SpecterError(f"{p}: no learned predictor fitted for this model file (run `pyspecter "
                                   f"fit-predictor {p}`)")
            return found
        return cls._read(p)

    @classmethod
    def for_model(cls, model_path: str | os.PathLike) -> LearnedPredictor | None:
        """The sidecar fitted for this model file's content, or None when there is none."""
        key = model_key(model_path)
        side = sidecar_path(model_path, key)
        if not side.is_file():
            return None
        pred = cls._read(side)
        if pred.meta.get("model_key") != key:
            return None
        return pred

    @classmethod
    def _read(cls, p: Path) -> LearnedPredictor:
        try:
            with np.load(p, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            meta = json.loads(str(arrays.pop("meta")))
        except Exception as e:  # noqa: BLE001 - numpy raises many types on a damaged .npz
            raise SpecterError(f"{p}: not a learned predictor ({type(e).__name__}: {e})") from None
        if meta.get("format") != FORMAT:
            raise SpecterError(f"{p}: predictor format {meta.get('format')!r}, this pyspecter reads {FORMAT!r}")
        meta["path"] = str(p)
        layers = [int(i) for i in meta["layers"]]
        n = len(layers)
        blend = arrays.get("blend")
        if blend is not None and blend.shape != (n, Recency.N_FEATURES + 2):
            raise SpecterError(f"{p}: reuse blend of shape {blend.shape}, expected ({n}, {Recency.N_FEATURES + 2})")
        return cls(meta=meta, layers=layers, A=[arrays.get(f"A{j}") for j in range(n)],
                   b=[arrays.get(f"b{j}") for j in range(n)], rank_prob=arrays["rank_prob"],
                   gap_edges=arrays["gap_edges"],
                   sel_bias=[arrays.get(f"sel_bias{j}") for j in range(n)],
                   A2=[arrays.get(f"A2_{j}") for j in range(n)],
                   R=[arrays.get(f"R{j}") for j in range(n)], rb=[arrays.get(f"rb{j}") for j in range(n)],
                   miss_curves=arrays.get("miss_curves"), blend=blend)
