"""Speculating that a ubatch hits (csrc/speculate.cpp) on the RPC device, whose --strict server aborts on an id a
GPU kernel would not survive, with slots that start as NaN: a token that hit everywhere runs with no host path, a
token that missed is computed again with its host paths, and the output is the one without speculation, bit for
bit. The routing the host hears is the same too: each layer once a token, in order, after the redo if any."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from pyspecter import native
from pyspecter.cache import ExpertCache
from pyspecter.layerplan import LayerPlan
from pyspecter.layout import ModelLayout, read_layout
from pyspecter.models.tiny import build_tiny
from pyspecter.native.devices import Device
from pyspecter.native.hooks import Hooks

PROMPT = "the scheduler counts what it does"
N_TOKENS = 24


pytestmark = pytest.mark.usefixtures("poisoned_slots")  # tests/conftest.py; the device: its `dev` fixture


@contextmanager
def slotted(path, dev: Device, *, speculate: bool, hook: bool = False, n_slots: int | None = None,
            mapped: bool = False) -> Iterator[tuple[native.Model, ExpertCache, ModelLayout]]:
    """The model on the device with every MoE layer in slots: every expert resident (hook=False: static residency,
    warmed) or LRU over n_slots (hook=True); ``mapped``: miss mode mapped (the device reads misses from the host
    copy), else cpu."""
    lay = read_layout(path)
    plan = LayerPlan({L.index: "slots" for L in lay.layers}, lay.n_expert)
    with native.Model(path, device=dev, host_layers=plan.host_layers) as m:
        cache = ExpertCache(m, lay, n_slots or lay.n_expert, miss="mapped" if mapped else "cpu",
                            kinds=plan.native_kinds(), hook=hook, speculate=speculate)
        try:
            if not hook:
                cache.warm({L.index: list(range(lay.n_expert)) for L in lay.layers})
            yield m, cache, lay
        finally:
            cache.close()


def evict(m: native.Model, lay: ModelLayout, step: int) -> None:
    """Take every step-th expert of each layer out of its slot: tokens that route to one miss."""
    for L in lay.layers:
        for e in range(0, lay.n_expert, step):
            assert native.slots().set_slot(m.ptr, L.index, e, -1) == 0


def decode(path, dev: Device, *, speculate: bool, evicted: int = 0, hook: bool = False, n_slots: int | None = None,
           on_input: bool = False, mapped: bool = False) -> dict:
    """Greedy tokens, their logits, the device's counters, the cache's and the routing the host heard
    (``slotted``; with static residency ``evicted`` experts of each layer taken out)."""
    heard: list[tuple[int, tuple[int, ...]]] = []
    with slotted(path, dev, speculate=speculate, hook=hook, n_slots=n_slots, mapped=mapped) as (m, cache, lay):
        hooks = Hooks(m, lambda il, n_tok, n_used, ids, _w: heard.append((il, tuple(ids[:n_tok * n_used]))),
                      on_input=(lambda _il, _x: None) if on_input else None)
        try:
            if evicted:
                evict(m, lay, lay.n_expert // evicted)
            tokens, logits = [], []
            with native.Context(m) as ctx:
                lg = ctx.decode(m.tokenize(PROMPT))
                heard.clear()
                for _ in range(N_TOKENS):
                    tokens.append(int(np.argmax(lg)))
                    logits.append(lg)
                    lg = ctx.decode([tokens[-1]])
            hooks.check()
            cache.check()
            stats = native.device_stats(m.ptr).as_dict()
            counters = cache.counters()
        finally:
            hooks.close()
    return {"tokens": tokens, "logits": np.stack(logits), "stats": stats, "heard": heard, "counters": counters}


@pytest.mark.parametrize("name", ["tiny-qwen3moe", "tiny-gptoss"])
def test_a_speculated_token_that_missed_is_computed_again_exactly(name: str, dev: Device) -> None:
    path = build_tiny(name)
    off = decode(path, dev, speculate=False, evicted=1)
    on = decode(path, dev, speculate=True, evicted=1)
    assert on["tokens"] == off["tokens"]
    assert np.array_equal(on["logits"], off["logits"])  # NaN slots or a skipped redo would show here
    s = on["stats"]
    assert s["spec_redos"] > 0, s  # tokens that read an evicted expert's zero slot were computed again
    assert s["spec_ubatches"] > s["spec_redos"], s  # and others hit everywhere and were kept
    assert off["stats"]["spec_ubatches"] == 0
    # the host heard each layer once a token, in the same order, with the same experts: a kept token's routing
    # from the device's log, a redone one's from its host paths only
    assert len(on["heard"]) == N_TOKENS * len(read_layout(path).layers)
    assert on["heard"] == off["heard"]


def test_speculation_under_lru_is_exact(dev: Device) -> None:
    """Native residency decides from the log after a kept token, and in the redo's routing ops after one that
    missed: the slots move differently in time, the output does not."""
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    off = decode(path, dev, speculate=False, hook=True, n_slots=lay.n_expert - 2)
    on = decode(path, dev, speculate=True, hook=True, n_slots=lay.n_expert - 2)
    assert on["tokens"] == off["tokens"]
    assert np.array_equal(on["logits"], off["logits"])
    assert on["stats"]["spec_ubatches"] > 0


def test_every_expert_resident_never_redoes(dev: Device) -> None:
    path = build_tiny("tiny-qwen3moe")
    on = decode(path, dev, speculate=True)
    # the first decode token follows the prompt, which ran with host paths and hit: every token speculates
    assert on["stats"]["spec_ubatches"] == N_TOKENS and on["stats"]["spec_redos"] == 0


def test_a_reader_of_the_layer_input_keeps_the_host_paths(dev: Device) -> None:
    """An input hook (learned predictors) reads each layer's input while the token runs: no speculation."""
    path = build_tiny("tiny-qwen3moe")
    on = decode(path, dev, speculate=True, on_input=True)
    assert on["stats"]["spec_ubatches"] == 0


def test_a_verification_window_speculates_and_stays_exact(dev: Device) -> None:
    """Ubatches of several tokens (a draft's K + 1) speculate as one-token ones do, up to 8 tokens; a prompt-sized
    ubatch keeps its host paths."""
    path = build_tiny("tiny-qwen3moe")
    got = {}
    for speculate in (False, True):
        with slotted(path, dev, speculate=speculate) as (m, _, _), native.Context(m) as ctx:
            rows = [ctx.decode(m.tokenize(PROMPT), logits_all=True)]  # hits: the windows may speculate
            for start in range(5, 45, 4):
                rows.append(ctx.decode(list(range(start, start + 4)), logits_all=True))
            rows.append(ctx.decode(list(range(50, 70)), logits_all=True))  # 20 tokens: host paths
            stats = native.device_stats(m.ptr).as_dict()
        got[speculate] = (np.concatenate(rows), stats)
    assert np.array_equal(got[True][0], got[False][0])
    assert got[True][1]["spec_ubatches"] == 10 and got[True][1]["spec_redos"] == 0


def test_turned_off_between_decodes_the_graph_keeps_its_host_paths_again(dev: Device) -> None:
    """A graph built speculated is not reused once speculation is off: the next token is built with host paths,
    so an expert taken out after that computes on the host, exactly, with nothing speculated."""
    path = build_tiny("tiny-qwen3moe")
    got = {}
    for speculate in (False, True):
        with slotted(path, dev, speculate=speculate) as (m, _, lay), native.Context(m) as ctx:
            rows = [ctx.decode(m.tokenize(PROMPT))]
            rows += [ctx.decode([t]) for t in range(5, 9)]  # speculated where on
            before = native.device_stats(m.ptr).spec_ubatches
            native.slots().set_speculate(m.ptr, False)
            evict(m, lay, 2)
            rows += [ctx.decode([t]) for t in range(9, 17)]
            after = native.device_stats(m.ptr).spec_ubatches
        got[speculate] = (np.stack(rows), before, after)
    assert np.array_equal(got[True][0], got[False][0])
    assert got[True][1] == 4 and got[True][2] == 4


def computed_graphs(dev: Device, *, evicted: bool = True, **slotted_kw) -> list[tuple[bool, tuple]]:
    """Every node of every graph computed for N_TOKENS one-token decodes after the prompt, in order, with whether
    the graph was speculated; each node as ggml-cuda compares it to keep a captured CUDA graph (its address, its
    tensor's fields, its sources' addresses and data: ``ggml_cuda_graph_update_required``). Read through the eval
    callback; ``evicted``: expert 0 of each layer out of its slot under static residency (tokens that route to it
    miss: speculated ones are redone)."""
    import ctypes

    import llama_cpp
    from llama_cpp import _ggml

    from pyspecter.models.calibration import _GgmlTensor

    get_name = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(("ggml_get_name", _ggml.libggml))
    computes: list[list[tuple]] = []

    def on_eval(addr: int, ask: bool, _ud) -> bool:
        if ask:
            name = get_name(addr)
            if not computes or computes[-1][0][0] == name:  # the graph's first node again: its next compute
                computes.append([])
            srcs = tuple((s, _GgmlTensor.from_address(s).data) for s in _GgmlTensor.from_address(addr).src if s)
            computes[-1].append((name, addr, ctypes.string_at(addr, ctypes.sizeof(_GgmlTensor)), srcs))
        return not ask  # wanting no node's data, each split runs whole

    cb = llama_cpp.ggml_backend_sched_eval_callback(on_eval)
    ran: list[tuple[bool, tuple]] = []
    path = build_tiny("tiny-qwen3moe")
    with slotted(path, dev, **slotted_kw) as (m, _, lay), native.Context(m, cb_eval=cb) as ctx:
        if evicted:
            evict(m, lay, lay.n_expert)
        ctx.decode(m.tokenize(PROMPT))
        token = 5
        for _ in range(N_TOKENS):
            s0, computes[:] = native.device_stats(m.ptr), []
            lg = ctx.decode([token])
            s1, token = native.device_stats(m.ptr), int(np.argmax(lg))
            spec, redo = s1.spec_ubatches - s0.spec_ubatches, s1.spec_redos - s0.spec_redos
            # one graph computed, or a speculated one and then its redo with host paths
            assert len(computes) == 1 + redo, (len(computes), spec, redo)
            ran.append((spec == 1, tuple(computes[0])))
            if redo:
                ran.append((False, tuple(computes[1])))
    return ran


def graphs_by_form(ran: list[tuple[bool, tuple]]) -> dict[bool, set[tuple]]:
    """The distinct graphs each form computed, from the first speculated one on (it makes the scheduler plan its
    compute buffer again: the form with host paths moves once, from the reserve's plan to its own)."""
    first = next((i for i, (spec, _) in enumerate(ran) if spec), 0)
    return {spec: {nodes for s, nodes in ran[first:] if s == spec} for spec in (True, False)}


def test_each_form_keeps_its_cuda_graph(dev: Device) -> None:
    """ggml-cuda keys a captured CUDA graph by its split's first node's address and runs without one again when a
    node changed. So each form's graph is the same from one token to the next, and the two forms share no node:
    they are built in arenas of their own (patch 0007), so switching forms after a miss keeps both captured."""
    ran = computed_graphs(dev, speculate=True)
    assert sum(not s for s, _ in ran) >= 3 and sum(s for s, _ in ran) >= 2, [s for s, _ in ran]  # both forms ran
    forms = graphs_by_form(ran)
    assert len(forms[True]) == 1 and len(forms[False]) == 1, {k: len(v) for k, v in forms.items()}
    (spec_nodes,), (host_nodes,) = forms[True], forms[False]
    assert not {n[1] for n in spec_nodes} & {n[1] for n in host_nodes}


@pytest.mark.parametrize("how", ["lru", "lru-speculated", "lru-mapped"])
def test_a_graph_under_lru_is_the_same_every_token(how: str, dev: Device) -> None:
    """Uploads, evictions and table pushes change data, never a node: under LRU (its slots moving every token), with
    host paths, speculated, or reading misses from the host copy, each form's graph stays as ggml-cuda captured it."""
    n_expert = read_layout(build_tiny("tiny-qwen3moe")).n_expert
    ran = computed_graphs(dev, evicted=False, speculate=how != "lru", hook=True, n_slots=n_expert - 2,
                          mapped=how == "lru-mapped")
    forms = graphs_by_form(ran)
    assert all(len(v) <= 1 for v in forms.values()), {k: len(v) for k, v in forms.items()}
    if how != "lru":
        assert forms[True], [s for s, _ in ran]
