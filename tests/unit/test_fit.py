"""Fitting to the machine: what generate/chat/serve/bench choose without --tier/--budget, and budgets the memory
available cannot hold refused with the numbers unless --force. Memory and layouts are made up: nothing loads."""

from __future__ import annotations

import json
from types import SimpleNamespace

import psutil
import pytest
from conftest import run_cli

from pyspecter.budget import check_budget_fits, fit_to_memory, parse_budget, usable_memory
from pyspecter.cli.bench import bench as bench_cmd
from pyspecter.errors import SpecterError
from pyspecter.layout import ExpertTensor, ModelLayout, MoELayer
from pyspecter.placement import Placement, place

GB = 10**9
EXPERT = 3 * 768 * 2048 * 34 // 32  # one Qwen3-30B-A3B expert in Q8_0


def _qwen3_30b(nonexpert: int = 2 * GB) -> ModelLayout:
    """big-qwen3moe's layout: 48 layers of 128 experts, top-8; ~31 GB of experts."""
    layers = [MoELayer(i, {"up": ExpertTensor(f"blk.{i}.ffn_up_exps.weight", "up", "Q8_0", (128, 768, 2048), 0,
                                              EXPERT)}) for i in range(48)]
    tensor_bytes = 48 * 128 * EXPERT + nonexpert
    return ModelLayout(path=None, arch="qwen3moe", name="big", n_layer=48, n_expert=128,  # type: ignore[arg-type]
                       n_expert_used=8, n_shared_expert_layers=0, file_bytes=tensor_bytes,
                       tensor_bytes=tensor_bytes, layers=layers)


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch):
    """Pretend the model is big-qwen3moe's layout and the machine has ``available`` bytes free."""
    lay = _qwen3_30b()
    state = SimpleNamespace(available=20 * GB, layout=lay)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=state.available))
    monkeypatch.setattr("pyspecter.placement.read_layout", lambda _path: state.layout)
    return state


def test_a_budget_above_the_memory_is_refused_with_the_numbers() -> None:
    lay = _qwen3_30b()
    check_budget_fits(lay, 10 * GB, 20 * GB)
    with pytest.raises(SpecterError) as e:
        check_budget_fits(lay, 20 * GB, 20 * GB)
    msg = str(e.value)
    assert msg.startswith("budget 20.0 GB + 2.0 GB of non-expert weights > 17.5 GB usable of 20.0 GB available")
    assert "--force" in msg
    # the budget it suggests fits
    suggested = msg.split("give --budget ")[1].split(" ")[0]
    check_budget_fits(lay, parse_budget(suggested, lay.expert_total_bytes), 20 * GB)
    # the fitted budget is never refused: both use the same usable share
    fit = fit_to_memory(lay, 20 * GB)
    check_budget_fits(lay, int(fit.budget), 20 * GB)
    assert int(fit.budget) + lay.nonexpert_bytes <= usable_memory(20 * GB)


def _where(**kw) -> tuple[str, str | None]:
    p = place("model.gguf", **kw)
    return p.tier, p.budget


def test_no_flags_fit_the_model(machine) -> None:
    p = place("model.gguf")
    assert p.tier == "disk" and int(p.budget) == int(fit_to_memory(machine.layout, machine.available).budget)
    assert p.why.startswith("model 32.8 GB > ") and "stream from disk" in p.why and not p.stock
    machine.available = 64 * GB  # now the file fits: every expert resident, from RAM, as stock llama.cpp runs it
    p = place("model.gguf")
    assert (p.tier, p.budget, p.stock) == ("ram", None, True)
    assert "every expert resident" in p.why and "stock" in p.why


def test_bench_fits_too_but_keeps_a_budget_its_policies_can_use(machine) -> None:
    assert _where(partial="50%")[0] == "disk"  # too big: fitted as above
    machine.available = 64 * GB
    p = place("model.gguf", partial="50%")
    assert (p.tier, p.budget) == ("ram", "50%") and "budget of 50%" in p.why
    assert _where(tier="disk", partial="50%") == ("disk", "50%")  # bench's old default


def test_a_budget_alone_picks_the_tier(machine) -> None:
    assert place("model.gguf", budget="10%") == Placement("disk", "10%")  # the user chose: no line (why None)
    machine.available = 64 * GB
    assert place("model.gguf", budget="10%") == Placement("ram", "10%")


def test_force_and_bad_tiers(machine) -> None:
    with pytest.raises(SpecterError, match="or --force"):
        place("model.gguf", tier="disk", budget="60%")
    assert _where(tier="disk", budget="60%", force=True) == ("disk", "60%")
    with pytest.raises(SpecterError, match="budget 27.7 GB"):
        place("model.gguf", tier="ram", budget="90%")
    with pytest.raises(SpecterError, match="is now --device"):  # refused before any fitting
        place("model.gguf", tier="gpu", budget="90%")


def test_sizes_keep_the_unit_family_given(machine) -> None:
    with pytest.raises(SpecterError) as e:
        place("model.gguf", tier="ram", budget="25GiB")
    msg = str(e.value)  # binary in, binary out, and the non-expert weights not rounded to 0.0
    assert msg.startswith("budget 25.0 GiB + 1.9 GiB of non-expert weights > 16.3 GiB usable"), msg
    assert "GB" not in msg.replace("GiB", "") and "give --budget 14.4GiB or less" in msg
    suggested = msg.split("give --budget ")[1].split(" ")[0]
    assert place("model.gguf", tier="ram", budget=suggested).budget == suggested  # the figure given fits


def test_bench_runs_what_was_fitted(machine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from pyspecter.study import bench

    calls = []
    monkeypatch.setattr(bench, "run_bench", lambda path, **kw: calls.append(kw) or {"tier": kw["tier"]})
    bench_cmd("tiny-qwen3moe", json_out=True)
    fitted = fit_to_memory(machine.layout, machine.available)
    assert [(c["tier"], c["budget"]) for c in calls] == [("disk", fitted.budget)]
    out = capsys.readouterr()
    assert json.loads(out.out) == {"tier": "disk"} and out.err.startswith("pyspecter: model 32.8 GB > ")
    calls.clear()
    with pytest.raises(SpecterError, match="--force"):
        bench_cmd("tiny-qwen3moe", budget="90%")
    bench_cmd("tiny-qwen3moe", budget="90%", force=True, json_out=True)
    assert [(c["tier"], c["budget"]) for c in calls] == [("disk", "90%")]
    calls.clear()
    with pytest.raises(SpecterError, match="budget 27.7 GB"):  # every point of a sweep is checked before any runs
        bench_cmd("tiny-qwen3moe", tier="ram,disk", budget="10%,90%")
    assert calls == []
    bench_cmd("tiny-qwen3moe", tier="ram,disk", budget="10%,20%", json_out=True)
    assert [(c["tier"], c["budget"]) for c in calls] == [("ram", "10%"), ("ram", "20%"), ("disk", "10%"),
                                                          ("disk", "20%")]
    calls.clear()
    bench_cmd("tiny-qwen3moe", budget="90%", force=True, json_out=True)
    assert [(c["tier"], c["budget"]) for c in calls] == [("disk", "90%")]


@pytest.mark.parametrize("cmd", [["bench"], ["generate", "-p", "hi"]])
def test_refusal_is_one_line_exit_2(cmd: list[str]) -> None:
    # a real process and model: refused before anything loads
    r = run_cli(cmd[0], "tiny-qwen3moe", *cmd[1:], "--budget", "100TB", "--tier", "ram")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pyspecter: error: budget 100.0 TB + ") and "--force" in lines[0]
    assert "--force" in run_cli(cmd[0], "--help").stdout
