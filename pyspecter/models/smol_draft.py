"""smol-moe's self-draft: each layer's FFN stored once at low bits, routed by the target's own routers.

This exploits the testbed's structure, and only works for it: every smol-moe expert is the same dense FFN with its
neurons permuted (models/smol.py), so a draft needs that FFN once per layer, not sixteen times. The draft is the
target's function computed with a low-bit FFN, and each of its layers applies the target's router to the draft's
own hidden state, so the draft's tokens follow the target's and its routing predicts the target's. A user's own
MoE has distinct experts: it gets the generic recipe (models/draft.py, ``pyspecter draft``).

llama's MoE layer has no shared expert, so the draft is written as a ``granitemoe`` GGUF, whose layer is llama's
with an ungated shared expert beside the routed ones (llama.cpp's src/models/granite.cpp):

- the shared expert is the dense FFN (smol-moe's expert 0, which keeps the dense neuron order), quantized;
- the routed experts are all-zero F16 tensors of width 1: they add exactly 0 to the shared expert's output, yet
  the layer still goes through build_moe_ffn, so the patched route op reports the draft's routing as it does the
  target's;
- the router is the target's ``ffn_gate_inp``, softmax top-k as in llama;
- attention, norms and embeddings are the target's tensors byte for byte. granitemoe's attention is llama's
  (normal RoPE on the same Q/K layout, the same kq scale); its extra scales are left unset (residual, embedding)
  or set to 1 (logits: a scale by exactly 1).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from pyspecter.errors import SpecterError
from pyspecter.layout import read_layout
from pyspecter.paths import build_lock, check_free, content_key, models_dir

__all__ = ["SELF_DRAFT_ARCH", "SELF_DRAFT_TYPES", "build_smol_moe_self_draft", "smol_moe_self_draft_path"]

SELF_DRAFT_ARCH = "granitemoe"
# Types offered for the FFN. gate/up rows are 576 wide, not a whole number of the K-quants' 256-blocks, so
# llama.cpp's quantizer gives those two its compatible 32-block type (Q2_K, Q3_K -> Q4_0; Q4_K -> Q5_0); down
# (1536-wide rows) takes the K-quant. Q4_1 is the target's own type: the FFN's bytes copied, the target's
# function exactly (a check, not a realistic draft).
SELF_DRAFT_TYPES = ("Q2_K", "Q3_K", "Q4_0", "IQ4_NL", "Q4_K", "Q4_1", "Q5_0")
# The smallest that meets the bars on the eval prompts at K = 3 (acceptance >= 0.7, same-token top-2
# routing recall >= 90%, FFN <= 10% of the target's expert bytes): Q4_K, 0.84 / 94.5% / 6.5%. Q4_0 and IQ4_NL
# (5.6%) reach 0.66-0.71 and 87-89%; Q3_K 0.60 / 83%; Q2_K 0.22 / 66% (docs/PREDICTION.md).
DEFAULT_FFN_TYPE = "Q4_K"
ZERO_WIDTH = 1  # the routed experts' width: the smallest the loader accepts (F16 rows need no whole blocks)
SHEXP_PATTERN = r"^blk\.\d+\.ffn_(gate|up|down)_shexp\.weight$"


def smol_moe_self_draft_path(ffn_type: str = DEFAULT_FFN_TYPE) -> Path:
    """Where build_smol_moe_self_draft(ffn_type) puts (or has put) its file; builds nothing. Needs the native
    library's Python package (llama.cpp's version is in the key, as its quantizer writes the file)."""
    import llama_cpp

    from pyspecter.models import draft
    from pyspecter.models.smol import smol_moe_path

    t = _check_type(ffn_type)
    key = content_key(smol_moe_path().name, t, Path(__file__).read_bytes(), Path(draft.__file__).read_bytes(),
                      llama_cpp.__version__, gguf.__version__ if hasattr(gguf, "__version__") else "")
    return models_dir() / f"smol-moe-self-draft-{t}-{key}.gguf"


def _check_type(ffn_type: str) -> str:
    t = ffn_type.upper()
    if t not in SELF_DRAFT_TYPES:
        raise SpecterError(f"self-draft FFN type {ffn_type!r}: choose from {', '.join(SELF_DRAFT_TYPES)}")
    return t


def build_smol_moe_self_draft(ffn_type: str = DEFAULT_FFN_TYPE, progress: bool = True) -> Path:
    """smol-moe's self-draft (smol-moe built first if needed), its FFN at ``ffn_type``. Cached by content key."""
    from pyspecter.models.smol import build_smol_moe

    t = _check_type(ffn_type)
    target = build_smol_moe(progress=progress)
    out = smol_moe_self_draft_path(t)
    if out.exists():
        return out
    with build_lock(out):  # a build of this key killed before us left its temporary files: removed here
        if out.exists():
            return out
        return make_smol_self_draft(target, out, t, progress=progress)


def make_smol_self_draft(target: Path, out: Path, ffn_type: str = DEFAULT_FFN_TYPE, progress: bool = True) -> Path:
    """Write smol-moe ``target``'s self-draft to ``out`` (see the module docstring): first a granitemoe GGUF with
    the dense FFN as each layer's shared expert at the target's type, then llama.cpp's quantizer takes the shared
    experts to ``ffn_type`` and keeps every other tensor as it is."""
    from pyspecter.models.draft import quantize_overrides, shared_expert_bytes

    target, out = Path(target), Path(out)
    t = _check_type(ffn_type)
    lay = read_layout(target).require_moe()
    if lay.arch != "llama" or lay.n_shared_expert_layers:
        raise SpecterError(f"{target}: not smol-moe (a llama-arch MoE without shared experts)")
    out.parent.mkdir(parents=True, exist_ok=True)
    check_free(out, 2 * target.stat().st_size // lay.n_expert + (64 << 20))  # the staged copy, then the draft
    t0 = time.monotonic()
    fd, staged_name = tempfile.mkstemp(prefix=f".{out.stem}-staged-", suffix=".gguf.tmp", dir=out.parent)
    os.close(fd)
    staged = Path(staged_name)
    try:
        _write_staged(target, staged, lay.n_expert, progress)
        name = f"self-draft (FFN {t}, once per layer; target's routers) of {lay.name}"
        quantize_overrides(staged, out, [(SHEXP_PATTERN, t)], name=name, progress=False)
    finally:
        staged.unlink(missing_ok=True)
    if progress:
        d, ffn = read_layout(out), shared_expert_bytes(out)
        print(f"self-draft: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, its FFN "
              f"{ffn / 2**20:.1f} MiB = {ffn / lay.expert_total_bytes:.1%} of "
              f"the target's expert bytes; routed experts {d.expert_total_bytes} bytes of zeros) in "
              f"{time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    return out


def _write_staged(target: Path, out: Path, n_expert: int, progress: bool) -> None:
    """The draft before quantization: target's tensors renamed into granitemoe's layout, FFN at the target's type."""
    from pyspecter.models.progress import done as progress_done
    from pyspecter.models.progress import step as progress_step

    r = gguf.GGUFReader(target)
    by_name = {t.name: t for t in r.tensors}
    n_layer = int(r.fields["llama.block_count"].contents())
    n_embd = int(r.fields["llama.embedding_length"].contents())
    n_ff = int(r.fields["llama.feed_forward_length"].contents())
    w = gguf.GGUFWriter(out, SELF_DRAFT_ARCH)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.name", "general.description"):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        k = SELF_DRAFT_ARCH + key[len("llama"):] if key.startswith("llama.") else key
        val = ZERO_WIDTH if k == f"{SELF_DRAFT_ARCH}.feed_forward_length" else f.contents()
        w.add_key_value(k, val, f.types[0], sub_type=sub)
    w.add_name("self-draft staging copy")
    w.add_uint32(f"{SELF_DRAFT_ARCH}.expert_shared_feed_forward_length", n_ff)
    w.add_float32(f"{SELF_DRAFT_ARCH}.logit_scale", 1.0)  # granite divides logits by it: 1 leaves them exact

    zeros = {"gate": np.zeros((n_expert, ZERO_WIDTH, n_embd), np.float16),
             "up": np.zeros((n_expert, ZERO_WIDTH, n_embd), np.float16),
             "down": np.zeros((n_expert, n_embd, ZERO_WIDTH), np.float16)}

    # (name, source tensor or None, array or None): the expert stacks become zeros + expert 0 as the shared FFN
    plan: list[tuple[str, object]] = []
    for t in r.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[2] in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            kind = parts[2][4:-5]
            plan.append((t.name, zeros[kind]))
            plan.append((f"blk.{parts[1]}.ffn_{kind}_shexp.weight", ("expert0", t)))
        else:
            plan.append((t.name, ("copy", t)))
    for tname, what in plan:
        if isinstance(what, np.ndarray):
            w.add_tensor_info(tname, what.shape, what.dtype, what.nbytes)
        else:
            src = what[1]
            a = _expert0(src) if what[0] == "expert0" else np.asarray(src.data)
            w.add_tensor_info(tname, a.shape, a.dtype, a.nbytes, raw_dtype=src.tensor_type)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        n_done = 0
        for tname, what in plan:
            if isinstance(what, np.ndarray):
                w.write_tensor_data(what)
                continue
            src = what[1]
            w.write_tensor_data(_expert0(src) if what[0] == "expert0" else np.asarray(src.data))
            if progress and tname.endswith("ffn_down_shexp.weight"):
                n_done += 1
                progress_step(f"self-draft: staged {n_done}/{n_layer} layers", n_done, n_layer)
        if progress:
            progress_done()
    finally:
        w.close()
    if n_layer != sum(1 for n, _ in plan if n.endswith("ffn_down_shexp.weight")) or not by_name:
        raise SpecterError(f"{target}: expected expert stacks in all {n_layer} layers")


def _expert0(t) -> np.ndarray:
    """Expert 0 of a reader's [n_expert, rows, row_bytes] expert stack: smol-moe's expert 0 keeps the dense FFN's
    neuron order (smol._block_permutations), so its bytes are the dense tensor's."""
    a = np.asarray(t.data)
    return np.ascontiguousarray(a[0])
