"""What learned routing predictors are fitted on: each MoE layer's router input and llama.cpp's routing, recorded
through the patched library's hooks on calibration (or held-out) text.

Recording: the input hook hands Python each MoE layer's router input x_j (the normalised FFN input) once per
ubatch; every token is marked as output, because the last layer's FFN runs only for output rows. The route hook
runs too: its ids are the truth held-out scores are measured against, and they check that the numpy router on
the recorded x reproduces llama.cpp's choice (a wrong tensor or a misaligned row would show there first).

Text: for a model with a chat template, the packaged "tune" prompts' chat turns with long greedy answers, then the
calibration prompts (data/calibration_prompts.txt, 60 of them) as chat turns and as bare text, each followed by
the model's own greedy continuation (later passes sample it, for variety); held-out: the packaged held-out prose
and the "eval" prompts' chat turns, with continuations.
Random-weight fixtures get seeded random token ids (their text is noise anyway), another seed for held-out.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from pyspecter.router_ahead import Routers, read_routers

TUNE_ANSWER_TOKENS = 256


class Progress:
    """A progress bar on stderr that advances by any step (models/progress.py's lines assume steps of one). A file
    or pipe gets whole lines about every 10%, and at least every QUIET_S seconds, from a watch thread when no step
    came (one decode of a long prompt on a busy machine can take that long): on a busy machine a tenth of a fit's
    recording can take half a minute, and a log silent that long looks hung."""

    QUIET_S = 5.0

    def __init__(self, what: str, total: int, unit: str) -> None:
        import threading

        self.what, self.total, self.unit = what, max(total, 1), unit
        self.t0, self.shown, self.i = time.monotonic(), -1, 0
        self.last = self.t0
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._watch = threading.Thread(target=self._heartbeat, daemon=True)
        self._watch.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(1.0):
            if time.monotonic() - self.last >= self.QUIET_S:
                self.update(self.i)

    def update(self, i: int) -> None:
        from pyspecter.models.progress import step

        with self._lock:
            self.i = i
            tenth = i * 10 // self.total
            now = time.monotonic()
            if sys.stderr.isatty() or tenth != self.shown or now - self.last >= self.QUIET_S:
                self.shown, self.last = tenth, now
                filled = i * 30 // self.total
                step(f"{self.what} [{'#' * filled}{'.' * (30 - filled)}] {i}/{self.total} {self.unit}, "
                     f"{now - self.t0:.0f}s", 1, 1)

    def close(self) -> None:
        from pyspecter.models.progress import done

        self._stop.set()
        self._watch.join()
        done()


class _Recorder:
    """Every MoE layer's router input (input hook) and llama.cpp's chosen experts (route hook), in decode order."""

    def __init__(self, model, layout) -> None:
        from pyspecter.native.hooks import Hooks

        self.pos = {L.index: j for j, L in enumerate(layout.layers)}
        self.n_used = layout.n_expert_used
        self.x: list[list[np.ndarray]] = [[] for _ in layout.layers]
        self.ids: list[list[np.ndarray]] = [[] for _ in layout.layers]
        # one slot per layer, never filled: every row stays on the host path (stock computation)
        self.hooks = Hooks(model, self._on_route, n_slots=1, on_input=self._on_input)

    def _on_input(self, il: int, x: np.ndarray) -> None:
        j = self.pos.get(il)
        if j is not None:
            self.x[j].append(np.array(x, np.float32))  # the view dies with the call

    def _on_route(self, il, n_tokens, n_used, ids_p, _w_p) -> None:
        j = self.pos.get(il)
        if j is not None:
            n = n_tokens * n_used
            self.ids[j].append(np.ctypeslib.as_array(ids_p, shape=(n,)).reshape(n_tokens, n_used).copy())

    def take(self) -> tuple[list[np.ndarray], np.ndarray]:
        """(X: per MoE layer [rows, n_embd] float32, ids [rows, L, k]) since the last take."""
        from pyspecter.errors import SpecterError

        self.hooks.check()
        if not all(self.x) or not all(self.ids):
            raise SpecterError("the input or routing hook never reported some MoE layer (was every row an output?)")
        X = [np.concatenate(a) for a in self.x]
        ids = np.stack([np.concatenate(a) for a in self.ids], axis=1)
        if len({len(a) for a in X} | {len(ids)}) != 1:
            raise SpecterError(f"the hooks reported {[len(a) for a in X]} input rows and {len(ids)} routing rows")
        for lst in (*self.x, *self.ids):
            lst.clear()
        return X, ids

    def close(self) -> None:
        self.hooks.close()


def _continue(ctx, model, tokens: list[int], n_gen: int, rng: np.random.Generator | None,
              tick=None) -> list[int]:
    """Decode ``tokens`` with every row an output, then n_gen more tokens (greedy, or sampled when rng is given),
    stopping at end of generation. Returns the whole sequence, one entry per recorded row. ``tick(n)``: called
    after each generated token with the sequence's length so far (progress within a long answer)."""
    ctx.clear()
    logits = ctx.decode(tokens, logits_all=True)[-1]
    seq = list(tokens)
    for _ in range(n_gen):
        if rng is None:
            g = int(np.argmax(logits))
        else:
            z = np.exp((logits - logits.max()).astype(np.float64))
            g = int(rng.choice(len(z), p=z / z.sum()))
        if model.is_eog(g):
            break
        logits = ctx.decode([g])
        seq.append(g)
        if tick is not None:
            tick(len(seq))
    return seq


def _texts(model, held_out: bool) -> list[tuple[list[int], int]]:
    """(prompt tokens, tokens to generate) for the fit or held-out text (module docstring)."""
    import llama_cpp

    from pyspecter.models.smol import heldout_text
    from pyspecter.prompts import calibration_prompts, load_prompts, render_prompt

    if not llama_cpp.llama_model_chat_template(model.ptr, None):  # random-weight fixtures: noise is their text
        rng = np.random.default_rng(1 if held_out else 0)
        return [([int(t) for t in rng.integers(1, model.n_vocab, 128)], 0) for _ in range(10_000)]
    out = []
    if held_out:
        for para in (s.strip() for s in heldout_text().split("\n\n")):
            if para:
                out.append((model.tokenize(para), 32))
        for p in load_prompts(split="eval"):
            out.append((model.tokenize(render_prompt(model, p["messages"]), add_special=False), 48))
        return out
    # First, long answers to the packaged "tune" prompts (text bench never measures): the reuse maps learn how
    # soon decode comes back to an expert, and on smol-moe maps fitted on 367 rows of such answers evicted better
    # than maps fitted on 12000 rows of the calibration text alone (17.5 against 19.3 misses per token, 8 of 16)
    for p in load_prompts(split="tune"):
        out.append((model.tokenize(render_prompt(model, p["messages"]), add_special=False), TUNE_ANSWER_TOKENS))
    for line in calibration_prompts():
        out.append((model.tokenize(render_prompt(model, [{"role": "user", "content": line}]), add_special=False), 64))
        out.append((model.tokenize(line), 64))
    return out


def record(model_path: str | os.PathLike, n_tokens: int, *, held_out: bool = False, n_threads: int = 2,
           progress: bool = True) -> dict:
    """Router inputs and routing on the fit (or held-out) text, at least ``n_tokens`` rows when the text has
    them; later passes over the fit prompts sample their continuations (temperature 1, seeded) for variety.
    Rows whose whole prefix was already recorded (a shared system prompt) are kept once."""
    from pyspecter import native
    from pyspecter.layout import read_layout

    lay = read_layout(model_path).require_moe()
    X_parts: list[list[np.ndarray]] = [[] for _ in lay.layers]
    ids_parts, gen_parts, lengths, seen = [], [], [], set()
    bar = Progress(f"recording {'held-out' if held_out else 'fit'} text", n_tokens, "tokens") if progress else None
    try:
        with native.Model(model_path) as model:
            items = _texts(model, held_out)
            n_ctx = -(-(max(len(t) + g for t, g in items) + 8) // 256) * 256
            rec = _Recorder(model, lay)
            try:
                with native.Context(model, n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=n_threads) as ctx:
                    total, i = 0, 0
                    while total < n_tokens and i < 4 * len(items):
                        toks, n_gen = items[i % len(items)]
                        n_gen = min(n_gen, max(n_tokens - total - len(toks), 0))  # no answer past what is wanted
                        rng = np.random.default_rng(i) if i >= len(items) else None
                        tick = (lambda m, t=total: bar.update(min(t + m, n_tokens))) if bar is not None else None
                        seq = _continue(ctx, model, toks, n_gen, rng, tick)
                        X, ids = rec.take()
                        keep = np.ones(len(seq), bool)
                        for t in range(len(seq)):
                            pre = tuple(seq[: t + 1])
                            keep[t] = pre not in seen
                            seen.add(pre)
                        if keep.any():
                            for j in range(len(X)):
                                X_parts[j].append(X[j][keep])
                            ids_parts.append(ids[keep])
                            # rows whose next tokens are the model's own text (the last prompt row's next is too)
                            gen_parts.append((np.arange(len(seq)) >= len(toks) - 1)[keep])
                            lengths.append(int(keep.sum()))
                            total += int(keep.sum())
                        i += 1
                        if bar is not None:
                            bar.update(min(total, n_tokens))
            finally:
                rec.close()
    finally:
        if bar is not None:
            bar.close()
    X = [np.concatenate(p)[:n_tokens] for p in X_parts]
    ends = np.minimum(np.cumsum([0, *lengths]), n_tokens)
    lengths = [int(n) for n in np.diff(ends) if n > 0]
    return {"X": X, "ids": np.concatenate(ids_parts)[:n_tokens], "lengths": lengths,
            "generated": np.concatenate(gen_parts)[:n_tokens],
            "layers": [L.index for L in lay.layers], "n_expert": lay.n_expert, "n_expert_used": lay.n_expert_used,
            "arch": lay.arch}


def record_sequences(model_path: str | os.PathLike, seqs: list[tuple[list[int], int]], *, n_threads: int = 2,
                     progress: bool = True) -> dict:
    """``record``'s result for given text: (tokens, prompt length) pairs, the rest of each sequence being the
    model's own continuation. Each sequence is read in one batch (every row an output) by stock llama.cpp with the
    eval callback observing each router (calibration.RouterInputTap: its input and logits, per ubatch), where
    ``record`` decodes a token at a time through the hooks' host path; the experts are llama.cpp's logits ranked
    by the router's rule (Routers.select). Rows whose whole prefix was already recorded (a shared system prompt)
    are kept once."""
    from pyspecter import native
    from pyspecter.errors import SpecterError
    from pyspecter.layout import read_layout
    from pyspecter.models.calibration import RouterInputTap

    lay = read_layout(model_path).require_moe()
    routers = load_routers(model_path)
    L = len(lay.layers)
    X_parts: list[list[np.ndarray]] = [[] for _ in lay.layers]
    ids_parts, gen_parts, lengths, seen = [], [], [], set()
    n_ctx = -(-(max(len(t) for t, _ in seqs) + 8) // 256) * 256
    bar = Progress("recording fit text", sum(len(t) for t, _ in seqs), "tokens") if progress else None
    tap = RouterInputTap(lay)
    done = 0
    try:
        with native.Model(model_path) as model, native.Context(model, n_ctx=n_ctx, n_batch=min(n_ctx, 512),
                                                               n_threads=n_threads, cb_eval=tap.cb) as ctx:
            for seq, n_prompt in seqs:
                ctx.clear()
                tap.active = True
                ctx.decode(list(seq), logits_all=True)
                tap.active = False
                x, logits = tap.take()
                if tap.error or len(x) != L or any(len(x[j]) != len(seq) for j in range(L)):
                    raise SpecterError(f"{model_path}: the eval callback did not see every router's input "
                                       f"({tap.error or f'{len(x)} of {L} layers'})")
                keep = np.ones(len(seq), bool)
                for t in range(len(seq)):
                    pre = tuple(seq[: t + 1])
                    keep[t] = pre not in seen
                    seen.add(pre)
                if keep.any():
                    for j in range(L):
                        X_parts[j].append(x[j][keep])
                    ids_parts.append(np.stack([routers.select(j, logits[j][keep]) for j in range(L)], axis=1))
                    gen_parts.append((np.arange(len(seq)) >= n_prompt - 1)[keep])
                    lengths.append(int(keep.sum()))
                done += len(seq)
                if bar is not None:
                    bar.update(done)
    finally:
        if bar is not None:
            bar.close()
    ids = np.concatenate(ids_parts).astype(np.int32)
    return {"X": [np.concatenate(p) for p in X_parts], "ids": ids, "lengths": lengths,
            "generated": np.concatenate(gen_parts), "layers": [L_.index for L_ in lay.layers],
            "n_expert": lay.n_expert, "n_expert_used": lay.n_expert_used, "arch": lay.arch}


def load_routers(model_path: str | os.PathLike) -> Routers:
    """The routers from the GGUF (dequantized where needed)."""
    from pyspecter.layout import read_layout

    return read_routers(model_path, read_layout(model_path).require_moe())


