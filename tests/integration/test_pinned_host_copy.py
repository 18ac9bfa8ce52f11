"""The routed experts' host copy beside a device, as slot sessions load it (csrc/pinned.cpp): in the device's pinned
host buffer type laid out as its own buffers, where stock leaves them in the file's mapping. The RPC device has no
host buffer type; SPECTER_PINNED_PROXY=1 gives it one over CPU memory, so the load, the placement of the host
layers' matmuls, the uploads and the mapped misses go through the same buffer type a GPU's would, and must stay
exact. (Why it exists: llama.cpp's loader swaps an override to the device's host type itself for the CPU's when the
file is mmap'd, so on the first GPU the experts were pageable: staged uploads, and no mapped misses.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_device import LONG_PROMPT, rpc_device

from pyspecter.layout import read_layout
from pyspecter.models.tiny import build_tiny
from pyspecter.native import Model
from pyspecter.native.devices import Device
from pyspecter.study.verify import verify


@pytest.fixture(scope="module")
def dev() -> Iterator[Device]:
    yield from rpc_device()


@pytest.fixture(autouse=True)
def proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECTER_PINNED_PROXY", "1")
    monkeypatch.setenv("SPECTER_POISON_SLOTS", "1")


@pytest.mark.parametrize("miss", ["wait", "cpu", "mapped"])
@pytest.mark.parametrize("name", ["tiny-qwen3moe", "tiny-mixtral", "tiny-gptoss"])
def test_slots_over_the_pinned_host_copy_are_exact(name: str, miss: str, dev: Device) -> None:
    """verify with the experts in the pinned type (what a slot session loads on CUDA): stock's tokens and logits
    to the bit, and the GPU contract."""
    path = build_tiny(name)
    r = verify(path, slots=read_layout(path).n_expert // 2, miss=miss, prompt=LONG_PROMPT, n_tokens=12,
               device=dev.spec)
    assert r["host_experts"] == "CPU_experts"
    assert r["identical_tokens"] and r["max_abs_logit_diff"] == 0.0, (r["stock_tokens"], r["slot_tokens"])
    assert r["contract_ok"] and r["uploads"] > 0, r["contract"]


def test_only_slot_sessions_pin_and_stock_stays_mapped(dev: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """pinned=True moves the host experts into the pinned type; stock's placement (and no host buffer type at
    all) leaves them in the file's mapping, as llama.cpp's --cpu-moe does."""
    from pyspecter.cache import ExpertCache

    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    seen = {}
    for case, pinned, env in (("ours", True, "1"), ("stock", False, "1"), ("no host type", True, "0")):
        monkeypatch.setenv("SPECTER_PINNED_PROXY", env)
        with Model(path, device=dev, pinned=pinned) as m:
            cache = ExpertCache(m, lay, lay.n_expert_used, hook=False)
            try:
                seen[case] = (m.pinned, m.host_experts())
            finally:
                cache.close()
    assert seen == {"ours": (True, "CPU_experts"), "stock": (False, "CPU_Mapped"),
                    "no host type": (False, "CPU_Mapped")}


def test_pinned_memory_refused_loads_as_stock_and_says_so(dev: Device, monkeypatch: pytest.MonkeyPatch,
                                                          capfd: pytest.CaptureFixture[str]) -> None:
    """Where the pinned memory cannot be had (cudaMallocHost refusing it; here SPECTER_PINNED_PROXY=refuse), the
    model loads as stock places it, in the file's mapping, and says so in one line: slower uploads, not a failure."""
    monkeypatch.setenv("SPECTER_PINNED_PROXY", "refuse")
    path = build_tiny("tiny-qwen3moe")
    with Model(path, device=dev, pinned=True) as m:
        assert not m.pinned and m.n_layer > 0
    err = capfd.readouterr().err
    assert "could not pin the host experts" in err and "file's mapping" in err
