"""inspect: what a GGUF holds and how it fits this machine or a device."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer

from pyspecter.cli.app import app
from pyspecter.cli.options import DEFAULT_MODEL, AutoTierOpt, DeviceOpt, ModelArg, fmt_bytes, native_errors_exit
from pyspecter.errors import SpecterError
from pyspecter.models.catalog import resolve_model


@app.command()
def inspect(
    model: ModelArg = DEFAULT_MODEL,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    budget: Annotated[str | None, typer.Option(help="fast-tier budget for experts: 64MiB, 1.5GB or 40%")] = None,
    device: DeviceOpt = None,
    tier: AutoTierOpt = None,
) -> None:
    """Show a MoE GGUF's expert layout: bytes per expert, expert vs non-expert bytes, slots a budget buys, and
    how the model fits this machine (or --device)."""
    from pyspecter.layout import read_layout
    from pyspecter.placement import budget_slot_count, device_fit, is_host, place

    lay = read_layout(resolve_model(model)).require_moe()
    info: dict = {
        "path": str(lay.path), "name": lay.name, "arch": lay.arch, "n_layer": lay.n_layer,
        "n_moe_layers": len(lay.layers), "n_expert": lay.n_expert, "n_expert_used": lay.n_expert_used,
        "shared_expert_layers": lay.n_shared_expert_layers,
        "expert_bytes": lay.layers[0].expert_bytes,
        "expert_total_bytes": lay.expert_total_bytes, "nonexpert_bytes": lay.nonexpert_bytes,
        "file_bytes": lay.file_bytes,
        "layers": [{"layer": L.index, "expert_bytes": L.expert_bytes,
                    "tensors": {k: {"type": t.ggml_type, "shape": list(t.shape), "expert_bytes": t.expert_bytes}
                                for k, t in L.tensors.items()}} for L in lay.layers],
    }
    try:
        fit = place(lay)
        info["fit"] = {"tier": fit.tier, "budget_bytes": int(fit.budget) if fit.budget else None,
                       "stock": fit.stock, "why": fit.why}
    except SpecterError as e:
        info["fit"] = {"tier": None, "budget_bytes": None, "stock": False, "why": str(e)}
    if budget is not None:
        # as a session given this budget (and tier) spends it: the tier it would run on, chosen as generate
        # chooses it; too small a budget is refused alike
        where = place(lay, tier=tier, budget=budget, device=device, force=True)
        count = budget_slot_count(lay, budget, lay.path, tier=where.tier, device=where.device)
        info.update(budget_bytes=count.budget_bytes, tier=where.tier, slots_per_layer=count.min,
                    slots_min=count.min, slots_mean=count.mean, slots_max=count.max, slots=str(count),
                    budget_takes=dict(count.others))
    if not is_host(device):
        assert device is not None
        native_errors_exit()
        info["device"] = dataclasses.asdict(device_fit(lay, device))
        from pyspecter.devcosts import plan_for
        from pyspecter.native.devices import open_device

        # the layer plan for the budget (else what the device holds), its inputs measured on the model (cached)
        room = info["budget_bytes"] if budget is not None else info["device"]["slot_bytes"]
        _, info["device"]["plan"] = plan_for(lay.path, lay, open_device(device), room)
    if json_out:
        print(json.dumps(info, indent=1))
        return
    print(f"{lay.name}  ({lay.path})")
    print(f"arch {lay.arch}: {lay.n_layer} layers, {len(lay.layers)} MoE layers, "
          f"{lay.n_expert} experts, top-{lay.n_expert_used}, shared experts in {lay.n_shared_expert_layers} layers")
    L0 = lay.layers[0]
    parts = ", ".join(f"{k} {t.ggml_type} {fmt_bytes(t.expert_bytes)}" for k, t in L0.tensors.items())
    same = all(L.expert_bytes == L0.expert_bytes for L in lay.layers)
    print(f"one expert: {fmt_bytes(L0.expert_bytes)} ({parts})" + ("" if same else "  [varies by layer, see --json]"))
    tot = lay.expert_total_bytes + lay.nonexpert_bytes
    print(f"experts: {fmt_bytes(lay.expert_total_bytes)} ({100 * lay.expert_total_bytes / tot:.1f}%), "
          f"non-expert: {fmt_bytes(lay.nonexpert_bytes)}")
    if budget is not None:
        print(f"budget {budget}, tier {info['tier']}: {info['slots']}")
    print(f"on this machine, without --tier/--budget: {info['fit']['why']}")
    if "device" in info:
        d = info["device"]
        print(f"on {d['name']} ({d['description']}): {fmt_bytes(d['free_bytes'])} free of "
              f"{fmt_bytes(d['total_bytes'])}; {d['why']}")
        p, c = d["plan"], d["plan"]["costs"]
        print(f"layer plan for {fmt_bytes(p['device_bytes'])} of experts on the device: {p['plan']}; predicted "
              f"{p['predicted_ms']:.2f} ms/token, stock --n-cpu-moe {p['stock_n_cpu_moe']} "
              f"{p['predicted_stock_n_cpu_moe_ms']:.2f}, stock --cpu-moe {p['predicted_stock_cpu_moe_ms']:.2f} "
              f"({p.get('cost_source', 'measured')}: a host switch {c['split_us']:.0f} us, "
              f"link {c['link_gbps']:.2f} GB/s, an expert row "
              f"{c['cpu_row_us']:.1f} us on the host, {c['dev_row_us']:.1f} us on the device)")
