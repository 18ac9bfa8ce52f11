"""GGUF expert layout: which tensors hold experts, and the bytes and file offsets of each expert.

Every llama.cpp MoE arch stores a layer's experts as 3-D tensors ``blk.L.ffn_{gate,up,down,gate_up}_exps`` whose
outermost dimension is the expert, so expert ``e`` is one contiguous run of ``nbytes / n_expert`` bytes. That is
what lets the slow tiers read an expert with a single pread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pyspecter.errors import SpecterError
from pyspecter.paths import atomic_path, cache_dir, content_key

# Matmul weights of the routed experts (biases and scales stay resident: they are tiny and indexed logically).
EXPERT_KINDS = ("gate_up", "gate", "up", "down")
_EXPS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.weight$")
_SHEXP_RE = re.compile(r"^blk\.(\d+)\.ffn_\w+_shexp\.weight$")


@dataclass(frozen=True)
class ExpertTensor:
    name: str
    kind: str  # gate | up | down | gate_up
    ggml_type: str  # e.g. F16, Q8_0
    shape: tuple[int, ...]  # numpy order, experts first: (n_expert, rows, cols)
    offset: int  # absolute file offset of expert 0
    expert_bytes: int  # one expert's bytes in this tensor

    def expert_offset(self, expert: int) -> int:
        return self.offset + expert * self.expert_bytes


@dataclass
class MoELayer:
    index: int
    tensors: dict[str, ExpertTensor] = field(default_factory=dict)  # kind -> tensor

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert of this layer, all its matmul weights together."""
        return sum(t.expert_bytes for t in self.tensors.values())


@dataclass
class ModelLayout:
    path: Path
    arch: str
    name: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_shared_expert_layers: int
    file_bytes: int
    tensor_bytes: int
    layers: list[MoELayer]
    # sampling settings the model's author recommends (general.sampling.*), by SamplingParams field name
    sampling: dict[str, float] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0 and bool(self.layers)

    @property
    def expert_total_bytes(self) -> int:
        return sum(layer.expert_bytes * self.n_expert for layer in self.layers)

    @property
    def nonexpert_bytes(self) -> int:
        return self.tensor_bytes - self.expert_total_bytes

    def layer(self, index: int) -> MoELayer:
        for layer in self.layers:
            if layer.index == index:
                return layer
        raise KeyError(index)

    def require_moe(self) -> ModelLayout:
        if not self.is_moe:
            raise SpecterError(f"{self.path}: model has no experts (dense {self.arch}); "
                               "this needs a Mixture-of-Experts model")
        return self


def _field_value(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    # gguf stores scalars as one-element arrays in parts[data[0]]; strings as uint8 arrays
    v = f.parts[f.data[0]]
    if v.dtype == np.uint8 and f.types and f.types[0].name == "STRING":
        return bytes(v).decode("utf-8", errors="replace")
    return v.item() if v.size == 1 else v.tolist()


def read_layout(path: str | Path) -> ModelLayout:
    """Parse a GGUF's header and tensor table. Raises SpecterError for a missing, foreign or truncated file.

    The result is cached by the file's identity (path, size, modification time, inode) and this code's own
    bytes: gguf's reader walks every tokenizer string of the header, 2.1 s for smol-moe's 49k-token vocabulary,
    which would otherwise delay every `generate` and `chat` before its first token."""
    p = Path(path)
    if not p.exists():
        raise SpecterError(f"{p}: no such file")
    if not p.is_file():
        raise SpecterError(f"{p}: not a file")
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
        st = p.stat()
    except OSError as e:
        raise SpecterError(f"{p}: cannot read ({e.strerror})") from None
    if magic != b"GGUF":
        raise SpecterError(f"{p}: not a GGUF file (bad magic)")
    cached = None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # any doubt: parse the file again
        cached = _cache_path(p, st)
        return _from_json(json.loads(cached.read_text()), p)
    layout = _parse(p, st.st_size)
    if cached is not None:
        with contextlib.suppress(OSError):  # a read-only cache only costs the next reader the parse
            cached.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(cached) as tmp:
                tmp.write_text(json.dumps(_to_json(layout)))
    return layout


@functools.cache
def _code_key() -> str:
    """This parser's own bytes (and the checks it runs): a change to either makes every cached layout stale."""
    from pyspecter import gguf_check

    return content_key(b"".join(Path(m).read_bytes() for m in (__file__, gguf_check.__file__)))


def _cache_path(p: Path, st: os.stat_result) -> Path:
    key = content_key(_code_key(), str(p.resolve()), str(st.st_size), str(st.st_mtime_ns), str(st.st_ino))
    return cache_dir() / "layouts" / f"{p.stem}-{key}.json"


def _to_json(lay: ModelLayout) -> dict:
    d = dataclasses.asdict(lay)
    d["path"] = str(lay.path)
    return d


def _from_json(d: dict, p: Path) -> ModelLayout:
    layers = [MoELayer(L["index"], {k: ExpertTensor(**{**t, "shape": tuple(t["shape"])})
                                    for k, t in L["tensors"].items()}) for L in d["layers"]]
    return ModelLayout(**{**d, "path": p, "layers": layers})


def _parse(p: Path, file_bytes: int) -> ModelLayout:
    import gguf

    try:
        reader = gguf.GGUFReader(p, "r")
    except Exception as e:  # the reader raises many types on a cut or garbled header
        raise SpecterError(f"{p}: corrupt or truncated GGUF ({type(e).__name__}: {e})") from None
    from pyspecter.gguf_check import check_gguf

    check_gguf(reader, p)  # values llama.cpp would abort on (not fail cleanly), before anything reads them

    arch = _field_value(reader, "general.architecture") or "unknown"
    name = _field_value(reader, "general.name") or p.stem
    n_layer = int(_field_value(reader, f"{arch}.block_count") or 0)
    n_expert = int(_field_value(reader, f"{arch}.expert_count") or 0)
    n_used = int(_field_value(reader, f"{arch}.expert_used_count") or 0)

    layers: dict[int, MoELayer] = {}
    shexp_layers: set[int] = set()
    tensor_bytes = 0
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > file_bytes:
            raise SpecterError(f"{p}: truncated GGUF (tensor {t.name} ends at byte {end}, file has {file_bytes})")
        tensor_bytes += int(t.n_bytes)
        if m := _SHEXP_RE.match(t.name):
            shexp_layers.add(int(m.group(1)))
        m = _EXPS_RE.match(t.name)
        if not m or n_expert == 0:
            continue
        il, kind = int(m.group(1)), m.group(2)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # gguf lists ggml order (ne0 first)
        if shape[0] != n_expert or int(t.n_bytes) % n_expert:
            raise SpecterError(f"{p}: {t.name} has shape {shape}, expected {n_expert} experts outermost")
        layers.setdefault(il, MoELayer(il)).tensors[kind] = ExpertTensor(
            name=t.name, kind=kind, ggml_type=t.tensor_type.name, shape=shape,
            offset=int(t.data_offset), expert_bytes=int(t.n_bytes) // n_expert,
        )
    return ModelLayout(
        path=p, arch=arch, name=str(name), n_layer=n_layer, n_expert=n_expert, n_expert_used=n_used,
        n_shared_expert_layers=len(shexp_layers), file_bytes=file_bytes, tensor_bytes=tensor_bytes,
        layers=[layers[k] for k in sorted(layers)], sampling=_sampling_defaults(reader),
    )


# general.sampling.* (written by convert_hf_to_gguf from generation_config.json) -> SamplingParams fields
_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "penalty_repeat": "repeat_penalty", "penalty_last_n": "repeat_last_n"}


def _sampling_defaults(reader) -> dict[str, float]:
    out = {}
    for key, name in _SAMPLING_KEYS.items():
        v = _field_value(reader, f"general.sampling.{key}")
        if isinstance(v, int | float) and v == v:  # a number, and not NaN
            out[name] = int(v) if name in ("top_k", "repeat_last_n") else float(v)
    return out
