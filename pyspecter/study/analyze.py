"""The routing-pattern analyzer: reads a routing trace (``trace.py``) and says how predictable the target's expert
needs are, and what simple caches would get, before any of it is built into the engine.

Definitions used throughout (``N(t, l)``: the experts the target selected for row ``t`` in MoE layer ``l``;
``U`` experts per token; sums run over (row, layer) pairs):

- recall = sum |N ∩ P| / sum |N|, precision = sum |N ∩ P| / sum |P|, full_cover = share of (row, layer) with N ⊆ P.
- Token lookahead ``h``: predict row ``t+h``'s experts when row ``t`` is known, inside one prompt. Every token
  predictor at a given ``h`` is scored on the same rows (eval rows whose row ``t-h`` exists in the same prompt),
  so their numbers compare.
- Rows scored: the "eval" split when the trace has both splits (profiles are then fitted on "tune"); otherwise all
  rows (and fitted profiles are then in-sample or online, which the result says).
- Predictors:
    draft-same-tokens  the draft's routing on the true token t+h (an upper bound for a draft: it knew the token)
    draft-own-tokens   the draft's routing on its own h-th drafted token after row t (what a prefetcher has)
    prev-token         N(t, l): the experts of the token h steps back
    frequency          the U most frequent experts of the layer (tune split, or online over earlier rows)
    next-layer-gate    router of layer l applied to the router input of layer l-h, same token: lookahead in MoE
                       *layers* (``lookahead_unit``), scored on every eval row, layers l >= h
    oracle             N itself (recall 1: checks the bookkeeping)
    learned            the learned routing predictor (learned.py, fitted by ``pyspecter fit-predictor`` on other
                       text) applied to the router input of layer l-h, same token (``lookahead_unit`` layers);
                       needs a trace with ``router_inputs`` and the predictor (the model's sidecar, or a file).
                       It predicts exactly U experts, so precision = recall and full_cover = exact-set match
- Caches (on the target's stream of rows in trace order, per layer, slots per layer): a step needs its U experts
  resident at once. hit_rate counts first-touch (compulsory) misses; hit_rate_warm leaves them out of both sides,
  so every policy reaches 1.0 at slots = n_expert. LRU is computed exactly for all slot counts from LRU stack
  positions; LFU (counts kept across evictions, ties by recency) and Belady MIN (evict the resident expert
  used farthest in the future, never one the step needs) are simulated (``simulate.py``, the one simulator).
- Batched calls (``batched``): misses per row when B rows of a prompt share one routing call, as a verify step of
  B - 1 accepted drafts does, under C's LRU, by slots per layer (``simulate.batched_misses``).
- Upload bytes per token at a confidence threshold: the bytes of the distinct predicted experts kept (router weight
  >= threshold) for one token, summed over MoE layers; wasted = kept but not needed, missed = needed, not kept.

The text format and the plots are in ``analyze_report``. Why this module is long: every analysis reads the
same trace arrays into one result.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from pyspecter.study.analyze_report import dumps, format_analysis, plot
from pyspecter.study.simulate import batched_misses, lru_stack_positions, simulate_cache
from pyspecter.tracefile import Trace, load_trace

__all__ = ["analyze", "dumps", "format_analysis", "plot"]

PREDICTORS = ("draft-same-tokens", "draft-own-tokens", "prev-token", "frequency", "next-layer-gate", "oracle")
LOOKAHEADS = (1, 2, 3, 4)
THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)
BATCHES = (1, 2, 3, 4)  # rows per routing call: a verify step of K = B - 1 drafts


# --- metric building blocks (pure functions on arrays; unit-tested) --------------------------------------------

def onehot(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """Expert-id lists [..., k] (-1 = none) as boolean sets [..., n_expert]."""
    return (np.asarray(ids)[..., :, None] == np.arange(n_expert)).any(axis=-2)


def lookahead_rows(prompt_index: np.ndarray, h: int) -> np.ndarray:
    """Rows s whose row s-h exists in the same prompt (rows of a prompt are contiguous and in order)."""
    pi = np.asarray(prompt_index)
    ok = np.zeros(len(pi), bool)
    if h < len(pi):
        ok[h:] = pi[h:] == pi[:-h] if h else True
    return ok


def shift_rows(a: np.ndarray, h: int, fill: int = -1) -> np.ndarray:
    """out[s] = a[s-h] (fill where s < h): a prediction made h rows earlier, aligned to the row it predicts."""
    out = np.full_like(a, fill)
    if h < len(a):
        out[h:] = a[: len(a) - h]
    return out


def prev_token_prediction(target_ids: np.ndarray, prompt_index: np.ndarray, h: int) -> tuple[np.ndarray, np.ndarray]:
    """Predict row s by the experts of row s-h. Returns (predicted ids [T, L, U], valid rows [T])."""
    return shift_rows(np.asarray(target_ids), h), lookahead_rows(prompt_index, h)


def set_scores(pred: np.ndarray, needed: np.ndarray, mask: np.ndarray) -> dict:
    """recall, precision, full_cover over masked (row, layer) cells, and recall per layer. pred/needed: boolean sets
    [T, L, E]; mask: [T] or [T, L]."""
    m = np.broadcast_to(mask[:, None] if mask.ndim == 1 else mask, needed.shape[:2])
    hits = (pred & needed).sum(-1)
    n_need, n_pred = needed.sum(-1), pred.sum(-1)
    cover = hits == n_need
    need_l = (n_need * m).sum(0)
    return {
        "recall": _ratio((hits * m).sum(), (n_need * m).sum()),
        "precision": _ratio((hits * m).sum(), (n_pred * m).sum()),
        "full_cover": _ratio((cover & m).sum(), m.sum()),
        "per_layer_recall": [_ratio(a, b) for a, b in zip((hits * m).sum(0), need_l, strict=True)],
        "samples": int(m.sum()),
    }


def _ratio(a, b) -> float | None:
    return float(a) / float(b) if b else None


def top_by_count(counts: np.ndarray, k: int) -> np.ndarray:
    """The k highest-count ids along the last axis (ties: lower id first)."""
    return np.argsort(-counts, axis=-1, kind="stable")[..., :k]


# --- caches ----------------------------------------------------------------------------------------------------

def default_slot_counts(n_used: int, n_expert: int) -> list[int]:
    if n_expert - n_used + 1 <= 33:
        return list(range(n_used, n_expert + 1))
    return sorted({int(round(x)) for x in np.linspace(n_used, n_expert, 24)})


def cache_curves(target_ids: np.ndarray, n_expert: int, slot_counts: list[int] | None = None) -> dict:
    """Hit-rate curves vs slots per layer for LRU, LFU and Belady on target_ids [T, L, U], plus reuse distances."""
    T, L, U = target_ids.shape
    slot_counts = slot_counts or default_slot_counts(U, n_expert)
    accesses = int((target_ids >= 0).sum())
    curves = {p: np.zeros(len(slot_counts)) for p in ("lru", "lfu", "belady")}
    lru_layer = np.zeros((L, len(slot_counts)))
    cold = 0
    stack_hist = np.zeros(n_expert, np.int64)
    reuse: list[int] = []
    for j in range(L):
        steps = target_ids[:, j, :]
        pos = lru_stack_positions(steps)
        valid = steps >= 0
        layer_cold = int((valid & (pos < 0)).sum())
        cold += layer_cold
        warm_pos = pos[valid & (pos >= 0)]
        stack_hist += np.bincount(warm_pos, minlength=n_expert)[:n_expert]
        for i, s in enumerate(slot_counts):
            h = int((warm_pos < s).sum())
            curves["lru"][i] += h
            lru_layer[j, i] = _ratio(h, valid.sum() - layer_cold) or 0.0
            curves["lfu"][i] += simulate_cache(steps, s, "lfu")
            curves["belady"][i] += simulate_cache(steps, s, "belady")
        last: dict[int, int] = {}
        for s, row in enumerate(steps):
            for e in row:
                if e >= 0:
                    if int(e) in last:
                        reuse.append(s - last[int(e)])
                    last[int(e)] = s
    warm = accesses - cold
    out: dict = {
        "stream": "target rows in trace order, prompts back to back (prefill routing not included)",
        "slots": slot_counts, "budget_fraction": [s / n_expert for s in slot_counts],
        "accesses": accesses, "compulsory_misses": cold,
    }
    for p, hits in curves.items():
        out[p] = {"hit_rate": [_ratio(h, accesses) for h in hits], "hit_rate_warm": [_ratio(h, warm) for h in hits]}
    out["lru_per_layer_warm"] = lru_layer.tolist()
    r = np.asarray(reuse, np.int64)
    edges = list(range(1, 33))
    out["reuse_distance_tokens"] = {
        "distance": [*edges, ">32"],
        "count": [int((r == d).sum()) for d in edges] + [int((r > 32).sum())],
        "first_touch": cold,
        "median": float(np.median(r)) if r.size else None,
    }
    out["lru_stack_position"] = {"count": stack_hist.tolist(), "first_touch": cold}
    return out


def batched_curves(target_ids: np.ndarray, prompt_index: np.ndarray, n_expert: int) -> dict:
    """Misses per row when B consecutive rows share one routing call (``simulate.batched_misses``: a verify step
    whose drafts are all accepted), at every slot count of ``cache_curves``. Below 1.0 against B = 1 is what the
    union of a step's experts saves; a draft's own memory buys fewer slots: read its row at the slots left."""
    T, _, U = target_ids.shape
    slots = default_slot_counts(U, n_expert)
    m = {s: [batched_misses(target_ids, prompt_index, n_expert, s, b) / max(T, 1) for b in BATCHES] for s in slots}
    return {"batch": list(BATCHES), "slots": slots, "misses_per_row": [m[s] for s in slots],
            "vs_one_row": [[_ratio(v, m[s][0]) for v in m[s]] for s in slots]}


# --- the analysis ----------------------------------------------------------------------------------------------

class _Rows:
    """Which rows are scored and which fit profiles."""

    def __init__(self, tr: Trace) -> None:
        split = tr.row_split
        has_tune, has_eval = bool((split == "tune").any()), bool((split == "eval").any())
        self.split_used = has_tune and has_eval
        self.eval = split == "eval" if self.split_used else np.ones(tr.n_rows, bool)
        self.fit = split == "tune" if self.split_used else np.ones(tr.n_rows, bool)
        self.eval_desc = "eval split" if self.split_used else "all rows"


def _frequency_prediction(needed: np.ndarray, rows: _Rows, U: int, h: int) -> tuple[np.ndarray, str]:
    T, L, E = needed.shape
    if rows.split_used:
        top = top_by_count(needed[rows.fit].sum(0), U)  # [L, U]
        return np.broadcast_to(top, (T, L, U)), "static profile from the tune split"
    # online: the profile of every row up to and including the one known at prediction time (s-h)
    cum = np.cumsum(needed, axis=0, dtype=np.int32)
    return shift_rows(top_by_count(cum, U), h), "online profile over earlier rows"


def _predictor_table(tr: Trace, rows: _Rows, lookaheads: list[int]) -> dict:
    E, U = tr.n_expert, tr.n_used
    T, L, _ = tr["target_ids"].shape
    needed = onehot(tr["target_ids"], E)
    K = tr["draft_own_ids"].shape[1] if tr.get("draft_own_ids") is not None else 0
    ga = tr.get("gate_ahead_ids")
    H = ga.shape[1] if ga is not None else 0
    out: dict = {}
    for name in PREDICTORS:
        entry: dict = {"available": True, "lookahead_unit": "layers" if name == "next-layer-gate" else "tokens",
                       "recall_at": {}, "precision_at": {}, "full_cover_at": {}, "samples_at": {},
                       "per_layer_recall_at_1": [None] * L}
        if name.startswith("draft") and K == 0:
            entry.update(available=False, note="trace has no draft")
        if name == "next-layer-gate" and H == 0:
            entry.update(available=False, note=tr.meta.get("gate_lookahead", {}).get("note") or "not recorded")
        for h in lookaheads:
            pred, mask = None, rows.eval & lookahead_rows(tr["prompt_index"], h)
            if not entry["available"]:
                pass
            elif name == "oracle":
                pred = needed
            elif name == "prev-token":
                pred = onehot(prev_token_prediction(tr["target_ids"], tr["prompt_index"], h)[0], E)
            elif name == "draft-same-tokens":
                pred = onehot(tr["draft_same_ids"], E)
            elif name == "draft-own-tokens" and h <= K:
                pred = onehot(shift_rows(tr["draft_own_ids"][:, h - 1], h), E)
            elif name == "frequency":
                ids, entry["profile"] = _frequency_prediction(needed, rows, U, h)
                pred = onehot(ids, E)
            elif name == "next-layer-gate" and h <= H:
                pred = onehot(ga[:, h - 1], E)
                mask = rows.eval[:, None] & (np.arange(L) >= h)[None, :]
            key = str(h)
            if pred is None:
                entry["recall_at"][key] = entry["precision_at"][key] = entry["full_cover_at"][key] = None
                entry["samples_at"][key] = 0
                continue
            sc = set_scores(pred, needed, mask)
            entry["recall_at"][key] = sc["recall"]
            entry["precision_at"][key] = sc["precision"]
            entry["full_cover_at"][key] = sc["full_cover"]
            entry["samples_at"][key] = sc["samples"]
            if h == 1:
                entry["per_layer_recall_at_1"] = sc["per_layer_recall"]
        out[name] = entry
    return out


def _learned(tr: Trace, rows: _Rows, lookaheads: list[int], predictor) -> tuple[dict | None, dict]:
    """The learned predictor scored like the others (a predictors-table entry) and per layer and horizon
    (recall and exact-set match), on the scored rows; (None, why) when it cannot be scored."""
    from pyspecter.errors import SpecterError
    from pyspecter.learned import LearnedPredictor

    X = tr.get("router_inputs")
    if predictor is False:
        return None, {"available": False, "note": "not asked for"}
    if X is None:
        return None, {"available": False, "note": "trace has no router inputs (record it again with this version)"}
    target = Path(tr.meta["target"])
    try:
        if predictor is None:
            predictor = LearnedPredictor.for_model(target) if target.is_file() else None
        elif not isinstance(predictor, LearnedPredictor):
            predictor = LearnedPredictor.load(predictor)
    except SpecterError as e:  # e.g. a sidecar of an older format: say so, and analyze the rest
        return None, {"available": False, "note": f"{e} (pyspecter fit-predictor {target} fits a new one)"}
    if predictor is None:
        return None, {"available": False, "note": f"no predictor fitted for {target} (pyspecter fit-predictor)"}
    if predictor.layers != list(tr.meta["moe_layers"]) or predictor.n_expert != tr.n_expert:
        return None, {"available": False, "note": "the predictor was fitted for another model"}
    E, L, H = tr.n_expert, len(predictor.layers), predictor.horizons
    needed = onehot(tr["target_ids"], E)
    pred = np.zeros((H + 1,) + needed.shape, bool)  # [h, T, L, E]
    for j, il in enumerate(predictor.layers):
        for layer, ids in predictor.topk(il, X[:, j].astype(np.float32)).items():
            jt = predictor.pos[layer]
            pred[jt - j, :, jt] = onehot(ids, E)
    entry: dict = {"available": True, "lookahead_unit": "layers", "recall_at": {}, "precision_at": {},
                   "full_cover_at": {}, "samples_at": {}, "per_layer_recall_at_1": [None] * L}
    detail: dict = {"available": True, "predictor": predictor.meta.get("path"), "nbytes": predictor.nbytes,
                    "horizons": H, "fit": predictor.meta.get("fit"), "by_horizon": {}, "per_layer": {}}
    for h in sorted(set(lookaheads) | set(range(1, H + 1))):
        key = str(h)
        if h > H:
            if h in lookaheads:
                for k in ("recall_at", "precision_at", "full_cover_at", "samples_at"):
                    entry[k][key] = None
            continue
        mask = rows.eval[:, None] & (np.arange(L) >= h)[None, :]
        sc = set_scores(pred[h], needed, mask)
        exact = ((pred[h] == needed).all(-1) & mask).sum(0)
        per_exact = [_ratio(a, b) for a, b in zip(exact, mask.sum(0), strict=True)]
        if h in lookaheads:
            entry["recall_at"][key], entry["precision_at"][key] = sc["recall"], sc["precision"]
            entry["full_cover_at"][key], entry["samples_at"][key] = sc["full_cover"], sc["samples"]
        if h == 1:
            entry["per_layer_recall_at_1"] = sc["per_layer_recall"]
        detail["by_horizon"][key] = {"recall": sc["recall"], "exact": sc["full_cover"], "samples": sc["samples"]}
        detail["per_layer"][key] = {"recall": sc["per_layer_recall"], "exact": per_exact}
    if predictor.has_reuse:
        # eviction by the reuse maps on the scored rows, one cache per layer, beside LRU and Belady's MIN
        from pyspecter.study.predictor_fit import evaluate_reuse

        k = tr.n_used
        slots = sorted({max(k, E // 2), max(k, round(0.3 * E))})
        Xs = [X[rows.eval, j].astype(np.float32) for j in range(L)]
        detail["eviction"] = {"reuse_horizon": predictor.reuse_horizon, "blend": predictor.blend is not None,
                              "misses_per_token": evaluate_reuse(predictor, Xs, tr["target_ids"][rows.eval], slots)}
    return entry, detail


def _threshold_scores(pred_ids: np.ndarray, pred_w: np.ndarray, needed: np.ndarray, mask: np.ndarray,
                      eb: np.ndarray, thresholds: list[float]) -> dict:
    E = needed.shape[-1]
    res: dict = {"thresholds": list(thresholds), "recall": [], "precision": [], "upload_bytes_per_token": [],
                 "wasted_bytes_per_token": [], "missed_bytes_per_token": []}
    n_rows = int(mask.sum())
    for thr in thresholds:
        kept = onehot(np.where(pred_w.astype(np.float32) >= thr, pred_ids, -1), E)
        sc = set_scores(kept, needed, mask)
        hits = (kept & needed).sum(-1)[mask]  # [rows, L]
        n_kept, n_need = kept.sum(-1)[mask], needed.sum(-1)[mask]
        res["recall"].append(sc["recall"])
        res["precision"].append(sc["precision"])
        for key, cnt in (("upload_bytes_per_token", n_kept), ("wasted_bytes_per_token", n_kept - hits),
                         ("missed_bytes_per_token", n_need - hits)):
            res[key].append(float((cnt * eb).sum() / n_rows) if n_rows else None)
    return res


def _confidence(tr: Trace, rows: _Rows, thresholds: list[float]) -> dict:
    E = tr.n_expert
    needed = onehot(tr["target_ids"], E)
    eb = tr.expert_bytes
    out: dict = {"needed_bytes_per_token": float(eb.sum() * tr.n_used),
                 "bytes_definition": "distinct predicted experts kept for one token, times their layer's expert "
                                     "bytes, summed over MoE layers; per scored row"}
    own = tr.get("draft_own_ids")
    if own is None:
        return out
    out["draft-same-tokens"] = _threshold_scores(tr["draft_same_ids"], tr["draft_same_w"], needed, rows.eval,
                                                 eb, thresholds)
    out["draft-own-tokens"] = {}
    for h in range(1, own.shape[1] + 1):
        mask = rows.eval & lookahead_rows(tr["prompt_index"], h)
        out["draft-own-tokens"][str(h)] = _threshold_scores(
            shift_rows(own[:, h - 1], h), shift_rows(tr["draft_own_w"][:, h - 1], h, fill=0), needed, mask, eb,
            thresholds)
    return out


def _speculative(tr: Trace, rows: _Rows) -> dict | None:
    own = tr.get("draft_own_ids")
    if own is None:
        return None
    E, K = tr.n_expert, own.shape[1]
    eb = tr.expert_bytes
    match = tr["draft_match"][rows.eval]
    out: dict = {"k": K, "acceptance_at": {}}
    for h in range(K):
        known = match[:, h][match[:, h] >= 0]
        out["acceptance_at"][str(h + 1)] = float(known.mean()) if known.size else None
    full = match[(match >= 0).all(axis=1)]
    out["mean_accepted_prefix"] = float(np.cumprod(full == 1, axis=1).sum(1).mean()) if len(full) else None
    verify = tr.get("verify_ids")
    if verify is None:
        return out
    # What a verify step needs: the target processes the last true token (row t) and the K drafts in one batch.
    need_v = onehot(verify, E)  # [T, K, L, E]
    pred_v = onehot(own, E)
    out["draft_own_recall_vs_verify_at"] = {}
    for h in range(K):
        sc = set_scores(pred_v[:, h], need_v[:, h], rows.eval)
        out["draft_own_recall_vs_verify_at"][str(h + 1)] = sc["recall"]
    union = []
    need_u = onehot(tr["target_ids"], E)
    pred_u = onehot(tr["draft_same_ids"], E)
    for h in range(K):
        need_u = need_u | need_v[:, h]
        pred_u = pred_u | pred_v[:, h]
        sc = set_scores(pred_u, need_u, rows.eval)
        m = rows.eval
        union.append({"drafts": h + 1, "tokens_in_batch": h + 2,
                      "needed_bytes_per_step": float((need_u.sum(-1)[m] * eb).sum() / max(m.sum(), 1)),
                      "predicted_bytes_per_step": float((pred_u.sum(-1)[m] * eb).sum() / max(m.sum(), 1)),
                      "recall": sc["recall"], "precision": sc["precision"]})
    out["verify_step_union"] = union
    return out


def _cross_layer(tr: Trace, rows: _Rows) -> dict:
    """How well layer l's experts predict layer l+1's (same token): the best conditional predictor, P(e'|e) fitted
    on the fit rows, scored against the frequency profile of l+1 fitted on the same rows."""
    E, U = tr.n_expert, tr.n_used
    N = onehot(tr["target_ids"], E).astype(np.float64)  # [T, L, E]
    L = N.shape[1]
    per, base = [], []
    hits = need = hits_b = 0.0
    for j in range(L - 1):
        a, b = N[rows.fit, j], N[rows.fit, j + 1]
        prior = (b.sum(0) + 1) / (b.sum() + E)
        cond = (a.T @ b + prior) / (a.sum(0)[:, None] + 1)  # [e, e'], smoothed toward layer l+1's profile
        score = N[rows.eval, j] @ cond
        pred = onehot(top_by_count(score, U), E)
        pred_b = onehot(np.broadcast_to(top_by_count(b.sum(0), U), (int(rows.eval.sum()), U)), E)
        truth = N[rows.eval, j + 1].astype(bool)
        h, hb, n = (pred & truth).sum(), (pred_b & truth).sum(), truth.sum()
        per.append(_ratio(h, n))
        base.append(_ratio(hb, n))
        hits, hits_b, need = hits + h, hits_b + hb, need + n
    return {"recall": _ratio(hits, need), "per_layer_pair_recall": per,
            "frequency_baseline_recall": _ratio(hits_b, need), "frequency_baseline_per_layer_pair": base,
            "fit": "tune split" if rows.split_used else "all rows (in-sample)"}


def _cross_token(tr: Trace, rows: _Rows) -> dict:
    E, U = tr.n_expert, tr.n_used
    N = onehot(tr["target_ids"], E)
    m = rows.eval & lookahead_rows(tr["prompt_index"], 1)
    prev = shift_rows(N, 1, fill=False)
    inter = (N & prev).sum(-1)[m]  # [rows, L]
    union = (N | prev).sum(-1)[m]
    return {"overlap": float(inter.mean() / U) if inter.size else None,
            "per_layer_overlap": (inter.mean(0) / U).tolist() if inter.size else [],
            "jaccard": float((inter / np.maximum(union, 1)).mean()) if inter.size else None,
            "random_baseline_overlap": U / E}


def _frequency(tr: Trace) -> dict:
    E, U = tr.n_expert, tr.n_used
    counts = onehot(tr["target_ids"], E).sum(0)  # [L, E]
    tot = counts.sum(1, keepdims=True).clip(min=1)
    p = counts / tot
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -(np.where(p > 0, p * np.log(p), 0.0)).sum(1) / math.log(E)
    return {"counts": counts.tolist(), "moe_layers": tr.meta["moe_layers"],
            "used_fraction_per_layer": (counts > 0).mean(1).tolist(),
            "top_k_share_per_layer": (np.sort(counts, 1)[:, ::-1][:, :U].sum(1) / tot[:, 0]).tolist(),
            "entropy_ratio_per_layer": ent.tolist()}


def analyze(trace_path: str | os.PathLike, plot_dir: str | os.PathLike | None = None, *,
            lookaheads: list[int] | None = None, thresholds: list[float] | None = None, predictor=None) -> dict:
    """Everything the module docstring defines, as one JSON-able dict; PNGs in plot_dir if given.
    predictor: the learned predictor to score (a LearnedPredictor or a file); None: the trace's target's sidecar
    when there is one; False: none."""
    tr = load_trace(trace_path)
    rows = _Rows(tr)
    K = tr["draft_own_ids"].shape[1] if tr.get("draft_own_ids") is not None else 0
    lookaheads = sorted(set(lookaheads or [*LOOKAHEADS, *range(1, K + 1)]))
    thresholds = list(thresholds or THRESHOLDS)
    result: dict = {
        "trace": {"path": str(trace_path), "target": tr.meta["target"], "draft": tr.meta["draft"],
                  "arch": tr.meta["arch"], "n_expert": tr.n_expert, "n_expert_used": tr.n_used,
                  "moe_layers": tr.meta["moe_layers"], "rows": tr.n_rows, "prompts": len(tr.meta["prompts"]),
                  "scored_rows": rows.eval_desc, "n_scored_rows": int(rows.eval.sum()),
                  "gate_lookahead": tr.meta.get("gate_lookahead")},
        "predictors": _predictor_table(tr, rows, lookaheads),
        "confidence": _confidence(tr, rows, thresholds),
        "cache": cache_curves(tr["target_ids"], tr.n_expert),
        "batched": batched_curves(tr["target_ids"], tr["prompt_index"], tr.n_expert),
        "frequency": _frequency(tr),
        "cross_layer": _cross_layer(tr, rows),
        "cross_token": _cross_token(tr, rows),
    }
    entry, result["learned"] = _learned(tr, rows, lookaheads, predictor)
    if entry is not None:
        result["predictors"]["learned"] = entry
    spec = _speculative(tr, rows)
    if spec is not None:
        result["speculative"] = spec
    if plot_dir is not None:
        result["plots"] = plot(result, plot_dir)
    return _jsonable(result)


def _jsonable(x):
    # NaN is not JSON; numpy scalars are not JSON-serialisable
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
