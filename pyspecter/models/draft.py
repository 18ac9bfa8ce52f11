"""Draft models: the same MoE with its experts at low bits and everything else untouched.

Specter's recipe (docs/DESIGN.md, Models): a draft that predicts the target's routing keeps attention, routers
and shared experts at the target's precision, because router-side quantization error mis-routes tokens, and
takes its size savings from the experts, which are most of the bytes. The file is made by llama.cpp's own
quantize API with per-tensor type overrides, so the draft is a plain GGUF that stock llama.cpp loads.

``routing_agreement`` measures what a draft is for: on held-out text, how many of the experts the target selects
(per token, per layer) the draft selects too.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pyspecter.errors import SpecterError
from pyspecter.layout import read_layout
from pyspecter.models.calibration import calibration_tokens, ffn_inputs, neuron_importance
from pyspecter.models.progress import done as progress_done
from pyspecter.models.progress import step as progress_step
from pyspecter.paths import build_lock, check_free, content_key, models_dir

__all__ = ["EXPERT_PATTERN", "build_smol_moe_draft", "make_draft", "quantize_overrides", "routing_agreement",
           "routing_trace", "shared_expert_bytes", "smol_moe_draft_path"]

N_THREADS = 2
# Every routed-expert matmul weight in llama.cpp's naming; shared experts (``*_shexp``) are not matched.
EXPERT_PATTERN = r"^blk\.\d+\.ffn_(gate_up|gate|up|down)_exps\.weight$"
_EXPERT_RE = re.compile(EXPERT_PATTERN)

# Types llama.cpp refuses to produce without an importance matrix (llama-quant.cpp, tensor_requires_imatrix).
IMATRIX_TYPES = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"})
# Target types we accept: ones llama.cpp can quantize to and gguf-py (hence read_layout) can read back.
# (This llama.cpp also has Q2_0, but gguf 0.19 cannot parse files containing it.)
QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
               "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "TQ1_0", "TQ2_0", "MXFP4", *sorted(IMATRIX_TYPES))


def _ggml_type(name: str) -> int:
    from gguf import GGMLQuantizationType

    key = name.upper()
    if key not in QUANT_TYPES:
        raise SpecterError(f"unsupported tensor type {name!r} (choose from {', '.join(QUANT_TYPES)})")
    if key in IMATRIX_TYPES:
        raise SpecterError(f"{key} needs an importance matrix, which make_draft does not take; "
                           "use a K-quant such as Q2_K or Q3_K, or IQ4_XS / IQ4_NL")
    return int(GGMLQuantizationType[key])


def make_draft(model: Path, out: Path, experts_type: str = "Q2_K", rest_type: str | None = None,
               ffn_keep: float = 1.0, progress: bool = True) -> Path:
    """Write a draft of MoE ``model`` to ``out``: routed-expert weights re-quantized to ``experts_type``; every
    other tensor kept byte-for-byte (``rest_type=None``) or quantized to ``rest_type`` (norms, routers and other
    1-D tensors always stay as they are). ``ffn_keep`` < 1 first narrows every expert to that fraction of its
    most important hidden neurons (prune_experts). Returns ``out``.

    Where a row is not a whole number of the type's blocks (e.g. SmolLM2's 576-wide gate/up rows and Q2_K's
    256-blocks), llama.cpp falls back to a compatible type (Q2_K/Q3_K -> Q4_0); read the result with read_layout.
    """
    model, out = Path(model), Path(out)
    exp_t = _ggml_type(experts_type)
    rest_t = _ggml_type(rest_type) if rest_type is not None else None
    if ffn_keep >= 1:
        return _quantize_draft(model, model, out, experts_type, exp_t, rest_t, "", progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_free(out, 2 * model.stat().st_size)  # the narrowed copy, then the draft: neither bigger than the model
    fd, narrow_name = tempfile.mkstemp(prefix=f".{out.stem}-narrow-", suffix=".gguf.tmp", dir=out.parent)
    os.close(fd)
    try:
        narrow = prune_experts(model, Path(narrow_name), ffn_keep, progress=progress)
        return _quantize_draft(narrow, model, out, experts_type, exp_t, rest_t, f", {ffn_keep:g} width", progress)
    finally:
        Path(narrow_name).unlink(missing_ok=True)


def _quantize_draft(model: Path, target: Path, out: Path, experts_type: str, exp_t: int, rest_t: int | None,
                    label: str, progress: bool) -> Path:
    lay = read_layout(model).require_moe()
    tgt = read_layout(target) if target != model else lay
    # general.name holds at most 127 bytes here; the distinguishing part goes first in case the tail is cut
    name = f"draft (experts {experts_type.upper()}{label}) of {tgt.name}"
    if progress:
        print(f"draft: quantizing experts of {model.name} to {experts_type.upper()} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    quantize_overrides(model, out, [(EXPERT_PATTERN, exp_t)], name=name, rest_type=rest_t)
    if progress:
        d = read_layout(out)
        print(f"draft: wrote {out} ({out.stat().st_size / 2**20:.0f} MiB, expert bytes "
              f"{d.expert_total_bytes / max(tgt.expert_total_bytes, 1):.0%} of the target's) "
              f"in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    return out


def quantize_overrides(model: Path, out: Path, retype: list[tuple[str, int | str]], *, name: str,
                       rest_type: int | None = None, progress: bool = False) -> Path:
    """Write ``model`` to ``out`` through llama.cpp's quantizer: tensors whose names match a ``retype`` pattern
    (first match wins) re-quantized to its type; every other tensor kept at its own type (or ``rest_type``).
    ``name`` becomes general.name. Returns ``out``; the file appears whole or not at all."""
    import gguf
    import llama_cpp

    from pyspecter.native import llama_lib, quiet_logs

    model, out = Path(model), Path(out)
    reader = gguf.GGUFReader(model)
    ftype = reader.fields.get("general.file_type")
    # ftype must name a quantized default type, or llama.cpp never consults the overrides; the source's own ftype
    # also keeps the output's general.file_type describing its untouched tensors.
    file_type = int(ftype.contents()) if ftype is not None else int(gguf.LlamaFileType.MOSTLY_Q8_0)
    if file_type in (int(gguf.LlamaFileType.ALL_F32), int(gguf.LlamaFileType.MOSTLY_F16),
                     int(gguf.LlamaFileType.MOSTLY_BF16)):
        file_type = int(gguf.LlamaFileType.MOSTLY_Q8_0)

    # Overrides are tried in order, first match wins: the retyped patterns first, then every other tensor pinned
    # to its own type (exact names, so nothing is re-quantized or re-chosen by llama.cpp's mixture heuristics).
    overrides: list[tuple[str, int]] = [(pat, _ggml_type(typ) if isinstance(typ, str) else int(typ))
                                        for pat, typ in retype]
    matchers = [re.compile(pat) for pat, _ in retype]
    for t in reader.tensors:
        if any(m.match(t.name) for m in matchers):
            continue
        overrides.append(("^" + re.escape(t.name) + "$", rest_type if rest_type is not None else int(t.tensor_type)))
    del reader

    arr = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()
    keep = []  # the C side only borrows the pattern strings
    for i, (pat, typ) in enumerate(overrides):
        b = pat.encode()
        keep.append(b)
        arr[i].pattern = b
        arr[i].type = typ
    arr[len(overrides)].pattern = None  # terminator

    kv = (llama_cpp.llama_model_kv_override * 2)()
    kv[0].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR
    kv[0].key = b"general.name"
    kv[0].value.val_str = name.encode()[:127].decode("utf-8", errors="ignore").encode()
    kv[1].key = b""  # terminator

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = N_THREADS
    params.ftype = file_type
    params.allow_requantize = True  # the source tensors are already quantized
    params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    params.kv_overrides = ctypes.cast(kv, ctypes.POINTER(llama_cpp.llama_model_kv_override))

    llama_lib()
    quiet_logs()
    out.parent.mkdir(parents=True, exist_ok=True)
    check_free(out, model.stat().st_size)  # re-quantized tensors: never bigger than the source's
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.stem}-", suffix=".gguf.tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    if progress:
        print(f"quantizing {model.name} ...", file=sys.stderr, flush=True)
    try:
        rc = llama_cpp.llama_model_quantize(str(model).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise SpecterError(f"{model}: llama.cpp's quantizer failed on it (rc {rc})")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# --- narrow experts ---------------------------------------------------------------------------------------------

# the key that sizes routed experts, per arch; llama (Mixtral layout) sizes them with the dense width
_EXPERT_FF_KEYS = ("{arch}.expert_feed_forward_length", "{arch}.feed_forward_length")
_SWIGLU_KINDS = ("gate", "up", "down")


def prune_experts(model: Path, out: Path, keep: float, n_calib: int = 512, progress: bool = True) -> Path:
    """Write ``model`` with every routed expert narrowed to its ``keep`` most important hidden neurons (measured
    per expert on calibration text, see neuron_importance), as F32; every other tensor byte-for-byte. The
    router, attention and shared experts are untouched, so routing still reads the full model's signals.

    This is the draft's second size lever after bits: at 4.5 bits an expert can shrink no further (SmolLM2's
    576-wide rows rule out the 256-block K- and IQ-quants), but a quarter of its neurons costs a quarter of
    the bytes. Narrowing uses nothing about how a model's experts relate to each other."""
    import gguf
    from gguf.quants import dequantize

    model, out = Path(model), Path(out)
    lay = read_layout(model).require_moe()
    if not 0 < keep <= 1:
        raise SpecterError(f"--ffn-keep must be in (0, 1], got {keep}")
    reader = gguf.GGUFReader(model)
    arch = lay.arch
    ff_key = next((k.format(arch=arch) for k in _EXPERT_FF_KEYS if k.format(arch=arch) in reader.fields), None)
    by_name = {t.name: t for t in reader.tensors}
    n_ff = int(by_name[f"blk.{lay.layers[0].index}.ffn_gate_exps.weight"].shape[1]) \
        if f"blk.{lay.layers[0].index}.ffn_gate_exps.weight" in by_name else 0
    if ff_key is None or n_ff == 0 or any(set(L.tensors) != set(_SWIGLU_KINDS) for L in lay.layers):
        raise SpecterError(f"{model}: narrowing needs separate gate/up/down expert tensors and an expert width key")
    if ff_key.endswith(".feed_forward_length") and len(lay.layers) != int(reader.fields[f"{arch}.block_count"]
                                                                            .contents()):
        raise SpecterError(f"{model}: its experts share feed_forward_length with dense layers; cannot narrow them")
    # whole 32-blocks, so the quantizer keeps every row type it would use for the full width
    n_keep = max(32, int(round(n_ff * keep / 32)) * 32)
    n_keep = min(n_keep, n_ff)

    tokens = calibration_tokens(model, n_calib)
    if progress:
        print(f"draft: measuring {lay.n_expert}x{n_ff} expert neurons per layer on {len(tokens)} tokens, keeping "
              f"{n_keep} ...", file=sys.stderr, flush=True)
    xs, logits = ffn_inputs(model, tokens)

    def dense(name: str) -> np.ndarray:
        t = by_name[name]
        return dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32, copy=False)

    w = gguf.GGUFWriter(out, arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the reader's header pseudo-keys; the writer sets the architecture itself
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        val = n_keep if key == ff_key else f.contents()
        w.add_key_value(key, val, f.types[0], sub_type=sub)

    expert_re = {f"blk.{L.index}.ffn_{k}_exps.{s}": (L.index, k, s) for L in lay.layers for k in _SWIGLU_KINDS
                 for s in ("weight", "bias")}
    for t in reader.tensors:
        hit = expert_re.get(t.name)
        if hit is None:
            a = np.asarray(t.data)
            w.add_tensor_info(t.name, a.shape, a.dtype, int(t.n_bytes), raw_dtype=t.tensor_type)
            continue
        _, kind, suffix = hit
        ne = [int(v) for v in t.shape]  # ggml order: ne0 first
        if suffix == "weight":
            ne[0 if kind == "down" else 1] = n_keep
        elif kind != "down":
            ne[0] = n_keep  # gate/up bias [n_ff, E]; the down bias [n_embd, E] keeps its size
        shape = tuple(reversed(ne))
        w.add_tensor_info(t.name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)

    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        done: dict = {}  # the layer being written: its index, kept neuron ids and narrowed tensors
        n_done = 0
        for t in reader.tensors:
            hit = expert_re.get(t.name)
            if hit is None:
                w.write_tensor_data(np.asarray(t.data))
                continue
            il, kind, suffix = hit
            if not done or done.get("layer") != il:  # first expert tensor of a layer: narrow all of them
                p = f"blk.{il}.ffn_"
                full = {k: dense(p + k + "_exps.weight") for k in _SWIGLU_KINDS}
                ids = np.argsort(-logits[il], axis=1)[:, : lay.n_expert_used]
                routed = [np.nonzero((ids == e).any(axis=1))[0] for e in range(lay.n_expert)]
                top = np.sort(np.argsort(-neuron_importance(full, xs[il], routed), axis=1)[:, :n_keep], axis=1)
                take = np.arange(lay.n_expert)[:, None]
                done = {"layer": il, "top": top,
                        "gate": full["gate"][take, top], "up": full["up"][take, top],
                        "down": np.take_along_axis(full["down"], top[:, None, :], axis=2)}
                n_done += 1
                if progress:
                    progress_step(f"draft: narrowed {n_done}/{len(lay.layers)} layers", n_done, len(lay.layers))
            if suffix == "weight":
                a = done[kind]
            else:
                b = dense(t.name)  # [E, n_ff] for gate/up, [E, n_embd] for down
                a = b if kind == "down" else np.take_along_axis(b, done["top"], axis=1)
            w.write_tensor_data(np.ascontiguousarray(a, dtype=np.float32))
        if progress:
            progress_done()
    finally:
        w.close()
    return out


def smol_moe_draft_path(experts_type: str = "Q2_K", ffn_keep: float = 1.0) -> Path:
    """Where build_smol_moe_draft(experts_type, ffn_keep) puts (or has put) its file. Needs the native library's
    Python package (its version is in the key), as the build does; builds nothing."""
    import llama_cpp

    from pyspecter.models.smol import smol_moe_path

    t = experts_type.upper()
    key = content_key(smol_moe_path().name, t, f"{ffn_keep:g}", Path(__file__).read_bytes(), llama_cpp.__version__)
    width = "" if ffn_keep >= 1 else f"-w{ffn_keep:g}"
    return models_dir() / f"smol-moe-draft-{t}{width}-{key}.gguf"


def build_smol_moe_draft(experts_type: str = "Q2_K", ffn_keep: float = 1.0, progress: bool = True) -> Path:
    """A draft of smol-moe (built first if needed): experts at ``experts_type``, narrowed to ``ffn_keep`` of
    their neurons, the rest unchanged. Cached by content key (the target file's key, the options, this file's
    source, the llama.cpp version)."""
    from pyspecter.models.smol import build_smol_moe

    target = build_smol_moe(progress=progress)
    out = smol_moe_draft_path(experts_type, ffn_keep)
    if out.exists():
        return out
    with build_lock(out):  # a build of this key killed before us left its temporary files: removed here
        if out.exists():
            return out
        return make_draft(target, out, experts_type=experts_type, ffn_keep=ffn_keep, progress=progress)


def shared_expert_bytes(path: Path) -> int:
    """Bytes of a GGUF's shared-expert tensors (``*_shexp``): FFN weights every token uses, outside the slots."""
    import gguf

    pat = re.compile(r"^blk\.\d+\.ffn_\w+_shexp\.weight$")
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if pat.match(t.name))


# --- routing -------------------------------------------------------------------------------------------------------

def routing_trace(path: Path, tokens: list[int]) -> np.ndarray:
    """Experts selected at every MoE layer for every token: int32 [n_moe_layers, n_tokens, n_used], in layer order.

    Uses the patched library's routing hook (slots enabled, none resident, so every expert is computed on the
    host as stock llama.cpp would). Logits are requested for every token: llama skips the last layer's FFN for
    rows without output, and so would the hook."""
    from pyspecter import native
    from pyspecter.native.hooks import Hooks

    lay = read_layout(path).require_moe()
    calls: dict[int, list[np.ndarray]] = {}

    def on_route(il, n_tokens, n_used, ids, _weights) -> None:
        calls.setdefault(int(il), []).append(
            np.ctypeslib.as_array(ids, shape=(n_tokens * n_used,)).reshape(n_tokens, n_used).copy())

    with native.Model(path) as model:
        hooks = Hooks(model, on_route, n_slots=lay.n_expert)  # slots never written: they take no memory
        with native.Context(model, n_ctx=len(tokens) + 8, n_batch=512, n_threads=N_THREADS) as ctx:
            ctx.decode(tokens, logits_all=True)
        hooks.close()
        hooks.check()
    layers = sorted(calls)
    trace = np.stack([np.concatenate(calls[il]) for il in layers])
    if trace.shape[1] != len(tokens):
        raise SpecterError(f"{path}: routing hook saw {trace.shape[1]} tokens per layer, expected {len(tokens)}")
    return trace


def routing_agreement(target: Path, draft: Path, text: str | None = None) -> dict:
    """On held-out text (default: pyspecter/data/heldout.txt), the fraction of the target's selected experts that
    the draft selects too, per MoE layer and overall; also the fraction of (token, layer) pairs whose whole
    top-k sets match, and the chance level (n_used / n_expert)."""
    from pyspecter import native
    from pyspecter.models.smol import heldout_text

    text = heldout_text() if text is None else text
    with native.Model(target) as m:
        tokens = m.tokenize(text, add_special=True, parse_special=False)
    t = routing_trace(target, tokens)
    d = routing_trace(draft, tokens)
    if t.shape != d.shape:
        raise SpecterError(f"target and draft route differently shaped ({t.shape} vs {d.shape}); same model?")
    n_layers, n_tok, k = t.shape
    n_expert = read_layout(target).n_expert
    # per (layer, token): |target set ∩ draft set| / k
    hit = (t[:, :, :, None] == d[:, :, None, :]).any(axis=3).sum(axis=2) / k
    same_set = (np.sort(t, axis=2) == np.sort(d, axis=2)).all(axis=2)
    return {
        "tokens": n_tok, "n_used": k, "n_expert": n_expert, "chance": k / n_expert,
        "overall": float(hit.mean()), "per_layer": [float(x) for x in hit.mean(axis=1)],
        "same_set": float(same_set.mean()),
    }
