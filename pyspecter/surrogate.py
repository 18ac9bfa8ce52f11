"""Surrogate experts: an approximate, opt-in way to serve a miss without waiting for the slow tier.

Each routed expert keeps, in fast memory, the ``keep`` fraction of its hidden neurons that matter most (measured
per expert on calibration text, as for narrowed drafts). They are stored as the target's own quantized bytes —
gate/up rows and whole down-projection blocks — so serving one is a copy into a slot with the dropped neurons'
bytes zeroed (an all-zero block is 0.0 in every ggml type used for weights), not a re-quantization. SPICE's LoRE
does this with a low-rank factorisation; a neuron subset is what a llama.cpp slot can hold without new kernels.

The output is no longer the target's: ``measure`` reports the perplexity cost next to the exact mode, and the
mode is never on by default.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from pyspecter import native
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout, read_layout
from pyspecter.paths import content_key, models_dir

_KINDS = ("gate", "up", "down")


def _group(layout: ModelLayout) -> int:
    """Neurons per selectable unit: one quantization block of the down projection's rows (1 for float types)."""
    import gguf

    t = layout.layers[0].tensors["down"]
    return int(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.ggml_type]][0])


def select_neurons(path: Path, keep: float, n_calib: int = 512, progress: bool = True) -> dict[int, np.ndarray]:
    """Per MoE layer: int32 [n_expert, n_groups_kept], the most important neuron groups of each expert, sorted.
    Cached next to the models, keyed by the model file's identity and the options."""
    import gguf
    from gguf.quants import dequantize

    from pyspecter.models.draft import _calibration_tokens, _ffn_inputs, _neuron_importance

    path = Path(path)
    lay = read_layout(path).require_moe()
    if any(set(L.tensors) != set(_KINDS) for L in lay.layers):
        raise SpecterError(f"{path}: surrogates need separate gate/up/down expert tensors")
    if not 0 < keep <= 1:
        raise SpecterError(f"surrogate width must be in (0, 1], got {keep}")
    st = path.stat()
    key = content_key(str(path.resolve()), str(st.st_size), str(st.st_mtime_ns), f"{keep:g}", str(n_calib),
                      Path(__file__).read_bytes())
    cached = models_dir() / f"surrogate-{path.stem}-{key}.npz"
    if cached.exists():
        z = np.load(cached)
        return {int(k): z[k] for k in z.files}
    g = _group(lay)
    n_ff = lay.layers[0].tensors["down"].shape[2]
    n_groups = n_ff // g
    n_keep = max(1, round(n_groups * keep))
    if progress:
        print(f"surrogate: ranking {lay.n_expert}x{n_ff} expert neurons per layer (groups of {g}), keeping "
              f"{n_keep}/{n_groups} groups ...", file=sys.stderr, flush=True)
    xs, logits = _ffn_inputs(path, _calibration_tokens(path, n_calib))
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    out: dict[int, np.ndarray] = {}
    for i, L in enumerate(lay.layers):
        w = {k: dequantize(np.asarray(by_name[t.name].data), by_name[t.name].tensor_type).astype(np.float32)
             for k, t in L.tensors.items()}
        ids = np.argsort(-logits[L.index], axis=1)[:, : lay.n_expert_used]
        routed = [np.nonzero((ids == e).any(axis=1))[0] for e in range(lay.n_expert)]
        score = _neuron_importance(w, xs[L.index], routed).reshape(lay.n_expert, n_groups, g).sum(axis=2)
        out[L.index] = np.sort(np.argsort(-score, axis=1)[:, :n_keep], axis=1).astype(np.int32)
        if progress:
            print(f"\rsurrogate: {i + 1}/{len(lay.layers)} layers", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    tmp = cached.with_suffix(".tmp.npz")
    np.savez(tmp, **{str(k): v for k, v in out.items()})
    tmp.replace(cached)
    return out


class Surrogates:
    """The kept bytes of every expert, in RAM, and how to put one into a slot."""

    def __init__(self, layout: ModelLayout, groups: dict[int, np.ndarray]) -> None:
        self.layout = layout
        self.group = g = _group(layout)
        self.data: dict[int, dict[str, np.ndarray]] = {}  # layer -> kind -> [E, ...kept bytes]
        self.rows: dict[int, np.ndarray] = {}  # layer -> [E, kept neurons]
        self.groups = groups
        self.nbytes = 0
        mm = np.memmap(layout.path, dtype=np.uint8, mode="r")
        for L in layout.layers:
            gr = groups[L.index]
            neurons = (gr[:, :, None] * g + np.arange(g)).reshape(gr.shape[0], -1)
            self.rows[L.index] = neurons
            per = {}
            for kind, t in L.tensors.items():
                E, n_rows, _ = t.shape
                raw = mm[t.offset: t.offset + E * t.expert_bytes].reshape(E, n_rows, -1)
                if kind == "down":  # [E, n_embd, n_groups, group bytes]: keep whole blocks
                    blocks = raw.reshape(E, n_rows, t.shape[2] // g, -1)
                    per[kind] = np.ascontiguousarray(np.take_along_axis(blocks, gr[:, None, :, None], axis=2))
                else:  # [E, n_ff, row bytes]: keep whole rows
                    per[kind] = np.ascontiguousarray(np.take_along_axis(raw, neurons[:, :, None], axis=1))
                self.nbytes += per[kind].nbytes
            self.data[L.index] = per
        del mm
        self._scratch: dict[str, np.ndarray] = {}

    def write(self, api: native.SlotAPI, model_ptr, il: int, expert: int, slot: int) -> None:
        """Expand expert ``expert`` of layer ``il`` into ``slot`` (dropped neurons zero)."""
        L = self.layout.layer(il)
        for kind, t in L.tensors.items():
            E, n_rows, _ = t.shape
            # one scratch buffer per tensor kind, shared by all layers (their experts have the same size here;
            # a bigger one is allocated when not)
            buf = self._scratch.get(kind)
            if buf is None or buf.size < t.expert_bytes:
                buf = self._scratch[kind] = np.zeros(t.expert_bytes, np.uint8)
            buf = buf[: t.expert_bytes]
            buf[:] = 0
            if kind == "down":
                view = buf.reshape(n_rows, t.shape[2] // self.group, -1)
                view[:, self.groups[il][expert], :] = self.data[il][kind][expert]
            else:
                view = buf.reshape(n_rows, -1)
                view[self.rows[il][expert]] = self.data[il][kind][expert]
            rc = api.write_slot(model_ptr, il, native.KIND_NAMES[kind], slot, buf.ctypes.data, t.expert_bytes)
            if rc != 0:
                raise SpecterError(f"write of a surrogate into slot {slot} of layer {il} failed ({rc})")


def perplexity_delta(path: Path, keep: float, n_slots: int, tier: str = "ram", n_tokens: int = 256,
                     progress: bool = True) -> dict:
    """Perplexity of held-out text decoded one token at a time through ``n_slots`` slots per layer on ``tier``:
    exact misses (wait) against surrogate misses. The surrogate mode's price, measured; cached by the model
    file's identity and the options (the tier matters: on a slow one fewer uploads land in time)."""
    from pyspecter.cache import ExpertCache, make_tier
    from pyspecter.models.smol import heldout_text

    path = Path(path)
    st = path.stat()
    key = content_key(str(path.resolve()), str(st.st_size), str(st.st_mtime_ns), f"{keep:g}", str(n_slots), tier,
                      str(n_tokens), Path(__file__).read_bytes())
    cached = models_dir() / f"surrogate-ppl-{path.stem}-{key}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    lay = read_layout(path).require_moe()
    sur = Surrogates(lay, select_neurons(path, keep, progress=progress))
    if progress:
        print(f"surrogate: measuring its perplexity cost on {n_tokens} held-out tokens ...", file=sys.stderr,
              flush=True)
    res = {}
    for mode in ("wait", "surrogate"):
        with native.Model(path) as m:
            toks = m.tokenize(heldout_text(), add_special=True)[:n_tokens]
            cache = ExpertCache(m, lay, n_slots, miss=mode, tier=make_tier(tier),
                                surrogates=sur if mode == "surrogate" else None)
            nll = 0.0
            with native.Context(m, n_ctx=len(toks) + 8, n_threads=2) as ctx:
                for i in range(len(toks) - 1):
                    lg = ctx.decode([toks[i]]).astype(np.float64)
                    mx = lg.max()
                    nll += mx + math.log(np.exp(lg - mx).sum()) - lg[toks[i + 1]]
                cache.check()
            c = cache.counters()
            cache.close()
        res[mode] = {"ppl": math.exp(nll / (len(toks) - 1)), "hit_rate": c["hit_rate"],
                     "surrogate_uses": c["surrogate_uses"], "needed": c["needed"]}
    res["keep"], res["slots"], res["tokens"] = keep, n_slots, n_tokens
    res["surrogate_mib"] = sur.nbytes / 2**20
    res["ppl_delta"] = res["surrogate"]["ppl"] - res["wait"]["ppl"]
    res["tier"] = tier
    cached.write_text(json.dumps(res))
    return res


def describe(res: dict) -> str:
    return (f"surrogate mode (approximate): perplexity {res['surrogate']['ppl']:.3f} vs exact {res['wait']['ppl']:.3f} "
            f"({res['ppl_delta']:+.3f}) on {res['tokens']} held-out tokens at {res['slots']} slots/layer on "
            f"{res['tier']}, width {res['keep']:g}, {res['surrogate_mib']:.0f} MiB of surrogates, "
            f"{100 * res['surrogate']['surrogate_uses'] / max(res['surrogate']['needed'], 1):.1f}% of experts "
            "served by one")


