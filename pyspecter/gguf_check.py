"""Refuse a hostile or corrupt GGUF before llama.cpp sees it.

llama.cpp turns many bad values into a clean load error, but some it only meets in a ``GGML_ASSERT`` (or an
unchecked division or index), which aborts the whole process: a negative norm epsilon at the first decode, a
duplicated vocab string or too many experts at load. ``check_gguf`` looks at the parsed header (no tensor data)
and raises SpecterError with one line naming the key or tensor. It checks values that are present; a key
llama.cpp requires but cannot find is already a clean load error. The limits are those of the pinned llama.cpp
(paths below are relative to its root).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, NoReturn

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from pyspecter.errors import SpecterError

LLAMA_MAX_LAYERS = 512  # src/llama-hparams.h
LLAMA_MAX_EXPERTS = 1024  # src/llama-hparams.h

U32, I32, F32, BOOL, STR = (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL,
                            GGUFValueType.STRING)

# MoE archs whose graph builder asserts n_embd_head_v == n_embd_head_k == n_rot (src/models/<arch>.cpp) and cuts
# q/k/v into n_head heads of that size: a mismatch aborts at the first decode. gpt-oss has no such assert but sizes
# its heads by n_rot and aborts the same way. Other archs may rope part of a head or lay attention out otherwise.
_STD_ATTN = {"gpt-oss", "llama", "llama4", "grok", "qwen2moe", "qwen3moe", "qwen3vlmoe", "cohere2moe", "dbrx",
             "olmoe", "arctic", "deepseek", "exaone-moe", "dots1", "ernie4_5-moe", "hunyuan-moe", "smallthinker",
             "llada-moe", "grovemoe", "rnd1", "mistral3"}
_ROPE_SCALING = {"none", "linear", "yarn", "longrope"}  # anything else: GGML_ASSERT in load_hparams

# tokenizer.ggml.model values llama_vocab::impl::load accepts -> the special-token ids it defaults to (a default
# outside the vocabulary is dropped).
_TOKENIZERS: dict[str, dict[str, int]] = {
    "llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11}, "hybriddna": {"bos": 11, "eos": 11},
    "whitespace": {"bos": 11, "eos": 11}, "gemma4": {},
    "bert": {"bos": 101, "unk": 100, "sep": 102, "pad": 0, "mask": 103}, "t5": {"eos": 1, "unk": 2, "pad": 0},
    "plamo2": {"bos": 1, "eos": 2, "unk": 0, "pad": 3}, "rwkv": {}, "test": {},
}
# Tokenizers whose tokenize() GGML_ASSERTs that a special token it adds exists -> the tokens added when the
# file has no add_<name>_token. BPE's add_bos depends on the pre-tokenizer (gemma4 forces it on), so it is taken
# as on: that refuses only a BPE model with no valid bos id at all. WPM (bert) adds bos and sep unconditionally.
# "test" (the fixtures' tokenizer), rwkv and plamo2 never add special tokens.
_ADDS: dict[str, set[str]] = {"llama": {"bos"}, "gpt2": {"bos"}, "hybriddna": {"bos"}, "whitespace": {"bos"},
                              "gemma4": {"bos"}, "t5": {"eos"}, "bert": {"bos", "sep"}}
_FORCED = {"bert": {"bos", "sep"}, "gemma4": {"bos"}}  # added whatever add_<name>_token says
# llama-vocab.cpp's special_token_types: tokenizer.ggml.<key>_token_id (sic "seperator")
_SPECIAL_KEYS = {n: {"unk": "unknown", "sep": "seperator", "pad": "padding"}.get(n, n) for n in (
    "bos", "eos", "eot", "eom", "unk", "sep", "pad", "mask", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep",
    "fim_sep", "prefix", "suffix", "middle")}

_BLK_RE = re.compile(r"^blk\.(\d+)\.")
_ATTN_RE = re.compile(r"^blk\.(\d+)\.attn_(q|k|v|qkv|output)\.weight$")
# Tensors indexed by expert, and the dimension (ggml order) that is the expert: weights [in, out, expert], biases
# [out, expert], the router [n_embd, expert].
_EXPERT_DIM = ((re.compile(r"^blk\.\d+\.ffn_(gate_up|gate|up|down)_exps\.weight$"), 2),
               (re.compile(r"^blk\.\d+\.(ffn_(gate_up|gate|up|down)_exps\.bias|ffn_gate_inp\.weight)$"), 1))


def check_gguf(reader: GGUFReader, path: object) -> None:
    """Raise SpecterError if the parsed GGUF has a value llama.cpp would abort (not fail cleanly) on."""
    g = _Fields(reader, path)
    arch = g.scalar("general.architecture", STR)
    if arch is None:
        g.fail("no general.architecture")
    _check_floats(g, arch)
    dims = _check_hparams(g, arch)
    dims.n_vocab = _check_vocab(g, required=dims.n_expert > 0)
    _check_tensors(g, reader, arch, dims)


@dataclass
class _Dims:
    """Hyperparameters the tensor table must agree with (0 or empty: unknown)."""

    n_layer: int = 0
    n_expert: int = 0
    n_embd: int = 0
    n_vocab: int = 0
    heads: list[int] = field(default_factory=list)  # per layer
    heads_kv: list[int] = field(default_factory=list)
    head_k: int = 0
    head_v: int = 0


class _Fields:
    """Typed reads of GGUF metadata; a value of the wrong type is an error that says which type it has."""

    def __init__(self, reader: GGUFReader, path: object) -> None:
        self.fields = reader.fields
        self.path = path

    def fail(self, msg: str) -> NoReturn:
        # Keys and tensor names come from the file: keep the message on one printable line.
        raise SpecterError(f"{self.path}: " + "".join(c if c.isprintable() else repr(c)[1:-1] for c in msg))

    def kind(self, key: str) -> str:
        f = self.fields[key]
        if f.types[0] != GGUFValueType.ARRAY:
            return f.types[0].name
        sub = _subtype(f)
        return f"an array of {sub.name if sub else 'unknown type'}"

    def scalar(self, key: str, vtype: GGUFValueType) -> Any:
        """The value, None if absent; llama.cpp's get_key<T> accepts only the exact GGUF type."""
        f = self.fields.get(key)
        if f is None:
            return None
        if f.types[0] != vtype:
            self.fail(f"{key} is {self.kind(key)}, expected {vtype.name}")
        v = f.parts[f.data[0]]
        return bytes(v).decode("utf-8", errors="replace") if vtype == STR else v.item()

    def array(self, key: str, *subtypes: GGUFValueType) -> list[Any] | None:
        f = self.fields.get(key)
        if f is None:
            return None
        if f.types[0] != GGUFValueType.ARRAY or _subtype(f) not in subtypes:
            self.fail(f"{key} is {self.kind(key)}, expected an array of {'/'.join(t.name for t in subtypes)}")
        if subtypes == (STR,):
            return [bytes(f.parts[i]) for i in f.data]
        return [f.parts[i].item() for i in f.data]

    def per_layer(self, key: str, n_layer: int) -> list[int] | None:
        """get_key_or_arr: one uint32 for every layer, or an int32/uint32/bool array of exactly n_layer (0: the
        layer count is unknown)."""
        f = self.fields.get(key)
        if f is None:
            return None
        if f.types[0] != GGUFValueType.ARRAY:
            return [self.scalar(key, U32)] * max(n_layer, 1)
        values = self.array(key, U32, I32, BOOL)
        if n_layer and len(values) != n_layer:
            self.fail(f"{key} has {len(values)} entries, expected one per layer ({n_layer})")
        if min(values, default=0) < 0:
            self.fail(f"{key} has a negative entry ({min(values)})")
        return [int(v) for v in values]


def _subtype(f: Any) -> GGUFValueType | None:
    """Element type of an array field (also when it is empty); parts are klen, key, type, itype, n, items..."""
    try:
        return GGUFValueType(int(f.parts[3][0]))
    except ValueError:
        return None


def _check_floats(g: _Fields, arch: str) -> None:
    # Norm epsilons reach ggml's norm ops, which GGML_ASSERT(eps >= 0.0f) (ggml-cpu/ops.cpp; NaN fails it too)
    # at the first decode. Other float hyperparameters are never meant to be inf or NaN either.
    for key, f in g.fields.items():
        if not (key.startswith(arch + ".") or key.endswith("epsilon")):
            continue
        if f.types[-1] not in (F32, GGUFValueType.FLOAT64):
            continue
        values = [f.parts[i].item() for i in f.data]
        bad = next((v for v in values if not math.isfinite(v)), None)
        if bad is not None:
            g.fail(f"{key} is {bad}, expected a finite number")
        if key.endswith("epsilon") and min(values, default=0.0) < 0:
            g.fail(f"{key} is {min(values):g}, expected >= 0 (ggml norm asserts eps >= 0)")


def _check_hparams(g: _Fields, arch: str) -> _Dims:
    """The asserts of llama_model_base::load_hparams (src/llama-model.cpp) and the graph asserts they feed."""
    a = arch + "."
    n_layer = g.scalar(a + "block_count", U32)
    if n_layer is None:
        n_layer = 0  # llama.cpp refuses the file cleanly
    elif not 0 < n_layer <= LLAMA_MAX_LAYERS:
        g.fail(f"{a}block_count is {n_layer}, expected 1..{LLAMA_MAX_LAYERS}")
    if (n_nextn := g.scalar(a + "nextn_predict_layers", U32) or 0) > n_layer:
        g.fail(f"{a}nextn_predict_layers is {n_nextn}, more than block_count {n_layer}")
    for key in ("context_length", "embedding_length"):
        if g.scalar(a + key, U32) == 0:
            g.fail(f"{a}{key} is 0")
    n_embd = g.scalar(a + "embedding_length", U32) or 0

    n_expert = g.scalar(a + "expert_count", U32) or 0
    if n_expert > LLAMA_MAX_EXPERTS:
        g.fail(f"{a}expert_count is {n_expert}, more than llama.cpp's maximum {LLAMA_MAX_EXPERTS}")
    used = max(g.per_layer(a + "expert_used_count", n_layer) or [0])
    groups = g.scalar(a + "expert_group_count", U32) or 0
    group_used = g.scalar(a + "expert_group_used_count", U32) or 0
    if n_expert == 0 and (used or groups):
        g.fail(f"{a}expert_used_count/expert_group_count set but the model has no expert_count")
    if n_expert and not 0 < used <= n_expert:
        g.fail(f"{a}expert_used_count is {used}, expected 1..expert_count ({n_expert})")
    if n_expert and groups >= n_expert:
        g.fail(f"{a}expert_group_count is {groups}, expected fewer than expert_count ({n_expert})")
    if groups > 1 and (n_expert % groups or not 0 < group_used < groups):
        g.fail(f"{a}expert groups are inconsistent: {n_expert} experts, {groups} groups, {group_used} used")
    for key in ("feed_forward_length", "expert_feed_forward_length", "expert_shared_feed_forward_length"):
        g.per_layer(a + key, n_layer)  # type and length; the tensor shapes must then agree with the values
    if (n_shared := g.scalar(a + "expert_shared_count", U32) or 0) > LLAMA_MAX_EXPERTS:
        g.fail(f"{a}expert_shared_count is {n_shared}, more than {LLAMA_MAX_EXPERTS}")

    heads = g.per_layer(a + "attention.head_count", n_layer) or []
    heads_kv = g.per_layer(a + "attention.head_count_kv", n_layer) or heads
    for il, (h, kv) in enumerate(zip(heads, heads_kv, strict=False)):  # one may be absent
        # ggml_mul_mat broadcasts kv heads over query heads and GGML_ASSERTs that they divide
        if h and kv and h % kv:
            g.fail(f"layer {il}: head_count {h} is not a multiple of head_count_kv {kv}")
    dims = _Dims(n_layer, n_expert, n_embd, heads=heads, heads_kv=heads_kv)
    head_k = g.scalar(a + "attention.key_length", U32)
    head_v = g.scalar(a + "attention.value_length", U32)
    n_rot = g.scalar(a + "rope.dimension_count", U32)
    if heads and heads[0]:
        head_k = n_embd // heads[0] if head_k is None else head_k
        head_v = n_embd // heads[0] if head_v is None else head_v
        n_rot = head_k if n_rot is None else n_rot
        # ggml rope: GGML_ASSERT(n_dims <= ne0) and GGML_ASSERT(n_dims % 2 == 0)
        if n_rot > head_k or n_rot % 2:
            g.fail(f"{a}rope.dimension_count is {n_rot}, expected an even number <= the head size {head_k}")
        if arch in _STD_ATTN and not n_rot == head_k == head_v:
            g.fail(f"{arch} needs rope.dimension_count == key_length == value_length, got {n_rot}, {head_k}, "
                   f"{head_v}")
        dims.head_k, dims.head_v = head_k, head_v

    for key in ("rope.freq_base", "rope.freq_base_swa"):
        if (base := g.scalar(a + key, F32)) is not None and not base > 0:
            g.fail(f"{a}{key} is {base:g}, expected > 0")
    if (scale := g.scalar(a + "rope.scaling.factor", F32)) is not None and scale < 0:
        g.fail(f"{a}rope.scaling.factor is {scale:g}, expected >= 0")
    if (kind := g.scalar(a + "rope.scaling.type", STR)) is not None and kind not in _ROPE_SCALING:
        g.fail(f"{a}rope.scaling.type is {kind!r}, expected one of {', '.join(sorted(_ROPE_SCALING))}")
    return dims


def _check_vocab(g: _Fields, required: bool) -> int:
    """llama_vocab::impl::load (src/llama-vocab.cpp); returns the vocab size (0 when there is no token list)."""
    model = g.scalar("tokenizer.ggml.model", STR)
    tokens = g.array("tokenizer.ggml.tokens", STR)
    if model is None or tokens is None:
        if required:  # a missing tokenizer is a clean llama.cpp error, but pyspecter needs one: say so first
            g.fail("no tokenizer (tokenizer.ggml.model and tokenizer.ggml.tokens)")
        return 0 if tokens is None else len(tokens)
    if model in ("none", "no_vocab"):
        g.fail(f"tokenizer.ggml.model is {model!r}: the model has no vocabulary to tokenize with")
    if model not in _TOKENIZERS:
        g.fail(f"tokenizer.ggml.model is {model!r}, which llama.cpp does not know")
    n = len(tokens)
    if not 0 < n < 2**31:  # the test tokenizer takes a hash modulo n; ids are int32
        g.fail(f"tokenizer.ggml.tokens has {n} entries")
    # llama.cpp reads each token as a C string (cut at the first NUL), renames an empty one "[EMPTY_<i>]", maps
    # text -> id and then GGML_ASSERTs that the map is as long as the list: no two tokens may read the same.
    seen: dict[bytes, int] = {}
    for i, raw in enumerate(tokens):
        text = raw.split(b"\0", 1)[0] or f"[EMPTY_{i}]".encode()
        if (j := seen.setdefault(text, i)) != i:
            g.fail(f"tokenizer.ggml.tokens has a duplicate: tokens {j} and {i} are both {text[:40]!r}")
    for key, types in (("tokenizer.ggml.scores", (F32, I32)), ("tokenizer.ggml.token_type", (I32,))):
        if (values := g.array(key, *types)) is not None and len(values) < n:  # read by token id
            g.fail(f"{key} has {len(values)} entries for {n} tokens")

    ids = {name: v for name, v in _TOKENIZERS[model].items() if v < n}
    for name, key in _SPECIAL_KEYS.items():
        if (v := g.scalar(f"tokenizer.ggml.{key}_token_id", U32)) is None:
            continue
        if v >= n:  # llama.cpp would fall back to the default with a warning; the file is wrong either way
            g.fail(f"tokenizer.ggml.{key}_token_id is {v}, outside the vocabulary of {n} tokens")
        ids[name] = v
    for name in ("bos", "eos", "sep") if model in _ADDS else ():
        add = g.scalar(f"tokenizer.ggml.add_{name}_token", BOOL)
        add = name in _ADDS[model] if add is None else add
        if (add or name in _FORCED.get(model, ())) and name not in ids:
            g.fail(f"the {model} tokenizer adds a {name} token but tokenizer.ggml.{_SPECIAL_KEYS[name]}_token_id "
                   "names none")
    return n


def _check_tensors(g: _Fields, reader: GGUFReader, arch: str, d: _Dims) -> None:
    file_bytes = len(reader.data)
    for t in reader.tensors:
        ne = [int(x) for x in t.shape]
        if len(ne) > 4 or max(ne, default=0) >= 2**63:  # ggml: at most 4 dims of int64
            g.fail(f"tensor {t.name} has shape {ne}")
        if math.prod(ne) >= 2**63:
            g.fail(f"tensor {t.name} has {math.prod(ne)} elements")
        block, _ = GGML_QUANT_SIZES[GGMLQuantizationType(t.tensor_type)]
        if ne[0] % block:
            g.fail(f"tensor {t.name}: row of {ne[0]} is not a whole number of {t.tensor_type.name} blocks")
        if int(t.data_offset) + int(t.n_bytes) > file_bytes:
            g.fail(f"truncated GGUF: tensor {t.name} ends at byte {int(t.data_offset) + int(t.n_bytes)}, the file "
                   f"has {file_bytes}")
        if d.n_layer and (m := _BLK_RE.match(t.name)) and int(m.group(1)) >= d.n_layer:
            g.fail(f"tensor {t.name} is in a block past block_count ({d.n_layer})")
        if t.name == "token_embd.weight":
            want = [d.n_embd or ne[0], ne[1] if arch == "eagle3" or not d.n_vocab else d.n_vocab]
            if ne[:2] != want or len(ne) != 2:
                g.fail(f"token_embd.weight has shape {ne}, expected [embedding_length, n_vocab] = {want}")
        for pattern, axis in _EXPERT_DIM if d.n_expert else ():
            if pattern.match(t.name) and (len(ne) != axis + 1 or ne[axis] != d.n_expert):
                g.fail(f"tensor {t.name} has shape {ne}, expected {d.n_expert} experts in dimension {axis}")
        if d.head_k and arch in _STD_ATTN and (m := _ATTN_RE.match(t.name)):
            _check_attention(g, t.name, ne, d, int(m.group(1)), m.group(2))


def _check_attention(g: _Fields, name: str, ne: list[int], d: _Dims, il: int, kind: str) -> None:
    # The graph views q/k/v as heads x head size and the attention output as their concatenation; tensors sized
    # otherwise (llama.cpp creates some, e.g. qwen2moe's attn_q, as n_embd x n_embd) abort in a ggml reshape,
    # view or matmul at the first decode.
    if il >= len(d.heads) or not d.heads[il]:
        return
    h, kv = d.heads[il], d.heads_kv[il]
    q, k, v = h * d.head_k, kv * d.head_k, kv * d.head_v
    want, axis = {"q": (q, 1), "k": (k, 1), "v": (v, 1), "qkv": (q + k + v, 1), "output": (h * d.head_v, 0)}[kind]
    if len(ne) < 2 or ne[axis] != want:
        g.fail(f"tensor {name} has shape {ne}, but {h} heads ({kv} kv) of {d.head_k}/{d.head_v} need {want} in "
               f"dimension {axis}")
