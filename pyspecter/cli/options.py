"""Options shared by several commands, and the few helpers every command module uses."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pyspecter.placement import DEFAULT_THREADS
from pyspecter.units import fmt_bytes

__all__ = ["DEFAULT_THREADS", "fmt_bytes"]

DEFAULT_MODEL = "smol-moe"  # the embedded model: every command that takes a model defaults to it
ModelArg = Annotated[str, typer.Argument(help="GGUF path, or a built-in name (`pyspecter models list`)")]
DraftOpt = Annotated[str | None, typer.Option(help="draft GGUF (or built-in name): speculative decoding + prefetch")]
BudgetOpt = Annotated[str | None, typer.Option(help="fast-tier bytes for experts (64MiB, 40%); default: fitted to "
                                                    "the memory available (every expert when the model fits)")]
TierOpt = Annotated[str, typer.Option(help="slow tier: ram, disk, emulated:GBPS")]
AutoTierOpt = Annotated[str | None, typer.Option(help="slow tier: ram, disk, emulated:GBPS; default: chosen with "
                                                      "--budget from the model's size and the memory available "
                                                      "(one line says what and why)")]
MissOpt = Annotated[str | None, typer.Option(help="on a miss: cpu (exact host compute, upload in the background), "
                                                    "host (host compute from the home copy, nothing moved), wait "
                                                    "(upload first) or mapped (a GPU reads the misses, prompts' "
                                                    "too, from pinned host memory, upload in the background); "
                                                    "default: wait "
                                                    "on the disk tier (its host copy is on disk too), host on the "
                                                    "RAM tier without a device, else cpu (on a GPU whose layer "
                                                    "plan is predicted faster with mapped: mapped). surrogate: "
                                                    "APPROXIMATE, "
                                                    "computes single-token misses with a narrow copy of the expert "
                                                    "kept in RAM and prints its measured perplexity cost")]
SurrogateOpt = Annotated[float, typer.Option(help="--miss surrogate: fraction of each expert's neurons kept")]
_FROM_MODEL = "default: the model's recommendation (general.sampling.* in its GGUF), else llama.cpp's"
TopKOpt = Annotated[int | None, typer.Option("--top-k", help=f"sampling: keep the K most likely tokens (0: off); "
                                                              f"{_FROM_MODEL} 40")]
TopPOpt = Annotated[float | None, typer.Option("--top-p", help=f"sampling: keep the smallest set with this much "
                                                                f"probability (1: off); {_FROM_MODEL} 0.95")]
MinPOpt = Annotated[float | None, typer.Option("--min-p", help=f"sampling: drop tokens below this fraction of the "
                                                                f"most likely one (0: off); {_FROM_MODEL} 0.05")]
RepeatOpt = Annotated[float | None, typer.Option("--repeat-penalty", help=f"penalise the last 64 tokens (1: off); "
                                                                          f"{_FROM_MODEL} 1.0")]
# bench's policies, named here so --help can list them without importing the bench
BENCH_POLICIES = ("stock", "all-resident", "all-resident-hooked", "on-demand-lru", "on-demand-lfu", "on-demand-cpu",
                  "on-demand-lru-ordered", "static-hot", "prev-token", "specter", "specter-equal-slots", "surrogate",
                  "stock-cpu-moe", "stock-n-cpu-moe", "stock-device", "learned", "learned-evict", "engine",
                  "plan", "default", "on-demand-mapped", "static-hot-mapped", "plan-mapped", "adaptive-hot",
                  "adaptive-hot-mapped")
BENCH_DEFAULTS = ("stock", "on-demand-lru", "on-demand-lru-ordered", "on-demand-lfu", "on-demand-cpu", "static-hot",
                  "prev-token")
PromptsOpt = Annotated[Path | None, typer.Option(help="your prompts: a text file, one prompt a line, or JSONL "
                                                      "(objects with \"prompt\", \"text\" or \"messages\", or JSON "
                                                      "strings; chosen per file); each is sent as a user message "
                                                      "through the model's chat template", show_default=False)]
THREADS_HELP = "llama.cpp threads: one per physical core unless given, as llama.cpp"
ThreadsOpt = Annotated[int, typer.Option("--threads", "-t", help=THREADS_HELP)]
CtxOpt = Annotated[int, typer.Option("--ctx-size", "-c", help="context length in tokens (prompt + answer; chat "
                                                           "drops its oldest turns when full)")]
ForceOpt = Annotated[bool, typer.Option("--force", help="run even when --budget and the non-expert weights need more "
                                                        "than the memory available (refused by default, with the "
                                                        "numbers)")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="where layers and expert slots live: cpu (default), "
                                                             "a ggml device such as cuda0, or rpc:HOST:PORT (a "
                                                             "`pyspecter rpc-server`); experts stay in host RAM "
                                                             "and --budget is the device's memory for slots")]
LayerPlanOpt = Annotated[str | None, typer.Option(
    "--layer-plan", show_default=False,
    help="with --device, what each MoE layer is: auto (default: the cost model's mix of full, host and slot layers, "
         "never predicted slower than stock --n-cpu-moe at the same device memory; its inputs measured once, a few "
         "seconds, and cached), slots (slots in every layer), n-cpu-moe:N (llama.cpp's --n-cpu-moe N: blocks below "
         "N on the host, the rest whole on the device)")]
ProfileOpt = Annotated[Path | None, typer.Option(help="trace from `pyspecter trace`: fill the slots with its "
                                                      "hottest experts before the first token (a device plan's hot "
                                                      "set starts there, then follows the text)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
ForcedOpt = Annotated[bool | None, typer.Option(
    "--teacher-forced/--free", show_default=False,
    help="teacher-forced: every decode step is fed the next token of a held-out text (the packaged held-out "
         "prose and eval prompts) instead of the one picked, identity checked on the logits; free: greedy "
         "tokens. Default: teacher-forced on the random-weight built-ins (tiny-*, bench-qwen3moe, big-qwen3moe), "
         "whose greedy text cycles through a few tokens so every cache hits; free otherwise")]


def native_errors_exit() -> None:
    """A fatal error inside ggml (an RPC server gone mid-answer among them) ends the command with one line and
    exit code 2, like any other error here, instead of a backtrace and a core dump."""
    from pyspecter.native.lib import llama_pyspecter_exit_on_abort

    llama_pyspecter_exit_on_abort(2)
