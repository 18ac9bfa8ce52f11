"""Misses the device reads from the host copy (csrc/mapped.cpp) on the RPC device, where a device copy of every
expert stands in for CUDA's view of pinned host memory: a speculated token that misses is not computed again, its
missed rows come from the second matmul, and the output is the unspeculated run's bit for bit (strict server, NaN
slots). What this cannot show: the rate a GPU reads host memory at (gpu_probe's zero_copy_gbps)."""

from __future__ import annotations

import numpy as np
import pytest
from test_speculate import N_TOKENS, PROMPT, decode, evict, slotted

from pyspecter import native
from pyspecter.cache import ExpertCache
from pyspecter.errors import SpecterError
from pyspecter.layerplan import LayerPlan
from pyspecter.layout import read_layout
from pyspecter.models.tiny import build_tiny
from pyspecter.native.devices import Device
from pyspecter.native.hooks import Hooks

pytestmark = pytest.mark.usefixtures("poisoned_slots")  # tests/conftest.py; the device: its `dev` fixture


@pytest.mark.parametrize("name", ["tiny-qwen3moe", "tiny-gptoss"])
def test_a_token_that_missed_is_read_from_the_host_copy_exactly(name: str, dev: Device) -> None:
    """Static residency with every expert of each layer out of its slot but one in two: most rows miss."""
    path = build_tiny(name)
    off = decode(path, dev, speculate=False, evicted=2)
    on = decode(path, dev, speculate=True, evicted=2, mapped=True)
    assert on["tokens"] == off["tokens"]
    assert np.array_equal(on["logits"], off["logits"])  # a row in both terms, or in neither, would show here
    s = on["stats"]
    # every ubatch ran speculated, none was computed again: the decode tokens and the prompt (7 tokens, under 8)
    assert s["spec_ubatches"] == N_TOKENS + 1 and s["spec_redos"] == 0, s
    # the same rows missed; the device read them from the host copy instead of the host computing them
    assert on["counters"]["miss_rows"] == off["counters"]["miss_rows"]
    assert s["mapped_rows"] > 0 and off["stats"]["mapped_rows"] == 0
    # the host heard the same routing, each layer once a token, in order
    assert on["heard"] == off["heard"]


LOG_MAX_TOKENS = 512  # csrc's PYSPECTER_LOG_MAX_TOKENS: the largest ubatch a speculated graph logs


def prompt(path, dev: Device, *, mapped: bool, n_tokens: int, n_batch: int) -> dict:
    """A prompt of n_tokens in ubatches of n_batch, every position's logits, with one expert in two of each layer
    taken out of its slot; the routing the host heard and the device's counters."""
    heard: list[tuple[int, tuple[int, ...]]] = []
    with slotted(path, dev, speculate=mapped, mapped=mapped) as (m, cache, lay):
        hooks = Hooks(m, lambda il, n_tok, n_used, ids, _w: heard.append((il, tuple(ids[:n_tok * n_used]))))
        try:
            evict(m, lay, 2)
            toks = (m.tokenize(PROMPT) * n_tokens)[:n_tokens]
            with native.Context(m, n_ctx=n_tokens + 16, n_batch=n_batch) as ctx:
                logits = ctx.decode(toks, logits_all=True)
            hooks.check()
            cache.check()
            stats = native.device_stats(m.ptr).as_dict()
        finally:
            hooks.close()
    return {"logits": logits, "heard": heard, "stats": stats}


@pytest.mark.parametrize("n_tokens, n_batch, speculated", [(100, 32, 4), (LOG_MAX_TOKENS + 20, LOG_MAX_TOKENS + 8, 1)])
def test_a_prompt_s_ubatches_read_their_misses_from_the_host_copy(n_tokens: int, n_batch: int, speculated: int,
                                                                 dev: Device) -> None:
    """Prompt-sized ubatches (over the 8 tokens hits are speculated on) run without host paths too when every
    slot layer is mapped: nothing is computed again, so a prompt that misses everywhere is as exact as a decode
    token. A ubatch larger than the log keeps its host paths (the 520-token one), the rest of the prompt does not."""
    path = build_tiny("tiny-qwen3moe")
    off = prompt(path, dev, mapped=False, n_tokens=n_tokens, n_batch=n_batch)
    on = prompt(path, dev, mapped=True, n_tokens=n_tokens, n_batch=n_batch)
    assert np.array_equal(on["logits"], off["logits"])  # every position's, not only the last
    s = on["stats"]
    assert s["spec_ubatches"] == speculated and s["spec_redos"] == 0, s
    assert s["mapped_rows"] > 0 and off["stats"]["spec_ubatches"] == 0
    assert on["heard"] == off["heard"]  # each layer once a ubatch, in order, the same experts


def test_under_lru_the_misses_move_in_after_the_token_and_stay_exact(dev: Device) -> None:
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    off = decode(path, dev, speculate=False, hook=True, n_slots=lay.n_expert // 2)
    on = decode(path, dev, speculate=True, hook=True, n_slots=lay.n_expert // 2, mapped=True)
    assert on["tokens"] == off["tokens"]
    assert np.array_equal(on["logits"], off["logits"])
    assert on["stats"]["spec_ubatches"] == N_TOKENS + 1 and on["stats"]["spec_redos"] == 0
    assert on["stats"]["mapped_rows"] > 0
    assert on["counters"]["uploads"] > 0  # LRU heard the misses from the log and brought them in
    # ... after the ubatch had run: its evictions waited for the next fence instead of each writing the device's
    # table at once (a copy to the device between tokens, queued behind the uploads in flight)
    assert on["stats"]["eviction_writes"] == 0, on["stats"]
    # ... and their uploads went out without waiting for the device work queued before them: nothing queued reads a
    # slot freed after its layer ran, and on a GPU the next token, queued meanwhile, would hold each upload back
    assert on["stats"]["compute_orders"] == 0, on["stats"]


def test_the_rpc_device_reads_from_a_copy_that_stands_in(dev: Device) -> None:
    """RPC cannot read this process's memory: a device copy of every expert stands in, and says what it took; the
    slots' own memory (llama_pyspecter_slots_nbytes) is what it is without it."""
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    plan = LayerPlan({L.index: "slots" for L in lay.layers}, lay.n_expert)
    nbytes = {}
    for miss in ("cpu", "mapped"):
        with native.Model(path, device=dev, host_layers=plan.host_layers) as m:
            cache = ExpertCache(m, lay, lay.n_expert // 2, miss=miss, kinds=plan.native_kinds())
            try:
                assert cache.mapped_copy_bytes == (lay.expert_total_bytes if miss == "mapped" else 0)
                nbytes[miss] = native.slots().slots_nbytes(m.ptr)
            finally:
                cache.close()
    assert nbytes["mapped"] == nbytes["cpu"] > 0


def test_without_a_stand_in_a_device_that_cannot_read_host_memory_maps_nothing(dev: Device) -> None:
    """The strict form (what Python asks of any device but RPC, where a copy would be a GPU's memory beyond the
    budget): refused, nothing half mapped, so the layers' graphs stay as they were and a later call can map."""
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    plan = LayerPlan({L.index: "slots" for L in lay.layers}, lay.n_expert)
    with native.Model(path, device=dev, host_layers=plan.host_layers) as m:
        cache = ExpertCache(m, lay, lay.n_expert // 2, miss="cpu", kinds=plan.native_kinds(), speculate=True)
        try:
            assert native.map_host_experts(m.ptr, False) == (native.ERR_ARG, 0)
            # a layer left mapped would refuse this (ERR_ENABLED: graphs built since may read its views)
            rc, nbytes = native.map_host_experts(m.ptr, True)
            assert rc == len(lay.layers) and nbytes == lay.expert_total_bytes
        finally:
            cache.close()


@pytest.mark.parametrize("why", ["zero slots", "no speculation", "speculation refused", "no device"])
def test_mapped_misses_need_negative_ids_speculation_and_a_device(why: str, dev: Device,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused in one line where the mapped path cannot run: a device without negative ids, no device, speculation
    not asked for, or refused by C (SPECTER_SPECULATE=0 here; a model with recurrent layers, whose state a redo
    would advance twice, is refused the same way: llama_pyspecter_set_speculate says whether it is on)."""
    if why == "zero slots":
        monkeypatch.setenv("SPECTER_ZERO_SLOTS", "1")
    if why == "speculation refused":
        monkeypatch.setenv("SPECTER_SPECULATE", "0")
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    plan = LayerPlan({L.index: "slots" for L in lay.layers}, lay.n_expert)
    device = None if why == "no device" else dev
    with native.Model(path, device=device, host_layers=plan.host_layers if device else None) as m:
        with pytest.raises(SpecterError, match="takes no negative expert ids|needs a device"):
            ExpertCache(m, lay, lay.n_expert, miss="mapped", kinds=plan.native_kinds(),
                        speculate=why != "no speculation")


def test_a_session_with_mapped_misses_decodes_what_cpu_misses_decode(dev: Device) -> None:
    """generate's session with --miss mapped, slots in every layer: the tokens of --miss cpu, every decode token
    speculated and none redone, and no learned predictor (it reads each layer's input mid-token, which would keep
    the host paths)."""
    from pyspecter.session import Session, SessionConfig

    path = build_tiny("tiny-qwen3moe")
    got = {}
    for miss in ("cpu", "mapped"):
        with Session(SessionConfig(model=path, budget="50%", device=dev.spec, n_ctx=256, layer_plan="slots",
                                   miss=miss)) as s:
            tokens = s.generate(s.target.tokenize("the scheduler counts what it does"), 12, stop_at_eog=False)
            got[miss] = (tokens, s.cache.counters(), s.predictor)
    assert got["mapped"][0] == got["cpu"][0]
    c = got["mapped"][1]
    assert c["spec_ubatches"] >= 11 and c["spec_redos"] == 0 and c["mapped_rows"] > 0, c
    assert got["mapped"][2] is None


def test_a_draft_s_verification_windows_read_their_misses_from_the_host_copy(dev: Device, tmp_path) -> None:
    """Speculative decoding with a draft: the full model's verification windows (K + 1 tokens, up to 8) are
    speculated ubatches too, their misses read from the copy, and the accepted tokens are --miss cpu's."""
    from pyspecter.models.draft import make_draft
    from pyspecter.session import Session, SessionConfig

    path = build_tiny("tiny-qwen3moe")
    draft = make_draft(path, tmp_path / "draft.gguf", experts_type="Q4_0", progress=False)
    got = {}
    for miss in ("cpu", "mapped"):
        with Session(SessionConfig(model=path, budget="75%", device=dev.spec, n_ctx=256, draft=draft, k=3,
                                   adaptive=False, miss=miss)) as s:
            assert s.decoder is not None and s.layer_plan is None
            tokens = s.generate(s.target.tokenize("the scheduler counts what it does"), 16, stop_at_eog=False)
            got[miss] = (tokens, s.cache.counters(), s.decoder.stats.steps)
    assert got["mapped"][0] == got["cpu"][0]
    c, steps = got["mapped"][1], got["mapped"][2]
    assert c["spec_redos"] == 0 and c["mapped_rows"] > 0, c
    assert c["spec_ubatches"] >= steps, (c, steps)  # every step's verification window, at least


def test_the_sessions_auto_plan_prices_mapped_slot_layers(dev: Device) -> None:
    """With --miss mapped and no layer plan, the session's plan is the cost model's with its slot layers priced as
    mapped runs them (a row read from the host copy, measured on the model), never predicted slower than stock at
    the same memory; its tokens are stock's."""
    from pyspecter.session import Session, SessionConfig

    path = build_tiny("tiny-qwen3moe")
    got = {}
    for miss in ("cpu", "mapped"):
        with Session(SessionConfig(model=path, budget="50%", device=dev.spec, n_ctx=256, miss=miss)) as s:
            got[miss] = (s.generate(s.target.tokenize("the scheduler counts what it does"), 8, stop_at_eog=False),
                         s.layer_plan)
    plan = got["mapped"][1]
    assert plan is not None and plan.info["mapped"] and plan.info["costs"]["map_row_us"] >= 0
    assert 0.0 <= plan.info["costs"]["upload_share"] <= 1.0
    assert plan.info["predicted_ms"] <= plan.info["predicted_stock_n_cpu_moe_ms"] + 1e-9
    assert got["mapped"][0] == got["cpu"][0]


def test_a_routing_after_the_slot_path_never_waits_for_a_read(dev: Device) -> None:
    """On a link slow enough that uploads are still in flight when the next token routes: where the rows looked up
    the table already (a split route's op for --miss cpu, a speculated token's settling for --miss mapped), a read
    landing serves none of them, so none is waited for (it held the compute thread, or the next token's launch);
    the decode is the same, and the uploads still go out."""
    from pyspecter.session import Session, SessionConfig

    path = build_tiny("tiny-qwen3moe")
    got = {}
    for miss in ("cpu", "mapped"):
        with Session(SessionConfig(model=path, budget="50%", device=dev.spec, tier="emulated:0.02", n_ctx=256,
                                   layer_plan="slots", miss=miss)) as s:
            tokens = s.generate(s.target.tokenize("the scheduler counts what it does"), 16, stop_at_eog=False)
            got[miss] = (tokens, s.cache.counters())
    assert got["mapped"][0] == got["cpu"][0]
    for miss, (_, c) in got.items():
        assert c["uploads"] > 0 and c["waited"] == 0, (miss, c)
