"""inspect: what a GGUF holds and how it fits this machine or a device."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from pyspecter.cli.app import app
from pyspecter.cli.options import (
    DEFAULT_MODEL,
    AutoTierOpt,
    DeviceOpt,
    ModelArg,
    ThreadsOpt,
    fmt_bytes,
    native_errors_exit,
)
from pyspecter.errors import SpecterError
from pyspecter.models.catalog import resolve_model

if TYPE_CHECKING:
    from pyspecter.layout import ModelLayout


@app.command()
def inspect(
    model: ModelArg = DEFAULT_MODEL,
    json_out: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    budget: Annotated[str | None, typer.Option(help="fast-tier budget for experts: 64MiB, 1.5GB or 40%")] = None,
    device: DeviceOpt = None,
    tier: AutoTierOpt = None,
    draft: Annotated[str | None, typer.Option(help="a draft for MODEL (GGUF or built-in name, e.g. "
                                                   "smol-moe-self-draft): its bytes against the target's expert "
                                                   "bytes and the budget, and its acceptance and routing recall "
                                                   "measured on the packaged eval prompts (eval split; a minute or "
                                                   "two), so you see whether it pays before using it")] = None,
    draft_tokens: Annotated[int, typer.Option(help="--draft: tokens the target generates per eval prompt")] = 32,
    k: Annotated[int, typer.Option("-k", help="--draft: tokens drafted ahead (acceptance at K)")] = 3,
    threads: ThreadsOpt = 1,
    mapped: Annotated[bool, typer.Option("--mapped", help="--device: price the layer plan as --miss mapped runs it "
                                                         "(slot layers' misses read by the device from pinned host "
                                                         "memory, no host visit; measured on the model). Default: "
                                                         "the plan generate runs without --miss (both ways where "
                                                         "the device reads pinned host memory, the faster)")] = False,
) -> None:
    """Show a MoE GGUF's expert layout: bytes per expert, expert vs non-expert bytes, slots a budget buys, and
    how the model fits this machine (or --device). With --draft, what the draft costs and how well it predicts."""
    from pyspecter.layout import read_layout
    from pyspecter.placement import budget_slot_count, device_fit, is_host, place

    if draft_tokens < 1 or k < 1:
        raise SpecterError("--draft-tokens and -k must be at least 1")
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
        from pyspecter.native.devices import open_device
        from pyspecter.placement import priced_plan

        # the layer plan for the budget (else what the device holds), its inputs measured on the model (cached)
        room = info["budget_bytes"] if budget is not None else info["device"]["slot_bytes"]
        _, info["device"]["plan"] = priced_plan(lay, open_device(device), room, mapped=True if mapped else None)
    if draft is not None:
        info["draft"] = draft_report(lay, resolve_model(draft), info.get("budget_bytes"), n=draft_tokens, k=k,
                                     threads=threads)
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
        print(f"layer plan for {fmt_bytes(p['device_bytes'])} of experts on the device: {p['plan']}"
              + (f" ({'hot set' if p.get('hot') else 'LRU'} hits {p['hit_rate']:.0%} on the calibration text)"
                 if p.get("hit_rate") is not None else "")
              + "; predicted "
              f"{p['predicted_ms']:.2f} ms/token, stock --n-cpu-moe {p['stock_n_cpu_moe']} "
              f"{p['predicted_stock_n_cpu_moe_ms']:.2f}, stock --cpu-moe {p['predicted_stock_cpu_moe_ms']:.2f} "
              f"({'slot layers as --miss mapped runs them; ' if p.get('mapped') else ''}"
              f"{p.get('cost_source', 'measured')}: a host switch {c['split_us']:.0f} us, "
              f"link {c['link_gbps']:.2f} GB/s, an expert row "
              f"{c['cpu_row_us']:.1f} us on the host, {c['dev_row_us']:.1f} us on the device"
              + (f", {c['map_row_us']:.1f} us read from the host copy (--miss mapped)" if "map_row_us" in c else "")
              + (f", {100 * c['upload_share']:.0f}% of an upload's time on the token beside it" if "upload_share" in c
                 else "")
              + ")")
    if "draft" in info:
        print(draft_lines(info["draft"]))


def draft_report(target: ModelLayout, draft_path: Path, budget_bytes: int | None, *, n: int, k: int,
                 threads: int) -> dict:
    """What a draft costs (its file counts in the budget: equal total fast memory) and what it buys: acceptance
    at K and the share of the target's top-k experts its routing contains on the same tokens, from a routing
    trace of the packaged eval prompts (eval split) scored by `analyze`'s rules."""
    import tempfile

    from pyspecter.layout import read_layout
    from pyspecter.models.draft import shared_expert_bytes
    from pyspecter.prompts import load_prompts
    from pyspecter.session import check_draft
    from pyspecter.study import analyze as an
    from pyspecter.study.trace import record_trace

    d = read_layout(draft_path)
    check_draft(target, d)
    d.require_moe()  # its routing is what is scored
    file_bytes = draft_path.stat().st_size
    ffn = d.expert_total_bytes + shared_expert_bytes(draft_path)
    out: dict = {"path": str(draft_path), "name": d.name, "arch": d.arch, "file_bytes": file_bytes,
                 "ffn_bytes": ffn, "routed_expert_bytes": d.expert_total_bytes,
                 "file_share_of_target_experts": file_bytes / target.expert_total_bytes,
                 "ffn_share_of_target_experts": ffn / target.expert_total_bytes,
                 "budget_bytes": budget_bytes,
                 "file_share_of_budget": file_bytes / budget_bytes if budget_bytes else None,
                 "k": k, "tokens_per_prompt": n, "prompts": "packaged eval prompts, eval split"}
    with tempfile.TemporaryDirectory(prefix="pyspecter-draft-") as tmp:
        trace = Path(tmp) / "draft.npz"
        record_trace(target.path, trace, draft_path=draft_path, prompts=load_prompts(None, split="eval"), n=n,
                     k=k, n_threads=threads, gate_lookahead=0, verify=False)
        res = an.analyze(trace)
    spec = res["speculative"]
    out["acceptance_at"] = spec["acceptance_at"]
    # accepted / drafted at K, as the decode loop counts it: the drafts up to the first mismatch
    prefix = spec["mean_accepted_prefix"]
    out["acceptance"] = prefix / k if prefix is not None else None
    out["routing_recall_same_token"] = res["predictors"]["draft-same-tokens"]["recall_at"]["1"]
    out["routing_recall_own_tokens"] = {h: v for h, v in res["predictors"]["draft-own-tokens"]["recall_at"].items()
                                        if int(h) <= k}  # analyze scores a fixed range of lookaheads
    out["rows"] = res["trace"]["n_scored_rows"]
    return out


def draft_lines(r: dict) -> str:
    """inspect --draft's report, a few lines."""
    share = r["file_share_of_budget"]
    budget = " (give --budget for its share of one)" if share is None else \
        (f", {100 * share:.1f}% of the budget ({fmt_bytes(r['budget_bytes'])}), which it "
         + ("comes out of" if share < 1 else "does not fit: a session refuses it"))
    own = ", ".join("n/a" if v is None else f"{100 * v:.1f}%" for v in r["routing_recall_own_tokens"].values())
    acc = ", ".join("n/a" if v is None else f"{100 * v:.0f}%" for v in r["acceptance_at"].values())
    return "\n".join([
        f"draft {Path(r['path']).name} ({r['arch']}): file {fmt_bytes(r['file_bytes'])} = "
        f"{100 * r['file_share_of_target_experts']:.1f}% of the target's expert bytes{budget}; its FFN "
        f"{fmt_bytes(r['ffn_bytes'])} = {100 * r['ffn_share_of_target_experts']:.1f}%",
        f"  acceptance at K={r['k']}: " + ("n/a" if r["acceptance"] is None else f"{100 * r['acceptance']:.1f}%")
        + f" of drafted tokens accepted (token h ahead right: {acc}); {r['rows']} rows of the eval prompts",
        f"  routing recall (the target's top-k the draft's contains): same tokens "
        f"{100 * r['routing_recall_same_token']:.1f}%, on its own drafts h ahead {own}",
    ])
