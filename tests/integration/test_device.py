"""The device tier on a device every machine has: llama.cpp's RPC backend, served by `pyspecter rpc-server` on a
free localhost port. Its buffers are not host memory, exactly a GPU's situation: layers and expert slots on the
device, the experts' host copy in RAM, misses computed on the CPU or uploaded first. Greedy tokens and logits must
equal stock llama.cpp's with the same placement, including a prompt of >= 32 tokens (the batch size at which
llama.cpp's op offload would send a host-weight matmul, with our negative ids, to the device)."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from pyspecter import native
from pyspecter.cache import ExpertCache
from pyspecter.engine import SpeculativeDecoder, greedy
from pyspecter.layerplan import DeviceCosts, LayerPlan, choose_plan, predict_us, stock_plan
from pyspecter.layout import read_layout
from pyspecter.models.draft import make_draft
from pyspecter.models.tiny import TINY_MODELS, build_tiny
from pyspecter.native import graph_splits
from pyspecter.native.devices import Device, open_device
from pyspecter.native.hooks import Hooks
from pyspecter.predict import DraftRouting
from pyspecter.study.verify import verify

# >= 32 tokens with every fixture's tokenizer
LONG_PROMPT = ("The device tier keeps expert slots in the accelerator's memory and computes every miss exactly "
               "on the host, so the output never depends on what is resident. " * 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    # --strict: the server aborts on an expert id a GPU kernel would not survive (out of range, or twice in a token)
    proc = subprocess.Popen([sys.executable, "-m", "pyspecter", "rpc-server", "--port", str(port), "--threads", "1",
                             "--strict"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rpc-server exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("rpc-server did not start listening")


def stop_server(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)


def rpc_device(*, count_syncs: bool = False) -> Iterator[Device]:
    """A strict server's device for one module's in-process tests (a fixture's body: ``yield from``);
    count_syncs: count its synchronisations from before any context of this process's is made on it."""
    port = free_port()
    proc = start_server(port)
    try:
        d = open_device(f"rpc:127.0.0.1:{port}")
        assert d is not None
        if count_syncs:
            native.count_syncs(d.ptr)
        yield d
    finally:
        stop_server(proc)


@pytest.fixture(autouse=True)
def poisoned_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device slots start as NaN here, not zeros (a GPU's fresh memory is garbage, the RPC server's is zeroed): a
    read of a slot before an upload wrote it, or of a zero slot never zeroed, turns the logits NaN."""
    monkeypatch.setenv("SPECTER_POISON_SLOTS", "1")


@pytest.fixture(scope="module")
def rpc() -> Iterator[str]:
    """One server for this process's in-process tests (ggml keeps one connection per endpoint per process)."""
    port = free_port()
    proc = start_server(port)
    yield f"rpc:127.0.0.1:{port}"
    stop_server(proc)


@pytest.fixture
def own_rpc() -> Iterator[tuple[str, subprocess.Popen]]:
    """A server for one CLI run (the server serves one client at a time, and this process may hold another)."""
    port = free_port()
    proc = start_server(port)
    yield f"rpc:127.0.0.1:{port}", proc
    if proc.poll() is None:
        stop_server(proc)


@pytest.mark.parametrize("miss", ["cpu", "mapped"])
@pytest.mark.parametrize("name", ["tiny-qwen3moe", "tiny-mixtral"])
def test_an_adaptive_hot_set_on_rpc_device_is_exact(name: str, miss: str, rpc: str) -> None:
    """verify --hot (what a layer plan's hot slot layers run): the profile's hot set in half the slots, no
    residency engine, re-chosen from the text's routing between decodes (experts uploaded into slots the device
    read the token before); the misses on the host or read from the host copy; stock's tokens and logits to the
    bit, and the GPU contract gpu_check's verify step holds it to."""
    from pyspecter.hitrates import hot_profile
    from pyspecter.policies import hot_experts

    path = build_tiny(name)
    lay = read_layout(path)
    half = lay.n_expert // 2
    r = verify(path, slots=half, miss=miss, prompt=LONG_PROMPT, n_tokens=12, device=rpc, hot=True)
    assert r["policy"] == "hot" and not r["native"]
    assert r["identical_tokens"] and r["max_abs_logit_diff"] == 0.0, (r["stock_tokens"], r["slot_tokens"])
    assert r["contract_ok"], r["contract"]
    assert r["hot_moves"] > 0  # the prompt and 12 tokens are two windows: the set moved
    # the profile's set, then the moves that landed (queued on the upload thread: the last may still be in flight)
    assert half * len(lay.layers) < r["uploads"] <= half * len(lay.layers) + r["hot_moves"]
    prof = hot_profile(path, lay)
    assert 0.0 < r["hit_rate"] < 1.0 and all(len(hot_experts(prof[L.index], half)) == half for L in lay.layers)
    if miss == "mapped":
        assert r["device_tables"]["mapped_rows"] > 0


@pytest.mark.parametrize("on_device", [False, True])
def test_take_uses_counts_what_each_slot_layer_routed(on_device: bool, rpc: str) -> None:
    """llama_pyspecter_take_uses (what an adaptive hot set reads between decodes) gives each slot layer's routing
    as a route hook heard it, on the CPU (the route op) and on a device (the split route op and the settled logs
    of speculated ubatches); it waits for min_tokens and restarts once taken."""
    import ctypes

    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    E, k = lay.n_expert, lay.n_expert_used
    heard: dict[int, np.ndarray] = {}

    def on_route(il: int, n_tokens: int, n_used: int, ids_p, _w) -> None:
        a = np.ctypeslib.as_array(ids_p, shape=(n_tokens * n_used,))
        heard[il] = heard.get(il, np.zeros(E, np.int64)) + np.bincount(a[a >= 0], minlength=E)

    with native.Model(path, device=open_device(rpc) if on_device else None) as m:
        cache = ExpertCache(m, lay, E // 2, hook=False, miss="cpu" if on_device else "wait")
        hooks = Hooks(m, on_route)
        try:
            cache.warm_hot(hotset_profile(lay), adapt=False)
            api, buf = native.slots(), (ctypes.c_uint32 * (m.n_layer * E))()
            with native.Context(m, n_ctx=128) as ctx:
                toks = m.tokenize(LONG_PROMPT)
                greedy(ctx, toks, 6)
                hooks.check()
                n = len(toks) + 5  # the last token is picked, never decoded
                assert api.take_uses(m.ptr, n + 1, buf, len(buf)) == 0  # not yet: nothing taken
                assert api.take_uses(m.ptr, n, buf, len(buf)) == n
                got = np.frombuffer(buf, np.uint32).reshape(-1, E)
                for L in lay.layers:  # the last layer routes only the rows whose logits are asked for
                    assert got[L.index].tolist() == heard[L.index].tolist()
                assert got[lay.layers[0].index].sum() == n * k
                assert api.take_uses(m.ptr, 1, buf, len(buf)) == 0  # restarted
                assert api.take_uses(m.ptr, 1, buf, 1) == native.ERR_ARG
        finally:
            hooks.close()
            cache.close()


def hotset_profile(lay) -> dict[int, list[int]]:
    """A profile whose hot set is experts 0.. of every layer."""
    return {L.index: list(range(lay.n_expert, 0, -1)) for L in lay.layers}


@pytest.mark.parametrize("miss", ["wait", "cpu"])
@pytest.mark.parametrize("share", ["top-k", "half", "all"])
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_slots_on_rpc_device_are_exact(name: str, share: str, miss: str, rpc: str) -> None:
    path = build_tiny(name)
    lay = read_layout(path)
    slots = {"top-k": lay.n_expert_used, "half": lay.n_expert // 2, "all": lay.n_expert}[share]
    r = verify(path, slots=slots, miss=miss, prompt=LONG_PROMPT, n_tokens=12, device=rpc)
    assert r["device"].startswith("RPC")
    assert r["n_prompt_tokens"] >= 32
    assert r["identical_tokens"], (r["stock_tokens"], r["slot_tokens"])
    assert r["max_abs_logit_diff"] == 0.0
    # the GPU contract, here where stock's own placements agree to the bit (the RPC server's CPU kernels)
    assert r["stock_gap_cpu_moe_vs_device"] == 0.0
    assert r["contract"]["finite"] and r["contract_ok"], r["contract"]
    if share == "all":  # every expert uploaded before the prompt: compared with stock-device to the bit
        assert r["hit_rate"] == 1.0 and r["contract"]["bound"] == 0.0
    else:
        assert r["uploads"] > 0


@pytest.mark.parametrize("miss", ["wait", "cpu"])
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_zero_slots_on_rpc_device_are_exact(name: str, miss: str, rpc: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SPECTER_ZERO_SLOTS=1: misses read all-zero slots, one per row of a token, as on a device whose kernel
    takes no negative id (and on CUDA where patch 0008 failed): the same exactness, with the slots NaN-poisoned, so
    a zero slot left unwritten would show."""
    monkeypatch.setenv("SPECTER_ZERO_SLOTS", "1")
    path = build_tiny(name)
    lay = read_layout(path)
    r = verify(path, slots=lay.n_expert // 2, miss=miss, prompt=LONG_PROMPT, n_tokens=12, device=rpc)
    assert r["identical_tokens"] and r["max_abs_logit_diff"] == 0.0, (r["stock_tokens"], r["slot_tokens"])
    assert r["contract"]["finite"] and r["contract_ok"] and r["uploads"] > 0, r["contract"]


def mixed_plans(lay) -> list[LayerPlan]:
    """Plans that mix every kind of layer, and the plan stock --n-cpu-moe makes of half the layers."""
    moe = [L.index for L in lay.layers]
    cycle = ["slots", "full", "host"]
    return [LayerPlan({il: cycle[i % 3] for i, il in enumerate(moe)}, lay.n_expert // 2),
            LayerPlan({il: "slots" if i % 2 else "full" for i, il in enumerate(moe)}, lay.n_expert_used),
            LayerPlan({il: "host" if i < len(moe) // 2 else "slots" for i, il in enumerate(moe)}, lay.n_expert // 2)]


@pytest.mark.parametrize("miss", ["wait", "cpu", "mapped"])
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_layer_plans_on_rpc_device_are_exact(name: str, miss: str, rpc: str) -> None:
    """Full, host and slot layers side by side; stock with the same placement (full layers' experts on the
    device) is the reference. Mapped: the slot layers' misses read by the device, the host layers'
    CPU splits kept."""
    path = build_tiny(name)
    lay = read_layout(path)
    for plan in mixed_plans(lay):
        r = verify(path, slots=plan.n_slots, miss=miss, prompt=LONG_PROMPT, n_tokens=12, device=rpc, plan=plan)
        assert r["n_prompt_tokens"] >= 32
        assert r["identical_tokens"], (plan, r["stock_tokens"], r["slot_tokens"])
        assert r["max_abs_logit_diff"] == 0.0, plan
        assert r["splits"] == r["stock_splits"], plan  # a slot layer costs what a host layer does
        if miss == "mapped":  # the decode tokens ran with no host path in their slot layers, none redone
            t = r["device_tables"]
            assert t["spec_ubatches"] >= r["n_tokens"] - 1 and t["spec_redos"] == 0 and t["mapped_rows"] > 0, t


@pytest.mark.parametrize("name", ["tiny-qwen3moe", "tiny-gptoss"])
def test_ordered_wait_on_rpc_device_is_exact_and_pays_its_switches(name: str, rpc: str) -> None:
    """Ordered wait (late experts) keeps the per-matmul route, asked for only: exact, at more host switches."""
    path = build_tiny(name)
    lay = read_layout(path)
    r = verify(path, slots=lay.n_expert // 2, miss="wait", ordered=True, prompt=LONG_PROMPT, n_tokens=8, device=rpc)
    assert r["identical_tokens"] and r["max_abs_logit_diff"] == 0.0
    assert r["splits"][1] > r["stock_splits"][1]


def test_splits_on_rpc_device_are_stock_cpu_moe_s(rpc: str) -> None:
    """Host round trips: a slot layer is one CPU split between two device ones, as a --cpu-moe layer; the device
    tables need no round trip of their own inside a layer."""
    dev = open_device(rpc)
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    with native.Model(path, device=dev) as m, native.Context(m):
        cpu_moe = graph_splits()
    with native.Model(path, device=dev, n_cpu_moe=2) as m, native.Context(m):
        n_cpu_moe = graph_splits()
    with native.Model(path, device=dev, n_cpu_moe=0) as m, native.Context(m):
        device_only = graph_splits()
    assert cpu_moe is not None and n_cpu_moe is not None and device_only is not None
    assert cpu_moe[1] == device_only[1] + 2 * len(lay.layers)
    # every layer slots, against --cpu-moe; stock --n-cpu-moe 2's full layers with slots for its host ones
    half = stock_plan(lay, 2)
    as_slots = LayerPlan({il: "slots" if k == "host" else k for il, k in half.kinds.items()}, lay.n_expert // 2)
    for plan, want in [(None, cpu_moe), (as_slots, n_cpu_moe)]:
        with native.Model(path, device=dev, host_layers=plan.host_layers if plan else None) as m:
            cache = ExpertCache(m, lay, lay.n_expert // 2, miss="cpu", kinds=plan.native_kinds() if plan else None)
            try:
                with native.Context(m) as ctx:
                    ours = graph_splits()
                    ctx.decode(m.tokenize(LONG_PROMPT))
                    for t in range(4):
                        ctx.decode([t + 1])
                    # the background uploads of miss mode cpu land when the readers get to them (in a full
                    # suite run, 4 steps were not always enough): land them, then one more step's fence
                    cache.drain()
                    ctx.decode([5])
                    cache.check()
                tables = native.device_stats(m.ptr)
                assert tables.fences >= 6 and tables.table_pushes >= 1  # landed uploads reached the device
            finally:
                cache.close()
        assert ours == want, plan


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_speculative_on_rpc_device_is_exact(name: str, rpc: str, tmp_path: Path) -> None:
    """Target layers and slots on the device, a whole draft on the device too, prefetch from its routing."""
    dev = open_device(rpc)
    path = build_tiny(name)
    draft = make_draft(path, tmp_path / "draft.gguf", experts_type="Q4_0", progress=False)
    lay, dlay = read_layout(path), read_layout(draft)
    with native.Model(path, device=dev) as m, native.Context(m, op_offload=False) as ctx:
        toks = m.tokenize(LONG_PROMPT)
        ref = greedy(ctx, toks, 24)[0]
    with native.Model(path, device=dev) as tm, native.Model(draft, device=dev, n_cpu_moe=0) as dm:
        cache = ExpertCache(tm, lay, lay.n_expert // 2, miss="cpu")
        routing = DraftRouting(dm, dlay)
        try:
            with native.Context(tm) as tctx, native.Context(dm) as dctx:
                eng = SpeculativeDecoder(tctx, dctx, k=3, adaptive=False, routing=routing,
                                         slots=cache)
                out = eng.generate(toks, 24, stop_at_eog=False)
                cache.check()
            assert out == ref
            assert cache.counters()["prefetches"] > 0
        finally:
            routing.close()
            cache.close()


def test_cli_verify_on_rpc_device(own_rpc: tuple[str, subprocess.Popen]) -> None:
    endpoint, _ = own_rpc
    r = run_cli("verify", "tiny-qwen3moe", "--slots", "8", "--device", endpoint, "--prompt", LONG_PROMPT, "-n", "8")
    assert r.returncode == 0, r.stderr
    assert "on RPC0" in r.stdout and "IDENTICAL" in r.stdout and "contract met" in r.stdout


def test_bad_device_name_is_one_line_exit_2() -> None:
    r = run_cli("verify", "tiny-qwen3moe", "--slots", "8", "--device", "nosuch0")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "nosuch0" in r.stderr.lower()
    r = run_cli("verify", "tiny-qwen3moe", "--slots", "8", "--device", "cuda")
    assert r.returncode == 2 and "--device" in r.stderr


def test_unreachable_rpc_endpoint_is_one_line_exit_2() -> None:
    r = run_cli("generate", "tiny-qwen3moe", "-p", "hi", "-n", "2", "--device", f"rpc:127.0.0.1:{free_port()}",
                timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "cannot connect" in r.stderr


def test_budget_above_device_memory_is_refused(own_rpc: tuple[str, subprocess.Popen]) -> None:
    endpoint, _ = own_rpc
    r = run_cli("generate", "tiny-qwen3moe", "-p", "hi", "-n", "2", "--device", endpoint, "--budget", "100TB",
                timeout=120)
    assert r.returncode == 2
    assert "free" in r.stderr and r.stderr.strip().count("\n") == 0


def test_server_dying_mid_answer_ends_with_one_line_exit_2(own_rpc: tuple[str, subprocess.Popen]) -> None:
    endpoint, server = own_rpc
    proc = subprocess.Popen([sys.executable, "-m", "pyspecter", "generate", "tiny-qwen3moe", "-p", "once upon",
                             "-n", "100000", "--ctx-size", "100000", "--device", endpoint],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        proc.stdout.read(16)  # it is answering
        stop_server(server)
        _, err = proc.communicate(timeout=120)  # nothing hangs
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    lines = err.decode().strip().splitlines()
    assert lines and lines[-1].startswith("pyspecter: fatal:"), lines


def test_bench_on_rpc_device_has_llamacpp_baselines(own_rpc: tuple[str, subprocess.Popen]) -> None:
    """llama.cpp's --cpu-moe and --n-cpu-moe N (N chosen so stock's device memory for experts equals our budget)
    beside our policies at that budget; every exact policy decodes stock's greedy tokens."""
    import json

    endpoint, _ = own_rpc
    r = run_cli("bench", "tiny-qwen3moe", "--device", endpoint, "--budget", "50%", "--repeat", "1", "-n", "4",
                "--policies", "stock-cpu-moe,stock-n-cpu-moe,on-demand-lru,on-demand-cpu,plan,on-demand-mapped,"
                              "plan-mapped",
                "--json", "--free",
                timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["device"].startswith("RPC")
    pol = out["policies"]
    assert pol["stock-n-cpu-moe"]["n_cpu_moe"] == 2  # 4 MoE layers, half the expert bytes on the device
    # equal device memory: the slot rows' slots (and zero slots, where the device has them) fit the budget stock
    # gets whole, and spend it
    lay = read_layout(build_tiny("tiny-qwen3moe"))
    row = sum(L.expert_bytes for L in lay.layers)
    zero = lay.n_expert_used if os.environ.get("SPECTER_ZERO_SLOTS") == "1" else 0  # RPC takes negative ids
    assert out["zero_slots"] == zero
    assert (out["slots_per_layer"] + zero) * row <= out["budget_bytes"] < (out["slots_per_layer"] + 1 + zero) * row
    assert pol["on-demand-lru"]["same_tokens_as_stock"] and pol["on-demand-cpu"]["same_tokens_as_stock"]
    assert pol["stock-n-cpu-moe"]["same_tokens_as_stock"]
    # host round trips: a slot layer costs what a --cpu-moe layer does; the plan is never predicted slower
    assert pol["stock-cpu-moe"]["host_switches_per_moe_layer"] == 2.0
    # where the time went: --cpu-moe's host layers are CPU splits, and the host waits for the device between them
    assert pol["stock-cpu-moe"]["host_split_ms_per_token"] > 0 and pol["stock-cpu-moe"]["host_wait_ms_per_token"] > 0
    for p in ("on-demand-lru", "on-demand-cpu"):
        assert pol[p]["splits_per_token"] == pol["stock-cpu-moe"]["splits_per_token"]
        assert pol[p]["bytes_per_token"] > 0 and pol[p]["upload_busy_gbps"] > 0  # the copies' own rate, where any
        assert pol[p]["upload_inflight_peak"] >= 1  # batches awaited by their event on the device's upload stream
    assert pol["stock-cpu-moe"]["upload_busy_gbps"] is None  # stock moves nothing
    assert pol["stock-cpu-moe"]["upload_inflight_peak"] == 0
    assert pol["plan"]["same_tokens_as_stock"]
    assert pol["plan"]["splits_per_token"] <= pol["stock-cpu-moe"]["splits_per_token"]
    lp = out["layer_plan"]
    assert lp["predicted_ms"] <= lp["predicted_stock_n_cpu_moe_ms"] + 1e-9
    assert lp["predicted_ms"] <= lp["predicted_stock_cpu_moe_ms"] + 1e-9
    assert lp["device_bytes"] <= out["budget_bytes"]
    # the plan bench ran is the cost model's choice from the costs it reports
    chosen = choose_plan(lay, out["budget_bytes"], DeviceCosts(**lp["costs"]), lp["n_zero"], hits=lp["lru_hits"],
                         hot_hits=lp["hot_hits"])
    assert lp["kinds"] == {str(il): k for il, k in sorted(chosen.kinds.items())}
    # --miss mapped: stock's tokens, no host switch taken whatever the token hit, its stand-in copy reported, and
    # a prediction from a row read from the host copy, measured (devcosts.measure_mapped)
    m = pol["on-demand-mapped"]
    assert m["same_tokens_as_stock"] and m["switches_taken_per_moe_layer"] == 0.0 and m["mapped_rows_per_token"] > 0
    assert m["mapped_copy_mb"] > 0 and lp["map_row_us"] >= 0 and m["predicted_ms"] > 0
    assert 0.0 <= lp["upload_share"] <= 1.0  # what a mapped token waits for of uploads beside it, measured
    # LRU's landings change the remap tables, which the fence pushes before a ubatch: counted, a token's worth
    assert m["table_bytes_per_token"] > 0 and m["host_settle_ms_per_token"] > 0
    # every eviction is decided after its layer ran (settling, a split route's op): no upload waits for compute
    assert m["compute_orders_per_token"] == 0 and pol["on-demand-cpu"]["compute_orders_per_token"] == 0
    assert m["predicted_calibrated_ms"] > 0
    # the plan priced as --miss mapped runs it so: stock's tokens, its own prediction, within the budget, never
    # predicted slower than stock at that memory, no more splits than --cpu-moe
    pm, lpm = pol["plan-mapped"], out["layer_plan_mapped"]
    assert pm["same_tokens_as_stock"] and lpm["mapped"] and pm["predicted_ms"] == lpm["predicted_ms"]
    assert lpm["device_bytes"] <= out["budget_bytes"]
    assert lpm["predicted_ms"] <= lpm["predicted_stock_n_cpu_moe_ms"] + 1e-9
    assert pm["splits_per_token"] <= pol["stock-cpu-moe"]["splits_per_token"]


def _stock_greedy(path: Path, dev, toks: list[int], n: int, plan: LayerPlan | None = None) -> tuple[list[int], tuple]:
    """Stock llama.cpp's greedy tokens with a plan's placement (full layers' experts on the device, the others' on
    the host; None: --cpu-moe), and the splits of its decode graph."""
    with native.Model(path, device=dev, host_layers=plan.host_layers if plan else None) as m, \
            native.Context(m, op_offload=False) as ctx:
        splits = graph_splits()
        return greedy(ctx, toks, n)[0], splits


def test_session_on_rpc_device_runs_the_plan_bench_chooses(rpc: str) -> None:
    """generate/chat's session builds the layer plan bench's `plan` policy runs (the cost model's choice at the
    same device memory, its inputs cached per machine, device and model), and decodes stock's greedy tokens."""
    from pyspecter.budget import parse_budget
    from pyspecter.devcosts import plan_for
    from pyspecter.session import Session, SessionConfig

    dev = open_device(rpc)
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    with native.Model(path, lazy_experts=True) as m:  # tokenizing reads no experts
        toks = m.tokenize(LONG_PROMPT)
    ref, cpu_moe = _stock_greedy(path, dev, toks, 12)
    with Session(SessionConfig(model=path, budget="50%", device=rpc, n_ctx=256)) as s:
        assert s.layer_plan is not None and s.layer_plan.info is not None
        bench_plan, info = plan_for(path, lay, dev, parse_budget("50%", lay.expert_total_bytes))
        assert s.layer_plan.plan == bench_plan
        assert info["predicted_ms"] <= info["predicted_stock_n_cpu_moe_ms"] + 1e-9
        assert info["predicted_ms"] <= info["predicted_stock_cpu_moe_ms"] + 1e-9
        assert s.layer_plan.why.startswith(f"layer plan: {bench_plan.describe(lay)}; predicted ")
        assert s.generate(toks, 12, stop_at_eog=False) == ref
        assert s.target_splits is not None and s.target_splits[1] <= cpu_moe[1]
        assert s.stats()["slots_text"] == f"layer plan {bench_plan.describe(lay)}"


def test_device_costs_measured_on_rpc_device(rpc: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """devcosts.measure on RPC: every cost finite and none negative (the switch may come out 0 on a loaded machine:
    no timing decides a test), cached under a key with the measurement's version (an entry of an older one is
    neither reused nor kept), and the plan chosen from it never predicted slower than stock --cpu-moe or
    --n-cpu-moe at its memory."""
    import json
    import math

    from pyspecter.budget import parse_budget
    from pyspecter.devcosts import cache_key, measure, plan_for
    from pyspecter.layerplan import n_cpu_moe_for

    monkeypatch.setenv("SPECTER_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECTER_MEASUREMENTS", raising=False)
    dev = open_device(rpc)
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    key = cache_key(path, dev)
    stale = key.split("|", 1)[1]  # the same machine, device and model, measured the old way
    bogus = {"split_us": 1e9, "link_gbps": 1.0, "cpu_row_us": 0.0, "dev_row_us": 0.0, "base_us": 0.0}
    (tmp_path / "devcosts.json").write_text(json.dumps({stale: bogus}))
    costs = measure(path, lay, dev)
    assert all(math.isfinite(v) and v >= 0 for v in costs.as_dict().values()), costs
    # a measured cost may round to 0 on a loaded machine (the measurement clamps noise at 0): only its sign is
    # asserted, as timings never decide a test
    assert costs.link_gbps > 0 and costs.split_us != bogus["split_us"], costs
    assert list(json.loads((tmp_path / "devcosts.json").read_text())) == [key]
    assert measure(path, lay, dev) == costs  # cached
    # a device measured slower per row than the host by more than a layer's switches: all host below the whole
    # model's memory; where every expert fits, bench's plan is the session's, every layer full
    slow = {"split_us": 100.0, "link_gbps": 1.0, "cpu_row_us": 10.0, "dev_row_us": 1000.0, "base_us": 0.0}
    (tmp_path / "devcosts.json").write_text(json.dumps({key: slow}))
    assert plan_for(path, lay, dev, parse_budget("50%", lay.expert_total_bytes))[0] == stock_plan(lay, None)
    assert plan_for(path, lay, dev, lay.expert_total_bytes)[0] == stock_plan(lay, 0)
    for share in ("30%", "50%", "100%"):
        budget = parse_budget(share, lay.expert_total_bytes)
        t = predict_us(choose_plan(lay, budget, costs), lay, costs)
        assert t <= predict_us(stock_plan(lay, None), lay, costs) + 1e-6
        assert t <= predict_us(stock_plan(lay, n_cpu_moe_for(lay, budget)), lay, costs) + 1e-6


def test_the_first_auto_plan_on_a_device_says_it_measures(rpc: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """pyspecter.load on a device with nothing cached: one line before the layer plan's costs are measured (the
    user waits for them), then the plan's own line; the second session reads them cached and says only the
    plan. A session with --miss mapped whose costs are cached but not the row read from the host copy says it
    measures that row, once; one whose costs are cached but not the model's routing (its cache dropped, or of an
    older version), that it traces the routing."""
    from pyspecter.api import load
    from pyspecter.paths import cache_dir

    monkeypatch.setenv("SPECTER_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECTER_MEASUREMENTS", raising=False)
    path = build_tiny("tiny-qwen3moe")
    for miss, says in ((None, "measuring the layer plan's costs"), (None, None),  # the second: cached
                       ("mapped", "measuring a row the device reads from the host copy"), ("mapped", None),
                       ("mapped", "measuring how the model's own routing")):
        if says and "routing" in says:
            (cache_dir() / "routing.json").unlink()
        lines: list[str] = []
        with load(path, budget="50%", device=rpc, n_ctx=128, miss=miss, notify=lines.append) as s:
            measuring = [i for i, line in enumerate(lines) if line.startswith("measuring ")]
            planned = [i for i, line in enumerate(lines) if line.startswith("layer plan: ")]
            assert planned and (measuring == [] if says is None else
                                (measuring[0] < planned[0] and lines[measuring[0]].startswith(says))), lines
            assert s.notes == lines


def test_session_with_a_draft_on_a_device_that_holds_the_model_runs_all_full(rpc: str, tmp_path: Path) -> None:
    """The whole model fits the device and a draft is given: every layer full (stock's placement, no slot, no
    routing hook), the draft speculating beside it, stock's greedy tokens and splits."""
    from pyspecter.session import Session, SessionConfig

    dev = open_device(rpc)
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    draft = make_draft(path, tmp_path / "draft.gguf", experts_type="Q4_0", progress=False)
    with native.Model(path, lazy_experts=True) as m:  # tokenizing reads no experts
        toks = m.tokenize(LONG_PROMPT)
    ref, splits = _stock_greedy(path, dev, toks, 12, stock_plan(lay, 0))
    with Session(SessionConfig(model=path, device=rpc, draft=draft, n_ctx=256)) as s:
        assert s.placement.budget is None and s.layer_plan is not None
        assert s.layer_plan.plan == stock_plan(lay, 0) and s.cache is None and s.decoder is not None
        assert s.generate(toks, 12, stop_at_eog=False) == ref
        assert s.target_splits == splits


@pytest.mark.parametrize("name", ["tiny-qwen3moe", "tiny-gptoss"])
def test_session_layer_plans_on_rpc_device_are_exact(name: str, rpc: str) -> None:
    """Mixed plans given to the session, one of them with a static hot set in its slot layers, stock's --n-cpu-moe
    N by name and slots in every layer: stock's greedy tokens, and with full and host layers alone (no slots)
    exactly stock's splits. The hot set starts as the calibration profile's and moves only between decodes (no
    residency engine)."""
    from pyspecter.session import Session, SessionConfig

    dev = open_device(rpc)
    path = build_tiny(name)
    lay = read_layout(path)
    with native.Model(path, lazy_experts=True) as m:  # tokenizing reads no experts
        toks = m.tokenize(LONG_PROMPT)
    ref, cpu_moe = _stock_greedy(path, dev, toks, 12)
    hot = dataclasses.replace(mixed_plans(lay)[0], hot=True)
    for spec in [*mixed_plans(lay), hot, "n-cpu-moe:2", "slots"]:
        with Session(SessionConfig(model=path, budget="50%", device=rpc, n_ctx=256, layer_plan=spec)) as s:
            assert (s.layer_plan is None) == (spec == "slots")
            if spec == hot:
                assert s.cache is not None and not s.cache.native
                assert s.stats()["slots_text"].startswith("layer plan") and "hot slots" in s.stats()["slots_text"]
            assert s.generate(toks, 12, stop_at_eog=False) == ref, spec
            if spec == hot:  # every slot holds an expert of the hot set as it stands after the last move
                for il in hot.layers("slots"):
                    held = [e for e in range(lay.n_expert) if native.slots().slot_of(s.target.ptr, il, e) >= 0]
                    assert len(held) == s.cache.usable(il)
                assert s.cache.counters()["uploads"] > 0
            plan = s.layer_plan.plan if s.layer_plan else None
            _, want = _stock_greedy(path, dev, toks, 1, plan)
            assert s.target_splits == want, spec  # a slot layer costs what a host layer does
            if plan is not None and not plan.layers("slots"):
                assert s.cache is None and not s.stats()["has_slots"]


def test_a_hot_plan_starts_from_a_given_profile_and_follows_the_text(rpc: str, tmp_path: Path) -> None:
    """--profile with a plan's hot slot layers: the set starts as the trace's hottest experts (not the calibration
    profile's), then moves between decodes as without one; stock's greedy tokens."""
    from pyspecter.policies import hot_experts
    from pyspecter.predict import routing_counts
    from pyspecter.session import Session, SessionConfig
    from pyspecter.study.trace import record_trace

    dev = open_device(rpc)
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    trace = tmp_path / "t.npz"
    record_trace(path, trace, prompts=["a profile of other text", "and more of it"], n=6, progress=False,
                 n_threads=1, gate_lookahead=0)
    counts = routing_counts(trace, lay)
    with native.Model(path, lazy_experts=True) as m:
        toks = m.tokenize(LONG_PROMPT)
    ref, _ = _stock_greedy(path, dev, toks, 12)
    hot = dataclasses.replace(mixed_plans(lay)[0], hot=True)
    with Session(SessionConfig(model=path, budget="50%", device=rpc, n_ctx=256, layer_plan=hot,
                               profile=trace)) as s:
        for il in hot.layers("slots"):
            held = {e for e in range(lay.n_expert) if native.slots().slot_of(s.target.ptr, il, e) >= 0}
            assert held == set(hot_experts(counts[il], s.cache.usable(il))), il
        start = s.cache.counters()["uploads"]
        assert s.generate(toks, 12, stop_at_eog=False) == ref
        assert s.cache.counters()["uploads"] > start  # it followed the text


def test_cli_generate_layer_plan_on_rpc_device(own_rpc: tuple[str, subprocess.Popen]) -> None:
    endpoint, _ = own_rpc
    r = run_cli("generate", "tiny-qwen3moe", "-p", "hi", "-n", "4", "--device", endpoint, "--budget", "50%",
                "--layer-plan", "n-cpu-moe:2", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "layer plan: 2 full, 2 host; stock --n-cpu-moe 2" in r.stderr
    assert "no slots, nothing moves" in r.stderr


@pytest.mark.parametrize("args", [["--layer-plan", "bogus", "--device", "rpc:127.0.0.1:1"],
                                  ["--layer-plan", "slots"]])
def test_bad_layer_plan_is_one_line_exit_2(args: list[str]) -> None:
    r = run_cli("generate", "tiny-qwen3moe", "-p", "hi", "-n", "2", *args)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--layer-plan" in r.stderr


@pytest.mark.parametrize("sync, zero", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("miss", ["cpu", "wait"])
def test_uploads_on_their_own_stream_and_the_table_names_slots_or_misses(miss: str, sync: bool, zero: bool, rpc: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A device that reports async copies and events (RPC does, as CUDA) gets an upload stream of its own: every
    upload is one batch awaited by its event before it counts as landed; SPECTER_SYNC_UPLOADS=1 (and a device
    without them) copies synchronously. Either way stock's tokens, and the remap table the device holds, read back
    between tokens under heavy eviction, names only slots or what a miss reads: ~expert where the device's kernel
    takes a negative id as a zero row (RPC, CUDA), else (SPECTER_ZERO_SLOTS=1, other devices) zero slot j for row j,
    never a negative id."""
    if sync:
        monkeypatch.setenv("SPECTER_SYNC_UPLOADS", "1")
    if zero:
        monkeypatch.setenv("SPECTER_ZERO_SLOTS", "1")
    dev = open_device(rpc)
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    with native.Model(path, lazy_experts=True) as m:
        toks = m.tokenize(LONG_PROMPT)
    ref, _ = _stock_greedy(path, dev, toks, 10)
    n_slots = lay.n_expert_used
    with native.Model(path, device=dev) as m:
        cache = ExpertCache(m, lay, n_slots, miss=miss, ordered=miss == "wait")
        try:
            with native.Context(m) as ctx:
                out = []
                for tok, _ in native_greedy_steps(ctx, toks, 10):
                    out.append(tok)
                    for L in lay.layers:
                        planes = native.read_table(m.ptr, L.index, lay.n_expert, lay.n_expert_used)
                        for j, table in enumerate(planes):
                            assert [x for _, x in table] == list(range(lay.n_expert))
                            # a resident expert's slot, or zero slot j (n_slots + j) for row j of a token, or
                            # ~expert (-1 - expert: the matmul over the host copy reads its ids from it)
                            assert all(0 <= slot < n_slots or slot == (n_slots + j if zero else ~e)
                                       for slot, e in table), table
                            assert [s for s, _ in table if s < n_slots] == [s for s, _ in planes[0] if s < n_slots]
                cache.check()
            assert out == ref
            cache.drain()  # miss mode cpu's background uploads: every one landed before they are counted
            stats = native.device_stats(m.ptr)
            uploads = cache.counters()["uploads"]
            assert uploads > 0
            if sync:
                assert stats.upload_streams == 0 and stats.async_batches == 0
            else:
                assert stats.upload_streams == 1 and stats.async_batches >= uploads
            # every slot here is freed by a route op (the ordered wait's per-matmul route before its slot matmul,
            # miss cpu's split route after the device's split): a CPU split the scheduler began by synchronising
            # the device, whose table is written before any later slot path is queued, so no upload waits for
            # device work (on CUDA such a wait, an event recorded on the compute stream from the upload thread,
            # could fall into a graph being captured there and abort the capture)
            assert stats.compute_orders == 0, stats.compute_orders
        finally:
            cache.close()


def native_greedy_steps(ctx: native.Context, prompt: list[int], n: int):
    """Greedy tokens one decode at a time, so the test can look at the device between them."""
    from pyspecter.engine import generate_step
    from pyspecter.sampling import Sampler

    for i, step in enumerate(generate_step(ctx, prompt, Sampler())):
        yield step
        if i + 1 >= n:
            return


@pytest.mark.parametrize("miss, ordered, hot", [("cpu", False, False), ("wait", False, False), ("wait", True, False),
                                               ("cpu", False, True), ("mapped", False, True)])
def test_uploads_that_land_late_are_never_read_early(miss: str, ordered: bool, hot: bool, rpc: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection in the upload path (SPECTER_UPLOAD_FAULT_US): every batch copies NaN, and its real bytes
    land 3 ms after its event has passed, as a copy on another stream is undefined until its batch has landed
    (RPC would otherwise run it before anything queued later). Under eviction at top-k slots, with misses computed
    on the host or awaited (ordered: in the same ubatch, by the wait op, several reads in flight at once), no
    kernel may read a slot in that window: the logits stay stock's to the bit. With reap mapping reads still in
    flight, the host and ordered cases fail. hot: an adaptive hot set's moves, queued between decodes and mapped
    once landed, while the next decodes run (half the slots, 40 tokens: several windows)."""
    monkeypatch.setenv("SPECTER_UPLOAD_FAULT_US", "3000")
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    r = verify(path, slots=lay.n_expert // 2 if hot else lay.n_expert_used, miss=miss, ordered=ordered,
               prompt=LONG_PROMPT, n_tokens=40 if hot else 10, device=rpc, hot=hot)
    assert r["uploads"] > 0 and (r["hot_moves"] > 0 or not hot)
    assert r["identical_tokens"] and r["max_abs_logit_diff"] == 0.0, (r["stock_tokens"], r["slot_tokens"])
    assert r["contract_ok"], r["contract"]
    if ordered:  # a layer's misses are read side by side: the readers keep several batches on the wire
        assert r["device_tables"]["inflight_peak"] >= 2, r["device_tables"]


def test_teacher_forced_verify_on_rpc_device_meets_the_contract(rpc: str) -> None:
    """verify --forced: stock, stock-device and the slots are fed the same held-out text, so the logits are
    compared at every step (what gpu_check runs on bench-qwen3moe, whose greedy text cycles)."""
    path = build_tiny("tiny-mixtral")
    lay = read_layout(path)
    r = verify(path, slots=lay.n_expert // 2, miss="cpu", prompt=LONG_PROMPT, n_tokens=12, device=rpc, forced=True)
    assert r["decode"] == "teacher-forced" and r["n_tokens"] == 12
    assert r["identical_tokens"] and r["max_abs_logit_diff"] == 0.0
    assert r["contract_ok"], r["contract"]


def test_hit_rates_come_from_the_models_own_routing_and_are_cached(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """hitrates: LRU's hit rate by slot count from a CPU prefill of the calibration text; none below top-k slots,
    more with more slots, and what a direct LRU simulation of the same routing gives. The static hot set's: the
    chat prompts' profile (a prefill of the tune split) measured on the calibration text, as counted directly; the
    profile is those counts. The adaptive set's (hits and moves): hotset.curves on the same routing. Cached per
    model file, so the session's plan and bench's predictions read them without running the model again."""
    from pyspecter import hitrates, hotset
    from pyspecter.lru import lru_miss_curve
    from pyspecter.policies import hot_experts
    from pyspecter.prompts import calibration_tokens, tune_tokens

    monkeypatch.setenv("SPECTER_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECTER_MEASUREMENTS", raising=False)
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    k, E = lay.n_expert_used, lay.n_expert
    hits = hitrates.lru_hits(path, lay)
    assert len(hits) == E + 1 and all(h == 0.0 for h in hits[:k])
    assert all(0.0 <= a <= b <= 1.0 for a, b in zip(hits, hits[1:], strict=False)) and hits[E - 1] > hits[k]
    # the same rows through the host-path hook, simulated directly: LRU with E // 2 slots a layer
    seen: list[dict[int, list]] = []
    with native.Model(path) as m:
        texts = [tune_tokens(m, hitrates.HIT_TOKENS), calibration_tokens(m, hitrates.HIT_TOKENS)]
        hooks = Hooks(m, lambda il, n, u, ids, _w: seen[-1].setdefault(il, []).append(
            np.ctypeslib.as_array(ids, shape=(n * u,)).reshape(n, u).copy()), n_slots=1)
        try:
            for toks in texts:
                seen.append({})
                with native.Context(m, n_ctx=len(toks) + 16) as ctx:
                    ctx.decode(toks, logits_all=True)
        finally:
            hooks.close()
    chat, calib = ({il: np.concatenate(v) for il, v in one.items()} for one in seen)
    assert all(len(t) == hitrates.HIT_TOKENS for t in texts) and texts[0] != texts[1]
    curves = [lru_miss_curve(a, E, warm=hitrates.HIT_WARM) for a in calib.values()]
    assert hits[E // 2] == pytest.approx(1 - float(np.mean([c[E // 2] for c in curves])) / k, abs=1e-6)
    static = hitrates.hot_hits(path, lay, static=True)
    prof = hitrates.hot_profile(path, lay)
    assert prof == {il: [int(x) for x in np.bincount(a.ravel(), minlength=E)] for il, a in chat.items()}
    direct = [np.mean([int(e) in set(hot_experts(prof[il], E // 2)) for e in a.ravel()]) for il, a in calib.items()]
    assert len(static) == E + 1 and static[0] == 0.0 and static[E] == 1.0
    assert static[E // 2] == pytest.approx(float(np.mean(direct)), abs=1e-6)
    hot, moves = hitrates.hot_hits(path, lay), hitrates.hot_moves(path, lay)
    want = np.mean([hotset.curves(prof[il], a, k) for il, a in calib.items()], axis=0)
    assert hot == pytest.approx(list(want[0]), abs=1e-9) and moves == pytest.approx(list(want[1]), abs=1e-9)
    assert len(moves) == E + 1 and moves[0] == moves[E] == 0.0

    def no_model(*_a, **_k):
        raise AssertionError("measured again")

    monkeypatch.setattr(hitrates.native, "Model", no_model)
    assert hitrates.lru_hits(path, lay) == hits and hitrates.hot_hits(path, lay) == hot
