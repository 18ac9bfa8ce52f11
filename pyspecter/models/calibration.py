"""Calibration: reading a MoE model's real activations through llama.cpp, and what they say about its experts.

Used by the model builders (a draft's narrowed experts keep their most important neurons) and by the
surrogates of ``--miss surrogate`` (which neurons an expert's surrogate keeps). Offline work: the runtime never
imports this module; it is handed the results.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout, read_layout
from pyspecter.models.progress import done as progress_done
from pyspecter.models.progress import step as progress_step
from pyspecter.paths import atomic_path, content_key, models_dir
from pyspecter.surrogate import group_size

N_THREADS = 2
_SURROGATE_SRC = Path(__file__).resolve().parent.parent / "surrogate.py"
_KINDS = ("gate", "up", "down")


# --- observing the router input ----------------------------------------------------------------------------------

class _GgmlTensor(ctypes.Structure):
    """The pinned ggml's ``struct ggml_tensor`` (ggml/include/ggml.h), read-only. Checked against ggml_get_name
    on first use, so a different ggml layout turns the gate lookahead off instead of reading garbage."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


_GGML_TYPE_F32 = 0
_LOGITS_PREFIX = b"ffn_moe_logits-"


def _ggml_lib() -> ctypes.CDLL:
    from llama_cpp import _ggml

    lib = _ggml.libggml
    lib.ggml_get_name.restype = ctypes.c_void_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_is_contiguous.restype = ctypes.c_bool
    lib.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
    # through the backend, so the same read works for device tensors
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return lib


class RouterInputTap:
    """Reads each MoE layer's router input through llama.cpp's eval callback (fine for observing, docs/DESIGN.md).

    The scheduler asks about every node; we want only ``ffn_moe_logits-L``. Saying yes splits the graph there and
    syncs, which costs time but no exactness: the same ops run on the same data."""

    def __init__(self, layout: ModelLayout) -> None:
        import llama_cpp

        self.pos = {L.index: j for j, L in enumerate(layout.layers)}
        self.active = False
        self.error: str | None = None
        # MoE layer position -> [n_tokens, n_embd] router inputs, [n_tokens, n_expert] logits, one per ubatch
        self.x: dict[int, list[np.ndarray]] = {}
        self.logits: dict[int, list[np.ndarray]] = {}
        self.router_names: dict[int, str] = {}
        self._lib = _ggml_lib()
        self._checked = False
        self.cb = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)

    def _read(self, addr: int) -> np.ndarray:
        t = _GgmlTensor.from_address(addr)
        if t.type != _GGML_TYPE_F32 or not self._lib.ggml_is_contiguous(addr) or t.ne[2] != 1 or t.ne[3] != 1:
            raise SpecterError(f"{t.name.decode()}: not a contiguous 2-D F32 tensor")
        out = np.empty((t.ne[1], t.ne[0]), np.float32)
        self._lib.ggml_backend_tensor_get(addr, out.ctypes.data, 0, out.nbytes)
        return out

    def _on_eval(self, addr, ask, _ud) -> bool:
        # Must answer True after computing a node it asked for: False there aborts the rest of the graph split.
        try:
            if not self.active or self.error:
                return not ask
            t = _GgmlTensor.from_address(addr)
            if not self._checked:
                if self._lib.ggml_get_name(addr) != addr + _GgmlTensor.name.offset:
                    self.error = "ggml_tensor layout differs from the pinned one"
                    return not ask
                self._checked = True
            name = t.name
            if not name.startswith(_LOGITS_PREFIX):
                return not ask
            if ask:
                return True
            j = self.pos.get(int(name[len(_LOGITS_PREFIX):]))
            if j is not None:
                self.x.setdefault(j, []).append(self._read(t.src[1]))
                self.logits.setdefault(j, []).append(self._read(addr))
                self.router_names[j] = _GgmlTensor.from_address(t.src[0]).name.decode()
        except BaseException as e:  # noqa: BLE001  (must not unwind into C)
            self.error = f"{type(e).__name__}: {e}"
        return True

    def take(self) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """Router inputs and llama.cpp's router logits by MoE layer position, since the last take (the rows of
        every ubatch, in order)."""
        x = {j: np.concatenate(v) for j, v in self.x.items()}
        logits = {j: np.concatenate(v) for j, v in self.logits.items()}
        self.x, self.logits = {}, {}
        return x, logits


# --- calibration text and what it activates -------------------------------------------------------------------

def calibration_tokens(model_path: Path, n: int) -> list[int]:
    """Text the importance of each expert neuron is measured on: the packaged calibration prompts for models with
    a real tokenizer; seeded random ids for the random fixtures, whose 'text' is noise anyway."""
    import llama_cpp

    from pyspecter import native
    from pyspecter.prompts import calibration_tokens as text_tokens

    with native.Model(model_path) as m:
        if llama_cpp.llama_model_chat_template(m.ptr, None):
            return text_tokens(m, n)
        rng = np.random.default_rng(0)
        return [int(x) for x in rng.integers(1, m.n_vocab, size=n)]


def ffn_inputs(model_path: Path, tokens: list[int]) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Each MoE layer's expert input (its normalised FFN input) and router logits for ``tokens``, by layer index,
    read from llama.cpp's own forward pass."""
    from pyspecter import native

    lay = read_layout(model_path).require_moe()
    tap = RouterInputTap(lay)
    with native.Model(model_path) as m, \
            native.Context(m, n_ctx=len(tokens) + 8, n_batch=512, n_threads=N_THREADS, cb_eval=tap.cb) as ctx:
        tap.active = True
        ctx.decode(tokens, logits_all=True)
        tap.active = False
    if tap.error:
        raise SpecterError(f"{model_path}: could not read the FFN inputs ({tap.error})")
    x, logits = tap.take()
    return ({L.index: x[j] for j, L in enumerate(lay.layers) if j in x},
            {L.index: logits[j] for j, L in enumerate(lay.layers) if j in logits})


def neuron_importance(w: dict[str, np.ndarray], x: np.ndarray, routed: list[np.ndarray]) -> np.ndarray:
    """[n_expert, n_ff] score of each hidden neuron of each expert: mean |activation| on the tokens routed to
    that expert (all of the layer's tokens when fewer than 16 were) times the norm of its output column. Like
    Wanda's |W|·||x||, measured on the neuron's real inputs rather than assumed from the weights alone."""
    gate, up, down = w["gate"], w["up"], w["down"]  # [E, ff, d], [E, ff, d], [E, d, ff]
    out = np.empty(gate.shape[:2], np.float32)
    for e in range(gate.shape[0]):
        xe = x[routed[e]] if len(routed[e]) >= 16 else x
        g, u = xe @ gate[e].T, xe @ up[e].T
        act = g / (1.0 + np.exp(-np.clip(g, -60, 60))) * u  # SiLU(gate)·up; a score, so gpt-oss's clamp is moot
        out[e] = np.abs(act).mean(axis=0) * np.linalg.norm(down[e], axis=0)
    return out


def select_neurons(path: Path, keep: float, n_calib: int = 512, progress: bool = True) -> dict[int, np.ndarray]:
    """Per MoE layer: int32 [n_expert, n_groups_kept], the most important neuron groups of each expert, sorted.
    Cached next to the models, keyed by the model file's identity and the options."""
    import gguf
    from gguf.quants import dequantize

    path = Path(path)
    lay = read_layout(path).require_moe()
    if any(set(L.tensors) != set(_KINDS) for L in lay.layers):
        raise SpecterError(f"{path}: surrogates need separate gate/up/down expert tensors")
    if not 0 < keep <= 1:
        raise SpecterError(f"surrogate width must be in (0, 1], got {keep}")
    st = path.stat()
    key = content_key(str(path.resolve()), str(st.st_size), str(st.st_mtime_ns), f"{keep:g}", str(n_calib),
                      Path(__file__).read_bytes(), _SURROGATE_SRC.read_bytes())
    cached = models_dir() / f"surrogate-{path.stem}-{key}.npz"
    if cached.exists():
        try:
            with np.load(cached) as z:
                return {int(k): z[k] for k in z.files}
        except Exception:  # noqa: BLE001 - a damaged cache file is rebuilt, not fatal
            cached.unlink(missing_ok=True)
    g = group_size(lay)
    n_ff = lay.layers[0].tensors["down"].shape[2]
    n_groups = n_ff // g
    n_keep = max(1, round(n_groups * keep))
    if progress:
        print(f"surrogate: ranking {lay.n_expert}x{n_ff} expert neurons per layer (groups of {g}), keeping "
              f"{n_keep}/{n_groups} groups ...", file=sys.stderr, flush=True)
    xs, logits = ffn_inputs(path, calibration_tokens(path, n_calib))
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    out: dict[int, np.ndarray] = {}
    for i, L in enumerate(lay.layers):
        w = {k: dequantize(np.asarray(by_name[t.name].data), by_name[t.name].tensor_type).astype(np.float32)
             for k, t in L.tensors.items()}
        ids = np.argsort(-logits[L.index], axis=1)[:, : lay.n_expert_used]
        routed = [np.nonzero((ids == e).any(axis=1))[0] for e in range(lay.n_expert)]
        score = neuron_importance(w, xs[L.index], routed).reshape(lay.n_expert, n_groups, g).sum(axis=2)
        out[L.index] = np.sort(np.argsort(-score, axis=1)[:, :n_keep], axis=1).astype(np.int32)
        if progress:
            progress_step(f"surrogate: {i + 1}/{len(lay.layers)} layers", i + 1, len(lay.layers))
    if progress:
        progress_done()
    with atomic_path(cached, suffix=".npz") as tmp:
        np.savez(tmp, **{str(k): v for k, v in out.items()})
    return out
