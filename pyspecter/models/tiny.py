"""Tiny random-weight MoE GGUF fixtures.

These let tests exercise real llama.cpp MoE code paths (router, ``*_exps`` tensors, quantized expert layouts,
shared experts, gpt-oss sinks/SWA) in seconds, with no downloads. The weights are random, so output is
meaningless, but it is deterministic, and the routers are scaled so different tokens pick different experts.

Each fixture is built once and cached under a content key (spec, this file's source, gguf and numpy versions), so
editing the builder or a spec yields a new file instead of silently reusing a stale one.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import re
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from pyspecter.paths import atomic_path, build_lock, check_free, content_key, models_dir

__all__ = ["BENCH_MODELS", "TINY_MODELS", "TinySpec", "build_tiny"]


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines a fixture's bytes; its repr is part of the cache key."""

    name: str
    arch: str  # GGUF general.architecture as the pinned loader spells it
    seed: int
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    expert_dtype: str  # GGMLQuantizationType name used for the ffn_*_exps weights
    dense_dtype: str = "F16"  # embeddings, attention, output and shared-expert matrices
    n_ff_shexp: int = 0  # > 0: qwen2moe-style shared expert with a sigmoid gate
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0  # gpt-oss only: window of its sliding-window layers
    rope_freq_base: float = 10000.0
    n_vocab: int = 320
    n_ctx_train: int = 4096
    # std of router logits per expert; ~2 makes the top-k differ from token to token instead of one expert winning
    router_logit_std: float = 2.0
    # std of output logits; peaked enough that greedy decoding is not decided by rounding noise
    output_logit_std: float = 3.0

    @property
    def expert_qtype(self) -> GGMLQuantizationType:
        return GGMLQuantizationType[self.expert_dtype]

    @property
    def dense_qtype(self) -> GGMLQuantizationType:
        return GGMLQuantizationType[self.dense_dtype]


# One fixture per block reads better than one field per line, so keep the formatter out of this table.
# fmt: off
TINY_MODELS: dict[str, TinySpec] = {
    spec.name: spec
    for spec in (
        # Qwen3-30B-A3B shape in miniature: q/k norms, head_dim * n_head != n_embd, many small experts.
        TinySpec(
            name="tiny-qwen3moe", arch="qwen3moe", seed=1301,
            n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32,
            n_expert=32, n_expert_used=4, n_ff_exp=64, expert_dtype="F16",
            qk_norm=True, rope_freq_base=1_000_000.0,
        ),
        # Qwen1.5-MoE / Qwen2-57B-A14B: qkv biases plus an always-on shared expert behind a sigmoid gate.
        # All F32 so the fixtures also cover an unconverted (4 bytes/weight) expert layout.
        TinySpec(
            name="tiny-qwen2moe", arch="qwen2moe", seed=1201,
            n_layer=4, n_embd=64, n_head=4, n_head_kv=4, head_dim=16,
            n_expert=16, n_expert_used=4, n_ff_exp=64, expert_dtype="F32", dense_dtype="F32",
            n_ff_shexp=128, qkv_bias=True, rope_freq_base=1_000_000.0,
        ),
        # Mixtral is arch "llama" with experts; its expert width is feed_forward_length. Q8_0 experts exercise a
        # block-quantized expert layout (34-byte blocks of 32).
        TinySpec(
            name="tiny-mixtral", arch="llama", seed=801,
            n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=16,
            n_expert=16, n_expert_used=2, n_ff_exp=128, expert_dtype="Q8_0",
            rope_freq_base=1_000_000.0,
        ),
        # gpt-oss: biases everywhere, attention sinks, alternating sliding-window/full layers, softmax over the
        # selected experts' logits, SWIGLU_OAI. MXFP4 experts like the released checkpoints.
        TinySpec(
            name="tiny-gptoss", arch="gpt-oss", seed=2001,
            n_layer=4, n_embd=64, n_head=8, n_head_kv=2, head_dim=16,
            n_expert=32, n_expert_used=4, n_ff_exp=64, expert_dtype="MXFP4",
            qkv_bias=True, sliding_window=8, rope_freq_base=150_000.0,
        ),
    )
}

# Scaled-up random fixtures for benchmarks (docs/DESIGN.md, Models): big enough that expert I/O shows, with
# distinct experts and little routing locality, the hard case. Not built by the tests.
BENCH_MODELS: dict[str, TinySpec] = {
    spec.name: spec
    for spec in (
        TinySpec(
            name="bench-qwen3moe", arch="qwen3moe", seed=4242,
            n_layer=16, n_embd=1024, n_head=16, n_head_kv=4, head_dim=64,
            n_expert=32, n_expert_used=4, n_ff_exp=512, expert_dtype="F16",
            qk_norm=True, rope_freq_base=1_000_000.0, n_vocab=2048,
        ),
    )
}
# fmt: on

_FILE_TYPES = {
    "F32": LlamaFileType.ALL_F32,
    "F16": LlamaFileType.MOSTLY_F16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "MXFP4": LlamaFileType.MOSTLY_MXFP4_MOE,
}


def build_tiny(name: str, out_dir: Path | None = None) -> Path:
    """Return the path of fixture ``name``, building it if no file with the current content key exists."""
    spec = TINY_MODELS.get(name) or BENCH_MODELS.get(name)
    if spec is None:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS | BENCH_MODELS))}")

    out_dir = models_dir() if out_dir is None else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{_cache_key(spec)}.gguf"
    if path.exists():
        return path
    with build_lock(path):  # a build of this key killed before us left its temporary file: removed here
        if not path.exists():
            _remove_unkeyed_orphans(out_dir, name)
            check_free(path, planned_bytes(spec) + (1 << 20))  # + the header, generously
            # written next to the target and renamed: nobody ever sees a truncated GGUF at `path`
            with atomic_path(path, suffix=".gguf.tmp") as tmp:
                _write(spec, tmp)
    return path


_UNKEYED_TMP_AGE_S = 3600


def _remove_unkeyed_orphans(out_dir: Path, name: str) -> None:
    """Temporary files named without their key (``.NAME-XXXXXXXX.gguf.tmp``, from builders before the build
    lock): no lock says whether one is being written, so only those untouched for an hour are removed."""
    pat = re.compile(rf"\.{re.escape(name)}-[a-z0-9_]{{8}}\.gguf\.tmp")
    now = time.time()
    for p in out_dir.glob(f".{name}-*.gguf.tmp"):
        with contextlib.suppress(FileNotFoundError):
            if pat.fullmatch(p.name) and now - p.stat().st_mtime > _UNKEYED_TMP_AGE_S:
                p.unlink()


def _cache_key(spec: TinySpec) -> str:
    # numpy is included too: the random streams (and so the bytes) are only promised per numpy version.
    return content_key(
        repr(spec),
        Path(__file__).read_bytes(),
        importlib.metadata.version("gguf"),
        np.__version__,
    )


class _Tensors:
    """Writes tensors in order, each made when written (the model is never whole in memory), each from its own
    RNG stream so one tensor's shape never shifts another's values. ``writer`` must have its tensor infos
    (from _Infos) and header written."""

    def __init__(self, writer: gguf.GGUFWriter | None, seed: int) -> None:
        self.writer = writer
        self.seed = seed

    def normal(self, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def add(self, name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> None:
        if qtype == GGMLQuantizationType.F32:
            self.writer.write_tensor_data(data.astype(np.float32))
        elif qtype == GGMLQuantizationType.F16:
            self.writer.write_tensor_data(data.astype(np.float16))
        else:
            # Quantized rows are stored as raw bytes; the writer derives the logical shape from the block size.
            self.writer.write_tensor_data(gguf.quants.quantize(data, qtype))

    def matrix(self, name: str, n_in: int, n_out: int, qtype: GGMLQuantizationType, gain: float = 1.0) -> None:
        # ggml ne = {n_in, n_out} is numpy (n_out, n_in). std = gain/sqrt(fan_in) keeps activations ~unit scale.
        self.add(name, self.normal(name, (n_out, n_in), gain / math.sqrt(n_in)), qtype)

    def experts(self, name: str, n_expert: int, n_in: int, n_out: int, qtype: GGMLQuantizationType) -> None:
        self.add(name, self.normal(name, (n_expert, n_out, n_in), 1.0 / math.sqrt(n_in)), qtype)

    def ones(self, name: str, n: int) -> None:
        # Norm weights of 1 leave RMS-normalised activations at unit scale; ggml wants 1-D tensors in F32.
        self.add(name, np.ones(n, dtype=np.float32), GGMLQuantizationType.F32)

    def small(self, name: str, shape: tuple[int, ...], std: float = 0.02) -> None:
        self.add(name, self.normal(name, shape, std), GGMLQuantizationType.F32)


class _Shape:
    """A tensor described by its shape alone (what _Infos needs to know)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = tuple(shape)


class _Infos(_Tensors):
    """The same tensor list, made of no data: each tensor's info (name, shape, type, size) goes to the writer,
    which puts them in the header before any data is written."""

    def __init__(self, writer: gguf.GGUFWriter) -> None:
        super().__init__(writer, seed=0)
        self.nbytes = 0

    def normal(self, name: str, shape: tuple[int, ...], std: float) -> _Shape:
        return _Shape(shape)

    def add(self, name: str, data: np.ndarray | _Shape, qtype: GGMLQuantizationType) -> None:
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dtype = np.dtype(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16)
            shape, raw = data.shape, None
        else:
            dtype, shape, raw = np.dtype(np.uint8), gguf.quant_shape_to_byte_shape(data.shape, qtype), qtype
        nbytes = math.prod(shape) * dtype.itemsize
        self.writer.add_tensor_info(name, shape, dtype, nbytes, raw_dtype=raw)
        self.nbytes += gguf.GGUFWriter.ggml_pad(nbytes, self.writer.data_alignment)


def planned_bytes(spec: TinySpec) -> int:
    """Bytes of tensor data the fixture's file holds (all of it but the header)."""
    infos = _Infos(gguf.GGUFWriter(None, spec.arch))
    _write_tensors(infos, spec)
    return infos.nbytes


def _write(spec: TinySpec, path: Path) -> None:
    w = gguf.GGUFWriter(path, spec.arch)
    _write_metadata(w, spec)
    _write_tensors(_Infos(w), spec)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        _write_tensors(_Tensors(w, spec.seed), spec)
    finally:
        w.close()


def _write_metadata(w: gguf.GGUFWriter, spec: TinySpec) -> None:
    w.add_name(f"pyspecter random-weight fixture {spec.name}")
    w.add_description("Random weights for tests of MoE code paths; outputs are meaningless. Built by pyspecter.")
    w.add_file_type(_FILE_TYPES[spec.expert_dtype])

    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    # Mixtral (arch llama) sizes its experts with feed_forward_length; the other arches read the expert key.
    w.add_feed_forward_length(spec.n_ff_exp)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)  # arch llama insists n_rot == head_dim
    w.add_rope_freq_base(spec.rope_freq_base)
    w.add_layer_norm_rms_eps(1e-6)

    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    if spec.arch != "llama":
        w.add_expert_feed_forward_length(spec.n_ff_exp)
    if spec.n_ff_shexp:
        w.add_expert_shared_feed_forward_length(spec.n_ff_shexp)
    if spec.sliding_window:
        # gpt-oss: the loader defaults to pattern 2 (even layers sliding, odd layers full), as in the real model.
        w.add_sliding_window(spec.sliding_window)

    # llama.cpp's "test" tokenizer hashes 5-byte chunks of text to ids and detokenizes ids as hex, so it needs only
    # a token list; there are no special tokens, so generation runs to max_tokens.
    w.add_tokenizer_model("test")
    w.add_token_list([f"tok_{i}" for i in range(spec.n_vocab)])
    w.add_token_scores([0.0] * spec.n_vocab)


def _write_tensors(t: _Tensors, spec: TinySpec) -> None:
    dense = spec.dense_qtype
    d, n_q, n_kv = spec.n_embd, spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    gpt_oss = spec.arch == "gpt-oss"

    # Unit-variance embeddings: every block reads the residual through an RMS norm, so only relative scale matters.
    t.add("token_embd.weight", t.normal("token_embd.weight", (spec.n_vocab, d), 1.0), dense)
    t.ones("output_norm.weight", d)
    t.matrix("output.weight", d, spec.n_vocab, dense, gain=spec.output_logit_std)

    for il in range(spec.n_layer):
        p = f"blk.{il}."
        t.ones(p + "attn_norm.weight", d)
        t.matrix(p + "attn_q.weight", d, n_q, dense)
        t.matrix(p + "attn_k.weight", d, n_kv, dense)
        t.matrix(p + "attn_v.weight", d, n_kv, dense)
        t.matrix(p + "attn_output.weight", n_q, d, dense)
        if spec.qkv_bias:
            t.small(p + "attn_q.bias", (n_q,))
            t.small(p + "attn_k.bias", (n_kv,))
            t.small(p + "attn_v.bias", (n_kv,))
        if spec.qk_norm:
            t.ones(p + "attn_q_norm.weight", spec.head_dim)
            t.ones(p + "attn_k_norm.weight", spec.head_dim)

        if gpt_oss:
            # gpt-oss names its pre-FFN norm post_attention_norm and requires these biases and per-head sinks.
            t.ones(p + "post_attention_norm.weight", d)
            t.small(p + "attn_output.bias", (d,))
            t.small(p + "attn_sinks.weight", (spec.n_head,), std=1.0)
        else:
            t.ones(p + "ffn_norm.weight", d)

        # Router in F32 (as converters keep it). Its input is RMS-normed, so std/sqrt(d) gives logits of ~std.
        t.matrix(p + "ffn_gate_inp.weight", d, spec.n_expert, GGMLQuantizationType.F32, gain=spec.router_logit_std)
        qt = spec.expert_qtype
        t.experts(p + "ffn_gate_exps.weight", spec.n_expert, d, spec.n_ff_exp, qt)
        t.experts(p + "ffn_up_exps.weight", spec.n_expert, d, spec.n_ff_exp, qt)
        t.experts(p + "ffn_down_exps.weight", spec.n_expert, spec.n_ff_exp, d, qt)
        if gpt_oss:
            t.small(p + "ffn_gate_inp.bias", (spec.n_expert,), std=0.5)
            t.small(p + "ffn_gate_exps.bias", (spec.n_expert, spec.n_ff_exp))
            t.small(p + "ffn_up_exps.bias", (spec.n_expert, spec.n_ff_exp))
            t.small(p + "ffn_down_exps.bias", (spec.n_expert, d))

        if spec.n_ff_shexp:
            # ffn_gate_inp_shexp is a single row (ne {n_embd}): one scalar sigmoid gate per token.
            name = p + "ffn_gate_inp_shexp.weight"
            t.add(name, t.normal(name, (d,), 1.0 / math.sqrt(d)), GGMLQuantizationType.F32)
            t.matrix(p + "ffn_gate_shexp.weight", d, spec.n_ff_shexp, dense)
            t.matrix(p + "ffn_up_shexp.weight", d, spec.n_ff_shexp, dense)
            t.matrix(p + "ffn_down_shexp.weight", spec.n_ff_shexp, d, dense)
