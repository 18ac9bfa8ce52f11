"""The bigger-than-RAM builder (models/big.py) on scaled-down instances: the same streaming code path as the
31 GB model, checked with gguf's reader. Nothing large is built here."""

from __future__ import annotations

import tracemalloc
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import run_cli

from pyspecter.errors import SpecterError
from pyspecter.models import big, catalog, tiny

FULL = big.BIG_MODELS["big-qwen3moe"]


def _small(expert_dtype: str = "Q8_0", **kw) -> tiny.TinySpec:
    shape = dict(name="big-test", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8,
                 n_expert_used=2, n_ff_exp=128, n_vocab=320)
    return replace(FULL, expert_dtype=expert_dtype, **(shape | kw))


def _tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_full_size_plan_has_qwen3_30b_a3b_shapes_and_is_bigger_than_this_ram() -> None:
    # the plan alone (nothing built): Qwen3-30B-A3B's expert shapes, ~31 GB in Q8_0 and ~17 GB in Q4_0
    entries = {e.name: e for e in big._plan(FULL)}
    assert entries["blk.47.ffn_gate_exps.weight"].shape == (128, 768, 2048)
    assert entries["blk.0.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert entries["blk.0.attn_q.weight"].shape == (32 * 128, 2048)
    assert entries["blk.0.attn_k.weight"].shape == (4 * 128, 2048)
    assert "blk.48.attn_norm.weight" not in entries and FULL.n_expert_used == 8
    assert 30e9 < big.planned_bytes(FULL) < 34e9
    assert 16e9 < big.planned_bytes(big.BIG_MODELS["big-qwen3moe-q4"]) < 19e9


@pytest.mark.parametrize("dtype", ["Q8_0", "Q4_0"])
def test_small_instance_reads_back(tmp_path: Path, dtype: str) -> None:
    spec = _small(dtype)
    path = big.build_big(spec, tmp_path, progress=False)
    assert path.name.startswith("big-test-") and not list(tmp_path.glob("*.tmp"))
    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == "qwen3moe"
    assert r.fields["qwen3moe.expert_count"].contents() == 8
    assert r.fields["general.file_type"].contents() == big._BLOCKS[spec.expert_qtype].file_type
    ts = {t.name: t for t in r.tensors}
    assert [t.name for t in r.tensors] == [e.name for e in big._plan(spec)]
    gate = ts["blk.1.ffn_gate_exps.weight"]
    assert gate.tensor_type.name == dtype and list(gate.shape) == [256, 128, 8]  # ggml order: n_in, n_out, E
    # every weight random, zero-mean, with the 1/sqrt(fan_in) std that keeps activations at unit scale
    for name, fan_in in (("blk.1.ffn_gate_exps.weight", 256), ("blk.0.ffn_down_exps.weight", 128)):
        w = gguf.quants.dequantize(ts[name].data, ts[name].tensor_type)
        assert abs(w.std() * np.sqrt(fan_in) - 1) < 0.02 and abs(w.mean()) < 0.01 / np.sqrt(fan_in)
        assert len({w[e].tobytes() for e in range(8)}) == 8  # distinct experts
    assert np.all(ts["blk.0.attn_norm.weight"].data == 1)
    # the last tensor ends the file, padded: nothing truncated or left over
    last = r.tensors[-1]
    assert last.data_offset + last.n_bytes <= path.stat().st_size < last.data_offset + last.n_bytes + 32


def test_same_tensors_as_the_tiny_fixture_writer(tmp_path: Path) -> None:
    """big.py only changes how the bytes are made: tiny's writer on the same spec gives the same tensor list,
    types and shapes, and the same dense (F16/F32) bytes."""
    spec = _small("Q8_0")
    ours = _tensors(big.build_big(spec, tmp_path, progress=False))
    tiny._write(spec, tmp_path / "tiny.gguf")
    theirs = _tensors(tmp_path / "tiny.gguf")
    assert list(ours) == list(theirs)
    for name, t in theirs.items():
        assert (t.tensor_type, list(t.shape)) == (ours[name].tensor_type, list(ours[name].shape)), name
        if "_exps" not in name:
            assert t.data.tobytes() == ours[name].data.tobytes(), name


def test_deterministic_and_cached(tmp_path: Path) -> None:
    a = big.build_big(_small(), tmp_path / "a", progress=False)
    b = big.build_big(_small(), tmp_path / "b", progress=False)
    assert a.name == b.name and a.read_bytes() == b.read_bytes()
    mtime = a.stat().st_mtime_ns
    assert big.build_big(_small(), tmp_path / "a", progress=False) == a and a.stat().st_mtime_ns == mtime
    assert big.build_big(replace(_small(), seed=1), tmp_path / "a", progress=False) != a  # spec is in the key


def test_streams_instead_of_holding_the_model(tmp_path: Path) -> None:
    # 64 experts x 4 layers: ~55 MB of experts; the writer holds one expert (~70 KB) or one dense tensor at a time
    spec = _small(n_layer=4, n_expert=64, n_ff_exp=256)
    tracemalloc.start()
    try:
        path = big.build_big(spec, tmp_path, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert path.stat().st_size > 50e6
    assert 0 < peak < path.stat().st_size / 10, peak  # tracemalloc sees numpy's buffers


def test_refuses_when_the_disk_is_too_small(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(big.shutil, "disk_usage", lambda _: type("U", (), {"free": 1 << 20})())
    with pytest.raises(SpecterError, match=r"big-test needs 0\.\d GB in .* and 0\.0 GB is free"):
        big.build_big(_small(), tmp_path, progress=False)
    assert not list(tmp_path.iterdir())


def test_only_random_block_types(tmp_path: Path) -> None:
    with pytest.raises(SpecterError, match="experts must be one of Q8_0, Q4_0"):
        big.build_big(_small("F16"), tmp_path, progress=False)
    with pytest.raises(SpecterError, match="unknown model"):
        big.build_big("big-nope", tmp_path)


def test_catalog_names_build_on_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {"big-qwen3moe", "big-qwen3moe-q4"} <= set(catalog.builtin_names())
    assert catalog.is_builtin("big-qwen3moe-q4")
    built = []
    monkeypatch.setattr(big, "build_big", lambda name: built.append(name) or Path(f"/cache/{name}.gguf"))
    assert catalog.resolve_model("big-qwen3moe") == Path("/cache/big-qwen3moe.gguf") and built == ["big-qwen3moe"]
    assert "big-qwen3moe" in run_cli("models", "list").stdout.split()


def test_the_bytes_do_not_depend_on_the_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts are made on several threads (the GPU machine builds big-qwen3moe-q4 inside its lease); each has its
    own random stream, so one thread and four write the same file."""
    spec = _small(n_layer=2, n_expert=16)
    monkeypatch.setattr(big, "_WORKERS", 1)
    one = big.build_big(spec, tmp_path / "one", progress=False).read_bytes()
    monkeypatch.setattr(big, "_WORKERS", 4)
    four = big.build_big(spec, tmp_path / "four", progress=False).read_bytes()
    assert one == four
