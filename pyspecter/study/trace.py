"""Routing traces: which experts a target MoE model needed for each generated token, and what each predictor said
before it knew.

A trace is what the routing-pattern analyzer (``analyze.py``) reads, so predictors and cache policies can be
compared offline on the same tokens, without re-running any model.

How a trace is recorded, per prompt (greedy, one token per decode, flash attention off, so the routing is what a
plain decode sees; batching and attention settings move near-tie routing, see docs/DESIGN.md):

- The target decodes the rendered prompt, then generates ``n`` tokens. Row ``t`` of the trace is the target
  *processing* input token ``g_t`` (the first is the prompt's greedy continuation): its selected experts and router
  weights in every MoE layer. Prompt (prefill) routing is not recorded: it is a batch, and not what the decode
  loop has to predict.
- With a draft: after the draft has processed the same true prefix and ``g_t`` (its routing on the same token:
  ``draft_same``), it greedily drafts ``k`` tokens ``d_1..d_k`` and we record its routing while processing each
  (``draft_own``, lookahead 1..k), then roll its KV cache back. ``d_h`` is the draft's guess of ``g_{t+h}``;
  its routing predicts the target's routing on row ``t+h``. Drafted tokens are kept even when wrong.
- ``verify``: the target's own routing on the drafted tokens ``d_1..d_k`` (one batch, as a speculative verify step
  would run it, then rolled back). These are the experts a verify step really needs, right or wrong drafts.
- ``gate_ahead`` (predictor "next-layer-gate"): llama.cpp's eval callback observes each MoE layer's router input
  (the ``src[1]`` of the ``ffn_moe_logits-L`` matmul, i.e. the normalised FFN input of that layer) for the row
  being decoded. Offline we apply the router of the MoE layer ``h`` layers further down (weights read from the
  GGUF) to it and keep its top-k. Lookahead here counts MoE *layers* of the same token, not tokens.

File format: one ``.npz`` (numpy, compressed). ``T`` rows, ``L`` MoE layers (in ``meta["moe_layers"]`` order),
``U`` = experts used per token, ``K`` = draft lookahead, ``H`` = gate lookahead (layers). Expert ids are logical ids;
-1 means "none".

  token_ids       int32   [T]          input token of each row (g_t)
  output_ids      int32   [T]          the target's greedy output after the row (g_{t+1})
  prompt_index    int16   [T]          index into meta["prompts"]; rows of one prompt are contiguous and in order
  position        int32   [T]          KV position of the row
  target_ids      int16   [T, L, U]    experts the target selected
  target_w        float16 [T, L, U]    their router weights (as the arch applies them)
  prompt_tokens   int32   [sum P]      every prompt's tokens, concatenated (a trace can be replayed)
  prompt_starts   int32   [n_prompts+1] offsets into prompt_tokens
  gate_ahead_ids  int16   [T, H, L, U] [t, h-1, j]: router of MoE layer j applied to the router input of MoE
                                       layer j-h, same row (-1 where j < h)
  gate_ahead_w    float16 [T, H, L, U] that router's gating probabilities (softmax/sigmoid, not renormalised)
  router_inputs   float16 [T, L, d]    each MoE layer's router input for the row (with gate_ahead): what the
                                       learned routing predictors (learned.py) read, so analyze can score them
with a draft:
  draft_same_ids  int16   [T, L, U]    draft routing on the same token g_t;    draft_same_w float16
  draft_own_ids   int16   [T, K, L, U] draft routing on its h-th drafted token; draft_own_w  float16
  draft_tokens    int32   [T, K]       d_1..d_K drafted after row t
  draft_match     int8    [T, K]       1 if d_h == g_{t+h}, 0 if not, -1 if the trace doesn't know g_{t+h}
  verify_ids      int16   [T, K, L, U] target routing on d_1..d_K (a verify batch);  verify_w float16
  meta            str                  JSON: format, paths, arch, n_expert, n_expert_used, moe_layers,
                                        expert_bytes (target, per MoE layer), draft_expert_bytes, n, k, prompts
                                        [{id, split, kind, n_prompt_tokens, rows}], gate-lookahead diagnostics

Why this module is long: the file format is documented here in full, beside the recorder that writes it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pyspecter._version import __version__
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout, read_layout
from pyspecter.learned import gate_probs
from pyspecter.models.calibration import RouterInputTap
from pyspecter.native import Context, Model
from pyspecter.native.hooks import Hooks
from pyspecter.paths import atomic_path
from pyspecter.prompts import load_prompts, normalize_prompt, render_prompt
from pyspecter.router_ahead import Routers, read_routers
from pyspecter.tracefile import TRACE_FORMAT


def _as_prompts(prompts: str | os.PathLike | list | None) -> list[dict]:
    if prompts is None or isinstance(prompts, str | os.PathLike):
        return load_prompts(prompts)
    return [normalize_prompt(p, f"prompt {i}", i) for i, p in enumerate(prompts)]


# --- observing the model ---------------------------------------------------------------------------------------

class _RouteRecorder:
    """Keeps what the patched routing hook reports (once per MoE layer per ubatch) until ``take``."""

    def __init__(self, model: Model, layout: ModelLayout) -> None:
        self.pos = {L.index: j for j, L in enumerate(layout.layers)}
        self.n_used = layout.n_expert_used
        self._ids: list[list[np.ndarray]] = [[] for _ in layout.layers]
        self._w: list[list[np.ndarray]] = [[] for _ in layout.layers]
        # One slot per layer, never filled: every row stays on the host path, which is stock llama.cpp's
        # computation, and the slot tensors cost one expert per layer.
        self.hooks = Hooks(model, self._on_route, n_slots=1, weights=True)

    def _on_route(self, il, n_tokens, n_used, ids_p, w_p) -> None:
        n = n_tokens * n_used
        self._ids[self.pos[il]].append(np.ctypeslib.as_array(ids_p, shape=(n,)).reshape(n_tokens, n_used).copy())
        self._w[self.pos[il]].append(np.ctypeslib.as_array(w_p, shape=(n,)).reshape(n_tokens, n_used).copy())

    def clear(self) -> None:
        for lst in (*self._ids, *self._w):
            lst.clear()

    def take(self, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Routing of the last n_tokens decoded rows: ids [n_tokens, L, U] and weights, then forget everything."""
        try:
            self.hooks.check()
        except Exception as err:  # noqa: BLE001
            raise SpecterError(f"routing hook failed: {err!r}") from None
        ids = np.full((n_tokens, len(self._ids), self.n_used), -1, np.int16)
        w = np.zeros((n_tokens, len(self._ids), self.n_used), np.float16)
        for j, (chunks, wchunks) in enumerate(zip(self._ids, self._w, strict=True)):
            if not chunks:
                raise SpecterError(f"the routing hook never reported MoE layer #{j} (was every row an output?)")
            a, b = np.concatenate(chunks), np.concatenate(wchunks)
            if len(a) < n_tokens or a.shape[1] != self.n_used:
                raise SpecterError(f"the routing hook reported {a.shape} at MoE layer #{j}, "
                                   f"expected {n_tokens} rows of {self.n_used}")
            ids[:, j], w[:, j] = a[-n_tokens:], b[-n_tokens:]
        self.clear()
        return ids, w

    def close(self) -> None:
        self.hooks.close()


# --- routers, for the next-layer gate lookahead ----------------------------------------------------------------

def _select(routers: Routers, j: int, x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-n experts of MoE layer j's router and their gating probabilities, for router inputs x [rows, n_embd]
    (expert groups are not modelled)."""
    logits = routers.logits(j, x)
    probs = gate_probs(logits, routers.gating)
    score = probs + routers.sel_bias[j] if routers.sel_bias[j] is not None else probs
    ids = np.argsort(-score, axis=-1, kind="stable")[:, :n]
    return ids, np.take_along_axis(probs, ids, axis=-1)


# --- recording -------------------------------------------------------------------------------------------------

@dataclass
class _Rows:
    """Per-row arrays, appended as the trace is recorded."""

    cols: dict[str, list] = field(default_factory=dict)

    def add(self, **kw: Any) -> None:
        for k, v in kw.items():
            self.cols.setdefault(k, []).append(v)

    def stack(self, name: str, dtype) -> np.ndarray:
        return np.asarray(np.stack(self.cols[name]), dtype)


def _argmax(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def record_trace(model_path: str | os.PathLike, out_path: str | os.PathLike,
                 draft_path: str | os.PathLike | None = None,
                 prompts: str | os.PathLike | list | None = None, n: int = 32, k: int = 4, progress: bool = True, *,
                 n_threads: int | None = None, gate_lookahead: int = 4, verify: bool = True,
                 stop_at_eog: bool = True) -> dict:
    """Record a routing trace (format in the module docstring) and return a summary.

    prompts: a prompt file (plain text, one prompt a line, or JSONL: ``prompts.load_prompts``), a list of prompt
    dicts / strings, or None for the packaged eval_prompts.jsonl.
    n: tokens the target generates per prompt (fewer if it ends the turn and stop_at_eog).
    k: draft lookahead (tokens drafted ahead of each true prefix). gate_lookahead: MoE layers the next-layer gate
    looks ahead (0 turns the eval callback off). verify: also record the target's routing on the drafted tokens.
    """
    t_start = time.perf_counter()
    model_path = Path(model_path)
    out_path = Path(out_path)
    if n < 1 or k < 1:
        raise SpecterError("n and k must be at least 1")
    items = _as_prompts(prompts)
    if not items:
        raise SpecterError("no prompts")
    layout = read_layout(model_path).require_moe()
    d_layout = read_layout(draft_path).require_moe() if draft_path is not None else None
    if d_layout is not None and ([L.index for L in d_layout.layers] != [L.index for L in layout.layers]
                                 or d_layout.n_expert != layout.n_expert
                                 or d_layout.n_expert_used != layout.n_expert_used):
        raise SpecterError(f"{draft_path}: the draft's MoE layers/experts differ from the target's, so its routing "
                           "cannot predict the target's")
    n_threads = n_threads or os.cpu_count() or 1
    H = max(0, min(gate_lookahead, len(layout.layers) - 1))
    U, L_n = layout.n_expert_used, len(layout.layers)

    routers = read_routers(model_path, layout) if H else None
    target = Model(model_path)
    draft = Model(draft_path) if draft_path is not None else None
    closers: list = [draft, target]
    try:
        rec = _RouteRecorder(target, layout)
        closers.insert(0, rec)
        d_rec = _RouteRecorder(draft, d_layout) if draft is not None else None
        if d_rec is not None:
            closers.insert(0, d_rec)
        if draft is not None and draft.n_vocab != target.n_vocab:
            raise SpecterError(f"{draft_path}: the draft's vocabulary ({draft.n_vocab}) differs from the target's "
                               f"({target.n_vocab})")
        rendered = [target.tokenize(render_prompt(target, p["messages"])) for p in items]
        n_ctx = max(len(t) for t in rendered) + n + k + 8
        n_ctx = -(-n_ctx // 256) * 256
        n_batch = min(n_ctx, 512)
        tap = RouterInputTap(layout) if H else None
        if tap is not None:
            ctx = Context(target, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, cb_eval=tap.cb)
        else:
            ctx = Context(target, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads)
        closers.insert(0, ctx)
        dctx = Context(draft, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads) if draft is not None else None
        if dctx is not None:
            closers.insert(0, dctx)

        rows = _Rows()
        meta_prompts = []
        reproduced = checked = 0
        logit_err = 0.0
        gate_note: str | None = None if H else "gate_lookahead=0"
        for pi, (item, toks) in enumerate(zip(items, rendered, strict=True)):
            t0 = time.perf_counter()
            ctx.clear()
            rec.clear()
            logits = ctx.decode(toks)
            g = _argmax(logits)
            if dctx is not None:
                dctx.clear()
                dctx.decode(toks)
                d_rec.clear()
            n_rows = 0
            for _ in range(n):
                if stop_at_eog and target.is_eog(g):
                    break
                pos = ctx.n_past
                rec.clear()
                if tap is not None:
                    tap.active = True
                logits = ctx.decode([g])
                if tap is not None:
                    tap.active = False
                t_ids, t_w = rec.take(1)
                out = _argmax(logits)
                row: dict[str, Any] = dict(token_ids=g, output_ids=out, prompt_index=pi, position=pos,
                                           target_ids=t_ids[0], target_w=t_w[0])
                if tap is not None:
                    ga_ids = np.full((H, L_n, U), -1, np.int16)
                    ga_w = np.zeros((H, L_n, U), np.float16)
                    x, tap_logits = tap.take()
                    if tap.error is None and len(x) == L_n:
                        for j in range(L_n):
                            own, _ = _select(routers, j, x[j][-1:], U)
                            reproduced += int(set(own[0].tolist()) == set(t_ids[0, j].tolist()))
                            checked += 1
                            for h in range(1, H + 1):
                                if j - h >= 0:
                                    ids, w = _select(routers, j, x[j - h][-1:], U)
                                    ga_ids[h - 1, j], ga_w[h - 1, j] = ids[0], w[0]
                        row["router_inputs"] = np.stack([x[j][-1] for j in range(L_n)])
                        if n_rows == 0 and pi == 0:
                            logit_err = _router_logit_error(routers, x, tap_logits)
                    elif gate_note is None:
                        gate_note = tap.error or f"the eval callback saw {len(x)} of {L_n} MoE router inputs"
                    row.update(gate_ahead_ids=ga_ids, gate_ahead_w=ga_w)
                if dctx is not None:
                    _draft_row(row, dctx, d_rec, ctx, rec, g, k, verify)
                rows.add(**row)
                n_rows += 1
                g = out
            meta_prompts.append({"id": item["id"], "split": item["split"], "kind": item["kind"],
                                 "n_prompt_tokens": len(toks), "rows": n_rows})
            if progress:
                print(f"[{pi + 1}/{len(items)}] {item['split']}/{item['kind']} {item['id']}: {len(toks)} prompt "
                      f"tokens, {n_rows} rows, {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    finally:
        for c in closers:
            if c is not None:
                c.close()

    T = len(rows.cols.get("token_ids", []))
    if T == 0:
        raise SpecterError("no rows recorded (every prompt ended at once?)")
    arrays: dict[str, np.ndarray] = {
        "token_ids": rows.stack("token_ids", np.int32), "output_ids": rows.stack("output_ids", np.int32),
        "prompt_index": rows.stack("prompt_index", np.int16), "position": rows.stack("position", np.int32),
        "target_ids": rows.stack("target_ids", np.int16), "target_w": rows.stack("target_w", np.float16),
        "prompt_tokens": np.asarray([t for toks in rendered for t in toks], np.int32),
        "prompt_starts": np.cumsum([0] + [len(t) for t in rendered]).astype(np.int32),
    }
    gate_ok = H > 0 and gate_note is None
    if gate_ok:
        arrays["gate_ahead_ids"] = rows.stack("gate_ahead_ids", np.int16)
        arrays["gate_ahead_w"] = rows.stack("gate_ahead_w", np.float16)
        arrays["router_inputs"] = rows.stack("router_inputs", np.float16)
    if draft is not None:
        for name, dt in (("draft_same_ids", np.int16), ("draft_same_w", np.float16), ("draft_own_ids", np.int16),
                         ("draft_own_w", np.float16), ("draft_tokens", np.int32)):
            arrays[name] = rows.stack(name, dt)
        if verify:
            arrays["verify_ids"] = rows.stack("verify_ids", np.int16)
            arrays["verify_w"] = rows.stack("verify_w", np.float16)
        arrays["draft_match"] = _draft_match(arrays["draft_tokens"], arrays["output_ids"], arrays["prompt_index"])

    meta = {
        "format": TRACE_FORMAT, "pyspecter": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "target": str(model_path), "draft": str(draft_path) if draft_path is not None else None,
        "arch": layout.arch, "n_expert": layout.n_expert, "n_expert_used": U,
        "moe_layers": [L.index for L in layout.layers], "expert_bytes": [L.expert_bytes for L in layout.layers],
        "draft_expert_bytes": [L.expert_bytes for L in d_layout.layers] if d_layout else None,
        "n": n, "k": k if draft is not None else 0, "verify": bool(verify and draft is not None),
        "stop_at_eog": stop_at_eog, "decode": "greedy, one token per decode, flash attention off",
        "prompts": meta_prompts,
        "gate_lookahead": {
            "layers": H if gate_ok else 0,
            "note": gate_note,
            "router_input": "src[1] of ffn_moe_logits-L (the layer's normalised FFN input), via cb_eval",
            "router_reproduction": reproduced / checked if checked else None,
            "router_logit_max_abs_err": logit_err if checked else None,
        },
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_path, suffix=".npz") as tmp:
        np.savez_compressed(tmp, meta=np.array(json.dumps(meta)), **arrays)

    summary = {"out": str(out_path), "rows": T, "prompts": len(items), "moe_layers": L_n,
               "n_expert": layout.n_expert, "n_expert_used": U, "k": meta["k"], "draft": meta["draft"],
               "gate_lookahead": meta["gate_lookahead"], "seconds": round(time.perf_counter() - t_start, 2),
               "bytes": out_path.stat().st_size}
    if draft is not None:
        m = arrays["draft_match"]
        summary["acceptance_at"] = {str(h + 1): _mean_known(m[:, h]) for h in range(m.shape[1])}
    return summary


def _draft_row(row: dict, dctx: Context, d_rec: _RouteRecorder, ctx: Context, rec: _RouteRecorder, g: int, k: int,
               verify: bool) -> None:
    """Draft routing for one row: the draft processes the true token g, drafts k tokens from there (routing of
    each), rolls back; then the target's routing on those drafts (a verify batch), rolled back too."""
    d_rec.clear()
    d_logits = dctx.decode([g])
    same_ids, same_w = d_rec.take(1)
    base = dctx.n_past
    drafted, own_ids, own_w = [], [], []
    d = _argmax(d_logits)
    for _ in range(k):
        drafted.append(d)
        d_logits = dctx.decode([d])
        ids, w = d_rec.take(1)
        own_ids.append(ids[0])
        own_w.append(w[0])
        d = _argmax(d_logits)
    dctx.truncate(base)
    row.update(draft_same_ids=same_ids[0], draft_same_w=same_w[0], draft_own_ids=np.stack(own_ids),
               draft_own_w=np.stack(own_w), draft_tokens=np.asarray(drafted, np.int32))
    if verify:
        t_base = ctx.n_past
        rec.clear()
        # logits for every row: the last layer's FFN runs only for output rows, and a verify step needs them all
        ctx.decode(drafted, logits_all=True)
        v_ids, v_w = rec.take(k)
        ctx.truncate(t_base)
        row.update(verify_ids=v_ids, verify_w=v_w)


def _router_logit_error(routers: Routers, x: dict[int, np.ndarray], logits: dict[int, np.ndarray]) -> float:
    """Our numpy router against llama.cpp's own ffn_moe_logits on the first row: a check that the GGUF weights we
    read are the ones the graph used."""
    err = 0.0
    for j, xj in x.items():
        lg = logits.get(j)
        if lg is None:
            continue
        err = max(err, float(np.abs(xj[-1:] @ routers.weight[j].T - lg[-1:]).max()))
    return err


def _draft_match(drafted: np.ndarray, output_ids: np.ndarray, prompt_index: np.ndarray) -> np.ndarray:
    """1/0 where d_h is/isn't the target's g_{t+h} (= output_ids[t+h-1] in the same prompt), -1 where unknown."""
    T, K = drafted.shape
    match = np.full((T, K), -1, np.int8)
    for h in range(1, K + 1):
        src = np.arange(T) + h - 1
        ok = src < T
        same = np.zeros(T, bool)
        same[ok] = prompt_index[src[ok]] == prompt_index[ok]
        ok = same
        match[ok, h - 1] = (drafted[ok, h - 1] == output_ids[src[ok]]).astype(np.int8)
    return match


def _mean_known(m: np.ndarray) -> float | None:
    known = m[m >= 0]
    return float(known.mean()) if known.size else None


