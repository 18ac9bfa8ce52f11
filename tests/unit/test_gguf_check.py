"""check_gguf refuses what llama.cpp would abort on, one rule per test, and passes the project's own models.

Fast: small GGUFs written here with gguf.GGUFWriter; no llama.cpp build needed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as T

from pyspecter.errors import SpecterError
from pyspecter.gguf_check import LLAMA_MAX_EXPERTS, check_gguf
from pyspecter.layout import read_layout
from pyspecter.models import tiny

A = "qwen3moe."
N_LAYER, N_EMBD, N_EXPERT, N_FF, N_VOCAB = 2, 16, 4, 8, 8


def _base_kv() -> dict[str, tuple[Any, T]]:
    """A valid small qwen3moe: key -> (value, GGUF type); arrays as (list, ARRAY-of-type) via _ARR."""
    return {
        A + "block_count": (N_LAYER, T.UINT32),
        A + "context_length": (256, T.UINT32),
        A + "embedding_length": (N_EMBD, T.UINT32),
        A + "feed_forward_length": (N_FF, T.UINT32),
        A + "attention.head_count": (2, T.UINT32),
        A + "attention.head_count_kv": (1, T.UINT32),
        A + "attention.key_length": (8, T.UINT32),
        A + "attention.value_length": (8, T.UINT32),
        A + "rope.dimension_count": (8, T.UINT32),
        A + "rope.freq_base": (10000.0, T.FLOAT32),
        A + "attention.layer_norm_rms_epsilon": (1e-6, T.FLOAT32),
        A + "expert_count": (N_EXPERT, T.UINT32),
        A + "expert_used_count": (2, T.UINT32),
        A + "expert_feed_forward_length": (N_FF, T.UINT32),
        "tokenizer.ggml.model": ("test", T.STRING),
        "tokenizer.ggml.tokens": ([f"tok_{i}" for i in range(N_VOCAB)], (T.ARRAY, T.STRING)),
        "tokenizer.ggml.scores": ([0.0] * N_VOCAB, (T.ARRAY, T.FLOAT32)),
    }


def _base_tensors() -> dict[str, np.ndarray]:
    """numpy shapes (ggml order reversed): experts outermost."""
    t = {"token_embd.weight": np.zeros((N_VOCAB, N_EMBD), np.float32)}
    for il in range(N_LAYER):
        # 2 query heads and 1 kv head of 8
        t[f"blk.{il}.attn_q.weight"] = np.zeros((16, N_EMBD), np.float32)
        t[f"blk.{il}.attn_k.weight"] = np.zeros((8, N_EMBD), np.float32)
        t[f"blk.{il}.attn_v.weight"] = np.zeros((8, N_EMBD), np.float32)
        t[f"blk.{il}.attn_output.weight"] = np.zeros((N_EMBD, 16), np.float32)
        t[f"blk.{il}.ffn_gate_inp.weight"] = np.zeros((N_EXPERT, N_EMBD), np.float32)
        for kind in ("gate", "up"):
            t[f"blk.{il}.ffn_{kind}_exps.weight"] = np.zeros((N_EXPERT, N_FF, N_EMBD), np.float32)
        t[f"blk.{il}.ffn_down_exps.weight"] = np.zeros((N_EXPERT, N_EMBD, N_FF), np.float32)
    return t


def write(path: Path, kv: dict[str, Any] | None = None, tensors: dict[str, np.ndarray | None] | None = None,
          arch: str = "qwen3moe") -> Path:
    """The base model with `kv` entries replaced or added ((value, type); None drops the key) and `tensors`
    replaced, added or (None) dropped."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, entry in {**_base_kv(), **(kv or {})}.items():
        if entry is None:
            continue
        value, vtype = entry
        if isinstance(vtype, tuple):
            w.add_key_value(key, value, vtype[0], sub_type=vtype[1])
        else:
            w.add_key_value(key, value, vtype)
    for name, data in {**_base_tensors(), **(tensors or {})}.items():
        if data is not None:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def check(path: Path) -> None:
    check_gguf(gguf.GGUFReader(path), path)


def refused(path: Path, *words: str) -> str:
    with pytest.raises(SpecterError) as exc:
        check(path)
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg
    for word in words:
        assert word in msg, msg
    return msg


@pytest.fixture
def gg(tmp_path: Path):
    return lambda **kw: write(tmp_path / "m.gguf", **kw)


def test_base_model_passes(gg) -> None:
    check(gg())
    assert read_layout(gg()).n_expert == N_EXPERT


# --- hyperparameters ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("eps", [-1e-6, math.nan, math.inf])
def test_bad_norm_eps(gg, eps: float) -> None:
    refused(gg(kv={A + "attention.layer_norm_rms_epsilon": (eps, T.FLOAT32)}), "layer_norm_rms_epsilon")


def test_zero_eps_allowed(gg) -> None:
    # ggml asserts eps >= 0, so 0 is legal upstream
    check(gg(kv={A + "attention.layer_norm_rms_epsilon": (0.0, T.FLOAT32)}))


def test_too_many_experts(gg) -> None:
    refused(gg(kv={A + "expert_count": (LLAMA_MAX_EXPERTS + 1, T.UINT32)}), "expert_count", str(LLAMA_MAX_EXPERTS))


@pytest.mark.parametrize("used", [0, N_EXPERT + 1])
def test_expert_used_count_out_of_range(gg, used: int) -> None:
    refused(gg(kv={A + "expert_used_count": (used, T.UINT32)}), "expert_used_count", str(used))


def test_per_layer_used_count(gg) -> None:
    check(gg(kv={A + "expert_used_count": ([2, 3], (T.ARRAY, T.UINT32))}))
    refused(gg(kv={A + "expert_used_count": ([2, 5], (T.ARRAY, T.UINT32))}), "expert_used_count", "5")
    refused(gg(kv={A + "expert_used_count": ([2, 2, 2], (T.ARRAY, T.UINT32))}), "3 entries", "one per layer")


def test_wrong_type_for_expert_count(gg) -> None:
    refused(gg(kv={A + "expert_count": ("4", T.STRING)}), "expert_count is STRING, expected UINT32")
    refused(gg(kv={A + "expert_count": ([4.0], (T.ARRAY, T.FLOAT32))}), "an array of FLOAT32", "UINT32")
    refused(gg(kv={A + "expert_count": (4, T.INT32)}), "INT32")


@pytest.mark.parametrize("n_layer", [0, 513])
def test_block_count_range(gg, n_layer: int) -> None:
    refused(gg(kv={A + "block_count": (n_layer, T.UINT32)}), "block_count", str(n_layer))


def test_head_count_kv_must_divide(gg) -> None:
    refused(gg(kv={A + "attention.head_count": (3, T.UINT32), A + "attention.head_count_kv": (2, T.UINT32)}),
            "not a multiple")


def test_attention_tensors_must_match_heads(gg) -> None:
    # qwen2moe's loader creates attn_q as n_embd x n_embd whatever head_count says; the graph then aborts
    refused(gg(kv={A + "attention.head_count": (4, T.UINT32)}), "blk.0.attn_q.weight", "4 heads")
    refused(gg(tensors={"blk.1.attn_output.weight": np.zeros((N_EMBD, 24), np.float32)}), "attn_output")
    refused(gg(tensors={"blk.0.attn_v.weight": np.zeros((16, N_EMBD), np.float32)}), "attn_v")


def test_rope_dimension_must_match_head_for_qwen3moe(gg) -> None:
    refused(gg(kv={A + "rope.dimension_count": (6, T.UINT32)}), "rope.dimension_count")
    refused(gg(kv={A + "rope.dimension_count": (7, T.UINT32)}), "even")


@pytest.mark.parametrize("base", [0.0, -1.0, math.nan])
def test_rope_freq_base(gg, base: float) -> None:
    refused(gg(kv={A + "rope.freq_base": (base, T.FLOAT32)}), "rope.freq_base")


def test_unknown_rope_scaling_type(gg) -> None:
    refused(gg(kv={A + "rope.scaling.type": ("wobbly", T.STRING)}), "rope.scaling.type")


def test_expert_groups(gg) -> None:
    refused(gg(kv={A + "expert_group_count": (3, T.UINT32), A + "expert_group_used_count": (1, T.UINT32)}),
            "expert groups")


# --- vocabulary -----------------------------------------------------------------------------------------------

def _tokens(tokens: list[str]) -> dict[str, Any]:
    n = len(tokens)
    return {"tokenizer.ggml.tokens": (tokens, (T.ARRAY, T.STRING)),
            "tokenizer.ggml.scores": ([0.0] * n, (T.ARRAY, T.FLOAT32))}


def test_duplicate_vocab(gg) -> None:
    toks = [f"tok_{i}" for i in range(N_VOCAB)]
    toks[5] = "tok_2"
    refused(gg(kv=_tokens(toks)), "duplicate", "tokens 2 and 5")


def test_duplicate_vocab_after_nul(gg) -> None:
    # llama.cpp reads tokens as C strings: these two read the same
    toks = [f"tok_{i}" for i in range(N_VOCAB)]
    toks[3], toks[4] = "ab\0x", "ab\0y"
    refused(gg(kv=_tokens(toks)), "duplicate")


def test_empty_token_is_renamed_not_duplicated(gg) -> None:
    toks = [f"tok_{i}" for i in range(N_VOCAB)]
    toks[3] = ""
    check(gg(kv=_tokens(toks)))
    toks[4] = "[EMPTY_3]"  # what llama.cpp renames token 3 to
    refused(gg(kv=_tokens(toks)), "duplicate")


def test_scores_shorter_than_tokens(gg) -> None:
    refused(gg(kv={"tokenizer.ggml.scores": ([0.0] * (N_VOCAB - 1), (T.ARRAY, T.FLOAT32))}), "scores")
    refused(gg(kv={"tokenizer.ggml.token_type": ([1] * (N_VOCAB - 1), (T.ARRAY, T.INT32))}), "token_type")


def test_special_token_out_of_range(gg) -> None:
    check(gg(kv={"tokenizer.ggml.eos_token_id": (N_VOCAB - 1, T.UINT32)}))
    refused(gg(kv={"tokenizer.ggml.eos_token_id": (N_VOCAB, T.UINT32)}), "eos_token_id", "outside")
    refused(gg(kv={"tokenizer.ggml.bos_token_id": (-1, T.INT32)}), "bos_token_id is INT32")


def test_tokenizer_model(gg) -> None:
    refused(gg(kv={"tokenizer.ggml.model": ("sentencepiece9", T.STRING)}), "does not know")
    refused(gg(kv={"tokenizer.ggml.model": ("none", T.STRING)}), "no vocabulary")
    refused(gg(kv={"tokenizer.ggml.model": None}), "no tokenizer")


def test_added_bos_must_exist(gg) -> None:
    # SPM ("llama") adds bos by default, and its default id 1 is outside a one-token vocabulary
    one = {**_tokens(["a"]), "tokenizer.ggml.model": ("llama", T.STRING)}
    tensors = {"token_embd.weight": np.zeros((1, N_EMBD), np.float32)}
    refused(gg(kv=one, tensors=tensors), "bos")
    check(gg(kv={**one, "tokenizer.ggml.add_bos_token": (False, T.BOOL)}, tensors=tensors))


# --- tensors --------------------------------------------------------------------------------------------------

def test_expert_tensor_with_wrong_expert_count(gg) -> None:
    bad = np.zeros((N_EXPERT - 1, N_FF, N_EMBD), np.float32)
    refused(gg(tensors={"blk.1.ffn_up_exps.weight": bad}), "blk.1.ffn_up_exps.weight", "experts")
    refused(gg(tensors={"blk.0.ffn_gate_inp.weight": np.zeros((N_EXPERT + 1, N_EMBD), np.float32)}),
            "ffn_gate_inp")


def test_token_embd_shape(gg) -> None:
    refused(gg(tensors={"token_embd.weight": np.zeros((N_VOCAB + 1, N_EMBD), np.float32)}), "token_embd")
    refused(gg(tensors={"token_embd.weight": np.zeros((N_VOCAB, N_EMBD + 1), np.float32)}), "token_embd")


def test_tensor_past_block_count(gg) -> None:
    refused(gg(tensors={"blk.7.attn_norm.weight": np.ones(N_EMBD, np.float32)}), "blk.7", "block_count")


def test_tensor_data_past_end_of_file(gg, tmp_path: Path) -> None:
    path = gg()
    reader = gguf.GGUFReader(path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: reader.tensors[-1].data_offset + 4])
    with pytest.raises(SpecterError, match="truncated GGUF"):
        read_layout(cut)


def test_read_layout_runs_the_check(gg) -> None:
    with pytest.raises(SpecterError, match="expert_count"):
        read_layout(gg(kv={A + "expert_count": ("many", T.STRING)}))


def test_dense_model_without_tokenizer_is_left_to_require_moe(gg) -> None:
    # a dense file gets "no experts" from require_moe, not a tokenizer complaint
    kv = {A + "expert_count": None, A + "expert_used_count": None, "tokenizer.ggml.model": None,
          "tokenizer.ggml.tokens": None, "tokenizer.ggml.scores": None}
    tensors = {name: None for name in _base_tensors() if "exps" in name or "gate_inp" in name}
    with pytest.raises(SpecterError, match="no experts"):
        read_layout(gg(kv=kv, tensors=tensors)).require_moe()


# --- the project's own models ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(tiny.TINY_MODELS))
def test_tiny_fixtures_pass(name: str, tmp_path: Path) -> None:
    path = tiny.build_tiny(name, tmp_path)
    check(path)
    assert read_layout(path).is_moe


def test_bench_fixture_header_passes(tmp_path: Path) -> None:
    # bench-qwen3moe is 1.7 GB; its header comes from the same builder, so check the header with no tensors
    write_metadata = getattr(tiny, "_write_metadata", None)
    if write_metadata is None:
        pytest.skip("pyspecter.models.tiny no longer has _write_metadata")
    path = tmp_path / "bench.gguf"
    spec = tiny.BENCH_MODELS["bench-qwen3moe"]
    w = gguf.GGUFWriter(str(path), spec.arch)
    write_metadata(w, spec)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    check(path)
