"""Random-weight MoE GGUFs with a real model's shapes, bigger than this machine's RAM.

``big-qwen3moe`` has Qwen3-30B-A3B's shapes (48 layers, d=2048, 32 query / 4 KV heads of 128, 128 experts of 768,
top-8) with Q8_0 experts: ~31 GB, more than a 24 GiB machine holds, so loading, page-cache behaviour and per-layer
bookkeeping can be seen at a user's scale. ``big-qwen3moe-q4`` is the same with Q4_0 experts (~17 GB) for capped
runs. The vocabulary is kept small (llama.cpp's "test" tokenizer, as in the tiny fixtures): it would only add
non-expert bytes that take time to write and say nothing about experts.

The tensor list and metadata are tiny.py's, run at this size, so these are the tiny qwen3moe fixture grown up.
What differs is how the bytes are made: the file is streamed (header and tensor infos first, then one tensor at
a time, expert tensors one expert at a time), never the whole model in memory, and expert weights are random
quantization blocks made directly as bytes, since quantizing 29 billion floats in numpy would take hours.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import shutil
import sys
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from pyspecter.errors import SpecterError
from pyspecter.models import tiny
from pyspecter.models.progress import done as progress_done
from pyspecter.models.progress import step as progress_step
from pyspecter.paths import atomic_path, build_lock, content_key, models_dir

__all__ = ["BIG_MODELS", "build_big", "planned_bytes"]

_QWEN3_30B_A3B = tiny.TinySpec(
    name="big-qwen3moe", arch="qwen3moe", seed=3030,
    n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
    n_expert=128, n_expert_used=8, n_ff_exp=768, expert_dtype="Q8_0",
    qk_norm=True, rope_freq_base=1_000_000.0, n_vocab=4096,
)
BIG_MODELS: dict[str, tiny.TinySpec] = {
    s.name: s for s in (_QWEN3_30B_A3B, replace(_QWEN3_30B_A3B, name="big-qwen3moe-q4", expert_dtype="Q4_0"))
}


@dataclass(frozen=True)
class _Block:
    """A quant type made from random bytes: ``d`` (fp16 scale) then ``n_q`` bytes of quants per 32 weights."""

    n_q: int
    # E[q^2] of the integer a uniformly random byte (Q8_0: int8) or nibble (Q4_0: nibble - 8) stands for: a
    # scale of std / sqrt(msq) gives weights of that std
    msq: float
    file_type: LlamaFileType


_BLOCKS = {
    GGMLQuantizationType.Q8_0: _Block(32, 5461.5, LlamaFileType.MOSTLY_Q8_0),
    GGMLQuantizationType.Q4_0: _Block(16, 21.5, LlamaFileType.MOSTLY_Q4_0),
}
_SYNC_BYTES = 1 << 30  # write-behind window: flushed and dropped from the page cache every this many bytes


@dataclass(frozen=True)
class _Planned:
    """One tensor, described but not made: numpy-order shape, type, and the std of its random values
    (None: ones, as norm weights are)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    std: float | None

    @property
    def nbytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * type_size


class _Plan(tiny._Tensors):
    """tiny's tensor list run without making data: each tensor it would add becomes a _Planned entry."""

    def __init__(self, seed: int) -> None:
        super().__init__(writer=None, seed=seed)  # never writes
        self.entries: list[_Planned] = []

    def normal(self, name: str, shape: tuple[int, ...], std: float) -> _Planned:
        return _Planned(name, tuple(shape), GGMLQuantizationType.F32, std)

    def add(self, name: str, data: _Planned, qtype: GGMLQuantizationType) -> None:
        self.entries.append(replace(data, name=name, qtype=qtype))

    def ones(self, name: str, n: int) -> None:
        self.entries.append(_Planned(name, (n,), GGMLQuantizationType.F32, None))


def _plan(spec: tiny.TinySpec) -> list[_Planned]:
    if spec.expert_qtype not in _BLOCKS:
        raise SpecterError(f"{spec.name}: experts must be one of {', '.join(t.name for t in _BLOCKS)}")
    plan = _Plan(spec.seed)
    tiny._write_tensors(plan, spec)
    for e in plan.entries:
        if e.qtype not in _BLOCKS and e.qtype not in (GGMLQuantizationType.F16, GGMLQuantizationType.F32):
            raise SpecterError(f"{spec.name}: {e.name} would be {e.qtype.name}; only F16/F32 and random "
                               f"{'/'.join(t.name for t in _BLOCKS)} blocks are made here")
    return plan.entries


def planned_bytes(spec: tiny.TinySpec) -> int:
    """Bytes of tensor data the file will hold (its size, less a header of a few hundred KiB)."""
    return _data_bytes(_plan(spec))


def _data_bytes(plan: list[_Planned]) -> int:
    return sum(gguf.GGUFWriter.ggml_pad(e.nbytes, gguf.GGUF_DEFAULT_ALIGNMENT) for e in plan)


def build_big(spec: str | tiny.TinySpec, out_dir: Path | None = None, *, progress: bool = True) -> Path:
    """Return the path of model ``spec`` (a name in BIG_MODELS, or a spec, e.g. a scaled-down one for tests),
    streaming it to the cache first if no file with the current content key exists."""
    if isinstance(spec, str):
        if spec not in BIG_MODELS:
            raise SpecterError(f"unknown model {spec!r}; known: {', '.join(BIG_MODELS)}")
        spec = BIG_MODELS[spec]
    out_dir = models_dir() if out_dir is None else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{spec.name}-{_cache_key(spec)}.gguf"
    if path.exists():
        return path
    plan = _plan(spec)
    need = _data_bytes(plan) + (16 << 20)  # + the header, generously
    with build_lock(path):  # a build of this key killed before us left its temporary file: removed here
        if path.exists():  # built by the one we waited for
            return path
        free = shutil.disk_usage(out_dir).free
        slack = 512 << 20  # a full disk breaks everything else on the machine: leave it this much
        if need + slack > free:
            raise SpecterError(f"{spec.name} needs {need / 1e9:.1f} GB in {out_dir} and {free / 1e9:.1f} GB is "
                               "free there (set SPECTER_CACHE to a bigger disk)")
        if progress:
            print(f"{spec.name}: writing {need / 1e9:.1f} GB of random weights to {path}", file=sys.stderr,
                  flush=True)
        with atomic_path(path, suffix=".gguf.tmp") as tmp:
            _write(spec, plan, tmp, progress)
    return path


def _cache_key(spec: tiny.TinySpec) -> str:
    # tiny.py gives the tensor list and metadata, so its source is part of these bytes too; numpy's version
    # because its random streams are only promised per version
    return content_key(repr(spec), Path(__file__).read_bytes(), Path(tiny.__file__).read_bytes(),
                       importlib.metadata.version("gguf"), np.__version__)


def _write(spec: tiny.TinySpec, plan: list[_Planned], path: Path, progress: bool) -> None:
    w = gguf.GGUFWriter(path, spec.arch)
    # tiny's metadata writer knows its own fixtures' file types only; general.file_type just labels the file
    # (llama.cpp reads each tensor's own type), so it is set to ours afterwards
    tiny._write_metadata(w, replace(spec, expert_dtype="F16"))
    del w.kv_data[0][gguf.Keys.General.FILE_TYPE]
    w.add_file_type(_BLOCKS[spec.expert_qtype].file_type)
    for e in plan:
        # a non-uint8 dtype with raw_dtype set: the writer takes the shape as the logical (element) shape
        w.add_tensor_info(e.name, e.shape, np.dtype(np.float32), e.nbytes, raw_dtype=e.qtype)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
    finally:
        w.close()
    align = w.data_alignment
    # The data section is ours to write: the writer's write_tensor_data takes a whole tensor at once, and one
    # expert tensor is 214 MB at this size. Same layout: each tensor starts at a multiple of the alignment.
    with open(path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        sink = _Sink(f)
        sink.pad(align)
        # progress by layer: layers are nearly all of the bytes, and all the same size
        last_of_layer = {max(j for j, e in enumerate(plan) if e.name.startswith(f"blk.{il}.")): il
                         for il in range(spec.n_layer)}
        for j, e in enumerate(plan):
            for chunk in _tensor_bytes(spec.seed, e):
                sink.write(chunk)
            sink.pad(align)
            if progress and j in last_of_layer:
                il = last_of_layer[j] + 1
                progress_step(f"{spec.name}: {il}/{spec.n_layer} layers, {sink.pos / 1e9:.1f} GB", il, spec.n_layer)
        sink.sync()
    if progress:
        progress_done()


class _Sink:
    """Appends to the file and, every _SYNC_BYTES, flushes what was written to disk and drops it from the page
    cache: a 31 GB build would otherwise fill RAM with dirty pages and push out everything else on the machine."""

    def __init__(self, f) -> None:
        self.f = f
        self.pos = f.tell()
        self.synced = 0

    def write(self, data: bytes | np.ndarray) -> None:
        self.f.write(data)
        self.pos += memoryview(data).nbytes
        if self.pos - self.synced >= _SYNC_BYTES:
            self.sync()

    def pad(self, align: int) -> None:
        self.write(bytes(gguf.GGUFWriter.ggml_pad(self.pos, align) - self.pos))

    def sync(self) -> None:
        self.f.flush()
        os.fdatasync(self.f.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.f.fileno(), 0, self.pos, os.POSIX_FADV_DONTNEED)
        self.synced = self.pos


def _tensor_bytes(seed: int, e: _Planned) -> Iterator[bytes | np.ndarray]:
    """The tensor's bytes in file order, in pieces of at most one expert (one row of the outermost dimension)."""
    if e.std is None:
        yield np.ones(e.shape, np.float32).tobytes()
    elif e.qtype in _BLOCKS:
        crc, n, std = zlib.crc32(e.name.encode()), math.prod(e.shape[1:]), e.std
        yield from _in_order(lambda i: _random_blocks(e.qtype, n, std, [seed, crc, i]), e.shape[0])
    else:
        # the same values tiny.py would give this tensor, so the dense part matches a tiny fixture of this spec
        data = tiny._Tensors(None, seed).normal(e.name, e.shape, e.std)
        yield data.astype(np.float16 if e.qtype == GGMLQuantizationType.F16 else np.float32).tobytes()


_WORKERS = max(1, min(os.cpu_count() or 1, 16))


def _in_order(make: Callable[[int], np.ndarray], n: int) -> Iterator[np.ndarray]:
    """make(i) for i < n, in order, on up to _WORKERS threads with at most 2 * _WORKERS pieces in flight (the
    writer still streams). numpy's bit generator fills its words without the GIL, so a 16-core GPU machine makes
    the 17 GB Q4 model in a fraction of one core's time, within the bench's lease; each expert has its own stream,
    so the bytes are the same however many threads make them."""
    if _WORKERS == 1 or n == 1:
        yield from map(make, range(n))
        return
    with ThreadPoolExecutor(_WORKERS) as pool:
        pending: deque = deque()
        for i in range(n):
            pending.append(pool.submit(make, i))
            if len(pending) >= 2 * _WORKERS:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _random_blocks(qtype: GGMLQuantizationType, n: int, std: float, key: list[int]) -> np.ndarray:
    """``n`` weights of random ``qtype`` blocks with element std ``std``, from their own RNG stream (per expert,
    so the bytes do not depend on how the writer chunks them). Quants are uniform random bytes; the scale's sign
    is random per block, which makes the weights' mean zero (Q4_0's nibble - 8 has mean -0.5, which would add
    the same bias to every output)."""
    b = _BLOCKS[qtype]
    n_blocks = n // 32
    # the bit generator's raw words are ~10x faster than Generator.bytes: 31 GB in seconds, not minutes
    bits = np.random.default_rng(key).bit_generator
    raw = bits.random_raw(-(-n_blocks * (b.n_q + 1) // 8)).view(np.uint8)
    out = np.empty(n_blocks, np.dtype([("d", "<f2"), ("qs", "u1", (b.n_q,))]))
    out["qs"] = raw[: n_blocks * b.n_q].reshape(n_blocks, b.n_q)
    scale = np.float16(std / math.sqrt(b.msq))
    out["d"] = np.where(raw[n_blocks * b.n_q: n_blocks * (b.n_q + 1)] & 1, scale, -scale)
    return out.view(np.uint8)
